"""Op 1 forward in Triton: per-chunk summary keys/values and the chunk log-normaliser (SPEC.md, op 1).

One program handles BLOCK_CHUNKS consecutive chunks of one (batch, head). It works on 3-D tiles
[BLOCK_CHUNKS, BLOCK_J, BLOCK_D] where token = chunk * C + j, so any chunk size works: lanes with
j >= C, token >= N or d >= D are masked. A chunk longer than BLOCK_J (at most 64) is read in
BLOCK_J-token pieces with a running-max (online) softmax. Every k/v element is read exactly once,
coalesced along D; every output element is written exactly once. Softmaxes run in base 2 on
fp32 values with the per-chunk maximum subtracted; a chunk with no valid token gives k_sum = v_sum = 0
and lse = -inf.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from flashswitch._common import next_pow2
from flashswitch.kernels_triton.kernel_call import KernelCall

LOG2E = 1.4426950408889634
MAX_BLOCK_J = 64
MAX_PER_THREAD = 128  # elements of a k (or v) tile per thread a launch accepts
FORCE_OFFS_64 = False  # 64-bit offsets even where 32 bits suffice (tests of that path)


@triton.jit
def _program_coords(H, n_blocks):
    """(b, h, blk) of this program: the grid runs over blocks of chunks, then heads, then batches."""
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n_blocks
    blk = pid - bh * n_blocks
    b = bh // H
    h = bh - b * H
    return b, h, blk


@triton.jit
def _round_strides(stride_b, stride_h, stride_n, VEC: tl.constexpr):
    """Row strides of one tensor rounded down to multiples of VEC. Exact where every row starts at
    such a multiple (the launchers check it), and it lets the compiler see the alignment, so odd D
    such as 76 still gets vector loads and stores."""
    return stride_b // VEC * VEC, stride_h // VEC * VEC, stride_n // VEC * VEC


@triton.jit
def _chunk_tile(blk, Nc, OFFS_64: tl.constexpr, EVEN_D: tl.constexpr, D: tl.constexpr,
                BLOCK_CHUNKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index tiles of block `blk` of chunks: c3 [BC, 1, 1] (int64 with OFFS_64, else int32),
    offs_j3 [1, BJ, 1], d3 [1, 1, BD] and the masks mask_c3 (c < Nc), mask_d3 (d < D)."""
    if OFFS_64:
        c = blk * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS).to(tl.int64)
    else:
        c = blk.to(tl.int32) * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS)
    c3 = c[:, None, None]                                         # [BC, 1, 1]
    offs_j3 = tl.arange(0, BLOCK_J)[None, :, None]                # [1, BJ, 1]
    d3 = tl.arange(0, BLOCK_D)[None, None, :]                     # [1, 1, BD]
    mask_c3 = c3 < Nc
    if EVEN_D:  # no lane past D: a constant mask lets the compiler vectorize any power-of-two D
        mask_d3 = d3 < BLOCK_D
    else:
        mask_d3 = d3 < D
    return c3, offs_j3, d3, mask_c3, mask_d3


