"""SwitchHead's output projection as one dense GEMM over every expert, forward and backward kernels.

The projection (nn/switchhead.py) is routed: token t uses k of head h's E experts with gates,
    y[t] = Σ_h Σ_e w[t, h·E + e] · a[t, h] @ weight[h·E + e]      a [T, H, D], weight [H·E, D, d],
where the dense gate table w [T, H·E] (fp32) holds each picked expert's gate and 0 elsewhere. That is
the dense GEMM y = Z · W_cat with
    Z[t, kk] = w[t, kk // D] · a[t, kk // (E·D), kk % D],   W_cat = weight viewed as [H·E·D, d],
which does E / k times the routed multiply-adds, shaped as a dense GEMM: no gather of the pairs, no
slot reduction (op 3's atomics or ordered scratch), no routing sort. Z is never stored: each K block of
it is built in registers from a and w (`_z_tile`), rounded to a's dtype (the one rounding of the gated
value, as op 3's DENSE_Z) and fed to tl.dot with fp32 accumulation. K runs over H·E·D in power-of-two
blocks with masks at its end only, so a head dim such as 112 or 76 costs no padded multiply-adds. fp32
master weights with 16-bit a are cast per tile in registers, as op 3 does.
The row-scale form (`_forward_rows_kernel`, form "rows") runs K over the H·E expert blocks instead, each
padded from D to a multiple of its K step (masked): a Z block is a's contiguous head tile times one gate
per row, so a and W load affinely and the pipeliner prefetches both; FORWARD_FORM picks the form.

Backward (dZ = dy · W_catᵀ is never stored either):
- `_da_dw_kernel`, one program per (token tile, head h): for each expert e of h, acc_e = dy · W[h·E+e]ᵀ
  over d (D padded to a power of two, masked); da[t, h] = Σ_e w[t, h·E+e] · acc_e and the gate-table
  gradient dw[t, h·E+e] = a[t, h] · acc_e, both from registers.
- `_dweight_kernel`: dW_cat = Zᵀ · dy, tiled over W_cat's rows as the forward tiles its K (no padding
  of D), the token sum split over `splits` ranges on a GPU with few output tiles: fp32 partial sums
  that `_sum_splits` adds in split order. No float atomics anywhere: the backward is deterministic.
  Its row-scale form `_dweight_rows_kernel` (DWEIGHT_FORM "rows") tiles per expert block as the
  row-scale forward does.
- dgates[t, s] = dw[t, ids[t, s]] (`_gate_grad_kernel`).

Tiles come from `triton.autotune` over a short list per kernel, keyed on the shape (the interpreter
takes the first config of each list). Every output is allocated by `new_output` (NaN under
FLASHSWITCH_POISON). `switchhead_output` is the public, differentiable call.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.autograd import forward_ad

from flashswitch import _common as C
from flashswitch.kernels_triton.expert_matmul import _aligned, _pow2_divisor

INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- kernels
@triton.jit
def _z_tile(a_ptr, g_ptr, t64, tmask, k0, s_at, s_ah, s_gt,
            D: tl.constexpr, E: tl.constexpr, H: tl.constexpr, DIV: tl.constexpr, BT: tl.constexpr,
            BK: tl.constexpr):
    """Z[t, k0 : k0 + BK] in a's dtype: w[t, kk // D] · a[t, kk // (E·D), kk % D] (0 past H·E·D and for
    masked tokens). The gate of each column comes from the at most (BK - 1) // D + 2 experts that a
    block of BK columns touches: one [BT] load each, selected per column, instead of a [BT, BK] gather."""
    kk = k0 + tl.arange(0, BK)
    he = kk // D
    j = kk - he * D
    # columns come in runs of DIV contiguous elements starting at multiples of DIV (the host checked
    # that DIV divides D and a's strides): vector loads
    col = tl.max_contiguous(tl.multiple_of((he // E) * s_ah + j, DIV), DIV)
    kmask = kk < H * E * D
    a = tl.load(a_ptr + t64[:, None] * s_at + col[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
    he0 = k0 // D
    gate = tl.zeros((BT, BK), dtype=tl.float32)
    for m in tl.static_range((BK - 1) // D + 2):
        gm = tl.load(g_ptr + t64 * s_gt + he0 + m, mask=tmask & (he0 + m < H * E), other=0.0)
        gate = tl.where(he[None, :] == he0 + m, gm[:, None], gate)
    return (a.to(tl.float32) * gate).to(a_ptr.dtype.element_ty)


@triton.jit
def _grouped_tile(T, d, BT: tl.constexpr, BN: tl.constexpr, GROUP_T: tl.constexpr):
    """(t64, tmask, offs_n, nmask): the tokens and columns of this program's output tile. GROUP_T token
    tiles side by side sweep the column tiles together, so their W_cat columns and a rows are read from
    L2."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BT)
    width = GROUP_T * tl.cdiv(d, BN)
    first_t = (pid // width) * GROUP_T
    rows = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_t = pid_t * BT + tl.arange(0, BT)
    tmask = offs_t < T
    t64 = offs_t.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return t64, tmask, offs_n, offs_n < d


@triton.jit
def _forward_kernel(a_ptr, g_ptr, w_ptr, y_ptr, T, T_BUCKET, d, s_at, s_ah, s_gt, s_we, s_wk, s_wn, s_yt,
                    D: tl.constexpr, E: tl.constexpr, H: tl.constexpr, DIV: tl.constexpr, DIV_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_T: tl.constexpr):
    """y[t tile, n tile] = Σ over K blocks of Z[t tile, K block] · W_cat[K block, n tile]."""
    s_at, s_ah = _aligned(s_at, DIV), _aligned(s_ah, DIV)
    d, s_we, s_wk, s_yt = _aligned(d, DIV_N), _aligned(s_we, DIV_N), _aligned(s_wk, DIV_N), _aligned(s_yt, DIV_N)
    t64, tmask, offs_n, nmask = _grouped_tile(T, d, BT, BN, GROUP_T)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, H * E * D, BK):
        z = _z_tile(a_ptr, g_ptr, t64, tmask, k0, s_at, s_ah, s_gt, D, E, H, DIV, BT, BK)
        kk = k0 + tl.arange(0, BK)
        he = kk // D
        w_rows = he.to(tl.int64) * s_we + (kk - he * D) * s_wk
        w = tl.load(w_ptr + w_rows[:, None] + offs_n[None, :] * s_wn,
                    mask=(kk < H * E * D)[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(z, w.to(z.dtype), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + t64[:, None] * s_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & nmask[None, :])


@triton.jit
def _forward_rows_kernel(a_ptr, g_ptr, w_ptr, y_ptr, T, T_BUCKET, d, s_at, s_ah, s_gt, s_we, s_wk, s_wn, s_yt,
                         D: tl.constexpr, E: tl.constexpr, H: tl.constexpr, DIV: tl.constexpr,
                         DIV_N: tl.constexpr, DOT_PRECISION: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, HEAD_LOOP: tl.constexpr, GROUP_T: tl.constexpr):
    """The forward's row-scale form: y tile = Σ_h Σ_e (w[:, h·E+e] ⊙ a[:, h]) · W[h·E+e], K running over
    the H·E (head, expert) blocks, each padded from D to a multiple of the K step (masked). A Z block is
    a's head tile scaled per row by one [BT] gate load: affine loads of a and W that the pipeliner can
    prefetch, no per-column index math or gate select.
    HEAD_LOOP: a's [BT, BD] head tile is loaded once per head and feeds its E experts (K step BD);
    otherwise one flat loop over (expert block, K step of min(BK, BD)), a's tile reloaded per step."""
    s_at, s_ah = _aligned(s_at, DIV), _aligned(s_ah, DIV)
    d, s_we, s_wk, s_yt = _aligned(d, DIV_N), _aligned(s_we, DIV_N), _aligned(s_wk, DIV_N), _aligned(s_yt, DIV_N)
    t64, tmask, offs_n, nmask = _grouped_tile(T, d, BT, BN, GROUP_T)
    a_rows = a_ptr + t64[:, None] * s_at
    g_rows = g_ptr + t64 * s_gt
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    if HEAD_LOOP:
        offs_j = tl.arange(0, BD)
        jmask = offs_j < D
        w_tile = offs_j[:, None] * s_wk + offs_n[None, :] * s_wn
        for h in range(H):
            a = tl.load(a_rows + h * s_ah + offs_j[None, :], mask=tmask[:, None] & jmask[None, :],
                        other=0.0).to(tl.float32)
            for e in range(E):
                he = h * E + e
                gate = tl.load(g_rows + he, mask=tmask, other=0.0)
                wt = tl.load(w_ptr + he.to(tl.int64) * s_we + w_tile, mask=jmask[:, None] & nmask[None, :],
                             other=0.0)
                z = (a * gate[:, None]).to(a_ptr.dtype.element_ty)
                acc = tl.dot(z, wt.to(z.dtype), acc, input_precision=DOT_PRECISION)
    else:
        BKE: tl.constexpr = min(BK, BD)
        NC: tl.constexpr = (D + BKE - 1) // BKE  # K steps per expert block
        offs_k = tl.arange(0, BKE)
        for step in range(H * E * NC):
            he = step // NC
            j = (step - he * NC) * BKE + offs_k
            jmask = j < D
            a = tl.load(a_rows + (he // E) * s_ah + j[None, :], mask=tmask[:, None] & jmask[None, :], other=0.0)
            gate = tl.load(g_rows + he, mask=tmask, other=0.0)
            wt = tl.load(w_ptr + he.to(tl.int64) * s_we + j[:, None] * s_wk + offs_n[None, :] * s_wn,
                         mask=jmask[:, None] & nmask[None, :], other=0.0)
            z = (a.to(tl.float32) * gate[:, None]).to(a_ptr.dtype.element_ty)
            acc = tl.dot(z, wt.to(z.dtype), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + t64[:, None] * s_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & nmask[None, :])


@triton.jit
def _da_dw_kernel(dy_ptr, a_ptr, g_ptr, w_ptr, da_ptr, dw_ptr, T, T_BUCKET, d,
                  s_dyt, s_at, s_ah, s_gt, s_we, s_wk, s_wn, s_dat, s_dah, s_dwt,
                  D: tl.constexpr, E: tl.constexpr, DIV: tl.constexpr, DIV_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, STORE_DA: tl.constexpr, STORE_DW: tl.constexpr,
                  BT: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Token tile × head h: acc_e = dy · W[h·E+e]ᵀ for each expert e of h; da = Σ_e w_e acc_e,
    dw[t, h·E+e] = a[t, h] · acc_e."""
    s_at, s_ah, s_dat, s_dah = _aligned(s_at, DIV), _aligned(s_ah, DIV), _aligned(s_dat, DIV), _aligned(s_dah, DIV)
    d, s_dyt, s_we, s_wk = _aligned(d, DIV_N), _aligned(s_dyt, DIV_N), _aligned(s_we, DIV_N), _aligned(s_wk, DIV_N)
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = offs_t < T
    t64 = offs_t.to(tl.int64)
    offs_j = tl.arange(0, BD)
    jmask = offs_j < D
    a_tile = t64[:, None] * s_at + h * s_ah + offs_j[None, :]
    tj_mask = tmask[:, None] & jmask[None, :]
    da = tl.zeros((BT, BD), dtype=tl.float32)
    for e in range(E):
        he = h * E + e
        w_base = w_ptr + he.to(tl.int64) * s_we + offs_j[None, :] * s_wk
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for n0 in range(0, d, BN):
            offs_n = n0 + tl.arange(0, BN)
            nmask = offs_n < d
            dy = tl.load(dy_ptr + t64[:, None] * s_dyt + offs_n[None, :], mask=tmask[:, None] & nmask[None, :],
                         other=0.0)
            wt = tl.load(w_base + offs_n[:, None] * s_wn, mask=nmask[:, None] & jmask[None, :], other=0.0)
            acc = tl.dot(dy, wt.to(dy.dtype), acc, input_precision=DOT_PRECISION)
        if STORE_DA:
            gate = tl.load(g_ptr + t64 * s_gt + he, mask=tmask, other=0.0)
            da += gate[:, None] * acc
        if STORE_DW:
            a = tl.load(a_ptr + a_tile, mask=tj_mask, other=0.0).to(tl.float32)
            tl.store(dw_ptr + t64 * s_dwt + he, tl.sum(a * acc, axis=1), mask=tmask)
    if STORE_DA:
        tl.store(da_ptr + t64[:, None] * s_dat + h * s_dah + offs_j[None, :], da.to(da_ptr.dtype.element_ty),
                 mask=tj_mask)


@triton.jit
def _dweight_kernel(dy_ptr, a_ptr, g_ptr, out_ptr, T, T_BUCKET, d, t_chunk, s_dyt, s_at, s_ah, s_gt, s_os, s_ok,
                    D: tl.constexpr, E: tl.constexpr, H: tl.constexpr, DIV: tl.constexpr, DIV_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr):
    """out[split, rows, n tile] = Z[tokens of the split, rows]ᵀ · dy[tokens of the split, n tile], rows a
    block of BM of W_cat's H·E·D rows (out: dW_cat, or the fp32 partial sums of several splits)."""
    s_at, s_ah = _aligned(s_at, DIV), _aligned(s_ah, DIV)
    d, s_dyt, s_ok = _aligned(d, DIV_N), _aligned(s_dyt, DIV_N), _aligned(s_ok, DIV_N)
    k0 = tl.program_id(0) * BM
    split = tl.program_id(2)
    kk = k0 + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < d
    t_lo = split * t_chunk
    t_hi = tl.minimum(T, t_lo + t_chunk)
    # the tile's transpose, dyᵀ · Z: Zᵀ as the dot's register operand made ptxas serialize the wgmma (an
    # sm_90 compile, bench/tools/compile_check.py), Z as its shared-memory operand does not
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BT):
        offs_t = t0 + tl.arange(0, BT)
        tmask = offs_t < t_hi
        t64 = offs_t.to(tl.int64)
        z = _z_tile(a_ptr, g_ptr, t64, tmask, k0, s_at, s_ah, s_gt, D, E, H, DIV, BT, BM)
        dy = tl.load(dy_ptr + t64[:, None] * s_dyt + offs_n[None, :], mask=tmask[:, None] & nmask[None, :],
                     other=0.0)
        acc = tl.dot(tl.trans(dy), z, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + split.to(tl.int64) * s_os + kk.to(tl.int64)[None, :] * s_ok + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=(kk < H * E * D)[None, :] & nmask[:, None])


@triton.jit
def _dweight_rows_kernel(dy_ptr, a_ptr, g_ptr, out_ptr, T, T_BUCKET, d, t_chunk, s_dyt, s_at, s_ah, s_gt, s_os,
                         s_ok, D: tl.constexpr, E: tl.constexpr, H: tl.constexpr, DIV: tl.constexpr,
                         DIV_N: tl.constexpr, DOT_PRECISION: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BT: tl.constexpr):
    """The row-scale form of _dweight_kernel: one program per (expert block h·E+e, block of BM of its D
    rows, n tile, split); out[split, rows, n tile] = (w[:, h·E+e] ⊙ a[:, h, rows])ᵀ · dy[:, n tile]."""
    # per expert block rather than the flat tiling over W_cat's rows: the Z tile is an affine load of a
    # scaled per row by one gate vector (no per-column index math or select), at the price of padding D
    # to a multiple of the row block (masked rows, computed and dropped)
    s_at, s_ah = _aligned(s_at, DIV), _aligned(s_ah, DIV)
    d, s_dyt, s_ok = _aligned(d, DIV_N), _aligned(s_dyt, DIV_N), _aligned(s_ok, DIV_N)
    BME: tl.constexpr = min(BM, BD)
    NC: tl.constexpr = (D + BME - 1) // BME  # row blocks per expert block
    he = tl.program_id(0) // NC
    j = (tl.program_id(0) - he * NC) * BME + tl.arange(0, BME)
    jmask = j < D
    split = tl.program_id(2)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < d
    t_lo = split * t_chunk
    t_hi = tl.minimum(T, t_lo + t_chunk)
    a_cols = a_ptr + (he // E) * s_ah + j[None, :]
    # dyᵀ · Z, Z as the dot's shared-memory operand (as _dweight_kernel: no serialized wgmma)
    acc = tl.zeros((BN, BME), dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BT):
        offs_t = t0 + tl.arange(0, BT)
        tmask = offs_t < t_hi
        t64 = offs_t.to(tl.int64)
        a = tl.load(a_cols + t64[:, None] * s_at, mask=tmask[:, None] & jmask[None, :], other=0.0)
        gate = tl.load(g_ptr + t64 * s_gt + he, mask=tmask, other=0.0)
        z = (a.to(tl.float32) * gate[:, None]).to(a_ptr.dtype.element_ty)
        dy = tl.load(dy_ptr + t64[:, None] * s_dyt + offs_n[None, :], mask=tmask[:, None] & nmask[None, :],
                     other=0.0)
        acc = tl.dot(tl.trans(dy), z, acc, input_precision=DOT_PRECISION)
    kk = he.to(tl.int64) * D + j
    tl.store(out_ptr + split.to(tl.int64) * s_os + kk[None, :] * s_ok + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=jmask[None, :] & nmask[:, None])


@triton.jit
def _sum_splits(part_ptr, out_ptr, n, splits, BLOCK: tl.constexpr):
    """out[i] = Σ_s part[s, i] in order s = 0, 1, ... (both contiguous)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    part = part_ptr + offs
    for _ in range(splits):
        acc += tl.load(part, mask=mask, other=0.0)
        part += n
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_table_kernel(ids_ptr, g_ptr, w_ptr, T, S, HE, s_it, s_is, s_gt, s_gs, s_wt,
                       BT: tl.constexpr, BE: tl.constexpr):
    """w[t, e] = Σ_{s : ids[t, s] = e} gates[t, s] in fp32 (ids outside [0, HE) match no column)."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = offs_t < T
    t64 = offs_t.to(tl.int64)
    cols = tl.arange(0, BE)
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for s in range(S):
        e = tl.load(ids_ptr + t64 * s_it + s * s_is, mask=tmask, other=-1)
        g = tl.load(g_ptr + t64 * s_gt + s * s_gs, mask=tmask, other=0.0).to(tl.float32)
        acc += tl.where(cols[None, :] == e[:, None], g[:, None], 0.0)
    tl.store(w_ptr + t64[:, None] * s_wt + cols[None, :], acc, mask=tmask[:, None] & (cols < HE)[None, :])


@triton.jit
def _gate_grad_kernel(ids_ptr, dw_ptr, dg_ptr, T, S, HE, s_it, s_is, s_dwt, s_dgt, s_dgs,
                      BT: tl.constexpr, BS: tl.constexpr):
    """dgates[t, s] = dw[t, ids[t, s]] (0 for an id outside [0, HE))."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_s = tl.arange(0, BS)
    t64 = offs_t.to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_s < S)[None, :]
    e = tl.load(ids_ptr + t64[:, None] * s_it + offs_s[None, :] * s_is, mask=mask, other=-1)
    ok = mask & (e >= 0) & (e < HE)
    v = tl.load(dw_ptr + t64[:, None] * s_dwt + e, mask=ok, other=0.0)
    tl.store(dg_ptr + t64[:, None] * s_dgt + offs_s[None, :] * s_dgs, v.to(dg_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- configs
# A short list per kernel; triton.autotune times them once per shape and dtypes (the interpreter takes
# the first). BT: tokens per tile, BN: output columns, BK / BM: rows of W_cat, BD: the padded head dim.
FORWARD_CONFIGS = (
    dict(BT=128, BN=128, BK=64, GROUP_T=8, num_warps=8, num_stages=3),
    dict(BT=128, BN=128, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=64, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=64, BN=128, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=128, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=64, BN=64, BK=64, GROUP_T=8, num_warps=4, num_stages=3),
)
# the row-scale form (_forward_rows_kernel): BK is the K step inside an expert block (at most BD, the
# padded head dim; HEAD_LOOP steps by BD), a smaller step pads less (D = 76: 80 rows at 16, 96 at 32, 128 at
# 64 or more)
FORWARD_ROWS_CONFIGS = (
    dict(BT=128, BN=128, BK=64, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=3),
    dict(BT=128, BN=128, BK=128, HEAD_LOOP=True, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=128, BN=64, BK=128, HEAD_LOOP=True, GROUP_T=8, num_warps=4, num_stages=3),
    dict(BT=128, BN=128, BK=128, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=128, BN=64, BK=64, HEAD_LOOP=False, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=32, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=4),
    dict(BT=64, BN=128, BK=32, HEAD_LOOP=False, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=16, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=5),
)
# which forward `forward` and which weight gradient `backward` run by default (the layer's too): "columns"
# (_forward_kernel, _dweight_kernel) or "rows" (_forward_rows_kernel, _dweight_rows_kernel); both stay until
# a GPU run shows one to be the faster at the papers' shapes
FORMS = ("columns", "rows")
FORWARD_FORM = "columns"
DWEIGHT_FORM = "columns"
DA_DW_CONFIGS = (
    dict(BT=64, BN=64, num_warps=4, num_stages=3),
    dict(BT=64, BN=128, num_warps=8, num_stages=3),
    dict(BT=128, BN=64, num_warps=8, num_stages=3),
    dict(BT=64, BN=64, num_warps=8, num_stages=4),
)
DWEIGHT_CONFIGS = (
    dict(BM=128, BN=128, BT=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=64, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=64, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=128, BT=128, num_warps=8, num_stages=3),
)
# the row-scale form (_dweight_rows_kernel): BM rows of one expert block (at most BD, the padded head dim)
DWEIGHT_ROWS_CONFIGS = (
    dict(BM=128, BN=128, BT=64, num_warps=8, num_stages=3),
    dict(BM=64, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=64, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=128, BT=128, num_warps=8, num_stages=3),
    dict(BM=32, BN=128, BT=128, num_warps=4, num_stages=4),
)
DWEIGHT_SPLIT_TILE = 128     # the output tile the split count assumes (the largest BM and BN above)
DWEIGHT_MIN_SPLIT_TOKENS = 1024  # a split sums at least this many tokens: its partial costs a write and a read


def _triton_config(cfg: dict) -> triton.Config:
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _tuned(kernel, configs, key):
    configs = configs[:1] if C.triton_interpret() else configs
    return triton.autotune([_triton_config(c) for c in configs], key=key)(kernel)


# keyed on the token count's power-of-two bucket (T_BUCKET, which the kernels do not read): one tuning per
# bucket, not per batch size
_forward_tuned = _tuned(_forward_kernel, FORWARD_CONFIGS, ["T_BUCKET", "d", "D", "E", "H", "DIV", "DIV_N"])
_forward_rows_tuned = _tuned(_forward_rows_kernel, FORWARD_ROWS_CONFIGS,
                             ["T_BUCKET", "d", "D", "E", "H", "DIV", "DIV_N"])
_da_dw_tuned = _tuned(_da_dw_kernel, DA_DW_CONFIGS,
                      ["T_BUCKET", "d", "D", "E", "DIV", "DIV_N", "STORE_DA", "STORE_DW"])
_dweight_tuned = _tuned(_dweight_kernel, DWEIGHT_CONFIGS, ["T_BUCKET", "d", "D", "E", "H", "DIV", "DIV_N"])
_dweight_rows_tuned = _tuned(_dweight_rows_kernel, DWEIGHT_ROWS_CONFIGS,
                             ["T_BUCKET", "d", "D", "E", "H", "DIV", "DIV_N"])


def _launch(tuned, kernel, grid, args, meta, config):
    """The autotuned kernel (config None) or `kernel` with an explicit config (tests, compile checks)."""
    if config is None:
        tuned[grid](*args, **meta)
    else:
        kernel[grid(config)](*args, **meta, **config)


# ---------------------------------------------------------------- launchers
def _strides(t: torch.Tensor, dims) -> list:
    """t's strides of `dims`, 0 for a dim of size 1 (its stride is never multiplied by a nonzero index)."""
    return [t.stride(i) if t.shape[i] > 1 else 0 for i in dims]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def gate_table(ids: torch.Tensor, gates: torch.Tensor, num_columns: int) -> torch.Tensor:
    """The dense gate table w [T, num_columns] fp32: w[t, e] = Σ_{s : ids[t, s] = e} gates[t, s]; ids
    outside [0, num_columns) are dropped. One launch."""
    T, S = ids.shape
    w = C.new_output((T, num_columns), torch.float32, ids.device)
    if w.numel():
        block_e = C.next_pow2(max(num_columns, 1))
        block_t = max(1, min(128, 4096 // block_e))
        _gate_table_kernel[(triton.cdiv(T, block_t),)](
            ids, gates, w, T, S, num_columns, ids.stride(0), ids.stride(1), gates.stride(0), gates.stride(1),
            w.stride(0), BT=block_t, BE=block_e, num_warps=4)
    return w


def _gate_grad(ids: torch.Tensor, dw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, S = ids.shape
    dg = C.new_output((T, S), dtype, ids.device)
    if dg.numel():
        block_s = C.next_pow2(S)
        block_t = max(1, min(128, 4096 // block_s))
        _gate_grad_kernel[(triton.cdiv(T, block_t),)](
            ids, dw, dg, T, S, dw.shape[1], ids.stride(0), ids.stride(1), dw.stride(0), dg.stride(0), dg.stride(1),
            BT=block_t, BS=block_s, num_warps=4)
    return dg


def forward(a: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, *, config=None, form=None) -> torch.Tensor:
    """y [T, d] (a's dtype) = Z · W_cat from a [T, H, D] (unit last stride), the gate table w [T, H·E]
    fp32 (`gate_table`) and weight [H·E, D, d] (a's dtype or fp32). form: "columns" (_forward_kernel) or
    "rows" (_forward_rows_kernel), default FORWARD_FORM. config: one of FORWARD_CONFIGS' kind
    (FORWARD_ROWS_CONFIGS' for "rows") instead of the autotuned choice."""
    form = _form(FORWARD_FORM if form is None else form)
    T, H, D = a.shape
    HE, _, d = weight.shape
    y = C.new_output((T, d), a.dtype, a.device)
    if y.numel() == 0:
        return y
    if D == 0:
        return y.zero_()
    s_at, s_ah = _strides(a, (0, 1))
    s_we, s_wk, s_wn = _strides(weight, (0, 1, 2))
    s_yt, = _strides(y, (0,))
    args = (a, w, weight, y, T, C.next_pow2(T), d, s_at, s_ah, w.stride(0), s_we, s_wk, s_wn, s_yt)
    meta = dict(D=D, E=HE // H, H=H, DIV=_pow2_divisor(D, s_at, s_ah),
                DIV_N=_pow2_divisor(d, s_we, s_wk, s_yt), DOT_PRECISION=_dot_precision(a.dtype))

    def grid(m):
        return (triton.cdiv(T, m["BT"]) * triton.cdiv(d, m["BN"]),)
    if form == "rows":
        _launch(_forward_rows_tuned, _forward_rows_kernel, grid, args, meta | dict(BD=_padded_head_dim(D)),
                config)
    else:
        _launch(_forward_tuned, _forward_kernel, grid, args, meta, config)
    return y


def _form(form) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form


def _padded_head_dim(D: int) -> int:
    """BD of the row-scale kernels: D padded to a power of two, at least a dot's 16."""
    return max(16, C.next_pow2(D))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def dweight_splits(T: int, K: int, d: int, device: torch.device) -> int:
    """How many token ranges dW_cat's sum is split into: enough programs for two per SM at the
    largest output tile, each range at least DWEIGHT_MIN_SPLIT_TOKENS tokens; 1 off the GPU."""
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(K, DWEIGHT_SPLIT_TILE) * triton.cdiv(d, DWEIGHT_SPLIT_TILE)
    return max(1, min(triton.cdiv(2 * _sm_count(device), tiles), T // DWEIGHT_MIN_SPLIT_TOKENS))


def backward(dy, a, ids, w, weight, gates_dtype, need_a: bool, need_gates: bool, need_weight: bool, *,
             configs=None, splits=None, form=None):
    """(da, dgates, dweight), None where not needed: da [T, H, D] in a's dtype, dgates [T, S] in
    gates_dtype, dweight in weight's dtype. dy [T, d]; w the forward's gate table. configs: explicit
    {"da_dw": ..., "dweight": ...} instead of the autotuned ones (DWEIGHT_ROWS_CONFIGS' kind for form
    "rows"); splits: the token ranges of dweight's sum (default `dweight_splits`); form: dweight's kernel,
    "columns" (_dweight_kernel) or "rows" (_dweight_rows_kernel), default DWEIGHT_FORM."""
    form = _form(DWEIGHT_FORM if form is None else form)
    T, H, D = a.shape
    HE, _, d = weight.shape
    E = HE // H
    dev = a.device
    configs = configs or {}
    da = C.new_output(a.shape, a.dtype, dev) if need_a else None
    dweight = C.new_output(weight.shape, weight.dtype, dev) if need_weight else None
    if T * D * d == 0:  # nothing to sum: zero gradients
        da = da.zero_() if need_a else None
        dweight = dweight.zero_() if need_weight else None
        dg = torch.zeros(ids.shape, dtype=gates_dtype, device=dev) if need_gates else None
        return da, dg, dweight
    dy = dy.to(a.dtype)
    if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
        dy = dy.contiguous()
    s_at, s_ah = _strides(a, (0, 1))
    s_dyt, = _strides(dy, (0,))
    div = _pow2_divisor(D, s_at, s_ah)
    precision = _dot_precision(a.dtype)

    dg = None
    if need_a or need_gates:
        dw = C.new_output((T, HE), torch.float32, dev) if need_gates else w
        s_we, s_wk, s_wn = _strides(weight, (0, 1, 2))
        da_arg = da if need_a else a
        s_dat, s_dah = _strides(da_arg, (0, 1))
        args = (dy, a, w, weight, da_arg, dw, T, C.next_pow2(T), d, s_dyt, s_at, s_ah, w.stride(0), s_we, s_wk,
                s_wn, s_dat, s_dah, dw.stride(0))
        meta = dict(D=D, E=E, DIV=_pow2_divisor(div, s_dat, s_dah), DIV_N=_pow2_divisor(d, s_dyt, s_we, s_wk),
                    DOT_PRECISION=precision, STORE_DA=need_a, STORE_DW=need_gates, BD=max(16, C.next_pow2(D)))

        def grid(m):
            return (triton.cdiv(T, m["BT"]), H)
        _launch(_da_dw_tuned, _da_dw_kernel, grid, args, meta, configs.get("da_dw"))
        if need_gates:
            dg = _gate_grad(ids, dw, gates_dtype)

    if need_weight:
        K = HE * D
        splits = dweight_splits(T, K, d, dev) if splits is None else splits
        t_chunk = triton.cdiv(triton.cdiv(T, splits), DWEIGHT_SPLIT_TILE) * DWEIGHT_SPLIT_TILE
        splits = triton.cdiv(T, t_chunk)  # ranges that hold a token
        out = dweight.view(K, d) if splits == 1 else C.new_output((splits, K, d), torch.float32, dev)
        s_os = 0 if splits == 1 else out.stride(0)
        args = (dy, a, w, out, T, C.next_pow2(T), d, t_chunk, s_dyt, s_at, s_ah, w.stride(0), s_os, out.stride(-2))
        meta = dict(D=D, E=E, H=H, DIV=div, DIV_N=_pow2_divisor(d, s_dyt, out.stride(-2)),
                    DOT_PRECISION=precision)
        if form == "rows":
            bd = _padded_head_dim(D)

            def grid(m):
                return (HE * triton.cdiv(D, min(m["BM"], bd)), triton.cdiv(d, m["BN"]), splits)
            _launch(_dweight_rows_tuned, _dweight_rows_kernel, grid, args, meta | dict(BD=bd),
                    configs.get("dweight"))
        else:
            def grid(m):
                return (triton.cdiv(K, m["BM"]), triton.cdiv(d, m["BN"]), splits)
            _launch(_dweight_tuned, _dweight_kernel, grid, args, meta, configs.get("dweight"))
        if splits > 1:
            block = 1024
            _sum_splits[(triton.cdiv(K * d, block),)](out, dweight, K * d, splits, BLOCK=block, num_warps=4)
    return da, dg, dweight


# ---------------------------------------------------------------- autograd, custom op, public call
class _FusedOutput(torch.autograd.Function):
    """Eager calls on plain tensors (C.eager_autograd_path): the kernels without the custom op's
    dispatcher layers; the gate table is kept for the backward."""

    @staticmethod
    def forward(ctx, a, ids, gates, weight):
        w = gate_table(ids, gates, weight.shape[0])
        ctx.save_for_backward(a, ids, w, weight)
        ctx.gates_dtype = gates.dtype
        return forward(a, w, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        a, ids, w, weight = ctx.saved_tensors
        need_a, _, need_gates, need_weight = ctx.needs_input_grad[:4]
        da, dg, dweight = backward(dy, a, ids, w, weight, ctx.gates_dtype, need_a, need_gates, need_weight)
        return da, None, dg, dweight


@torch.library.custom_op("flashswitch::switchhead_output", mutates_args=())
def _fused_op(a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return forward(a, gate_table(ids, gates, weight.shape[0]), weight)


@_fused_op.register_fake
def _(a, ids, gates, weight):
    return a.new_empty((a.shape[0], weight.shape[2]))


@torch.library.custom_op("flashswitch::switchhead_output_backward", mutates_args=())
def _fused_backward_op(dy: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor,
                       weight: torch.Tensor, need_a: bool, need_gates: bool,
                       need_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = gate_table(ids, gates, weight.shape[0])
    da, dg, dweight = backward(dy, a, ids, w, weight, gates.dtype, need_a, need_gates, need_weight)
    return (a.new_empty(0) if da is None else da, gates.new_empty(0) if dg is None else dg,
            weight.new_empty(0) if dweight is None else dweight)


@_fused_backward_op.register_fake
def _(dy, a, ids, gates, weight, need_a, need_gates, need_weight):
    return (a.new_empty(a.shape if need_a else (0,)), gates.new_empty(gates.shape if need_gates else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)))


def _setup_context(ctx, inputs, output):
    a, ids, gates, weight = inputs
    ctx.save_for_backward(a, ids, gates, weight)


def _op_backward(ctx, dy):
    a, ids, gates, weight = ctx.saved_tensors
    need_a, _, need_gates, need_weight = ctx.needs_input_grad[:4]
    da, dg, dweight = _fused_backward_op(dy, a, ids, gates, weight, need_a, need_gates, need_weight)
    return da if need_a else None, None, dg if need_gates else None, dweight if need_weight else None


_fused_op.register_autograd(_op_backward, setup_context=_setup_context)


def torch_switchhead_output(a, ids, gates, weight, num_experts: int) -> torch.Tensor:
    """The torch version of `switchhead_output` (differentiable, any device and float dtype): the
    dense gate table (fp32, fp64 for fp64 a) and one matmul of Z in a's dtype."""
    T, H, D = a.shape
    HE, _, d = weight.shape
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    valid = (ids >= 0) & (ids < HE)
    table = torch.zeros(T, HE, dtype=acc, device=a.device).scatter_add(
        1, torch.where(valid, ids, 0).long(), torch.where(valid, gates.to(acc), 0))
    z = (a.to(acc).unsqueeze(2) * table.view(T, H, num_experts, 1)).to(a.dtype)
    return z.reshape(T, HE * D) @ weight.to(a.dtype).reshape(HE * D, d)


def _validate(a, ids, gates, weight, num_experts, check, backend):
    C.check_tensor("a", a, ndim=3)
    E = C.check_positive_int("num_experts", num_experts)
    T, H, D = a.shape
    if H < 1:
        raise ValueError(f"a must have at least one head, got shape {tuple(a.shape)}")
    C.check_tensor("weight", weight, ndim=3, device=a.device, last_contiguous=False)
    if weight.dtype != a.dtype and not (weight.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)):
        raise TypeError(f"weight has dtype {weight.dtype} but a has {a.dtype}; weight must match a "
                        f"(or be float32 master weights with fp16/bf16 a)")
    if weight.shape[0] != H * E:
        raise ValueError(f"weight has {weight.shape[0]} experts (shape {tuple(weight.shape)}) but a has H = {H} "
                         f"heads of num_experts = {E}: expected H * num_experts = {H * E}")
    if weight.shape[1] != D:
        raise ValueError(f"weight has d_head = {weight.shape[1]} (shape {tuple(weight.shape)}) but a has "
                         f"d_head = {D}")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"ids has dtype {ids.dtype}; expected int32 or int64")
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"ids must be [T, S] with T = {T} (a's tokens), got shape {tuple(ids.shape)}")
    if ids.device != a.device:
        raise ValueError(f"ids is on {ids.device}, expected {a.device} (all inputs must share one device)")
    C.check_tensor("gates", gates, ndim=2, device=a.device, last_contiguous=False)
    C.check_shape("gates", gates, ids.shape)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and not _triton_runs(str(a.device)):
        raise ValueError(f"backend 'triton' is not available for tensors on {a.device}")
    if check and ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # the one host sync
        if lo < 0 or hi >= H * E:
            raise ValueError(f"ids values {lo}..{hi} out of range [0, H * num_experts) = [0, {H * E})")


@torch.compiler.assume_constant_result  # imports and an environment read: a constant to torch.compile
def _triton_runs(device: str) -> bool:
    from flashswitch import backends
    return backends.available("triton", torch.device(device))


def _transformed() -> bool:
    """A functorch transform or a forward-mode AD level is active: only the torch version carries
    their batching and tangents."""
    return not torch.compiler.is_compiling() and (C._under_functorch() or forward_ad._current_level >= 0)


def switchhead_output(a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor,
                      num_experts: int, *, check: bool = True, backend: str = "auto") -> torch.Tensor:
    """SwitchHead's gated output projection over the routed experts of each head, as one dense GEMM.

    a: [T, H, D] attention output (fp16 / bf16 / fp32, unit last stride). weight: [H·E, D, d]
    (E = num_experts per head; a's dtype, or fp32 master weights with 16-bit a, cast in the kernel).
    ids: int32/int64 [T, S], global expert ids h·E + e. gates: float [T, S]. Returns y [T, d] in a's
    dtype:
        y[t] = Σ_s gates[t, s] · a[t, ids[t, s] // E] @ weight[ids[t, s]]
    (duplicate ids of a token add up). With SwitchHeadAttention's routing (slot s = h·k + j holds an
    expert of head h) this is expert_matmul(a, route(ids, H·E), weight, gates=gates, out_groups=1),
    computed as y = Z · W_cat over all H·E·D rows of weight with zero gates where a token picked no
    expert: E / k times the routed multiply-adds as one dense GEMM, no slot reduction, no routing.

    check=True: one host sync checks that every id lies in [0, H·E) (ValueError naming ids); pass
    False for CUDA-graph capture and torch.compile, where out-of-range ids are dropped. backend: "auto"
    (the Triton kernels on CUDA, the torch version elsewhere), "triton" (also on the CPU under
    TRITON_INTERPRET=1) or "reference" (torch_switchhead_output).

    Differentiable in a, gates and weight (the kernels' backward is deterministic: no float atomics);
    weight's gradient has weight's dtype. Eager calls run an autograd.Function, traced ones (torch.compile)
    and tensor subclasses the custom op flashswitch::switchhead_output (with a fake implementation);
    under torch.func transforms and forward-mode AD the torch version runs.
    """
    _validate(a, ids, gates, weight, num_experts, check, backend)
    kernels = backend == "triton" or (backend == "auto" and a.is_cuda and _triton_runs(str(a.device)))
    if not kernels or _transformed():
        return torch_switchhead_output(a, ids, gates, weight, num_experts)
    if C.eager_fast_path(a, ids, gates, weight):
        return forward(a, gate_table(ids, gates, weight.shape[0]), weight)
    if C.eager_autograd_path(a, ids, gates, weight):
        return _FusedOutput.apply(a, ids, gates, weight)
    return _fused_op(a, ids, gates, weight)


__all__ = ["switchhead_output", "torch_switchhead_output", "gate_table", "forward", "backward"]
