"""Op 2's tile geometry, shared by the Triton kernels (eva_attention.py, eva_attention_bwd.py) and the
Gluon one (eva_attention_gluon.py): where a query's window starts, which key blocks a tile of queries
walks, and the kernels' base-2 logit scale."""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _start(t, C, W, SLIDING: tl.constexpr):
    """First exact key of position t (int tensor or scalar, t >= 0)."""
    if SLIDING:
        s = (tl.maximum(t - W + 1, 0) // C) * C
    else:
        s = (t // W) * W
    return s


@triton.jit
def _tile_blocks(t_min, t_max, C, W, Nc, SLIDING: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks of a tile whose queries sit at positions t_min..t_max: summaries [0, nb_s) (no
    mask below nb_s_full), then nb_e blocks of exact keys from st_min: [0, e_a) masked, [e_a, e_b)
    unmasked, [e_b, nb_e) masked. (st_min, c_hi, nb_s_full, nb_s, nb_e, e_a, e_b); c_hi: the
    summaries any query of the tile sees."""
    st_min = _start(t_min, C, W, SLIDING)
    st_max = _start(t_max, C, W, SLIDING)
    c_full = tl.minimum(st_min // C, Nc)
    c_hi = tl.minimum(st_max // C, Nc)
    nb_s_full = c_full // BLOCK_N
    nb_s = tl.cdiv(c_hi, BLOCK_N)
    nb_e = tl.cdiv(t_max + 1 - st_min, BLOCK_N)
    e_a = tl.cdiv(st_max - st_min, BLOCK_N)
    e_b = tl.maximum(e_a, (t_min + 1 - st_min) // BLOCK_N)
    return st_min, c_hi, nb_s_full, nb_s, nb_e, e_a, e_b


@triton.jit
def _log2_count(n, Nk, C):
    """log2 of the token count of chunks n (a tensor) of Nk keys: C for every chunk but the last, whose
    count Nk - last * C is its own, and 0 past the last (log2 of a count clamped to 1). Two scalar
    log2s instead of one per element: Triton's log2 is a polynomial of a dozen FMAs."""
    last = (Nk - 1) // C
    full2 = tl.log2(tl.cast(C, tl.float32))
    last2 = tl.log2(tl.cast(Nk - last * C, tl.float32))
    return tl.where(n < last, full2, tl.where(n == last, last2, 0.0))


def _window_start(t: int, C: int, W: int, sliding: bool) -> int:
    """start(t) of the SPEC on the host: the first exact key position t sees."""
    return (max(t - W + 1, 0) // C) * C if sliding else (t // W) * W


def _qk_scale(scale: float) -> float:
    """|scale| log2(e) for the kernel (a negative scale negates q instead). Scale 0 runs as 1e-30: the
    masked logits are -inf before the scale multiplies them, which must keep them -inf; a visible logit
    q.k below 1e12 in magnitude then becomes one below 1e-18, whose exp2 rounds to 1 in fp32 as exp2(0)
    does."""
    return abs(float(scale)) * LOG2E or 1e-30