@triton.jit
def _load_omega_kw(om_ptr, kw_ptr, b, h, c3, d3, mask_cd, mask_d3, stride_ob, stride_oh, stride_oc, stride_kwh,
                   HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr,
                   BLOCK_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 omega of the chunks ([BC, 1, BD]) and key_weight of the head ([1, 1, BD]); zeros where
    there is none, so that callers need no branch."""
    if HAS_OMEGA:
        om_base = om_ptr + b * stride_ob + h * stride_oh
        om = tl.load(om_base + c3 * stride_oc + d3, mask=mask_cd, other=0.0).to(tl.float32)
    else:
        om = tl.zeros([BLOCK_CHUNKS, 1, BLOCK_D], dtype=tl.float32)
    if HAS_KEY_WEIGHT:
        kw = tl.load(kw_ptr + h * stride_kwh + d3, mask=mask_d3, other=0.0).to(tl.float32)
    else:
        kw = tl.zeros([1, 1, BLOCK_D], dtype=tl.float32)
    return om, kw


@triton.jit
def _load_piece(k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn,
                offs_j3, d3, mask_d3, HAS_VALID: tl.constexpr):
    """Tokens [j0, j0 + BLOCK_J) of each chunk: (tok, inside, tmask, kk, vv). `inside` marks tokens
    of the sequence, `tmask` the valid ones among them; kk, vv are fp32 and 0 off tmask."""
    j = j0 + offs_j3                                              # [1, BJ, 1]
    tok = c3 * C + j                                              # [BC, BJ, 1], chunk's int type
    inside = (j < C) & (tok < N)
    tmask = inside
    if HAS_VALID:
        ok = tl.load(valid_base + tok * stride_valn, mask=inside, other=0)
        tmask = inside & (ok != 0)
    mask = tmask & mask_d3                                        # [BC, BJ, BD]
    kk = tl.load(k_base + tok * stride_kn + d3, mask=mask, other=0.0).to(tl.float32)
    vv = tl.load(v_base + tok * stride_vn + d3, mask=mask, other=0.0).to(tl.float32)
    if HAS_VALID:  # padding may hold anything (inf, NaN): keep it out of every sum and gradient
        kk = tl.where(mask, kk, 0.0)
        vv = tl.where(mask, vv, 0.0)
    return tok, inside, tmask, kk, vv


@triton.jit
def _value_logits(kk, om, tmask, qk_scale, HAS_OMEGA: tl.constexpr):
    """Value-softmax logits l = scale * (omega . k - |k|^2 / 2) in base 2 ([BC, BJ, 1]), -inf off
    tmask."""
    if HAS_OMEGA:
        logit = tl.sum(kk * (om - 0.5 * kk), axis=2, keep_dims=True) * qk_scale
    else:
        logit = tl.sum(kk * kk, axis=2, keep_dims=True) * (-0.5 * qk_scale)
    return tl.where(tmask, logit, float("-inf"))


@triton.jit
def _key_logits(kk, kw, tmask):
    """Key-softmax logits a = key_weight_h . k (no scale) in base 2 ([BC, BJ, 1]), -inf off tmask."""
    a = tl.sum(kk * kw, axis=2, keep_dims=True) * 1.4426950408889634
    return tl.where(tmask, a, float("-inf"))


@triton.jit
def _online_softmax(logit, m, s, acc, x):
    """Fold one piece's base-2 logits ([BC, BJ, 1]) into the running max m, sum of exp2 s ([BC, 1, 1])
    and exp2-weighted sum acc of x over the piece's tokens (reduced over axis 1, keep_dims)."""
    m_new = tl.maximum(m, tl.max(logit, axis=1, keep_dims=True))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)         # all -inf so far: exp2 gives 0
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(logit - m_safe)
    s = s * alpha + tl.sum(p, axis=1, keep_dims=True)
    acc = acc * alpha + tl.sum(p * x, axis=1, keep_dims=True)
    return m_new, s, acc


@triton.jit
def _safe_reciprocal(s):
    """1 / s, and 0 where s = 0 (an empty chunk) without dividing by zero."""
    return tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)


