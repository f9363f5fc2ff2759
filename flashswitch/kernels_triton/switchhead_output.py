"""SwitchHead's fused output projection (ops/switchhead_output.py): the forward kernels, one dense GEMM over
every expert.

The projection (nn/switchhead.py) is routed: token t uses k of head h's E experts with gates,
    y[t] = Σ_h Σ_e w[t, h·E + e] · a[t, h] @ weight[h·E + e]      a [T, H, D], weight [H·E, D, d],
where the dense gate table w [T, H·E] (fp32, `_gate_table_kernel`) holds each picked expert's gate and 0
elsewhere. That is the dense GEMM y = Z · W_cat with
    Z[t, kk] = w[t, kk // D] · a[t, kk // (E·D), kk % D],   W_cat = weight viewed as [H·E·D, d],
which does E / k times the routed multiply-adds, shaped as a dense GEMM: no gather of the pairs, no
slot reduction (op 3's atomics or ordered scratch), no routing sort. Z is never stored: each K block of
it is built in registers from a and w (`_z_tile`), rounded to a's dtype (the one rounding of the gated
value, as op 3's DENSE_Z) and fed to tl.dot with fp32 accumulation. K runs over H·E·D in power-of-two
blocks with masks at its end only, so a head dim such as 112 or 76 costs no padded multiply-adds. fp32
master weights with 16-bit a are cast per tile in registers, as op 3 does.
The row-scale form (`_forward_rows_kernel`, config FORM "rows") runs K over the H·E expert blocks
instead, each padded from D to a multiple of its K step (masked): a Z block is a's contiguous head tile
times one gate per row, so a and W load affinely and the pipeliner prefetches both. A config without
FORM runs FORWARD_FORM.

`prepare` builds the launches of one call signature (the gate table, then the GEMM) from a complete
config (autotune/space.py's "switchhead_output" table: tiles BT, BN, BK, GROUP_T, HEAD_LOOP, FORM);
`forward` runs the GEMM on a given gate table (tests, compile checks). The backward is
switchhead_output_bwd.py. Every output is allocated by `new_output` (NaN under FLASHSWITCH_POISON).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch import _common as C
from flashswitch.kernels_triton.expert_matmul import _aligned, _pow2_divisor
from flashswitch.kernels_triton.kernel_call import KernelCall

FORMS = ("columns", "rows")
# the forward a config without FORM runs (the default config has none): "columns" (_forward_kernel) or
# "rows" (_forward_rows_kernel); both stay until a GPU run shows one to be the faster at the papers' shapes
FORWARD_FORM = "columns"


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
def _forward_kernel(a_ptr, g_ptr, w_ptr, y_ptr, T, d, s_at, s_ah, s_gt, s_we, s_wk, s_wn, s_yt,
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
def _forward_rows_kernel(a_ptr, g_ptr, w_ptr, y_ptr, T, d, s_at, s_ah, s_gt, s_we, s_wk, s_wn, s_yt,
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



# ---------------------------------------------------------------- launches
def _strides(t: torch.Tensor, dims) -> list:
    """t's strides of `dims`, 0 for a dim of size 1 (its stride is never multiplied by a nonzero index)."""
    return [t.stride(i) if t.shape[i] > 1 else 0 for i in dims]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _form(form) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form


def _padded_head_dim(D: int) -> int:
    """BD of the row-scale kernels: D padded to a power of two, at least a dot's 16."""
    return max(16, C.next_pow2(D))


def _options(config, prefix: str = "") -> dict:
    return dict(num_warps=int(config[prefix + "num_warps"]), num_stages=int(config[prefix + "num_stages"]))


