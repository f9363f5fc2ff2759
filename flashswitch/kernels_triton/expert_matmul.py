"""Triton forward kernels of op 3: gather -> per-expert GEMM -> scatter over expert-sorted pairs.

One program computes a [BLOCK_M, BLOCK_N] tile of the per-pair products for BLOCK_M consecutive
pairs of the expert-sorted list (a *row tile*) and BLOCK_N output features. Row tiles never
straddle two experts: expert e owns ceil(n_e / BLOCK_M) tiles, and each program finds its expert
and first row from the route's offsets [E+1] on the device (no host sync, no extra launch). The
grid is sized on the host from sizes only, `ceil(P / BLOCK_M) + min(E, P)` row tiles (an upper
bound of Σ_e ceil(n_e / BLOCK_M)); programs past the last tile exit at once.

Per tile: gather the A rows x[t, s // (S / G_in)] of its pairs, stream the B tile of weight[e]
(cast to x's dtype in registers when weight is fp32 master weights), `tl.dot` with fp32
accumulation (ieee for fp32 inputs), scale each row by its gate, then

- G_out == S: store row (t, s) of y directly (each output row has exactly one pair);
- G_out < S (default): fp32 atomic adds into a zeroed fp32 accumulator [T, G_out, d_out], cast once
  into y (y itself when x is fp32);
- G_out < S, deterministic: store each pair's fp32 row into a scratch [T, S, d_out], then a second
  kernel sums each group's slots in slot order.

Without `deterministic`, config `REDUCE` picks between the two for G_out < S: "atomic" (default) or
"ordered" (the deterministic path). Config `PARTIALS` = "out" (not with `deterministic`) rounds each
pair's gated product to y's dtype before the slot sum, as torch's grouped_mm pipeline does: the
ordered scratch then holds half the bytes, and with at most two slots per output group the atomics
add straight into a zeroed y (no fp32 accumulator, no cast pass). With two addends that is what the
ordered sum of the rounded partials gives (0 + a is exact, a + b one rounding of the exact sum), in
either order, so it is also reproducible; with more addends every add would round, so those groups
take the ordered sum.

The ordered path writes and reads back S·d_out fp32 values per token (S / G_out times the
accumulator: for SwitchHead O and σ-MoE down 8x, ~1 GB per 16k-token step), while the atomics land in an accumulator S / G_out times smaller that the tile schedule
below keeps mostly in L2, but contend when S / G_out pairs of one row are added at once; which is
faster depends on the shape, so the tuner tries both.

Config `DENSE_Z` (few experts per output group, as SwitchHead's output projection, whose slot sum
makes the atomics or the ordered scratch the bottleneck): `_dense_z` sums each token's gated x rows
per expert into a dense Z [T·G_out, E·d_in] (zeros where the output group did not pick the expert),
and y = Z · W_cat (W_cat = weight viewed as [E·d_in, d_out]) is one dense GEMM (torch.mm: fp32
accumulation, deterministic) doing G_out·E / S times the pairs' MACs at tensor-core rate, with no slot
reduction. Z holds x's dtype: one rounding of each gated sum before the GEMM. The backward's DENSE_Z
builds its Z the same way from dy rows.

Config `CAST_W` (fp32 master weights under 16-bit x): cast the weights to x's dtype once per call
(`weights_in`, one elementwise pass over E·d_in·d_out values) and run the tile kernel on 16-bit
weights, instead of converting every B tile in registers on each of its reads.

Tile schedule (config knobs):
- `GROUP_N`: programs are ordered (group of GROUP_N column tiles, row tile, column tile in group).
  GROUP_N = all column tiles makes the column tiles of one row tile neighbours (the gathered A rows
  are read from L2); a small GROUP_N sweeps all row tiles for a slice of columns first, so the
  atomically updated accumulator slice [T, G_out, GROUP_N·BLOCK_N] stays in L2.
- `INTERLEAVE`: row tiles ordered by (tile index within expert, expert) instead of (expert, tile).
  Within an expert the pairs are in token order, so tile j of every expert covers about the same
  token range: concurrently running tiles then touch a narrow window of x and of the outputs. Good
  for few experts with many pairs each (SwitchHead) when all weights fit in L2; bad for many experts
  (σ-MoE), whose weight tiles are better reused by an expert's tiles running side by side.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashswitch.kernels_triton.kernel_call import KernelCall

MAX_INTERLEAVE_E = 1024  # the interleaved schedule keeps all experts' tile counts in registers
MAX_BLOCK_E = 1024       # experts scanned per step when a program looks for its tile


@triton.jit
def _tile_of(off_ptr, E, pid_m, n_iter, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
             INTERLEAVE: tl.constexpr):
    """(expert, first row, end row) of row tile `pid_m`; expert == E when there is no such tile."""
    zero = pid_m * 0
    if INTERLEAVE:
        j = tl.arange(0, BLOCK_E)
        mj = j < E
        lo = tl.load(off_ptr + j, mask=mj, other=0).to(tl.int32)
        hi = tl.load(off_ptr + j + 1, mask=mj, other=0).to(tl.int32)
        nt = (hi - lo + BLOCK_M - 1) // BLOCK_M
        total = tl.sum(nt, 0)
        # level L = the largest tile index with base(L) = Σ_e min(nt_e, L) <= pid_m
        lvl_lo = zero
        lvl_hi = tl.maximum(tl.max(nt, 0) - 1, 0)
        for _ in range(n_iter):
            mid = (lvl_lo + lvl_hi + 1) // 2
            ok = tl.sum(tl.minimum(nt, mid), 0) <= pid_m
            lvl_lo = tl.where(ok, mid, lvl_lo)
            lvl_hi = tl.where(ok, lvl_hi, mid - 1)
        base = tl.sum(tl.minimum(nt, lvl_lo), 0)
        active = ((nt > lvl_lo) & mj).to(tl.int32)
        rank = tl.cumsum(active, 0)
        e = tl.sum(((rank <= pid_m - base) & mj).to(tl.int32), 0)
        e = tl.where(pid_m < total, e, E)
        row0 = tl.sum(tl.where(j == e, lo, 0), 0) + lvl_lo * BLOCK_M
        row_end = tl.sum(tl.where(j == e, hi, 0), 0)
    else:
        carry = zero
        e = zero
        first_tile = zero
        row_lo = tl.load(off_ptr).to(tl.int32)
        row_end = tl.load(off_ptr + E).to(tl.int32)
        for c in range(0, E, BLOCK_E):
            j = c + tl.arange(0, BLOCK_E)
            mj = j < E
            lo = tl.load(off_ptr + j, mask=mj, other=0).to(tl.int32)
            hi = tl.load(off_ptr + j + 1, mask=mj, other=0).to(tl.int32)
            nt = (hi - lo + BLOCK_M - 1) // BLOCK_M
            cum = tl.cumsum(nt, 0) + carry          # tiles of experts <= j
            done = (cum <= pid_m) & mj              # experts whose tiles all come before pid_m
            e += tl.sum(done.to(tl.int32), 0)
            first_tile = tl.maximum(first_tile, tl.max(tl.where(done, cum, 0), 0))
            row_lo = tl.maximum(row_lo, tl.max(tl.where(done, hi, 0), 0))
            row_end = tl.minimum(row_end, tl.min(tl.where(mj & (cum > pid_m), hi, 2147483647), 0))
            carry += tl.sum(nt, 0)
        row0 = row_lo + (pid_m - first_tile) * BLOCK_M
    return e, row0, row_end


@triton.jit
def _aligned(v, DIV: tl.constexpr):
    """v, which the host checked is a multiple of DIV, written so that the compiler sees it too
    (sizes that are not multiples of 16 would otherwise keep loads, stores and atomics scalar)."""
    return (v // DIV) * DIV


@triton.jit
def _tile_pairs(tok_ptr, slot_ptr, row0, row_end, BLOCK_M: tl.constexpr):
    """(mask, token int64, slot) of the row tile's pairs row0 .. row0 + BLOCK_M - 1, masked at
    row_end: loaded once per tile and shared by every gather and scatter of its rows."""
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    slt = tl.load(slot_ptr + rows, mask=rmask, other=0)
    return rmask, tok, slt


@triton.jit
def _group_row(tok, slt, spg, stride_t, stride_g):
    """Offset of row [t, s // spg] of a [T, G, d] tensor for each pair (t, s): slot s belongs to
    group s // spg (spg = S / G slots per group)."""
    return tok * stride_t + (slt // spg).to(tl.int64) * stride_g


@triton.jit
def _pair_gates(g_ptr, tok, slt, stride_gt, stride_gs, rmask):
    """gates[t, s] of each pair as fp32 (0 where masked): the gate scales the pair's product."""
    return tl.load(g_ptr + tok * stride_gt + slt * stride_gs, mask=rmask, other=0.0).to(tl.float32)


@triton.jit
def _gather_gemm(a_ptr, a_row, rmask, b_ptr, e, stride_be, stride_bk, stride_bn, pid_n, K, N,
                 EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(acc, offs_n, nmask): the fp32 [BLOCK_M, BLOCK_N] tile A[rows] · B[e][:, column tile pid_n]
    over K, with the gathered A rows at a_ptr + a_row (unit k stride, masked by rmask) and B[e] of
    any strides, cast to A's dtype in registers. Shared by the forward and the backward's dx GEMM,
    which differ only in what they gather and how they store."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    a_ptrs = a_ptr + a_row[:, None] + offs_k[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (offs_k + k) < K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc, offs_n, nmask


@triton.jit
def _expert_matmul_fwd(
    x_ptr, w_ptr, g_ptr, tok_ptr, slot_ptr, off_ptr, out_ptr,
    E, d_in, d_out, spg_in, spg_out,
    stride_xt, stride_xg,
    stride_we, stride_wk, stride_wn,
    stride_gt, stride_gs,
    stride_ot, stride_og,
    grid_m, n_tiles_n, group_n, n_iter,
    ATOMIC: tl.constexpr, HAS_GATES: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERLEAVE: tl.constexpr,
    EVEN_K: tl.constexpr, DIV_K: tl.constexpr, DIV_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Alignment the host checked but the compiler cannot see when a size is not a multiple of 16
    # (d_model 412, d_head 76): d_in and x's row strides are multiples of DIV_K; d_out, weight's
    # and out's row strides multiples of DIV_N. It lets loads, stores and atomics use vectors.
    d_in, stride_xt, stride_xg = _aligned(d_in, DIV_K), _aligned(stride_xt, DIV_K), _aligned(stride_xg, DIV_K)
    d_out, stride_we, stride_wk = _aligned(d_out, DIV_N), _aligned(stride_we, DIV_N), _aligned(stride_wk, DIV_N)
    stride_ot, stride_og = _aligned(stride_ot, DIV_N), _aligned(stride_og, DIV_N)

    pid = tl.program_id(0)
    per_group = group_n * grid_m
    group = pid // per_group
    first_n = group * group_n
    gn = tl.minimum(n_tiles_n - first_n, group_n)
    local = pid - group * per_group
    pid_m = local // gn
    pid_n = first_n + local % gn

    e, row0, row_end = _tile_of(off_ptr, E, pid_m, n_iter, BLOCK_M, BLOCK_E, INTERLEAVE)
    if e >= E:
        return

    rmask, tok, slt = _tile_pairs(tok_ptr, slot_ptr, row0, row_end, BLOCK_M)
    x_row = _group_row(tok, slt, spg_in, stride_xt, stride_xg)
    acc, offs_n, nmask = _gather_gemm(x_ptr, x_row, rmask, w_ptr, e, stride_we, stride_wk, stride_wn, pid_n,
                                      d_in, d_out, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)

    if HAS_GATES:
        acc = acc * _pair_gates(g_ptr, tok, slt, stride_gt, stride_gs, rmask)[:, None]
    o_ptrs = out_ptr + _group_row(tok, slt, spg_out, stride_ot, stride_og)[:, None] + offs_n[None, :]
    omask = rmask[:, None] & nmask[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask, sem="relaxed")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _group_sum(src_ptr, y_ptr, R, d_out, spg, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[r] = Σ_{j < spg} src[r·spg + j] in order j = 0, 1, ... (rows of d_out; both contiguous)."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < R)[:, None] & (n < d_out)[None, :]
    src = src_ptr + (r.to(tl.int64) * spg * d_out)[:, None] + n[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for _ in range(spg):
        acc += tl.load(src, mask=mask, other=0.0)
        src += d_out
    tl.store(y_ptr + (r.to(tl.int64) * d_out)[:, None] + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


REDUCE_MODES = ("atomic", "ordered")
PARTIALS_MODES = ("fp32", "out")


def _pow2(name: str, v, lo: int = 16) -> int:
    v = int(v)
    if v < lo or v & (v - 1):
        raise ValueError(f"config {name} must be a power of two >= {lo}, got {v}")
    return v


def _pow2_divisor(*values: int, cap: int = 16) -> int:
    """The largest power of two <= cap dividing every value (0 divides nothing away)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if g == 0:
        return cap
    return min(cap, g & -g)


def _row_tile_grid(E: int, P: int, BM: int, interleave: bool) -> tuple[bool, int, int, int]:
    """(INTERLEAVE, BLOCK_E, grid_m, n_iter) of the row tiles `_tile_of` finds for P pairs of E
    experts: the interleaved schedule only up to MAX_INTERLEAVE_E experts, grid_m the host's upper
    bound of the tile count (module docstring), n_iter the steps of its binary search."""
    interleave = interleave and E <= MAX_INTERLEAVE_E
    block_e = max(16, triton.next_power_of_2(E))
    if not interleave:
        block_e = min(block_e, MAX_BLOCK_E)
    return interleave, block_e, triton.cdiv(P, BM) + min(E, P), triton.cdiv(P, BM).bit_length() + 1


def _group_sum_call(R: int, d: int, spg: int, fast: bool = False) -> KernelCall:
    """The launch of `_group_sum` (y [R, d] = scratch [R, spg, d] summed over its spg slots in slot
    order), called with (scratch, y)."""
    BLOCK_N = min(128, max(16, triton.next_power_of_2(d)))
    BLOCK_R = max(1, 4096 // BLOCK_N)
    return KernelCall(_group_sum, (triton.cdiv(R, BLOCK_R), triton.cdiv(d, BLOCK_N)), 2, (R, d, spg),
                      dict(BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N), dict(num_warps=4), fast=fast)


@triton.jit
def _pair_experts(tok_ptr, slot_ptr, off_ptr, pe_ptr, S, BLOCK: tl.constexpr):
    """pe[t·S + s] = the expert of pair (t, s): program e walks its sorted rows."""
    e = tl.program_id(0)
    lo = tl.load(off_ptr + e)
    hi = tl.load(off_ptr + e + 1)
    for r0 in range(lo, hi, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        rmask = rows < hi
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        slt = tl.load(slot_ptr + rows, mask=rmask, other=0)
        tl.store(pe_ptr + tok * S + slt, e.to(tl.int32), mask=rmask)


@triton.jit
def _dense_z(src_ptr, g_ptr, pe_ptr, z_ptr, T, S, G, spg, spg_src, d,
             stride_st, stride_sg, stride_gt, stride_gs, stride_zr,
             HAS_GATES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Z[t·G + g, e·d + k] = Σ over the slots s of group g (slots g·spg ... g·spg + spg - 1) with expert
    e, in slot order, of gate[t, s] · src[t, s // spg_src, k] (fp32 sums, one rounding). Z starts
    zeroed; each slot of the group writes its expert's whole sum (slots sharing an expert write the
    same values), so no entry is read back. The forward's Z gathers x rows per output group, the
    backward's dy rows per input group."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < T
    kmask = offs_k < d
    t64 = offs_t.to(tl.int64)
    z_row = z_ptr + (t64 * G + g) * stride_zr
    for j in range(spg):
        e = tl.load(pe_ptr + t64 * S + g * spg + j, mask=tmask, other=0)
        total = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for jj in range(spg):
            s2 = g * spg + jj
            same = (tl.load(pe_ptr + t64 * S + s2, mask=tmask, other=-1) == e) & tmask
            v = tl.load(src_ptr + t64[:, None] * stride_st + (s2 // spg_src) * stride_sg + offs_k[None, :],
                        mask=same[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            if HAS_GATES:
                gv = tl.load(g_ptr + t64 * stride_gt + s2 * stride_gs, mask=same, other=0.0).to(tl.float32)
                v = v * gv[:, None]
            total += v
        tl.store(z_row[:, None] + e.to(tl.int64)[:, None] * d + offs_k[None, :],
                 total.to(z_ptr.dtype.element_ty), mask=tmask[:, None] & kmask[None, :])


def _dense_z_calls(T, S, E, G, spg_src, d, s_src, sg, has_gates, fast):
    """(pair experts, dense Z) launches: called with (token, slot, offsets, pe) and (src, gates, pe, z),
    Z [T·G, E·d] zeroed."""
    BLOCK_K = max(16, triton.next_power_of_2(d))
    BLOCK_T = max(1, min(64, 2048 // BLOCK_K))
    pair_experts = KernelCall(_pair_experts, (E,), 4, (S,), dict(BLOCK=256), dict(num_warps=4), fast=fast)
    dense_z = KernelCall(_dense_z, (triton.cdiv(T, BLOCK_T), G), 4,
                         (T, S, G, S // G, spg_src, d, s_src[0], s_src[1], sg[0], sg[1], E * d),
                         dict(HAS_GATES=has_gates, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K), dict(num_warps=4), fast=fast)
    return pair_experts, dense_z


def weights_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Config CAST_W: weight [E, d_in, d_out] in `dtype`, contiguous (weight itself when it has that
    dtype already)."""
    if weight.dtype == dtype:
        return weight
    return torch.empty(weight.shape, dtype=dtype, device=weight.device).copy_(weight)


def cast_weights(config, weight, x_dtype) -> bool:
    """Whether config CAST_W applies: asked for, and weights of another dtype than x (master weights)."""
    cast = config.get("CAST_W", False)
    if not isinstance(cast, bool):
        raise TypeError(f"config CAST_W must be a bool, got {cast!r}")
    return cast and weight.dtype != x_dtype


def _weights_cat(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [E, d_in, d_out] as W_cat [E·d_in, d_out] in `dtype` (fp32 master weights under 16-bit x
    are cast: the dense GEMMs read x's dtype), in one copy at most."""
    E, d_in, d_out = weight.shape
    return weights_in(weight, dtype).reshape(E * d_in, d_out)


def _dense_forward(T, S, E, d_in, d_out, G_in, G_out, sx, sg, has_gates, fast):
    """Config DENSE_Z (module docstring): Z [T·G_out, E·d_in] of gated x rows, then y = Z · W_cat."""
    pair_experts, dense_z = _dense_z_calls(T, S, E, G_out, S // G_in, d_in, sx, sg, has_gates, fast)

    def enqueue(x3, weight, gates, route, y):
        pe = torch.empty(T * S, dtype=torch.int32, device=x3.device)
        pair_experts(route.token, route.slot, route.offsets, pe)
        z = torch.zeros((T * G_out, E * d_in), dtype=x3.dtype, device=x3.device)
        dense_z(x3, gates if has_gates else x3, pe, z)
        torch.mm(z, _weights_cat(weight, x3.dtype), out=y.view(T * G_out, d_out))

    enqueue.calls = (pair_experts, dense_z)
    return enqueue


def _nothing(*tensors) -> None:
    """The enqueue of a problem with nothing to compute."""


def _zero_output(x3, weight, gates, route, y) -> None:
    """The enqueue of a problem with d_in = 0: every product is 0."""
    y.zero_()


_nothing.calls = _zero_output.calls = ()


def prepare(x3, weight, gates, route, y, *, G_in, G_out, deterministic, config, fast=False):
    """The launches `launch` makes for these arguments, prepared from their metadata only (shapes,
    strides, dtypes, the route's sizes; y may be a meta tensor): an enqueue taking the tensors of a
    call with the same metadata, (x3, weight, gates, route, y). fast: direct launches (kernel_call)."""
    T, _, d_in = x3.shape
    E, _, d_out = weight.shape
    S = route.S
    P = T * S
    if y.numel() == 0:
        return _nothing
    if d_in == 0:
        return _zero_output
    has_gates = gates is not None
    sg = gates.stride() if has_gates else (0, 0)
    sx = (x3.stride(0), x3.stride(1) if G_in > 1 else 0)  # with one input group every slot reads group 0
    if config.get("DENSE_Z", False):
        return _dense_forward(T, S, E, d_in, d_out, G_in, G_out, sx, sg, has_gates, fast)
    BM = _pow2("BLOCK_M", config["BLOCK_M"])
    BN = _pow2("BLOCK_N", config["BLOCK_N"])
    BK = _pow2("BLOCK_K", config["BLOCK_K"])
    n_tiles_n = triton.cdiv(d_out, BN)
    group_n = max(1, min(int(config["GROUP_N"]), n_tiles_n))
    interleave, block_e, grid_m, n_iter = _row_tile_grid(E, P, BM, bool(config["INTERLEAVE"]))

    reduce = config.get("REDUCE", "atomic")
    if reduce not in REDUCE_MODES:
        raise ValueError(f"config REDUCE must be one of {REDUCE_MODES}, got {reduce!r}")
    partials = config.get("PARTIALS", "fp32")
    if partials not in PARTIALS_MODES:
        raise ValueError(f"config PARTIALS must be one of {PARTIALS_MODES}, got {partials!r}")
    part_dtype = torch.float32 if deterministic or partials == "fp32" else y.dtype
    narrow_atomics_round = part_dtype != torch.float32 and S // G_out > 2  # see the module docstring
    ordered = atomic = False
    if G_out == S:  # one pair per output row: store straight into y
        st, spg_out = y.stride(), 1
    elif deterministic or reduce == "ordered" or narrow_atomics_round:  # per-pair rows, summed in slot order
        ordered, spg_out = True, 1
        scratch_shape = (T, S, d_out)
        st = torch.empty(scratch_shape, dtype=part_dtype, device="meta").stride()
    else:  # atomic adds into y zeroed, or into a zeroed fp32 accumulator cast into y after
        atomic, spg_out = True, S // G_out
        into_y = y.dtype == part_dtype
        st = y.stride() if into_y else torch.empty(y.shape, dtype=part_dtype, device="meta").stride()

    dot_precision = "ieee" if x3.dtype == torch.float32 else "tf32"
    cast_w = cast_weights(config, weight, x3.dtype)
    sw = torch.empty(weight.shape, device="meta").stride() if cast_w else weight.stride()
    call = KernelCall(
        _expert_matmul_fwd, (grid_m * n_tiles_n,), 7,
        (E, d_in, d_out, S // G_in, spg_out,
         sx[0], sx[1],
         sw[0], sw[1], sw[2],
         sg[0], sg[1],
         st[0], st[1],
         grid_m, n_tiles_n, group_n, n_iter),
        dict(ATOMIC=atomic, HAS_GATES=has_gates, DOT_PRECISION=dot_precision, INTERLEAVE=interleave,
             EVEN_K=d_in % BK == 0, DIV_K=_pow2_divisor(d_in, sx[0], sx[1]),
             DIV_N=_pow2_divisor(d_out, sw[0], sw[1], st[0], st[1]),
             BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_E=block_e),
        dict(num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"])), fast=fast)
    group_sum = _group_sum_call(T * G_out, d_out, S // G_out, fast) if ordered else None
    device = y.device if y.device.type != "meta" else x3.device

    def enqueue(x3, weight, gates, route, y):
        if cast_w:
            weight = weights_in(weight, x3.dtype)
        if ordered:
            target = torch.empty(scratch_shape, dtype=part_dtype, device=device)
        elif atomic:
            target = y.zero_() if into_y else torch.zeros(y.shape, dtype=part_dtype, device=device)
        else:
            target = y
        call(x3, weight, gates if has_gates else x3, route.token, route.slot, route.offsets, target)
        if ordered:
            group_sum(target, y)
        elif atomic and not into_y:
            y.copy_(target)

    enqueue.calls = (call,) if group_sum is None else (call, group_sum)  # what it launches (tests)
    return enqueue


def launch(x3, weight, gates, route, y, *, G_in, G_out, deterministic, config):
    """Fill y [T, G_out, d_out] (contiguous, x's dtype).

    x3: [T, G_in, d_in] with a unit last stride. weight: [E, d_in, d_out], any strides, x's dtype or
    fp32. gates: None or [T, S] (any float dtype, any strides). route: a `Route` (token, slot int32
    [P]; offsets int64 [E+1]). config (complete, from call_plan.config or complete_config): BLOCK_M,
    BLOCK_N, BLOCK_K, GROUP_N, INTERLEAVE, num_warps, num_stages, optional REDUCE ("atomic" or "ordered"),
    PARTIALS ("fp32" or "out": the dtype of the per-pair partials of the slot sum; `deterministic`
    keeps fp32), DENSE_Z and CAST_W (module docstring).
    """
    prepare(x3, weight, gates, route, y, G_in=G_in, G_out=G_out, deterministic=deterministic,
            config=config)(x3, weight, gates, route, y)
