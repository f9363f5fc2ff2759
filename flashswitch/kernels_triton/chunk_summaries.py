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

import torch
import triton
import triton.language as tl

from flashswitch.autotune import space

LOG2E = 1.4426950408889634
MAX_BLOCK_J = 64


@triton.jit
def _piece(k_ptr, v_ptr, valid_ptr, b, h, chunk, j0, N, C,
           stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_valb, stride_valn,
           om, kw, offs_j, offs_d, mask_d, qk_scale,
           m_v, s_v, acc_v, m_k, s_k, acc_k,
           HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr, HAS_VALID: tl.constexpr,
           VEC: tl.constexpr):
    """Fold tokens [j0, j0 + BLOCK_J) of each chunk into the running statistics.

    m_v, s_v, acc_v: running max (base-2 logits), sum of exp2 and weighted value sum of the value
    softmax. m_k, s_k, acc_k: the same for the key softmax (HAS_KEY_WEIGHT), or s_k = valid count
    and acc_k = key sum for the mean (m_k unused).
    """
    j = j0 + offs_j                                               # [BJ]
    tok = chunk[:, None] * C + j[None, :]                         # [BC, BJ] int64
    tmask = (j[None, :] < C) & (tok < N)                          # [BC, BJ]
    if HAS_VALID:
        ok = tl.load(valid_ptr + b * stride_valb + tok * stride_valn, mask=tmask, other=0)
        tmask = tmask & (ok != 0)
    mask3 = tmask[:, :, None] & mask_d[None, None, :]             # [BC, BJ, BD]
    d3 = offs_d[None, None, :]
    # every row starts at a multiple of VEC elements: lets odd D (76) use vector loads
    krow = tl.multiple_of(b * stride_kb + h * stride_kh + tok * stride_kn, [VEC, VEC])
    vrow = tl.multiple_of(b * stride_vb + h * stride_vh + tok * stride_vn, [VEC, VEC])
    kk = tl.load(k_ptr + krow[:, :, None] + d3, mask=mask3, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + vrow[:, :, None] + d3, mask=mask3, other=0.0).to(tl.float32)
    if HAS_VALID:  # padding may hold anything (inf, NaN): keep it out of every sum
        kk = tl.where(mask3, kk, 0.0)
        vv = tl.where(mask3, vv, 0.0)

    # value softmax: l = scale * (omega . k - |k|^2 / 2), here in base 2
    if HAS_OMEGA:
        logit = tl.sum(kk * (om[:, None, :] - 0.5 * kk), axis=2) * qk_scale
    else:
        logit = tl.sum(kk * kk, axis=2) * (-0.5 * qk_scale)
    logit = tl.where(tmask, logit, float("-inf"))
    m_new = tl.maximum(m_v, tl.max(logit, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)         # all -inf so far: exp2 gives 0
    alpha = tl.exp2(m_v - m_safe)
    p = tl.exp2(logit - m_safe[:, None])
    s_v = s_v * alpha + tl.sum(p, axis=1)
    acc_v = acc_v * alpha[:, None] + tl.sum(p[:, :, None] * vv, axis=1)
    m_v = m_new

    if HAS_KEY_WEIGHT:  # key softmax: a = key_weight_h . k (no scale)
        a = tl.sum(kk * kw[None, None, :], axis=2) * 1.4426950408889634
        a = tl.where(tmask, a, float("-inf"))
        mk_new = tl.maximum(m_k, tl.max(a, axis=1))
        mk_safe = tl.where(mk_new == float("-inf"), 0.0, mk_new)
        beta = tl.exp2(m_k - mk_safe)
        q = tl.exp2(a - mk_safe[:, None])
        s_k = s_k * beta + tl.sum(q, axis=1)
        acc_k = acc_k * beta[:, None] + tl.sum(q[:, :, None] * kk, axis=1)
        m_k = mk_new
    else:  # mean: masked lanes of kk are 0
        s_k = s_k + tl.sum(tmask.to(tl.float32), axis=1)
        acc_k = acc_k + tl.sum(kk, axis=1)
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
    D: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n_blocks
    blk = pid - bh * n_blocks
    b = bh // H
    h = bh - b * H

    chunk = blk * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS).to(tl.int64)   # [BC]
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c = chunk < Nc
    if EVEN_D:  # no lane past D: a constant mask lets the compiler vectorize any power-of-two D
        mask_d = offs_d < BLOCK_D
    else:
        mask_d = offs_d < D

    if HAS_OMEGA:
        om = tl.load(om_ptr + b * stride_ob + h * stride_oh + chunk[:, None] * stride_oc + offs_d[None, :],
                     mask=mask_c[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    else:
        om = tl.zeros([BLOCK_CHUNKS, BLOCK_D], dtype=tl.float32)
    if HAS_KEY_WEIGHT:
        kw = tl.load(kw_ptr + h * stride_kwh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        kw = tl.zeros([BLOCK_D], dtype=tl.float32)

    m_v = tl.full([BLOCK_CHUNKS], float("-inf"), tl.float32)
    s_v = tl.zeros([BLOCK_CHUNKS], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_CHUNKS, BLOCK_D], dtype=tl.float32)
    m_k = tl.full([BLOCK_CHUNKS], float("-inf"), tl.float32)
    s_k = tl.zeros([BLOCK_CHUNKS], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK_CHUNKS, BLOCK_D], dtype=tl.float32)

    if ONE_PIECE:
        m_v, s_v, acc_v, m_k, s_k, acc_k = _piece(
            k_ptr, v_ptr, valid_ptr, b, h, chunk, 0, N, C,
            stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_valb, stride_valn,
            om, kw, offs_j, offs_d, mask_d, qk_scale, m_v, s_v, acc_v, m_k, s_k, acc_k,
            HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID, VEC)
    else:
        for j0 in range(0, C, BLOCK_J):
            m_v, s_v, acc_v, m_k, s_k, acc_k = _piece(
                k_ptr, v_ptr, valid_ptr, b, h, chunk, j0, N, C,
                stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_valb, stride_valn,
                om, kw, offs_j, offs_d, mask_d, qk_scale, m_v, s_v, acc_v, m_k, s_k, acc_k,
                HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID, VEC)

    nonempty = s_v > 0.0
    inv_v = tl.where(nonempty, 1.0 / tl.where(nonempty, s_v, 1.0), 0.0)
    v_out = acc_v * inv_v[:, None]
    k_ok = s_k > 0.0
    inv_k = tl.where(k_ok, 1.0 / tl.where(k_ok, s_k, 1.0), 0.0)
    k_out = acc_k * inv_k[:, None]
    lse = tl.where(nonempty, (m_v + tl.log2(tl.where(nonempty, s_v, 1.0))) * 0.6931471805599453,
                   float("-inf"))

    mask_o = mask_c[:, None] & mask_d[None, :]
    ksrow = tl.multiple_of(b * stride_ksb + h * stride_ksh + chunk * stride_ksc, [VEC_OUT])
    vsrow = tl.multiple_of(b * stride_vsb + h * stride_vsh + chunk * stride_vsc, [VEC_OUT])
    tl.store(ks_ptr + ksrow[:, None] + offs_d[None, :], k_out.to(ks_ptr.dtype.element_ty), mask=mask_o)
    tl.store(vs_ptr + vsrow[:, None] + offs_d[None, :], v_out.to(vs_ptr.dtype.element_ty), mask=mask_o)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + chunk * stride_lc, lse, mask=mask_c)