@triton.jit
def _piece(k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn,
           om, kw, offs_j3, d3, mask_d3, qk_scale,
           m_v, s_v, acc_v, m_k, s_k, acc_k,
           HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr, HAS_VALID: tl.constexpr):
    """Fold tokens [j0, j0 + BLOCK_J) of each chunk into the running statistics.

    Everything stays 3-D ([BC, BJ, BD] tiles, [BC, 1, BD] and [BC, 1, 1] reductions with keep_dims)
    so that all values share one register layout and no layout conversion is needed.
    m_v, s_v, acc_v: running max (base-2 logits), sum of exp2 and weighted value sum of the value
    softmax. m_k, s_k, acc_k: the same for the key softmax (HAS_KEY_WEIGHT), or s_k = valid count
    and acc_k = key sum for the mean (m_k unused).
    """
    tok, inside, tmask, kk, vv = _load_piece(k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn,
                                             stride_valn, offs_j3, d3, mask_d3, HAS_VALID)
    logit = _value_logits(kk, om, tmask, qk_scale, HAS_OMEGA)
    m_v, s_v, acc_v = _online_softmax(logit, m_v, s_v, acc_v, vv)                  # acc_v: [BC, 1, BD]
    if HAS_KEY_WEIGHT:  # key softmax
        m_k, s_k, acc_k = _online_softmax(_key_logits(kk, kw, tmask), m_k, s_k, acc_k, kk)
    else:  # mean: masked lanes of kk are 0
        s_k = s_k + tl.sum(tmask.to(tl.float32), axis=1, keep_dims=True)
        acc_k = acc_k + tl.sum(kk, axis=1, keep_dims=True)
    return m_v, s_v, acc_v, m_k, s_k, acc_k


@triton.jit
def _chunk_summaries_fwd(
    k_ptr, v_ptr, om_ptr, kw_ptr, valid_ptr, ks_ptr, vs_ptr, lse_ptr,
    H, N, Nc, C, n_blocks,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_oc, stride_kwh, stride_valb, stride_valn,
    stride_ksb, stride_ksh, stride_ksc, stride_vsb, stride_vsh, stride_vsc,
    stride_lb, stride_lh, stride_lc,
    qk_scale,
    HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr, HAS_VALID: tl.constexpr,
    ONE_PIECE: tl.constexpr, EVEN_D: tl.constexpr, VEC: tl.constexpr, VEC_OUT: tl.constexpr,
    OFFS_64: tl.constexpr, D: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h, blk = _program_coords(H, n_blocks)
    stride_kb, stride_kh, stride_kn = _round_strides(stride_kb, stride_kh, stride_kn, VEC)
    stride_vb, stride_vh, stride_vn = _round_strides(stride_vb, stride_vh, stride_vn, VEC)
    stride_ksb, stride_ksh, stride_ksc = _round_strides(stride_ksb, stride_ksh, stride_ksc, VEC_OUT)
    stride_vsb, stride_vsh, stride_vsc = _round_strides(stride_vsb, stride_vsh, stride_vsc, VEC_OUT)

    # per-(b, h) bases in 64 bits; offsets inside one head in 32 bits unless they may overflow
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    valid_base = valid_ptr + b * stride_valb
    c3, offs_j3, d3, mask_c3, mask_d3 = _chunk_tile(blk, Nc, OFFS_64, EVEN_D, D, BLOCK_CHUNKS, BLOCK_J, BLOCK_D)
    om, kw = _load_omega_kw(om_ptr, kw_ptr, b, h, c3, d3, mask_c3 & mask_d3, mask_d3,
                            stride_ob, stride_oh, stride_oc, stride_kwh,
                            HAS_OMEGA, HAS_KEY_WEIGHT, BLOCK_CHUNKS, BLOCK_D)

    m_v = tl.full([BLOCK_CHUNKS, 1, 1], float("-inf"), tl.float32)
    s_v = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_CHUNKS, 1, BLOCK_D], dtype=tl.float32)
    m_k = tl.full([BLOCK_CHUNKS, 1, 1], float("-inf"), tl.float32)
    s_k = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK_CHUNKS, 1, BLOCK_D], dtype=tl.float32)

    if ONE_PIECE:
        m_v, s_v, acc_v, m_k, s_k, acc_k = _piece(
            k_base, v_base, valid_base, c3, 0, N, C, stride_kn, stride_vn, stride_valn,
            om, kw, offs_j3, d3, mask_d3, qk_scale, m_v, s_v, acc_v, m_k, s_k, acc_k,
            HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID)
    else:
        for j0 in range(0, C, BLOCK_J):
            m_v, s_v, acc_v, m_k, s_k, acc_k = _piece(
                k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn,
                om, kw, offs_j3, d3, mask_d3, qk_scale, m_v, s_v, acc_v, m_k, s_k, acc_k,
                HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID)

    nonempty = s_v > 0.0                                          # [BC, 1, 1]
    inv_v = _safe_reciprocal(s_v)
    inv_k = _safe_reciprocal(s_k)
    lse = tl.where(nonempty, (m_v + tl.log2(tl.where(nonempty, s_v, 1.0))) * 0.6931471805599453,
                   float("-inf"))

    mask_o = mask_c3 & mask_d3                                    # [BC, 1, BD]
    ks_base = ks_ptr + b * stride_ksb + h * stride_ksh
    vs_base = vs_ptr + b * stride_vsb + h * stride_vsh
    tl.store(ks_base + c3 * stride_ksc + d3, (acc_k * inv_k).to(ks_ptr.dtype.element_ty), mask=mask_o)
    tl.store(vs_base + c3 * stride_vsc + d3, (acc_v * inv_v).to(vs_ptr.dtype.element_ty), mask=mask_o)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + c3 * stride_lc, lse, mask=mask_c3)


