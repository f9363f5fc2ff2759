"""SwitchHead's fused output projection (ops/switchhead_output.py): the backward kernels.

With the forward's y = Z · W_cat (switchhead_output.py; dZ = dy · W_catᵀ is never stored either):
- `_da_dw_kernel`, one program per (token tile, head h): for each expert e of h, acc_e = dy · W[h·E+e]ᵀ
  over d (D padded to a power of two, masked); da[t, h] = Σ_e w[t, h·E+e] · acc_e and the gate-table
  gradient dw[t, h·E+e] = a[t, h] · acc_e, both from registers.
- `_dweight_kernel`: dW_cat = Zᵀ · dy, tiled over W_cat's rows as the forward tiles its K (no padding
  of D), the token sum split over `splits` ranges on a GPU with few output tiles: fp32 partial sums
  that `_sum_splits` adds in split order. No float atomics anywhere: the backward is deterministic.
  Its row-scale form `_dweight_rows_kernel` (config DW_FORM "rows"; without DW_FORM: DWEIGHT_FORM) tiles
  per expert block as the row-scale forward does.
- dgates[t, s] = dw[t, ids[t, s]] (`_gate_grad_kernel`).
The gate table is written again (one small launch) rather than kept from the forward.

`prepare` builds the launches of one signature from a complete config (autotune/space.py's
"switchhead_output.bwd" table: DA_* tiles of the da/dw kernel, DW_* of the dweight kernel, DW_FORM);
`backward` runs them on a given gate table (tests, compile checks).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashswitch import _common as C
from flashswitch.kernels_triton.expert_matmul import _aligned, _pow2_divisor
from flashswitch.kernels_triton.kernel_call import KernelCall
from flashswitch.kernels_triton.switchhead_output import (_dot_precision, _form, _options, _padded_head_dim, _strides,
                                                          _z_tile, gate_table_call)

# the weight gradient a config without DW_FORM runs: "columns" (_dweight_kernel) or "rows" (_dweight_rows_kernel)
DWEIGHT_FORM = "columns"
DWEIGHT_SPLIT_TILE = 128     # the output tile the split count assumes (the largest DW_BM and DW_BN of the space)
DWEIGHT_MIN_SPLIT_TOKENS = 1024  # a split sums at least this many tokens: its partial costs a write and a read


@triton.jit
def _da_dw_kernel(dy_ptr, a_ptr, g_ptr, w_ptr, da_ptr, dw_ptr, T, d,
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
def _dweight_kernel(dy_ptr, a_ptr, g_ptr, out_ptr, T, d, t_chunk, s_dyt, s_at, s_ah, s_gt, s_os, s_ok,
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
def _dweight_rows_kernel(dy_ptr, a_ptr, g_ptr, out_ptr, T, d, t_chunk, s_dyt, s_at, s_ah, s_gt, s_os,
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



# ---------------------------------------------------------------- launches
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


def _part(config, prefix: str) -> dict:
    """One kernel's keys of a backward config (DA_BT -> BT, ...)."""
    return {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix) and k != "DW_FORM"}


def _zero(*grads) -> None:
    for g in grads:
        if g is not None:
            g.zero_()


