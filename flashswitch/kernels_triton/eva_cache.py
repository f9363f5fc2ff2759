"""The bookkeeping of EvaCache in Triton (the design: flashswitch/cache.py): of a decode step, two launches
around op 1 or one with op 1's math inside; of a prefill, one.

All read each sequence's position t = lengths[b] on the device, so their launch arguments never
change from token to token (CUDA-graph capturable, no host sync):

  gather_chunk  the C ring rows of the chunk ending at t - 1 (rows S + p % R), as op 1's input
                [B, Hkv, C, D] (before any chunk completed: chunk 0's rows, whose summary append()
                then leaves unwritten), and a copy of t;
  append        per (sequence, kv head, block of bias entries): the new token into its ring row
                S + t % R and the decode row S + R; the completed chunk's summary into slot t / C - 1
                only where t % C == 0 and t >= C; the fp32 bias row of the query at t (SPEC op 2:
                summary slot c on for c < start(t) / C, ring row of position p on for
                start(t) <= p < t, otherwise MASKED); and lengths[b] = t + 1.

append's programs read t from gather_chunk's copy, not from lengths, so the one program that writes
lengths[b] races no reader and the increment needs no launch of its own.

  prefill       what a prefill leaves in the cache (op 1's summaries, the ring rows of the prompt's last
                positions, lengths) in one launch after op 1 and op 2 ran on the prompt.

  step          both in one launch with op 1's math between them (its jit helpers,
                kernels_triton/chunk_summaries.py), for caches whose op 1 runs in Triton anyway: the
                program of block 0 summarises the completed chunk straight from the ring (only where
                t % C == 0 and t >= C), then writes the new token; every program writes its bias block
                and counts itself done on an int32 [B] counter; the last one of a sequence writes
                lengths[b] = t + 1 and zeroes the counter, after every program of that sequence read t.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from flashswitch._common import new_output, next_pow2
from flashswitch.kernels_triton.kernel_call import launch
from flashswitch.kernels_triton.chunk_summaries import (LOG2E, _key_logits, _online_softmax, _safe_reciprocal,
                                                        _value_logits)

MASKED = tl.constexpr(-1e30)  # flashswitch.cache.MASKED (a constexpr: jit code may read no other global)
MAX_TILE = 4096  # elements of a gathered [rows, D] tile per loop step
BIAS_BLOCK = 1024  # bias entries per append program


@triton.jit
def _gather_chunk_kernel(k_ptr, v_ptr, len_ptr, ck_ptr, cv_ptr, t_ptr,
                         Hkv, S, R, D,
                         s_b, s_h, s_n, cs_b, cs_h, cs_n,
                         CHUNK: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // Hkv
    h = pid - b * Hkv
    t = tl.load(len_ptr + b).to(tl.int64)
    if h == 0:
        tl.store(t_ptr + b, t)  # append() reads t here, so it may write lengths while others read t
    # ring row of the completed chunk's first position (chunk 0 before any completed)
    first = (tl.maximum(t // CHUNK - 1, 0) * CHUNK % R).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    src = b * s_b + h * s_h
    dst = b * cs_b + h * cs_h
    for j0 in range(0, CHUNK, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        row = first + j
        row = S + tl.where(row >= R, row - R, row)  # j < C <= R: at most one wrap
        mask = (j < CHUNK)[:, None] & (d < D)[None, :]
        s_off = src + row[:, None].to(tl.int64) * s_n + d[None, :]
        d_off = dst + j[:, None].to(tl.int64) * cs_n + d[None, :]
        tl.store(ck_ptr + d_off, tl.load(k_ptr + s_off, mask=mask), mask=mask)
        tl.store(cv_ptr + d_off, tl.load(v_ptr + s_off, mask=mask), mask=mask)


@triton.jit
def _bias_block(bias_ptr, ub_ptr, b, h, blk, t, start, t_ring, S, R, on_bias, bs_b, bs_h, ub_b, ub_h, ub_n,
                CHUNK: tl.constexpr, USER_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bias entries [blk * BLOCK_N, +BLOCK_N) of the query at t: summary slot c on for c < start / C;
    ring row r holds position t - ((t - r) mod R) = (t - t_ring) + r - (R if r > t_ring), on for
    start <= it < t. Offsets from t - t_ring stay within int32 (|start - (t - t_ring)| < R + C)."""
    n_sum = (start // CHUNK).to(tl.int32)
    t_ring32 = t_ring.to(tl.int32)
    lo = (start - (t - t_ring)).to(tl.int32)
    j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    sum_on = j < n_sum
    if USER_BIAS:
        on = tl.load(ub_ptr + b * ub_b + h * ub_h + j.to(tl.int64) * ub_n, mask=sum_on, other=0.0).to(tl.float32)
    else:
        on = on_bias
    r = j - S
    rel = r - tl.where(r > t_ring32, R, 0)
    ring_on = (rel >= lo) & (rel < t_ring32)
    val = tl.where(j < S, tl.where(sum_on, on, MASKED), tl.where(ring_on, 0.0, MASKED))
    tl.store(bias_ptr + b * bs_b + h * bs_h + j, val, mask=j < S + R)


@triton.jit
def _append_kernel(k_ptr, v_ptr, bias_ptr, len_ptr, t_ptr, kn_ptr, vn_ptr, ks_ptr, vs_ptr, ub_ptr,
                   Hkv, S, R, D, W, on_bias,
                   s_b, s_h, s_n, bs_b, bs_h,
                   kn_b, kn_h, vn_b, vn_h, ks_b, ks_h, vs_b, vs_h, ub_b, ub_h, ub_n,
                   CHUNK: tl.constexpr, SLIDING: tl.constexpr, USER_BIAS: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = pid // Hkv
    h = pid - b * Hkv
    t = tl.load(t_ptr + b)
    # start(t) of SPEC op 2 (t >= 0, so truncating division is floor division where it is used)
    if SLIDING:
        start = tl.where(t >= W, CHUNK * ((t - W + 1) // CHUNK), 0)
    else:
        start = W * (t // W)
    t_ring = t % R
    if blk == 0:  # the rows: the new token, and the completed chunk's summary
        done = (t % CHUNK == 0) & (t >= CHUNK)  # chunk t / C - 1 has just completed
        slot = tl.maximum(t // CHUNK - 1, 0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        sum_ok = d_ok & done
        row0 = b * s_b + h * s_h + d
        kn = tl.load(kn_ptr + b * kn_b + h * kn_h + d, mask=d_ok)
        vn = tl.load(vn_ptr + b * vn_b + h * vn_h + d, mask=d_ok)
        tl.store(k_ptr + row0 + (S + t_ring) * s_n, kn, mask=d_ok)
        tl.store(v_ptr + row0 + (S + t_ring) * s_n, vn, mask=d_ok)
        tl.store(k_ptr + row0 + (S + R) * s_n, kn, mask=d_ok)
        tl.store(v_ptr + row0 + (S + R) * s_n, vn, mask=d_ok)
        ks = tl.load(ks_ptr + b * ks_b + h * ks_h + d, mask=sum_ok)
        vs = tl.load(vs_ptr + b * vs_b + h * vs_h + d, mask=sum_ok)
        tl.store(k_ptr + row0 + slot * s_n, ks, mask=sum_ok)
        tl.store(v_ptr + row0 + slot * s_n, vs, mask=sum_ok)
        if h == 0:
            tl.store(len_ptr + b, t + 1)
    _bias_block(bias_ptr, ub_ptr, b, h, blk, t, start, t_ring, S, R, on_bias, bs_b, bs_h, ub_b, ub_h, ub_n,
                CHUNK, USER_BIAS, BLOCK_N)


@triton.jit
def _step_kernel(k_ptr, v_ptr, bias_ptr, len_ptr, cnt_ptr, kn_ptr, vn_ptr, om_ptr, kw_ptr, ub_ptr,
                 Hkv, S, R, D, W, on_bias, qk_scale, programs_per_seq,
                 s_b, s_h, s_n, bs_b, bs_h, kn_b, kn_h, vn_b, vn_h, om_h, om_d, kw_h, kw_d, ub_b, ub_h, ub_n,
                 CHUNK: tl.constexpr, SLIDING: tl.constexpr, USER_BIAS: tl.constexpr, HAS_OMEGA: tl.constexpr,
                 HAS_KEY_WEIGHT: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = pid // Hkv
    h = pid - b * Hkv
    t = tl.load(len_ptr + b)
    if SLIDING:  # start(t) of SPEC op 2 (t >= 0: truncating division is floor division here)
        start = tl.where(t >= W, CHUNK * ((t - W + 1) // CHUNK), 0)
    else:
        start = W * (t // W)
    t_ring = t % R
    if blk == 0:
        d3 = tl.arange(0, BLOCK_D)[None, None, :]
        mask_d3 = d3 < D
        rows0 = b * s_b + h * s_h
        if (t % CHUNK == 0) & (t >= CHUNK):  # chunk t / C - 1 has just completed: op 1 over its ring rows
            slot = t // CHUNK - 1
            first = (slot * CHUNK) % R
            if HAS_OMEGA:
                om = tl.load(om_ptr + h * om_h + d3 * om_d, mask=mask_d3, other=0.0).to(tl.float32)
            else:
                om = tl.zeros([1, 1, BLOCK_D], dtype=tl.float32)
            if HAS_KEY_WEIGHT:
                kw = tl.load(kw_ptr + h * kw_h + d3 * kw_d, mask=mask_d3, other=0.0).to(tl.float32)
            else:
                kw = tl.zeros([1, 1, BLOCK_D], dtype=tl.float32)
            m_v = tl.full([1, 1, 1], float("-inf"), tl.float32)
            s_v = tl.zeros([1, 1, 1], dtype=tl.float32)
            acc_v = tl.zeros([1, 1, BLOCK_D], dtype=tl.float32)
            m_k = tl.full([1, 1, 1], float("-inf"), tl.float32)
            s_k = tl.zeros([1, 1, 1], dtype=tl.float32)
            acc_k = tl.zeros([1, 1, BLOCK_D], dtype=tl.float32)
            for j0 in range(0, CHUNK, BLOCK_J):
                j3 = j0 + tl.arange(0, BLOCK_J)[None, :, None]
                row = first + j3
                row = S + tl.where(row >= R, row - R, row)  # j < C <= R: at most one wrap
                tmask = j3 < CHUNK
                mask = tmask & mask_d3
                off = rows0 + row.to(tl.int64) * s_n + d3
                kk = tl.load(k_ptr + off, mask=mask, other=0.0).to(tl.float32)
                vv = tl.load(v_ptr + off, mask=mask, other=0.0).to(tl.float32)
                m_v, s_v, acc_v = _online_softmax(_value_logits(kk, om, tmask, qk_scale, HAS_OMEGA),
                                                  m_v, s_v, acc_v, vv)
                if HAS_KEY_WEIGHT:
                    m_k, s_k, acc_k = _online_softmax(_key_logits(kk, kw, tmask), m_k, s_k, acc_k, kk)
                else:
                    s_k = s_k + tl.sum(tmask.to(tl.float32), axis=1, keep_dims=True)
                    acc_k = acc_k + tl.sum(kk, axis=1, keep_dims=True)
            out = rows0 + slot * s_n + d3
            tl.store(k_ptr + out, (acc_k * _safe_reciprocal(s_k)).to(k_ptr.dtype.element_ty), mask=mask_d3)
            tl.store(v_ptr + out, (acc_v * _safe_reciprocal(s_v)).to(v_ptr.dtype.element_ty), mask=mask_d3)
        # the new token's ring row may be the chunk's first row (R = C): written after every read of it
        tl.debug_barrier()
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        kn = tl.load(kn_ptr + b * kn_b + h * kn_h + d, mask=d_ok)
        vn = tl.load(vn_ptr + b * vn_b + h * vn_h + d, mask=d_ok)
        tl.store(k_ptr + rows0 + (S + t_ring) * s_n + d, kn, mask=d_ok)  # its ring row
        tl.store(v_ptr + rows0 + (S + t_ring) * s_n + d, vn, mask=d_ok)
        tl.store(k_ptr + rows0 + (S + R) * s_n + d, kn, mask=d_ok)       # the decode row
        tl.store(v_ptr + rows0 + (S + R) * s_n + d, vn, mask=d_ok)
    _bias_block(bias_ptr, ub_ptr, b, h, blk, t, start, t_ring, S, R, on_bias, bs_b, bs_h, ub_b, ub_h, ub_n,
                CHUNK, USER_BIAS, BLOCK_N)
    # every warp of this program has used t (the barrier), every program of sequence b has counted
    # itself (acquire-release): the last one moves t on
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel") == programs_per_seq - 1:
        tl.store(len_ptr + b, t + 1)
        tl.store(cnt_ptr + b, 0)


@triton.jit(do_not_specialize=["P"])  # P = 1 would be a constexpr, which has no .to()
def _prefill_kernel(k_ptr, v_ptr, len_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, pl_ptr, P, Hkv, Nc, S, R, D,
                    s_b, s_h, s_n, kp_b, kp_h, kp_n, vp_b, vp_h, vp_n, ks_b, ks_h, ks_n, vs_b, vs_h, vs_n,
                    HAS_LENGTHS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [blk * BLOCK_J, +BLOCK_J) of the Nc + R a prefill writes for one (sequence, kv head): summary
    slot j < Nc from op 1's output, ring row r = j - Nc from the latest prompt position p <= L - 1
    with p = r (mod R) (position 0 where none is: a row its bias keeps off); lengths[b] = L."""
    pid = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = pid // Hkv
    h = pid - b * Hkv
    if HAS_LENGTHS:
        L = tl.load(pl_ptr + b).to(tl.int64)
    else:
        L = P.to(tl.int64)
    if (h == 0) & (blk == 0):
        tl.store(len_ptr + b, L)
    j = blk * BLOCK_J + tl.arange(0, BLOCK_J)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < D)[None, :]
    is_sum = j < Nc
    r = (j - Nc).to(tl.int64)
    back = (L - 1 - r) % R
    back = tl.where(back < 0, back + R, back)          # a floored modulo: L - 1 - r may be negative
    pos = tl.maximum(L - 1 - back, 0)
    ring = (j >= Nc) & (r < R)
    dst = b * s_b + h * s_h + tl.where(is_sum, j, S + r)[:, None] * s_n + d[None, :]
    smask = is_sum[:, None] & dmask
    rmask = ring[:, None] & dmask
    js = j.to(tl.int64)[:, None]
    ksum = tl.load(ks_ptr + b * ks_b + h * ks_h + js * ks_n + d[None, :], mask=smask)
    vsum = tl.load(vs_ptr + b * vs_b + h * vs_h + js * vs_n + d[None, :], mask=smask)
    kr = tl.load(kp_ptr + b * kp_b + h * kp_h + pos[:, None] * kp_n + d[None, :], mask=rmask)
    vr = tl.load(vp_ptr + b * vp_b + h * vp_h + pos[:, None] * vp_n + d[None, :], mask=rmask)
    tl.store(k_ptr + dst, tl.where(is_sum[:, None], ksum, kr), mask=smask | rmask)
    tl.store(v_ptr + dst, tl.where(is_sum[:, None], vsum, vr), mask=smask | rmask)


def prefill(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, k_prompt: torch.Tensor, v_prompt: torch.Tensor,
            k_sum: torch.Tensor, v_sum: torch.Tensor, prompt_lengths: Optional[torch.Tensor], *,
            num_summaries: int, ring_size: int) -> None:
    """What a prefill leaves in the cache buffers k, v [B, Hkv, S + R + 1, D] and lengths int64 [B], in one
    launch: the Nc summaries k_sum, v_sum [B, Hkv, Nc, D] in slots [0, Nc), each ring row the latest
    position of the prompt k_prompt, v_prompt [B, Hkv, P, D] that maps to it, lengths = prompt_lengths
    ([B] ints on the device, each <= P) or P."""
    B, Hkv, P, D = k_prompt.shape
    Nc, S, R = k_sum.shape[2], int(num_summaries), int(ring_size)
    if k.stride() != v.stride() or k.stride(-1) != 1 or lengths.stride(0) != 1:
        raise ValueError("the cache buffers must share strides with unit last strides")
    if B * Hkv == 0 or P == 0:
        lengths.zero_()
        return
    BLOCK_D = next_pow2(D)
    BLOCK_J = max(1, min(next_pow2(Nc + R), MAX_TILE // BLOCK_D))
    pl = lengths if prompt_lengths is None else prompt_lengths
    launch(_prefill_kernel, (B * Hkv, triton.cdiv(Nc + R, BLOCK_J)),
           (k, v, lengths, k_prompt, v_prompt, k_sum, v_sum, pl),
           (P, Hkv, Nc, S, R, D, *k.stride()[:3], *k_prompt.stride()[:3], *v_prompt.stride()[:3],
            *k_sum.stride()[:3], *v_sum.stride()[:3]),
           dict(HAS_LENGTHS=prompt_lengths is not None, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D),
           {"num_warps": 4 if BLOCK_J * BLOCK_D >= 1024 else 1})


def _check_cache(k, v, bias, lengths):
    if v.stride() != k.stride() or k.stride(-1) != 1 or bias.stride(-1) != 1 or lengths.stride(0) != 1:
        raise ValueError("the cache buffers must share strides with unit last strides")


def gather_chunk(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, chunk_size: int,
                 num_summaries: int, ring_size: int):
    """(chunk_k, chunk_v, t): the ring rows [B, Hkv, C, D] of the chunk ending at lengths - 1 in the cache
    buffers k, v [B, Hkv, S + R + 1, D], and a copy t of lengths (int64 [B]) for append()."""
    B, Hkv, _, D = k.shape
    Cs = int(chunk_size)
    ck = new_output((B, Hkv, Cs, D), k.dtype, k.device)
    cv = new_output((B, Hkv, Cs, D), v.dtype, v.device)
    t = new_output((B,), torch.int64, k.device)
    if B * Hkv == 0:
        return ck, cv, t
    BLOCK_D = next_pow2(D)
    BLOCK_J = min(next_pow2(Cs), max(1, MAX_TILE // BLOCK_D))
    launch(_gather_chunk_kernel, (B * Hkv,), (k, v, lengths, ck, cv, t),
           (Hkv, int(num_summaries), int(ring_size), D, *k.stride()[:3], *ck.stride()[:3]),
           dict(CHUNK=Cs, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D), {"num_warps": 4 if BLOCK_J * BLOCK_D >= 1024 else 1})
    return ck, cv, t


def _token_launch(k, v, bias, lengths, user_bias, num_summaries, ring_size):
    """What append and step share: (B, Hkv, D, S, R, the user bias or a stand-in, its strides, BLOCK_D,
    BLOCK_N), or None for an empty cache."""
    _check_cache(k, v, bias, lengths)
    B, Hkv, _, D = k.shape
    if B * Hkv == 0:
        return None
    S, R = int(num_summaries), int(ring_size)
    ub = bias if user_bias is None else user_bias
    sub = (0, 0, 0) if user_bias is None else user_bias.stride()
    return B, Hkv, D, S, R, ub, sub, next_pow2(D), min(next_pow2(S + R), BIAS_BLOCK)


def append(k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, lengths: torch.Tensor, t: torch.Tensor,
           k_new: torch.Tensor, v_new: torch.Tensor, k_sum: torch.Tensor, v_sum: torch.Tensor,
           user_bias: Optional[torch.Tensor], *, chunk_size: int, window_size: int, window: str,
           num_summaries: int, ring_size: int, on_bias: float) -> None:
    """One token per sequence into the cache buffers k, v [B, Hkv, S + R + 1, D], bias fp32 [B, Hkv, S + R]
    and lengths int64 [B] (in place; see the module docstring) at the positions t (gather_chunk's copy
    of lengths). k_new, v_new: [B, Hkv, 1, D]; k_sum, v_sum: [B, Hkv, 1, D], op 1 over gather_chunk's
    rows; user_bias: None (every visible summary gets `on_bias`) or [B, Hkv, S] (any float dtype and
    strides)."""
    shared = _token_launch(k, v, bias, lengths, user_bias, num_summaries, ring_size)
    if shared is None:
        return
    B, Hkv, D, S, R, ub, sub, BLOCK_D, BLOCK_N = shared
    launch(_append_kernel, (B * Hkv, triton.cdiv(S + R, BLOCK_N)),
           (k, v, bias, lengths, t, k_new, v_new, k_sum, v_sum, ub),
           (Hkv, S, R, D, int(window_size), float(on_bias), *k.stride()[:3], *bias.stride()[:2],
            *k_new.stride()[:2], *v_new.stride()[:2], *k_sum.stride()[:2], *v_sum.stride()[:2], *sub),
           dict(CHUNK=int(chunk_size), SLIDING=window == "sliding", USER_BIAS=user_bias is not None,
                BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N), {"num_warps": 4})


def step(k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, lengths: torch.Tensor, counter: torch.Tensor,
         k_new: torch.Tensor, v_new: torch.Tensor, omega: Optional[torch.Tensor], key_weight: Optional[torch.Tensor],
         user_bias: Optional[torch.Tensor], *, chunk_size: int, window_size: int, window: str, num_summaries: int,
         ring_size: int, on_bias: float, scale: float) -> None:
    """gather_chunk, op 1 (Triton, `scale`, omega / key_weight [Hkv, D] or None) and append in one launch;
    counter: int32 [B] zeros, left zeros."""
    shared = _token_launch(k, v, bias, lengths, user_bias, num_summaries, ring_size)
    if shared is None:
        return
    B, Hkv, D, S, R, ub, sub, BLOCK_D, BLOCK_N = shared
    Cs = int(chunk_size)
    n_blocks = triton.cdiv(S + R, BLOCK_N)
    om = bias if omega is None else omega
    kw = bias if key_weight is None else key_weight
    launch(_step_kernel, (B * Hkv, n_blocks), (k, v, bias, lengths, counter, k_new, v_new, om, kw, ub),
           (Hkv, S, R, D, int(window_size), float(on_bias), float(scale) * LOG2E, Hkv * n_blocks,
            *k.stride()[:3], *bias.stride()[:2], *k_new.stride()[:2], *v_new.stride()[:2],
            *((0, 0) if omega is None else omega.stride()), *((0, 0) if key_weight is None else key_weight.stride()),
            *sub),
           dict(CHUNK=Cs, SLIDING=window == "sliding", USER_BIAS=user_bias is not None, HAS_OMEGA=omega is not None,
                HAS_KEY_WEIGHT=key_weight is not None, BLOCK_J=min(next_pow2(Cs), max(1, MAX_TILE // BLOCK_D)),
                BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N), {"num_warps": 4})


__all__ = ["gather_chunk", "append", "step", "prefill"]