def gate_table_call(ids: torch.Tensor, gates: torch.Tensor, num_columns: int, fast: bool = False) -> KernelCall:
    """The launch that writes the dense gate table w [T, num_columns] (fp32, contiguous) of ids and gates
    of this metadata: w[t, e] = Σ_{s : ids[t, s] = e} gates[t, s]; ids outside [0, num_columns) dropped."""
    T, S = ids.shape
    block_e = C.next_pow2(max(num_columns, 1))
    block_t = max(1, min(128, 4096 // block_e))
    return KernelCall(_gate_table_kernel, (triton.cdiv(T, block_t),), 3,
                      (T, S, num_columns, ids.stride(0), ids.stride(1), gates.stride(0), gates.stride(1),
                       num_columns), dict(BT=block_t, BE=block_e), dict(num_warps=4), fast=fast)


def gate_table(ids: torch.Tensor, gates: torch.Tensor, num_columns: int) -> torch.Tensor:
    """The dense gate table w [T, num_columns] fp32 of ids and gates. One launch."""
    w = C.new_output((ids.shape[0], num_columns), torch.float32, ids.device)
    if w.numel():
        gate_table_call(ids, gates, num_columns)(ids, gates, w)
    return w


def _gemm_call(a, weight, y, config, form, fast: bool) -> KernelCall:
    """The launch y = Z · W_cat of a [T, H, D], a gate table [T, H·E] (fp32, contiguous), weight [H·E, D, d]
    and y [T, d] of this metadata, in `form` (None: the config's FORM, else FORWARD_FORM)."""
    form = _form(form or config.get("FORM", FORWARD_FORM))
    T, H, D = a.shape
    HE, _, d = weight.shape
    s_at, s_ah = _strides(a, (0, 1))
    s_we, s_wk, s_wn = _strides(weight, (0, 1, 2))
    s_yt, = _strides(y, (0,))
    meta = dict(D=D, E=HE // H, H=H, DIV=_pow2_divisor(D, s_at, s_ah), DIV_N=_pow2_divisor(d, s_we, s_wk, s_yt),
                DOT_PRECISION=_dot_precision(a.dtype), BT=int(config["BT"]), BN=int(config["BN"]),
                BK=int(config["BK"]), GROUP_T=int(config["GROUP_T"]))
    kernel = _forward_kernel
    if form == "rows":
        kernel = _forward_rows_kernel
        meta.update(BD=_padded_head_dim(D), HEAD_LOOP=bool(config.get("HEAD_LOOP", False)))
    grid = (triton.cdiv(T, meta["BT"]) * triton.cdiv(d, meta["BN"]),)
    return KernelCall(kernel, grid, 4, (T, d, s_at, s_ah, HE, s_we, s_wk, s_wn, s_yt), meta, _options(config),
                      fast=fast)


def _nothing(*tensors) -> None:
    pass


def _zero_output(a, ids, gates, weight, y) -> None:
    y.zero_()  # D = 0: nothing to sum


def prepare(a, ids, gates, weight, y, *, config, fast=False):
    """The launches of a call with this metadata (y may be a meta tensor): an enqueue taking the call's
    tensors (a, ids, gates, weight, y) that writes the gate table, then y = Z · W_cat. fast: direct
    launches (kernel_call)."""
    T, H, D = a.shape
    HE = weight.shape[0]
    if y.numel() == 0:
        return _nothing
    if D == 0:
        return _zero_output
    table = gate_table_call(ids, gates, HE, fast)
    gemm = _gemm_call(a, weight, y, config, None, fast)
    device = a.device

    def enqueue(a, ids, gates, weight, y):
        w = C.new_output((T, HE), torch.float32, device)
        table(ids, gates, w)
        gemm(a, w, weight, y)

    enqueue.calls = (table, gemm)  # what it launches (tests)
    return enqueue


def launch(a, ids, gates, weight, y, *, config):
    prepare(a, ids, gates, weight, y, config=config)(a, ids, gates, weight, y)


def forward(a: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, *, config, form=None) -> torch.Tensor:
    """y [T, d] (a's dtype) = Z · W_cat from a [T, H, D] (unit last stride), the gate table w [T, H·E]
    (`gate_table`) and weight [H·E, D, d] (a's dtype or fp32), with a complete forward config (tiles of
    the form run). form: "columns" or "rows" (None: the config's FORM, else FORWARD_FORM)."""
    if form is not None:
        _form(form)
    T, H, D = a.shape
    y = C.new_output((T, weight.shape[2]), a.dtype, a.device)
    if y.numel() == 0:
        return y
    if D == 0:
        return y.zero_()
    _gemm_call(a, weight, y, config, form, False)(a, w.contiguous(), weight, y)
    return y


__all__ = ["FORMS", "forward", "gate_table", "launch", "prepare"]
