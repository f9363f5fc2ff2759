"""Op 1 backward in Triton: d k, d v, d omega, d key_weight of the chunk summaries (SPEC.md, op 1).

Same tiling as the forward: one program handles BLOCK_CHUNKS consecutive chunks of one (batch,
head) on [BLOCK_CHUNKS, BLOCK_J, BLOCK_D] tiles (token = chunk * C + j). Nothing from the forward is
needed: the program recomputes the value softmax p_j (and the key softmax a_j) of its chunks from k,
omega, key_weight, together with the centring terms delta_v = sum_j p_j dv_sum . v_j and
delta_k = sum_j a_j dk_sum . k_j in fp32, then writes

    dv_j = p_j dv_sum
    dl_j = p_j (dv_sum . v_j - delta_v + dlse)
    dk_j = s dl_j (omega - k_j) + dk_sum / n_c                                      (mean keys)
         = s dl_j (omega - k_j) + a_j dk_sum + g_j key_weight,
           g_j = a_j (dk_sum . k_j - delta_k)                                       (weighted keys)
    domega_c = s sum_j dl_j k_j,  dkey_weight += sum_j g_j k_j

When a chunk fits one BLOCK_J piece (C <= BLOCK_J) its tiles are loaded once and serve both the
statistics and the gradients; a longer chunk is read twice (statistics pass, then gradient pass).
Padding tokens (valid False) get exact zeros. d omega of a per-head omega and d key_weight are sums
over chunks and batches: each program writes its fp32 partial, and the launcher sums the partials
with torch.sum (a fixed order: bitwise deterministic, no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch._common import new_output
from flashswitch.kernels_triton.kernel_call import KernelCall
from flashswitch.kernels_triton.chunk_summaries import (LOG2E, _chunk_tile, _fit_tile, _key_logits, _load_omega_kw,
                                                        _load_piece, _online_softmax, _program_coords,
                                                        _round_strides, _row_strides, _safe_reciprocal,
                                                        _valid_arg, _value_logits, _vec, block_sizes)

MAX_PER_THREAD = 64  # elements of one k (or v) tile per thread a launch accepts (dk, dv tiles double it)
FORCE_OFFS_64 = False  # 64-bit offsets even where 32 bits suffice (tests of that path)


@triton.jit
def _piece_terms(k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn,
                 offs_j3, d3, mask_d3, om, kw, dks, dvs, qk_scale,
                 HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr, HAS_VALID: tl.constexpr):
    """Load tokens [j0, j0 + BLOCK_J) of each chunk (see _load_piece) and their per-token values
    ([BC, BJ, 1]): value logit l2 and key logit z2 (base 2, -inf off tmask), gv = dv_sum . v_j and
    gk = dk_sum . k_j (0 off tmask). Returns (tok, inside, tmask, kk, l2, z2, gv, gk)."""
    tok, inside, tmask, kk, vv = _load_piece(k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn,
                                             stride_valn, offs_j3, d3, mask_d3, HAS_VALID)
    l2 = _value_logits(kk, om, tmask, qk_scale, HAS_OMEGA)
    gv = tl.sum(vv * dvs, axis=2, keep_dims=True)
    if HAS_KEY_WEIGHT:
        z2 = _key_logits(kk, kw, tmask)
        gk = tl.sum(kk * dks, axis=2, keep_dims=True)
    else:  # unused
        z2 = l2
        gk = gv
    return tok, inside, tmask, kk, l2, z2, gv, gk


@triton.jit
def _fold_stats(l2, z2, gv, gk, tmask, m_v, s_v, t_v, m_k, s_k, t_k, HAS_KEY_WEIGHT: tl.constexpr):
    """Online (running-max) softmax statistics of one piece: max, sum of exp2 and the exp2-weighted
    sum of gv (gk) per chunk; without key_weight s_k counts the valid tokens."""
    m_v, s_v, t_v = _online_softmax(l2, m_v, s_v, t_v, gv)
    if HAS_KEY_WEIGHT:
        m_k, s_k, t_k = _online_softmax(z2, m_k, s_k, t_k, gk)
    else:
        s_k = s_k + tl.sum(tmask.to(tl.float32), axis=1, keep_dims=True)
    return m_v, s_v, t_v, m_k, s_k, t_k


@triton.jit
def _finish_stats(m, s, t):
    """(log2 normaliser, t / s) per chunk; an empty chunk (s = 0) gives (0, 0) so that exp2 of its
    -inf logits is 0 and nothing is NaN."""
    nonempty = s > 0.0
    s_safe = tl.where(nonempty, s, 1.0)
    lse2 = tl.where(nonempty, m + tl.log2(s_safe), 0.0)
    return lse2, tl.where(nonempty, t / s_safe, 0.0)


@triton.jit
def _gradient_terms(m_v, s_v, t_v, m_k, s_k, t_k):
    """What the gradient pass needs of the finished statistics: (lse2_v, delta_v, lse2_k, delta_k,
    inv_n), inv_n = 1 / valid count for mean keys."""
    lse2_v, delta_v = _finish_stats(m_v, s_v, t_v)
    lse2_k, delta_k = _finish_stats(m_k, s_k, t_k)
    return lse2_v, delta_v, lse2_k, delta_k, _safe_reciprocal(s_k)


@triton.jit
def _piece_grads(tok, inside, tmask, kk, l2, z2, gv, gk, om, kw, dks, dvs, dlse, scale,
                 lse2_v, delta_v, lse2_k, delta_k, inv_n, dom_acc, dkw_acc,
                 dk_base, dv_base, stride_dkn, stride_dvn, d3, mask_d3,
                 HAS_OMEGA: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr):
    """Write dk, dv of one piece (zeros for padding) and fold its d omega / d key_weight terms."""
    p = tl.exp2(l2 - lse2_v)                                      # [BC, BJ, 1], 0 off tmask
    dl = p * (gv - delta_v + dlse)
    sdl = scale * dl
    if HAS_OMEGA:
        dk = sdl * (om - kk)
    else:
        dk = -sdl * kk
    dom_acc += tl.sum(sdl * kk, axis=1, keep_dims=True)           # [BC, 1, BD]
    if HAS_KEY_WEIGHT:
        a = tl.exp2(z2 - lse2_k)
        g = a * (gk - delta_k)
        dk += a * dks + g * kw
        dkw_acc += tl.sum(g * kk, axis=1, keep_dims=True)
    else:
        dk += tl.where(tmask, inv_n, 0.0) * dks
    mask = inside & mask_d3
    tl.store(dk_base + tok * stride_dkn + d3, dk.to(dk_base.dtype.element_ty), mask=mask)
    tl.store(dv_base + tok * stride_dvn + d3, (p * dvs).to(dv_base.dtype.element_ty), mask=mask)
    return dom_acc, dkw_acc


@triton.jit
def _chunk_summaries_bwd(
    k_ptr, v_ptr, om_ptr, kw_ptr, valid_ptr, dks_ptr, dvs_ptr, dlse_ptr,
    dk_ptr, dv_ptr, dom_ptr, dkw_ptr,
    H, N, Nc, C, n_blocks,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_oc, stride_kwh, stride_valb, stride_valn,
    stride_dksb, stride_dksh, stride_dksc, stride_dvsb, stride_dvsh, stride_dvsc,
    stride_dlb, stride_dlh, stride_dlc,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dob, stride_doh, stride_doc, stride_dkwb, stride_dkwh, stride_dkwc,
    scale, qk_scale,
    HAS_OMEGA: tl.constexpr, OMEGA_PER_CHUNK: tl.constexpr, HAS_KEY_WEIGHT: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_DLSE: tl.constexpr,
    ONE_PIECE: tl.constexpr, EVEN_D: tl.constexpr, VEC: tl.constexpr,
    OFFS_64: tl.constexpr, D: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h, blk = _program_coords(H, n_blocks)
    # rows of k, v, dk, dv start at multiples of VEC elements (the launcher checks it)
    stride_kb, stride_kh, stride_kn = _round_strides(stride_kb, stride_kh, stride_kn, VEC)
    stride_vb, stride_vh, stride_vn = _round_strides(stride_vb, stride_vh, stride_vn, VEC)
    stride_dkb, stride_dkh, stride_dkn = _round_strides(stride_dkb, stride_dkh, stride_dkn, VEC)
    stride_dvb, stride_dvh, stride_dvn = _round_strides(stride_dvb, stride_dvh, stride_dvn, VEC)

    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    dk_base = dk_ptr + b * stride_dkb + h * stride_dkh
    dv_base = dv_ptr + b * stride_dvb + h * stride_dvh
    valid_base = valid_ptr + b * stride_valb
    c3, offs_j3, d3, mask_c3, mask_d3 = _chunk_tile(blk, Nc, OFFS_64, EVEN_D, D, BLOCK_CHUNKS, BLOCK_J, BLOCK_D)
    mask_cd = mask_c3 & mask_d3

    om, kw = _load_omega_kw(om_ptr, kw_ptr, b, h, c3, d3, mask_cd, mask_d3, stride_ob, stride_oh, stride_oc,
                            stride_kwh, HAS_OMEGA, HAS_KEY_WEIGHT, BLOCK_CHUNKS, BLOCK_D)
    dks = tl.load(dks_ptr + b * stride_dksb + h * stride_dksh + c3 * stride_dksc + d3,
                  mask=mask_cd, other=0.0).to(tl.float32)
    dvs = tl.load(dvs_ptr + b * stride_dvsb + h * stride_dvsh + c3 * stride_dvsc + d3,
                  mask=mask_cd, other=0.0).to(tl.float32)
    if HAS_DLSE:
        dlse = tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + c3 * stride_dlc,
                       mask=mask_c3, other=0.0).to(tl.float32)
    else:
        dlse = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)

    m_v = tl.full([BLOCK_CHUNKS, 1, 1], float("-inf"), tl.float32)
    s_v = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    t_v = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    m_k = tl.full([BLOCK_CHUNKS, 1, 1], float("-inf"), tl.float32)
    s_k = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    t_k = tl.zeros([BLOCK_CHUNKS, 1, 1], dtype=tl.float32)
    dom_acc = tl.zeros([BLOCK_CHUNKS, 1, BLOCK_D], dtype=tl.float32)
    dkw_acc = tl.zeros([BLOCK_CHUNKS, 1, BLOCK_D], dtype=tl.float32)

    if ONE_PIECE:  # the whole chunk is one tile: load once, statistics then gradients
        tok, inside, tmask, kk, l2, z2, gv, gk = _piece_terms(
            k_base, v_base, valid_base, c3, 0, N, C, stride_kn, stride_vn, stride_valn, offs_j3, d3, mask_d3,
            om, kw, dks, dvs, qk_scale, HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID)
        m_v, s_v, t_v, m_k, s_k, t_k = _fold_stats(l2, z2, gv, gk, tmask, m_v, s_v, t_v, m_k, s_k, t_k,
                                                   HAS_KEY_WEIGHT)
        lse2_v, delta_v, lse2_k, delta_k, inv_n = _gradient_terms(m_v, s_v, t_v, m_k, s_k, t_k)
        dom_acc, dkw_acc = _piece_grads(tok, inside, tmask, kk, l2, z2, gv, gk, om, kw, dks, dvs, dlse, scale,
                                        lse2_v, delta_v, lse2_k, delta_k, inv_n, dom_acc, dkw_acc,
                                        dk_base, dv_base, stride_dkn, stride_dvn, d3, mask_d3,
                                        HAS_OMEGA, HAS_KEY_WEIGHT)
    else:  # longer chunks: a statistics pass, then a gradient pass over the same pieces
        for j0 in range(0, C, BLOCK_J):
            tok, inside, tmask, kk, l2, z2, gv, gk = _piece_terms(
                k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn, offs_j3, d3, mask_d3,
                om, kw, dks, dvs, qk_scale, HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID)
            m_v, s_v, t_v, m_k, s_k, t_k = _fold_stats(l2, z2, gv, gk, tmask, m_v, s_v, t_v, m_k, s_k, t_k,
                                                       HAS_KEY_WEIGHT)
        lse2_v, delta_v, lse2_k, delta_k, inv_n = _gradient_terms(m_v, s_v, t_v, m_k, s_k, t_k)
        for j0 in range(0, C, BLOCK_J):
            tok, inside, tmask, kk, l2, z2, gv, gk = _piece_terms(
                k_base, v_base, valid_base, c3, j0, N, C, stride_kn, stride_vn, stride_valn, offs_j3, d3, mask_d3,
                om, kw, dks, dvs, qk_scale, HAS_OMEGA, HAS_KEY_WEIGHT, HAS_VALID)
            dom_acc, dkw_acc = _piece_grads(tok, inside, tmask, kk, l2, z2, gv, gk, om, kw, dks, dvs, dlse,
                                            scale, lse2_v, delta_v, lse2_k, delta_k, inv_n, dom_acc, dkw_acc,
                                            dk_base, dv_base, stride_dkn, stride_dvn, d3, mask_d3,
                                            HAS_OMEGA, HAS_KEY_WEIGHT)

    if HAS_OMEGA:
        dom_base = dom_ptr + b * stride_dob + h * stride_doh
        if OMEGA_PER_CHUNK:  # d omega_c itself, in omega's dtype
            tl.store(dom_base + c3 * stride_doc + d3, dom_acc.to(dom_ptr.dtype.element_ty), mask=mask_cd)
        else:  # fp32 partial of this program's chunks
            tl.store(dom_base + blk * stride_doc + d3, tl.sum(dom_acc, axis=0, keep_dims=True), mask=mask_d3)
    if HAS_KEY_WEIGHT:
        tl.store(dkw_ptr + b * stride_dkwb + h * stride_dkwh + blk * stride_dkwc + d3,
                 tl.sum(dkw_acc, axis=0, keep_dims=True), mask=mask_d3)


def tile(chunk_size: int, head_dim: int, config: dict) -> tuple[int, int, int, int]:
    """(BLOCK_CHUNKS, BLOCK_J, BLOCK_D, num_warps) a launch uses: the config's, with BLOCK_J at most
    next_pow2(C) (default min(next_pow2(C), 64)), shrunk to at most MAX_PER_THREAD elements of a
    tile per thread (a config tuned for another C or D may not fit this one)."""
    try:
        BLOCK_CHUNKS = int(config["BLOCK_CHUNKS"])
        num_warps = int(config["num_warps"])
    except KeyError as err:
        raise ValueError(f"config must give {err.args[0]} (got {config})") from None
    if BLOCK_CHUNKS < 1 or BLOCK_CHUNKS & (BLOCK_CHUNKS - 1):
        raise ValueError(f"config BLOCK_CHUNKS must be a power of two >= 1, got {BLOCK_CHUNKS}")
    block_j, block_d = block_sizes(chunk_size, head_dim, config)
    BLOCK_CHUNKS, block_j = _fit_tile(BLOCK_CHUNKS, block_j, block_d, MAX_PER_THREAD * 32 * num_warps)
    return BLOCK_CHUNKS, block_j, block_d, num_warps


def launch(k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkey_weight, *,
           chunk_size, scale, config):
    """Fill dk, dv ([B, Hkv, N, D], k's dtype), domega (omega's shape and dtype) and dkey_weight
    ([Hkv, D], key_weight's dtype).

    k, v: [B, Hkv, N, D] with a unit last stride. omega: None, [Hkv, D] or [B, Hkv, Nc, D] (stride 0
    is fine). key_weight: None or [Hkv, D]. valid: None or bool [B, N]. dk_sum, dv_sum: [B, Hkv, Nc, D]
    (unit last stride); dlse: None (no gradient into lse) or [B, Hkv, Nc]. domega / dkey_weight: None
    where omega / key_weight is. config: BLOCK_CHUNKS, num_warps, optional BLOCK_J and num_stages.
    """
    tensors = (k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkey_weight)
    prepare(*tensors, chunk_size=chunk_size, scale=scale, config=config)(*tensors)


def prepare(k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkey_weight, *,
            chunk_size, scale, config, fast=False):
    """The launch `launch` makes for these arguments, prepared from their metadata (shapes, strides,
    dtypes, device; which of omega, key_weight, valid, dlse are given): an enqueue taking the 12 tensors
    of a call with the same metadata, in `launch`'s order. The per-program partials of a per-head omega
    and of key_weight are allocated, and summed in a fixed order, per call. fast: direct launches."""
    B, H, N, D = k.shape
    Nc = -(-N // int(chunk_size))
    C = min(int(chunk_size), max(N, 1))  # a chunk longer than N holds tokens [0, N): loop over those only
    if B * H * N == 0 or D == 0:  # no token or nothing to read: every gradient is 0
        def zero(*tensors):
            for g in tensors[8:]:
                if g is not None:
                    g.zero_()
        return zero
    BLOCK_CHUNKS, BLOCK_J, BLOCK_D, num_warps = tile(C, D, config)
    n_blocks = triton.cdiv(Nc, BLOCK_CHUNKS)

    has_omega = omega is not None
    per_chunk = has_omega and omega.dim() == 4
    has_kw = key_weight is not None
    has_valid = valid is not None
    has_dlse = dlse is not None
    device = k.device
    part_shape = (B, H, n_blocks, D)  # fp32 partials, one row per program
    part_strides = torch.empty(part_shape, device="meta").stride()[:3]

    def omega_view(omega):
        return omega if per_chunk else omega[None, :, None, :].expand(B, H, Nc, D)

    if has_omega:
        so = omega_view(omega).stride()[:3]
        sdo = domega.stride()[:3] if per_chunk else part_strides
    else:
        so, sdo = (0, 0, 0), (0, 0, 0)
    skw, sdkw = (key_weight.stride(0), part_strides) if has_kw else (0, (0, 0, 0))
    sval = _valid_arg(valid, k)[1]
    sdl = dlse.stride() if has_dlse else (0, 0, 0)

    sk, sv, sdk, sdv = (_row_strides(t) for t in (k, v, dk, dv))
    sdks, sdvs = _row_strides(dk_sum), _row_strides(dv_sum)
    chunks_pad = n_blocks * BLOCK_CHUNKS
    tokens_pad = chunks_pad * C + BLOCK_J
    reach = max(tokens_pad * max(sk[2], sv[2], sdk[2], sdv[2], sval[1]),
                chunks_pad * max(so[2], sdo[2], sdks[2], sdvs[2], sdl[2]), n_blocks * sdkw[2]) + BLOCK_D
    offs_64 = FORCE_OFFS_64 or reach >= 2 ** 31 or N >= 2 ** 31

    call = KernelCall(
        _chunk_summaries_bwd, (n_blocks * B * H,), 12,
        (H, N, Nc, C, n_blocks, *sk, *sv, *so, skw, sval[0], sval[1], *sdks, *sdvs, *sdl, *sdk, *sdv, *sdo, *sdkw,
         float(scale), float(scale) * LOG2E),
        dict(HAS_OMEGA=has_omega, OMEGA_PER_CHUNK=per_chunk, HAS_KEY_WEIGHT=has_kw, HAS_VALID=has_valid,
             HAS_DLSE=has_dlse, ONE_PIECE=C <= BLOCK_J, EVEN_D=D == BLOCK_D,
             VEC=_vec(sk + sv + sdk + sdv, D, k.element_size()), OFFS_64=offs_64, D=D,
             BLOCK_CHUNKS=BLOCK_CHUNKS, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D),
        dict(num_warps=num_warps, num_stages=int(config.get("num_stages", 1))), fast=fast)

    def enqueue(k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkey_weight):
        if has_omega:
            # per-head omega: one fp32 partial row per program, summed below in a fixed order
            om = omega_view(omega)
            dom = domega if per_chunk else new_output(part_shape, torch.float32, device)
        else:
            om = dom = k
        dkw = new_output(part_shape, torch.float32, device) if has_kw else k
        call(k, v, om, key_weight if has_kw else k, _valid_arg(valid, k)[0], dk_sum, dv_sum,
             dlse if has_dlse else k, dk, dv, dom, dkw)
        if has_omega and not per_chunk:
            domega.copy_(dom.sum(dim=(0, 2)))
        if has_kw:
            dkey_weight.copy_(dkw.sum(dim=(0, 2)))

    enqueue.calls = (call,)  # what it launches (tests)
    return enqueue