def prepare(a, ids, gates, weight, dy, want_a: bool, want_gates: bool, want_weight: bool, *, config, fast=False,
            splits=None, form=None):
    """The backward's launches for this metadata (dy may be a meta tensor, of a's dtype with a unit last
    stride): an enqueue taking (a, ids, gates, weight, dy, da, dgates, dweight), the wanted gradients
    contiguous (None for the others), that writes them. splits: the token ranges of dweight's sum (default
    `dweight_splits`); form: dweight's kernel (default: the config's DW_FORM, else DWEIGHT_FORM)."""
    T, H, D = a.shape
    HE, _, d = weight.shape
    E = HE // H
    dev = a.device
    if T * D * d == 0:  # nothing to sum: zero gradients
        return lambda a, ids, gates, weight, dy, da, dg, dweight: _zero(da, dg, dweight)
    table = gate_table_call(ids, gates, HE, fast)
    s_at, s_ah = _strides(a, (0, 1))
    s_dyt, = _strides(dy, (0,))
    div = _pow2_divisor(D, s_at, s_ah)
    precision = _dot_precision(a.dtype)

    da_dw = gate_grad = None
    if want_a or want_gates:
        cfg = _part(config, "DA_")
        s_we, s_wk, s_wn = _strides(weight, (0, 1, 2))
        s_dat, s_dah = _strides(torch.empty(a.shape, device="meta") if want_a else a, (0, 1))
        da_dw = KernelCall(
            _da_dw_kernel, (triton.cdiv(T, int(cfg["BT"])), H), 6,
            (T, d, s_dyt, s_at, s_ah, HE, s_we, s_wk, s_wn, s_dat, s_dah, HE),
            dict(D=D, E=E, DIV=_pow2_divisor(div, s_dat, s_dah), DIV_N=_pow2_divisor(d, s_dyt, s_we, s_wk),
                 DOT_PRECISION=precision, STORE_DA=want_a, STORE_DW=want_gates, BT=int(cfg["BT"]), BN=int(cfg["BN"]),
                 BD=_padded_head_dim(D)), _options(cfg), fast=fast)
        if want_gates:
            S = ids.shape[1]
            block_s = C.next_pow2(S)
            block_t = max(1, min(128, 4096 // block_s))
            sdg = torch.empty(gates.shape, device="meta").stride()
            gate_grad = KernelCall(_gate_grad_kernel, (triton.cdiv(T, block_t),), 3,
                                   (T, S, HE, ids.stride(0), ids.stride(1), HE, sdg[0], sdg[1]),
                                   dict(BT=block_t, BS=block_s), dict(num_warps=4), fast=fast)

    dweight_call = sum_call = None
    if want_weight:
        cfg = _part(config, "DW_")
        form = _form(form or config.get("DW_FORM", DWEIGHT_FORM))
        K = HE * D
        splits = dweight_splits(T, K, d, dev) if splits is None else splits
        t_chunk = triton.cdiv(triton.cdiv(T, splits), DWEIGHT_SPLIT_TILE) * DWEIGHT_SPLIT_TILE
        splits = triton.cdiv(T, t_chunk)  # ranges that hold a token
        meta = dict(D=D, E=E, H=H, DIV=div, DIV_N=_pow2_divisor(d, s_dyt, d), DOT_PRECISION=precision,
                    BM=int(cfg["BM"]), BN=int(cfg["BN"]), BT=int(cfg["BT"]))
        if form == "rows":
            meta["BD"] = _padded_head_dim(D)
            kernel, grid = _dweight_rows_kernel, (HE * triton.cdiv(D, min(meta["BM"], meta["BD"])),
                                                  triton.cdiv(d, meta["BN"]), splits)
        else:
            kernel, grid = _dweight_kernel, (triton.cdiv(K, meta["BM"]), triton.cdiv(d, meta["BN"]), splits)
        s_os = 0 if splits == 1 else K * d  # the partial sums [splits, K, d], or dweight itself
        dweight_call = KernelCall(kernel, grid, 4, (T, d, t_chunk, s_dyt, s_at, s_ah, HE, s_os, d), meta,
                                  _options(cfg), fast=fast)
        if splits > 1:
            block = 1024
            sum_call = KernelCall(_sum_splits, (triton.cdiv(K * d, block),), 2, (K * d, splits), dict(BLOCK=block),
                                  dict(num_warps=4), fast=fast)

    def enqueue(a, ids, gates, weight, dy, da, dg, dweight):
        w = C.new_output((T, HE), torch.float32, dev)
        table(ids, gates, w)
        if da_dw is not None:
            dw = C.new_output((T, HE), torch.float32, dev) if want_gates else w
            da_dw(dy, a, w, weight, da if want_a else a, dw)
            if want_gates:
                gate_grad(ids, dw, dg)
        if dweight_call is not None:
            out = dweight.view(HE * D, d) if sum_call is None else C.new_output((splits, HE * D, d), torch.float32, dev)
            dweight_call(dy, a, w, out)
            if sum_call is not None:
                sum_call(out, dweight)

    enqueue.calls = tuple(c for c in (table, da_dw, gate_grad, dweight_call, sum_call) if c is not None)
    return enqueue


def backward(dy, a, ids, gates, weight, need_a: bool, need_gates: bool, need_weight: bool, *, config, splits=None,
             form=None):
    """(da, dgates, dweight), None where not needed: da [T, H, D] in a's dtype, dgates [T, S] in gates'
    dtype, dweight in weight's dtype, from dy [T, d] with a complete backward config (tests, compile
    checks). splits, form: as `prepare`."""
    if form is not None:
        _form(form)
    dy = dy.to(a.dtype)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    da, dg, dweight = C.new_outputs(((a.shape, a.dtype) if need_a else None,
                                     (gates.shape, gates.dtype) if need_gates else None,
                                     (weight.shape, weight.dtype) if need_weight else None), a.device)
    prepare(a, ids, gates, weight, dy, need_a, need_gates, need_weight, config=config, splits=splits,
            form=form)(a, ids, gates, weight, dy, da, dg, dweight)
    return da, dg, dweight


__all__ = ["DWEIGHT_FORM", "backward", "dweight_splits", "prepare"]