def _vec(a, b, D) -> int:
    """Largest power of two (at most 16 bytes' worth) dividing D and the row strides of a and b
    (dims of size 1 are only ever indexed at 0)."""
    g = math.gcd(D, *(st for t in (a, b) for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))
    vec = 1
    while vec * 2 * a.element_size() <= 16 and g % (vec * 2) == 0:
        vec *= 2
    return vec


def block_sizes(chunk_size: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_J, BLOCK_D) the kernel uses for this chunk size and head dim."""
    return min(space.next_pow2(chunk_size), MAX_BLOCK_J), space.next_pow2(head_dim)


def launch(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config):
    """Fill k_sum, v_sum ([B, Hkv, Nc, D], k's dtype) and lse (fp32 [B, Hkv, Nc]).

    k, v: [B, Hkv, N, D] with a unit last stride. omega: None or a [B, Hkv, Nc, D] view (stride 0 is
    fine). key_weight: None or [Hkv, D]. valid: None or bool [B, N] (any strides). config:
    BLOCK_CHUNKS, num_warps, num_stages (missing keys take the heuristic default).
    """
    B, H, N, D = k.shape
    C = int(chunk_size)
    Nc = k_sum.shape[2]
    if B * H * Nc == 0 or D == 0:
        return
    BLOCK_J, BLOCK_D = block_sizes(C, D)
    cfg = dict(config or {})
    if "BLOCK_CHUNKS" not in cfg:
        feats = space.features("chunk_summaries", dtype="", D=D, C=C, rows=B * H * N)
        cfg = {**space.default_config("chunk_summaries", "triton", feats), **cfg}
    BLOCK_CHUNKS = int(cfg["BLOCK_CHUNKS"])
    if BLOCK_CHUNKS < 1 or BLOCK_CHUNKS & (BLOCK_CHUNKS - 1):
        raise ValueError(f"config BLOCK_CHUNKS must be a power of two >= 1, got {BLOCK_CHUNKS}")
    n_blocks = triton.cdiv(Nc, BLOCK_CHUNKS)

    has_omega = omega is not None
    has_kw = key_weight is not None
    has_valid = valid is not None
    om = omega if has_omega else k
    so = omega.stride()[:3] if has_omega else (0, 0, 0)
    kw = key_weight if has_kw else k
    skw = key_weight.stride(0) if has_kw else 0
    if has_valid:
        vl = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
        sval = vl.stride()
    else:
        vl, sval = k, (0, 0)

    grid = (n_blocks * B * H,)
    _chunk_summaries_fwd[grid](
        k, v, om, kw, vl, k_sum, v_sum, lse,
        H, N, Nc, C, n_blocks,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        so[0], so[1], so[2], skw, sval[0], sval[1],
        k_sum.stride(0), k_sum.stride(1), k_sum.stride(2), v_sum.stride(0), v_sum.stride(1), v_sum.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        float(scale) * LOG2E,
        HAS_OMEGA=has_omega, HAS_KEY_WEIGHT=has_kw, HAS_VALID=has_valid,
        ONE_PIECE=C <= BLOCK_J, EVEN_D=D == BLOCK_D,
        VEC=_vec(k, v, D), VEC_OUT=_vec(k_sum, v_sum, D), D=D,
        BLOCK_CHUNKS=BLOCK_CHUNKS, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D,
        num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 2)),
    )