def _row_strides(t) -> tuple[int, ...]:
    """The strides of all but the last dim, 0 for dims of size 1 (only ever indexed at 0)."""
    return tuple(st if n > 1 else 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]))


def _vec(strides, D, element_size) -> int:
    """Largest power of two (at most 16 bytes' worth) dividing D and every one of `strides`."""
    g = math.gcd(D, *strides)
    vec = 1
    while vec * 2 * element_size <= 16 and g % (vec * 2) == 0:
        vec *= 2
    return vec


def block_sizes(chunk_size: int, head_dim: int, config: Optional[dict] = None) -> tuple[int, int]:
    """(BLOCK_J, BLOCK_D) for this chunk size and head dim: BLOCK_J is the config's (a power of two)
    or min(next_pow2(C), 64), never more than next_pow2(C)."""
    block_j = min(next_pow2(chunk_size), MAX_BLOCK_J)
    if config and config.get("BLOCK_J"):
        want = int(config["BLOCK_J"])
        if want < 1 or want & (want - 1):
            raise ValueError(f"config BLOCK_J must be a power of two >= 1, got {want}")
        block_j = min(want, next_pow2(chunk_size))
    return block_j, next_pow2(head_dim)


def _fit_tile(block_chunks: int, block_j: int, block_d: int, budget: int) -> tuple[int, int]:
    """(BLOCK_CHUNKS, BLOCK_J) halved until a tile holds at most `budget` elements: a config tuned
    for a neighbouring shape (other C or D) may not fit this one."""
    while block_chunks > 1 and block_chunks * block_j * block_d > budget:
        block_chunks //= 2
    while block_j > 1 and block_j * block_d > budget:
        block_j //= 2
    return block_chunks, block_j


def _valid_arg(valid, k) -> tuple:
    """(tensor, strides) to pass for the padding mask: bool seen as uint8, or k and zero strides when
    there is none."""
    if valid is None:
        return k, (0, 0)
    vl = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    return vl, vl.stride()


def _nothing(*tensors) -> None:
    """The enqueue of a problem with nothing to compute."""


_nothing.calls = ()


