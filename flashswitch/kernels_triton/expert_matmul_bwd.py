"""Triton backward kernels of op 3 (d x, d weight, d gates), deterministic: no float atomics.

With pair p = (t, s) of expert e, x_row(p) = x[t, s // (S / G_in)], dy_row(p) = dy[t, s // (S / G_out)]:

- `_dx_kernel`: the forward's gather-GEMM over expert-sorted row tiles (`_tile_of`), with dy rows as
  the A operand and weight[e]ᵀ as B (read through swapped strides, no copy): z_p = dy_row(p) · W[e]ᵀ.
  Epilogue: the d gates partial x_row(p) · z_p over this program's d_in columns goes to an fp32
  buffer [column tiles, P]; then gate_p · z_p is stored to dx[t, gi] directly when G_in == S (one
  pair per dx row), else to an fp32 (or x-dtype, config DX_PARTIALS = "out") scratch [T, S, d_in]
  that the forward's `_group_sum` reduces over each input group's slots in slot order.
- `_dw_kernel`: the grouped transpose-A GEMM d W[e] = Σ_{p in e} x_row(p)ᵀ · (gate_p dy_row(p)), one
  program per (expert, split, d_in tile, d_out tile), looping over its share of the expert's sorted
  pairs in DW_BLOCK_K steps (pair counts read on the device; an empty share gives zeros). With
  SPLIT_K > 1 each split writes an fp32 partial [SPLIT_K, E, d_in, d_out], summed in split order.
- `_sum_leading`: out[i] = Σ_j src[j, i] in order j = 0, 1, ...: the fixed-order sums of the d gates
  partials and of the split-K partials.
- Config DENSE_Z (16-bit, few experts per input group, as SwitchHead's value projection): the per-pair
  dx rows are what makes the scratch path write-bound (S rows of d_in per token for one dx row). Instead
  the forward module's `_dense_z` sums each token's gated dy rows per expert into a dense Z [T·G_in, E·d_out] (zeros where
  the token's group did not pick the expert), and dx = Z · W_catᵀ, dW = X_flatᵀ · Z are two dense GEMMs
  (torch.mm: fp32 accumulation, deterministic; dW in fp32 for fp32 master weights) that do G_in·E / S times the pairs' MACs at full
  tensor-core rate. d gates: U = X_flat · W_catᵀ (every expert's product of every x row, one more
  dense GEMM) and `_dense_dg` dots each pair's dy row with its expert's block of U.
- Config DENSE_X (few experts per output group, as SwitchHead's output projection, whose forward takes
  the forward's DENSE_Z): dW = Zᵀ · dy over the forward's dense Z [T·G_out, E·d_in] of gated x rows,
  dZ = dy · W_catᵀ [T·G_out, E·d_in] (every expert's dy · W[e]ᵀ), both dense GEMMs at G_out·E / S times
  the pairs' MACs; then `_dense_dx` sums each input group's gated dZ blocks into dx in slot order and
  dots them with the x row for d gates. No per-pair scratch, no split-K partials.
- Config CAST_W (fp32 master weights): the dx kernel reads a 16-bit copy of the weights, as the
  forward's CAST_W; d W stays in the weights' dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch.kernels_triton.kernel_call import KernelCall
from flashswitch.kernels_triton.expert_matmul import (_aligned, _dense_z_calls, _gather_gemm, _group_row,
                                                       _group_sum_call, _pair_gates, _pow2, _pow2_divisor,
                                                       _row_tile_grid, _tile_of, _tile_pairs, _weights_cat,
                                                       cast_weights, weights_in)

DX_KEYS = ("DX_BLOCK_M", "DX_BLOCK_N", "DX_BLOCK_K", "DX_INTERLEAVE", "DX_PARTIALS", "DX_num_warps",
           "DX_num_stages")
DW_KEYS = ("DW_BLOCK_M", "DW_BLOCK_N", "DW_BLOCK_K", "SPLIT_K", "DW_num_warps", "DW_num_stages")
MODE_KEYS = ("DENSE_Z",)
CONFIG_KEYS = DX_KEYS + DW_KEYS + MODE_KEYS  # required; DENSE_X and CAST_W are optional (default off)
PARTIALS_MODES = ("fp32", "out")


@triton.jit
def _dx_kernel(
    dy_ptr, w_ptr, g_ptr, x_ptr, tok_ptr, slot_ptr, off_ptr, out_ptr, dg_ptr,
    E, S, d_in, d_out, spg_in, spg_out, P,
    stride_dyt, stride_dyg,
    stride_we, stride_wk, stride_wn,
    stride_gt, stride_gs,
    stride_xt, stride_xg,
    stride_ot, stride_og,
    grid_m, n_tiles_n, n_iter,
    HAS_GATES: tl.constexpr, WRITE_DX: tl.constexpr, WRITE_DG: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERLEAVE: tl.constexpr, EVEN_K: tl.constexpr, DIV_K: tl.constexpr, DIV_N: tl.constexpr, DIV_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Alignment the host checked but the compiler cannot see at sizes that are not multiples of 16
    # (as in the forward): d_out and dy's row strides are multiples of DIV_K; d_in, x's and out's row
    # strides of DIV_N; weight's expert and d_in strides of DIV_W. Loads and stores then use vectors.
    d_out, stride_dyt, stride_dyg = _aligned(d_out, DIV_K), _aligned(stride_dyt, DIV_K), _aligned(stride_dyg, DIV_K)
    d_in, stride_xt, stride_xg = _aligned(d_in, DIV_N), _aligned(stride_xt, DIV_N), _aligned(stride_xg, DIV_N)
    stride_ot, stride_og = _aligned(stride_ot, DIV_N), _aligned(stride_og, DIV_N)
    stride_we, stride_wn = _aligned(stride_we, DIV_W), _aligned(stride_wn, DIV_W)

    # column tiles of one row tile are neighbours: the gathered dy rows are read from L2
    pid = tl.program_id(0)
    pid_m = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    e, row0, row_end = _tile_of(off_ptr, E, pid_m, n_iter, BLOCK_M, BLOCK_E, INTERLEAVE)
    if e >= E:
        return

    rmask, tok, slt = _tile_pairs(tok_ptr, slot_ptr, row0, row_end, BLOCK_M)
    dy_row = _group_row(tok, slt, spg_out, stride_dyt, stride_dyg)
    # B[k, n] = weight[e, n, k]: the caller passes weight's strides swapped
    acc, offs_n, nmask = _gather_gemm(dy_ptr, dy_row, rmask, w_ptr, e, stride_we, stride_wk, stride_wn, pid_n,
                                      d_out, d_in, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)

    omask = rmask[:, None] & nmask[None, :]
    if WRITE_DG:  # d gate_p partial over this program's columns: x_row(p) . z_p
        x_row = _group_row(tok, slt, spg_in, stride_xt, stride_xg)
        xv = tl.load(x_ptr + x_row[:, None] + offs_n[None, :], mask=omask, other=0.0).to(tl.float32)
        part = tl.sum(xv * acc, 1)
        pair = tok * S + slt
        tl.store(dg_ptr + pid_n.to(tl.int64) * P + pair, part, mask=rmask)
    if WRITE_DX:
        if HAS_GATES:
            acc = acc * _pair_gates(g_ptr, tok, slt, stride_gt, stride_gs, rmask)[:, None]
        o_ptrs = out_ptr + (tok * stride_ot + slt.to(tl.int64) * stride_og)[:, None] + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dw_kernel(
    x_ptr, dy_ptr, g_ptr, tok_ptr, slot_ptr, off_ptr, out_ptr,
    d_in, d_out, spg_in, spg_out,
    stride_xt, stride_xg,
    stride_dyt, stride_dyg,
    stride_gt, stride_gs,
    stride_os, stride_oe, stride_om,
    n_tiles_m, n_tiles_n,
    SPLIT_K: tl.constexpr, HAS_GATES: tl.constexpr, DOT_PRECISION: tl.constexpr, DIV_M: tl.constexpr,
    DIV_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # alignment hints (see _dx_kernel): d_in and x's row strides are multiples of DIV_M; d_out, dy's
    # and out's row strides of DIV_N. Written out rather than through `_aligned`: as for the pair
    # loads below, the inlined helper's line info alone changes how ptxas schedules this kernel.
    d_in = (d_in // DIV_M) * DIV_M
    stride_xt = (stride_xt // DIV_M) * DIV_M
    stride_xg = (stride_xg // DIV_M) * DIV_M
    d_out = (d_out // DIV_N) * DIV_N
    stride_dyt = (stride_dyt // DIV_N) * DIV_N
    stride_dyg = (stride_dyg // DIV_N) * DIV_N
    stride_os = (stride_os // DIV_N) * DIV_N
    stride_oe = (stride_oe // DIV_N) * DIV_N
    stride_om = (stride_om // DIV_N) * DIV_N
    # program order (expert, split, d_in tile, d_out tile): programs reading the same pairs run together
    pid = tl.program_id(0)
    pid_n = pid % n_tiles_n
    r = pid // n_tiles_n
    pid_m = r % n_tiles_m
    r = r // n_tiles_m
    sp = r % SPLIT_K
    e = r // SPLIT_K

    lo = tl.load(off_ptr + e).to(tl.int32)
    hi = tl.load(off_ptr + e + 1).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(hi - lo, SPLIT_K), BLOCK_K) * BLOCK_K
    start = lo + sp * chunk
    end = tl.minimum(hi, start + chunk)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < d_in
    nmask = offs_n < d_out
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        # pairs loaded inline, not through `_tile_pairs` / `_group_row`: inlined into this loop, their
        # line info alone changes how ptxas schedules it (`_pair_gates` does not)
        rows = k0 + offs_k
        rmask = rows < end
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        slt = tl.load(slot_ptr + rows, mask=rmask, other=0)
        x_row = tok * stride_xt + (slt // spg_in).to(tl.int64) * stride_xg
        dy_row = tok * stride_dyt + (slt // spg_out).to(tl.int64) * stride_dyg
        a = tl.load(x_ptr + x_row[:, None] + offs_m[None, :], mask=rmask[:, None] & mmask[None, :], other=0.0)
        b = tl.load(dy_ptr + dy_row[:, None] + offs_n[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        if HAS_GATES:
            g = _pair_gates(g_ptr, tok, slt, stride_gt, stride_gs, rmask)
            b = (b.to(tl.float32) * g[:, None]).to(a.dtype)
        acc = tl.dot(tl.trans(a), b.to(a.dtype), acc, input_precision=DOT_PRECISION)

    # split sp's partial lives at out + sp * stride_os (stride_os = 0 when SPLIT_K == 1)
    o_ptrs = (out_ptr + sp.to(tl.int64) * stride_os + e.to(tl.int64) * stride_oe
              + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :])
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dense_dg(u_ptr, dy_ptr, pe_ptr, dg_ptr, T, S, G_in, spg_in, spg_out, d_out, stride_ur, stride_dyt, stride_dyg,
              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """dg[t, s] = Σ_k dy_row(t, s)[k] · U[t·G_in + s // spg_in, e(t, s)·d_out + k] (fp32 sum; dg
    contiguous [T, S])."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < T
    mask = tmask[:, None] & (offs_k < d_out)[None, :]
    t64 = offs_t.to(tl.int64)
    e = tl.load(pe_ptr + t64 * S + s, mask=tmask, other=0).to(tl.int64)
    u = tl.load(u_ptr + ((t64 * G_in + s // spg_in) * stride_ur + e * d_out)[:, None] + offs_k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    dyv = tl.load(dy_ptr + (t64 * stride_dyt + (s // spg_out) * stride_dyg)[:, None] + offs_k[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    tl.store(dg_ptr + t64 * S + s, tl.sum(u * dyv, 1).to(dg_ptr.dtype.element_ty), mask=tmask)


@triton.jit
def _sum_leading(src_ptr, dst_ptr, J, N, BLOCK: tl.constexpr):
    """dst[i] = Σ_{j < J} src[j·N + i], in order j = 0, 1, ... (both contiguous)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(J):
        acc += tl.load(src_ptr + j * N + i, mask=mask, other=0.0)
    tl.store(dst_ptr + i, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dense_dx(dz_ptr, x_ptr, g_ptr, pe_ptr, dx_ptr, dg_ptr, T, S, G_out, spg_in, spg_out, d, stride_zr,
              stride_xt, stride_xg, stride_gt, stride_gs, stride_dxt, stride_dxg,
              HAS_GATES: tl.constexpr, WRITE_DX: tl.constexpr, WRITE_DG: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Config DENSE_X, input group gi of BLOCK_T tokens: with u_s = dZ[t·G_out + s // spg_out, e(t, s)·d
    ... + d] (dy_row(p) · W[e]ᵀ for every expert, one dense GEMM) for each slot s of the group,
    dx[t, gi] = Σ_s gate[t, s] · u_s in slot order (fp32) and dg[t, s] = x[t, gi] · u_s (dg contiguous
    [T, S])."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    gi = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < T
    mask = tmask[:, None] & (offs_k < d)[None, :]
    t64 = offs_t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    if WRITE_DG:
        xv = tl.load(x_ptr + (t64 * stride_xt + gi * stride_xg)[:, None] + offs_k[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    for j in range(spg_in):
        s = gi * spg_in + j
        e = tl.load(pe_ptr + t64 * S + s, mask=tmask, other=0).to(tl.int64)
        u = tl.load(dz_ptr + ((t64 * G_out + s // spg_out) * stride_zr + e * d)[:, None] + offs_k[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        if WRITE_DG:
            tl.store(dg_ptr + t64 * S + s, tl.sum(xv * u, 1).to(dg_ptr.dtype.element_ty), mask=tmask)
        if HAS_GATES:
            u = u * tl.load(g_ptr + t64 * stride_gt + s * stride_gs, mask=tmask, other=0.0).to(tl.float32)[:, None]
        acc += u
    if WRITE_DX:
        tl.store(dx_ptr + (t64 * stride_dxt + gi * stride_dxg)[:, None] + offs_k[None, :],
                 acc.to(dx_ptr.dtype.element_ty), mask=mask)


def _sum_call(J: int, N: int, fast: bool) -> KernelCall:
    """The launch of `_sum_leading` over a [J, N] source, called with (src, dst)."""
    BLOCK = 1024
    return KernelCall(_sum_leading, (triton.cdiv(N, BLOCK),), 2, (J, N), dict(BLOCK=BLOCK), dict(num_warps=4),
                      fast=fast)


def _check_config(cfg) -> dict:
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"expert_matmul backward config is missing keys {missing}")
    if cfg["DX_PARTIALS"] not in PARTIALS_MODES:
        raise ValueError(f"config DX_PARTIALS must be one of {PARTIALS_MODES}, got {cfg['DX_PARTIALS']!r}")
    split = int(cfg["SPLIT_K"])
    if split < 1:
        raise ValueError(f"config SPLIT_K must be >= 1, got {split}")
    for key in ("DENSE_Z", "DENSE_X"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"config {key} must be a bool, got {cfg[key]!r}")
    return cfg


def launch(x3, weight, gates, route, dy, dx, dweight, dgates, *, G_in, G_out, config):
    """Fill the gradients that are not None: dx [T, G_in, d_in] (x's dtype), dweight [E, d_in, d_out]
    (weight's dtype), dgates [T, S] (gates' dtype), all contiguous.

    x3: [T, G_in, d_in] (unit last stride); weight: [E, d_in, d_out], any strides; gates: None or
    [T, S], any strides; dy: [T, G_out, d_out], unit last stride, x's dtype; route: a `Route`.
    config: every key of CONFIG_KEYS (see autotune/space.py, "expert_matmul.bwd").
    """
    want = [t is not None and t.numel() > 0 for t in (dx, dweight, dgates)]
    enqueue = prepare(x3, weight, gates, route, dy, *want, G_in=G_in, G_out=G_out, config=config)
    enqueue(x3, weight, gates, route, dy, dx, dweight, dgates)


def prepare(x3, weight, gates, route, dy, want_dx: bool, want_dw: bool, want_dg: bool, *, G_in, G_out, config,
            fast=False):
    """The launches `launch` makes for these arguments and wanted gradients, prepared from metadata
    only (shapes, strides, dtypes, the route's sizes; dy may be a meta tensor): an enqueue taking the
    tensors of a call with the same metadata, (x3, weight, gates, route, dy, dx, dweight, dgates),
    the gradients not wanted None. fast: direct launches (kernel_call)."""
    cfg = _check_config(config)
    T, _, d_in = x3.shape
    E, _, d_out = weight.shape
    S = route.S
    has_gates = gates is not None
    want_dg = want_dg and has_gates
    dot_precision = "ieee" if x3.dtype == torch.float32 else "tf32"
    sg = gates.stride() if has_gates else (0, 0)
    sx = (x3.stride(0), x3.stride(1) if G_in > 1 else 0)
    sdy = (dy.stride(0), dy.stride(1) if G_out > 1 else 0)
    dims = (T, S, E, d_in, d_out, G_in, G_out)
    steps = []
    if cfg.get("DENSE_X", False) and T and d_in and d_out and (want_dx or want_dw or want_dg):
        steps.append(_dense_x_steps(dims, x3.dtype, weight.dtype, has_gates, sg, sx, want_dx, want_dw, want_dg,
                                    fast))
        want_dx = want_dw = want_dg = False
    if cfg["DENSE_Z"] and G_in < S and T and d_in and d_out and (want_dx or want_dw or want_dg):
        steps.append(_dense_z_steps(dims, x3.dtype, weight.dtype, has_gates, sg, sdy, want_dx, want_dw, want_dg,
                                    fast))
        want_dx = want_dw = want_dg = False
    if want_dw:
        steps.append(_dw_step(dims, has_gates, sg, sx, sdy, route.num_pairs, dot_precision, cfg, fast))
    if want_dx or want_dg:
        if d_in == 0 or d_out == 0:  # z_p = 0: zero gradients
            steps.append(_zero_step(want_dx, want_dg))
        else:
            cast_w = cast_weights(cfg, weight, x3.dtype)
            sw = torch.empty(weight.shape, device="meta").stride() if cast_w else weight.stride()
            steps.append(_dx_step(dims, x3.dtype, sw, has_gates, sg, sx, sdy, want_dx, want_dg,
                                  dot_precision, cfg, fast, cast_w))

    def enqueue(x3, weight, gates, route, dy, dx, dweight, dgates):
        g = gates if has_gates else x3  # a placeholder pointer when there are no gates
        for step in steps:
            step(x3, weight, g, route, dy, dx, dweight, dgates)

    enqueue.steps = steps
    return enqueue


def _zero_step(want_dx, want_dg):
    def step(x3, weight, g, route, dy, dx, dweight, dgates):
        if want_dx:
            dx.zero_()
        if want_dg:
            dgates.zero_()
    return step


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a · b with fp32 accumulation, returned in out_dtype: 16-bit inputs with an fp32 result keep the
    fp32 sum (no rounding through 16 bits) through cuBLAS's out_dtype form where torch has it."""
    if out_dtype == a.dtype:
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=out_dtype)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


def _dense_z_steps(dims, x_dtype, w_dtype, has_gates, sg, sdy, want_dx, want_dw, want_dg, fast):
    """Config DENSE_Z (module docstring): pair experts, Z, then the dense GEMMs and the d gates dots."""
    T, S, E, d_in, d_out, G_in, G_out = dims
    BLOCK_K = max(16, triton.next_power_of_2(d_out))
    BLOCK_T = max(1, min(64, 2048 // BLOCK_K))
    rows = T * G_in
    pair_experts, dense_z = _dense_z_calls(T, S, E, G_in, S // G_out, d_out, sdy, sg, has_gates, fast)
    dense_dg = KernelCall(_dense_dg, (triton.cdiv(T, BLOCK_T), S), 4,
                          (T, S, G_in, S // G_in, S // G_out, d_out, E * d_out, sdy[0], sdy[1]),
                          dict(BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K), dict(num_warps=4), fast=fast)

    def step(x3, weight, g, route, dy, dx, dweight, dgates):
        pair_expert = torch.empty(T * S, dtype=torch.int32, device=x3.device)
        pair_experts(route.token, route.slot, route.offsets, pair_expert)
        x_flat = x3.reshape(rows, d_in)
        if want_dx or want_dg:  # W_cat[e·d_out + k, n] = W[e, n, k]
            w_cat = torch.empty((E, d_out, d_in), dtype=x_dtype, device=x3.device)
            w_cat = w_cat.copy_(weight.permute(0, 2, 1)).view(E * d_out, d_in)  # cast and transpose: one copy
        if want_dx or want_dw:
            z = torch.zeros((rows, E * d_out), dtype=x_dtype, device=x3.device)
            dense_z(dy, g, pair_expert, z)
            if want_dx:  # dx = Z · W_cat
                torch.mm(z, w_cat, out=dx.view(rows, d_in))
            if want_dw:  # dW[e] = X_flatᵀ · Z[:, e block], in dweight's dtype (fp32 for master weights)
                dweight.copy_(_mm(x_flat.t(), z, w_dtype).view(d_in, E, d_out).permute(1, 0, 2))
        if want_dg:  # U = X_flat · W_catᵀ holds x_row(p) · W[e] for every expert; d gate_p = dy_row(p) · U[p]
            dense_dg(torch.mm(x_flat, w_cat.t()), dy, pair_expert, dgates)
    return step


def _dense_x_steps(dims, x_dtype, w_dtype, has_gates, sg, sx, want_dx, want_dw, want_dg, fast):
    """Config DENSE_X (module docstring): the forward's dense Z of gated x rows for dW = Zᵀ · dy, and
    dZ = dy · W_catᵀ for dx and d gates (one kernel); dy contiguous."""
    T, S, E, d_in, d_out, G_in, G_out = dims
    rows = T * G_out
    pair_experts, dense_z = _dense_z_calls(T, S, E, G_out, S // G_in, d_in, sx, sg, has_gates, fast)
    BLOCK_K = max(16, triton.next_power_of_2(d_in))
    BLOCK_T = max(1, min(64, 2048 // BLOCK_K))
    dense_dx = KernelCall(_dense_dx, (triton.cdiv(T, BLOCK_T), G_in), 6,
                          (T, S, G_out, S // G_in, S // G_out, d_in, E * d_in, sx[0], sx[1], sg[0], sg[1],
                           G_in * d_in, d_in),
                          dict(HAS_GATES=has_gates, WRITE_DX=want_dx, WRITE_DG=want_dg, BLOCK_T=BLOCK_T,
                               BLOCK_K=BLOCK_K), dict(num_warps=4), fast=fast)

    def step(x3, weight, g, route, dy, dx, dweight, dgates):
        pe = torch.empty(T * S, dtype=torch.int32, device=x3.device)
        pair_experts(route.token, route.slot, route.offsets, pe)
        dy_flat = dy.view(rows, d_out)
        if want_dw:  # dW[e] = Σ_p gate_p x_row(p)ᵀ dy_row(p): Z's rows hold the gated x rows
            z = torch.zeros((rows, E * d_in), dtype=x_dtype, device=x3.device)
            dense_z(x3, g, pe, z)
            if w_dtype == x_dtype:
                torch.mm(z.t(), dy_flat, out=dweight.view(E * d_in, d_out))
            else:  # fp32 master weights: the fp32 sums, not rounded through x's dtype
                dweight.view(E * d_in, d_out).copy_(_mm(z.t(), dy_flat, w_dtype))
        if want_dx or want_dg:
            dz = torch.mm(dy_flat, _weights_cat(weight, x_dtype).t())
            dense_dx(dz, x3, g, pe, dx if want_dx else dz, dgates if want_dg else dz)
    return step


def _dw_step(dims, has_gates, sg, sx, sdy, num_pairs, dot_precision, cfg, fast):
    T, S, E, d_in, d_out, G_in, G_out = dims
    BM = _pow2("DW_BLOCK_M", cfg["DW_BLOCK_M"])
    BN = _pow2("DW_BLOCK_N", cfg["DW_BLOCK_N"])
    BK = _pow2("DW_BLOCK_K", cfg["DW_BLOCK_K"])
    split = int(cfg["SPLIT_K"])
    if num_pairs == 0:
        return lambda x3, weight, g, route, dy, dx, dweight, dgates: dweight.zero_()
    tm, tn = triton.cdiv(d_in, BM), triton.cdiv(d_out, BN)
    dw = KernelCall(
        _dw_kernel, (E * split * tm * tn,), 7,
        (d_in, d_out, S // G_in, S // G_out,
         sx[0], sx[1], sdy[0], sdy[1], sg[0], sg[1],
         E * d_in * d_out if split > 1 else 0, d_in * d_out, d_out,
         tm, tn),
        dict(SPLIT_K=split, HAS_GATES=has_gates, DOT_PRECISION=dot_precision,
             DIV_M=_pow2_divisor(d_in, sx[0], sx[1]), DIV_N=_pow2_divisor(d_out, sdy[0], sdy[1], d_in * d_out),
             BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK),
        dict(num_warps=int(cfg["DW_num_warps"]), num_stages=int(cfg["DW_num_stages"])), fast=fast)
    sum_split = _sum_call(split, E * d_in * d_out, fast) if split > 1 else None

    def step(x3, weight, g, route, dy, dx, dweight, dgates):
        if sum_split is None:
            dw(x3, dy, g, route.token, route.slot, route.offsets, dweight)
            return
        partial = torch.empty((split, E, d_in, d_out), dtype=torch.float32, device=dweight.device)
        dw(x3, dy, g, route.token, route.slot, route.offsets, partial)
        sum_split(partial, dweight)
    return step


def _dx_step(dims, x_dtype, sw, has_gates, sg, sx, sdy, want_dx, want_dg, dot_precision, cfg, fast, cast_w=False):
    T, S, E, d_in, d_out, G_in, G_out = dims
    P = T * S
    BM = _pow2("DX_BLOCK_M", cfg["DX_BLOCK_M"])
    BN = _pow2("DX_BLOCK_N", cfg["DX_BLOCK_N"])
    BK = _pow2("DX_BLOCK_K", cfg["DX_BLOCK_K"])
    n_tiles_n = triton.cdiv(d_in, BN)
    interleave, block_e, grid_m, n_iter = _row_tile_grid(E, P, BM, bool(cfg["DX_INTERLEAVE"]))
    # where the pairs' dx rows go: x3 itself as a never-written placeholder (no dx wanted), dx (one
    # pair per dx row), or per-pair rows summed over each input group's slots in slot order
    if not want_dx:
        target, st = "x", sx
    elif G_in == S:
        target, st = "dx", torch.empty((T, G_in, d_in), device="meta").stride()[:2]
    else:
        target, st = "scratch", torch.empty((T, S, d_in), device="meta").stride()[:2]
    part_dtype = torch.float32 if cfg["DX_PARTIALS"] == "fp32" else x_dtype
    dx_call = KernelCall(
        _dx_kernel, (grid_m * n_tiles_n,), 9,
        (E, S, d_in, d_out, S // G_in, S // G_out, P,
         sdy[0], sdy[1],
         sw[0], sw[2], sw[1],
         sg[0], sg[1],
         sx[0], sx[1],
         st[0], st[1] if target != "x" or G_in > 1 else 0,
         grid_m, n_tiles_n, n_iter),
        dict(HAS_GATES=has_gates, WRITE_DX=want_dx, WRITE_DG=want_dg, DOT_PRECISION=dot_precision,
             INTERLEAVE=interleave, EVEN_K=d_out % BK == 0, DIV_K=_pow2_divisor(d_out, sdy[0], sdy[1]),
             DIV_N=_pow2_divisor(d_in, sx[0], sx[1], st[0], st[1]),
             DIV_W=_pow2_divisor(sw[0], sw[1]) if sw[2] == 1 else 1, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
             BLOCK_E=block_e),
        dict(num_warps=int(cfg["DX_num_warps"]), num_stages=int(cfg["DX_num_stages"])), fast=fast)
    group_sum = _group_sum_call(T * G_in, d_in, S // G_in, fast) if target == "scratch" else None
    sum_dg = _sum_call(n_tiles_n, P, fast) if want_dg else None

    def step(x3, weight, g, route, dy, dx, dweight, dgates):
        if target == "scratch":
            out = torch.empty((T, S, d_in), dtype=part_dtype, device=x3.device)
        else:
            out = dx if target == "dx" else x3
        dg_part = torch.empty((n_tiles_n, P), dtype=torch.float32, device=x3.device) if want_dg else out
        if cast_w:  # config CAST_W (forward module): the dx kernel streams 16-bit weight tiles
            weight = weights_in(weight, x_dtype)
        dx_call(dy, weight, g, x3, route.token, route.slot, route.offsets, out, dg_part)
        if group_sum is not None:
            group_sum(out, dx)
        if sum_dg is not None:
            sum_dg(dg_part, dgates)
    return step