def prepare(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config, fast=False):
    """The launch `launch` makes for these arguments, prepared from their metadata only (shapes, strides,
    dtypes; the outputs may be meta tensors): an enqueue taking the tensors of a call with the same
    metadata, (k, v, omega, key_weight, valid, k_sum, v_sum, lse). fast: direct launches (kernel_call)."""
    B, H, N, D = k.shape
    C = min(int(chunk_size), max(N, 1))  # a chunk longer than N holds tokens [0, N): loop over those only
    Nc = k_sum.shape[2]
    if B * H * Nc == 0 or D == 0:
        return _nothing
    BLOCK_J, BLOCK_D = block_sizes(C, D, config)
    BLOCK_CHUNKS = int(config["BLOCK_CHUNKS"])
    if BLOCK_CHUNKS < 1 or BLOCK_CHUNKS & (BLOCK_CHUNKS - 1):
        raise ValueError(f"config BLOCK_CHUNKS must be a power of two >= 1, got {BLOCK_CHUNKS}")
    num_warps = int(config["num_warps"])
    BLOCK_CHUNKS, BLOCK_J = _fit_tile(BLOCK_CHUNKS, BLOCK_J, BLOCK_D, MAX_PER_THREAD * 32 * num_warps)
    n_blocks = triton.cdiv(Nc, BLOCK_CHUNKS)

    has_omega = omega is not None
    has_kw = key_weight is not None
    has_valid = valid is not None
    valid_bool = has_valid and valid.dtype == torch.bool
    so = omega.stride()[:3] if has_omega else (0, 0, 0)
    skw = key_weight.stride(0) if has_kw else 0
    sval = valid.stride() if has_valid else (0, 0)

    sk, sv, sks, svs = (_row_strides(t) for t in (k, v, k_sum, v_sum))
    # offsets inside one (b, h) (tokens, chunks, d, also on padded lanes) fit in int32?
    chunks_pad = n_blocks * BLOCK_CHUNKS
    tokens_pad = chunks_pad * C + BLOCK_J
    reach = max(tokens_pad * max(sk[2], sv[2], sval[1]),
                chunks_pad * max(so[2], sks[2], svs[2], lse.stride(2))) + BLOCK_D
    forced_64 = FORCE_OFFS_64
    offs_64 = forced_64 or reach >= 2 ** 31 or N >= 2 ** 31

    call = KernelCall(
        _chunk_summaries_fwd, (n_blocks * B * H,), 8,
        (H, N, Nc, C, n_blocks,
         *sk, *sv, so[0], so[1], so[2], skw, sval[0], sval[1], *sks, *svs,
         lse.stride(0), lse.stride(1), lse.stride(2),
         float(scale) * LOG2E),
        dict(HAS_OMEGA=has_omega, HAS_KEY_WEIGHT=has_kw, HAS_VALID=has_valid,
             ONE_PIECE=C <= BLOCK_J, EVEN_D=D == BLOCK_D,
             VEC=_vec(sk + sv, D, k.element_size()), VEC_OUT=_vec(sks + svs, D, k_sum.element_size()),
             OFFS_64=offs_64, D=D,
             BLOCK_CHUNKS=BLOCK_CHUNKS, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D),
        dict(num_warps=num_warps, num_stages=int(config["num_stages"])), fast=fast)

    def enqueue(k, v, omega, key_weight, valid, k_sum, v_sum, lse):
        if FORCE_OFFS_64 != forced_64:  # a test switched the 64-bit path since: prepare again
            launch(k, v, omega, key_weight, valid, k_sum, v_sum, lse, chunk_size=chunk_size, scale=scale,
                   config=config)
            return
        # absent inputs are stood in for by k (never read); the padding mask is read as bytes
        call(k, v, omega if has_omega else k, key_weight if has_kw else k,
             (valid.view(torch.uint8) if valid_bool else valid) if has_valid else k, k_sum, v_sum, lse)

    enqueue.calls = (call,)  # what it launches (tests)
    return enqueue


def launch(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config):
    """Fill k_sum, v_sum ([B, Hkv, Nc, D], k's dtype) and lse (fp32 [B, Hkv, Nc]).

    k, v: [B, Hkv, N, D] with a unit last stride. omega: None or a [B, Hkv, Nc, D] view (stride 0 is
    fine). key_weight: None or [Hkv, D]. valid: None or bool [B, N] (any strides). config (complete,
    from call_plan.config or complete_config): BLOCK_CHUNKS, num_warps, num_stages, optional BLOCK_J.
    """
    prepare(k, v, omega, key_weight, valid, k_sum, v_sum, lse, chunk_size=chunk_size, scale=scale,
            config=config)(k, v, omega, key_weight, valid, k_sum, v_sum, lse)
