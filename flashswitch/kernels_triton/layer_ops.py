"""Fused inference kernels of the decoder layers around attention: rotary embedding of q and k in one
launch (positions from the cache lengths on the device), RMSNorm with the residual add before it, and
SwiGLU's silu(gate) * up; and, with its backward, the partial rotary embedding of a packed q/k
projection that the training layers use (nn/switchhead.py). The torch versions (nn/rotary.py,
nn/llama.py, nn/switchhead.py) take 2 to 14 elementwise kernels each (25 or so for a rotary forward and
backward), fp32 copies of their inputs included; in a decode step or a training layer those small
kernels and their host time, not the attention, can set the pace, and in a long prefill their memory
traffic does. Same math as the torch versions (fp32 arithmetic, the same roundings to the input dtype).
The inference kernels serve calls that need no gradient (the torch versions keep autograd). Also the
routers' top-k over a few experts per row with its gates and their gradient (nn/_routing.py), where torch's
row sort launches a block per 4-expert row and the gather, offsets and layout as many launches again.
Which calls they serve is decided in ops/layers.py, through which the layers reach them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch._common import new_output, next_pow2, poison_outputs
from flashswitch.kernels_triton.kernel_call import launch

_WARPS4, _WARPS8 = {"num_warps": 4}, {"num_warps": 8}


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, off_ptr, freq_ptr,
                   H, Hkv, n,
                   sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sqo_b, sqo_h, sqo_n, sko_b, sko_h, sko_n,
                   HAS_OFF: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    """One program per (sequence b, token i): every head of q and then of k at position off[b] + i."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n
    i = pid - b * n
    offs_f = tl.arange(0, BLOCK_F)
    fmask = offs_f < HALF
    pos = i
    if HAS_OFF:
        pos = pos + tl.load(off_ptr + b)
    angle = pos.to(tl.float32) * tl.load(freq_ptr + offs_f, mask=fmask, other=0.0)
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    for h0 in range(0, H + Hkv, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        is_q = heads < H
        hk = heads - H
        mask = (heads < H + Hkv)[:, None] & fmask[None, :]
        src = tl.where(is_q, b * sq_b + heads * sq_h + i * sq_n, b * sk_b + hk * sk_h + i * sk_n)
        dst = tl.where(is_q, b * sqo_b + heads * sqo_h + i * sqo_n, b * sko_b + hk * sko_h + i * sko_n)
        qm = mask & is_q[:, None]
        km = mask & (~is_q)[:, None]
        p1 = src[:, None] + offs_f[None, :]
        x1 = (tl.load(q_ptr + p1, mask=qm, other=0.0).to(tl.float32)
              + tl.load(k_ptr + p1, mask=km, other=0.0).to(tl.float32))
        x2 = (tl.load(q_ptr + p1 + HALF, mask=qm, other=0.0).to(tl.float32)
              + tl.load(k_ptr + p1 + HALF, mask=km, other=0.0).to(tl.float32))
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        d1 = dst[:, None] + offs_f[None, :]
        tl.store(qo_ptr + d1, o1.to(qo_ptr.dtype.element_ty), mask=qm)
        tl.store(qo_ptr + d1 + HALF, o2.to(qo_ptr.dtype.element_ty), mask=qm)
        tl.store(ko_ptr + d1, o1.to(ko_ptr.dtype.element_ty), mask=km)
        tl.store(ko_ptr + d1 + HALF, o2.to(ko_ptr.dtype.element_ty), mask=km)


def _like(t: torch.Tensor) -> torch.Tensor:
    """An output with t's shape and strides (NaN under FLASHSWITCH_POISON: unwritten elements show)."""
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if poison_outputs() else out


def rotary_qk(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, offsets=None):
    """q [B, H, n, D], k [B, Hkv, n, D] (unit last stride) rotated at positions offsets[b] + i (offsets:
    None for 0, or a [B] integer tensor on the device such as a cache's lengths) by the angles
    position * inv_freq ([D / 2] fp32), rotate-half pairing: new tensors with the inputs' strides."""
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    qo, ko = _like(q), _like(k)
    if B * n == 0 or D == 0:
        return qo, ko
    half = D // 2
    block_f = next_pow2(max(half, 1))
    block_h = max(1, min(next_pow2(H + Hkv), 4096 // block_f))
    launch(_rotary_kernel, (B * n,), (q, k, qo, ko, inv_freq if offsets is None else offsets, inv_freq),
           (H, Hkv, n, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3]),
           dict(HAS_OFF=offsets is not None, HALF=half, BLOCK_H=block_h, BLOCK_F=block_f), _WARPS4)
    return qo, ko


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, d, s_x, s_r, s_s, s_y, eps,
                     HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    """One row: s = x + r rounded to s's dtype (stored), y = (s / rms(s)) rounded, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        x = x + tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * s_s + offs, x, mask=mask)
        x = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
    normed = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)  # the Llama convention: round, then the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """(s, y): s = x + residual (x alone when residual is None) and y = (s / rms(s)) rounded to x's
    dtype, times weight; x, residual [..., d] with unit last stride, one program per row. The residual
    add of a pre-norm block fused with the next norm: s is the block's new residual stream."""
    d = x.shape[-1]
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    y = new_output(x2.shape, x.dtype, x.device)
    s = x2 if residual is None else new_output(x2.shape, x.dtype, x.device)
    if x2.shape[0] and d:
        launch(_rms_norm_kernel, (x2.shape[0],), (x2, r2, weight, s, y),
               (d, x2.stride(0), r2.stride(0), s.stride(0), y.stride(0), float(eps)),
               dict(HAS_R=residual is not None, BLOCK=next_pow2(d)), _WARPS4 if d <= 2048 else _WARPS8)
    return s.view(x.shape), y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x)) rounded to x's dtype, times weight: x [..., d] with unit last stride."""
    return add_rms_norm(x, None, weight, eps)[1]


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, d, s_g, s_u, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(g_ptr + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * s_u + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)  # F.silu's rounding, then the product
    tl.store(o_ptr + row * s_o + offs, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU's activation) in one pass: gate, up [..., d] with unit last stride."""
    d = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = new_output(g2.shape, gate.dtype, gate.device)
    block = min(next_pow2(max(d, 1)), 1024)
    if g2.shape[0] and d:
        launch(_silu_mul_kernel, (g2.shape[0], -(-d // block)), (g2, u2, out),
               (d, g2.stride(0), u2.stride(0), out.stride(0)), dict(BLOCK=block), _WARPS4)
    return out.view(gate.shape)


@triton.jit
def _rotary_packed_kernel(x_ptr, o_ptr, freq_ptr, N, R, s_b, s_n, s_r, so_b, so_n, so_r, sign,
                          D: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence b, position n): R rows of D dims, the first 2 * HALF rotated by the
    angles n * freq (dim j pairs with j + HALF; sign -1 rotates back: the backward), the rest copied."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // N
    n = pid - b * N
    offs_d = tl.arange(0, BLOCK_D)
    j = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
    rot = offs_d < 2 * HALF
    angle = n.to(tl.float32) * tl.load(freq_ptr + j, mask=rot, other=0.0)
    cos = tl.cos(angle)[None, :]
    sin = (sign * tl.where(offs_d < HALF, -1.0, 1.0) * tl.sin(angle))[None, :]
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        base = x_ptr + b * s_b + n * s_n + rows[:, None] * s_r
        mask = (rows < R)[:, None] & (offs_d < D)[None, :]
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        out = tl.where(rot[None, :], x * cos + xp * sin, x)
        tl.store(o_ptr + b * so_b + n * so_n + rows[:, None] * so_r + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask)


def _rotary_packed(t: torch.Tensor, inv_freq: torch.Tensor, n_rot: int, sign: float) -> torch.Tensor:
    B, N = t.shape[:2]
    D = t.shape[-1]
    rows = t.reshape(B, N, -1, D)  # the heads of one position as rows (a view for the layers' layouts)
    out = new_output(t.shape, t.dtype, t.device)
    o3 = out.view(B, N, -1, D)
    R = rows.shape[2]
    if B * N * R and D:
        block_d = next_pow2(D)
        launch(_rotary_packed_kernel, (B * N,), (rows, o3, inv_freq),
               (N, R, *rows.stride()[:3], *o3.stride()[:3], float(sign)),
               dict(D=D, HALF=n_rot // 2, BLOCK_R=max(1, min(next_pow2(R), 4096 // block_d)), BLOCK_D=block_d),
               _WARPS4)
    return out


class _RotaryPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, inv_freq, n_rot):
        ctx.save_for_backward(inv_freq)
        ctx.n_rot = n_rot
        return _rotary_packed(t, inv_freq, n_rot, 1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (inv_freq,) = ctx.saved_tensors
        return _rotary_packed(grad.contiguous(), inv_freq, ctx.n_rot, -1.0), None, None


def rotary_packed(t: torch.Tensor, inv_freq: torch.Tensor, n_rot: int) -> torch.Tensor:
    """t [B, N, ..., D] (positions 0..N-1 along dim 1, unit last stride) with the first n_rot dims of
    every row rotated (rotate-half pairing: dim j with j + n_rot / 2) by the angles position * inv_freq
    ([n_rot / 2] fp32), the rest copied; a new contiguous tensor of t's dtype. Differentiable (the
    backward rotates the gradient back, one kernel)."""
    return _RotaryPacked.apply(t, inv_freq, n_rot)


@triton.jit
def _top_k_kernel(s_ptr, idx_ptr, g_ptr, R, E, PH, H, s_row, s_ip, s_it, s_gp, s_gt, K: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, GATES: tl.constexpr, OFFSET: tl.constexpr):
    """BLOCK_R rows r = (t, p, h) of scores [T, P, H, E] (row stride s_row): K rounds of argmax (ties: the
    lowest column), each taking its winner out; pick j of row r goes to [p, t, h K + j] of the outputs,
    its id plus h E with OFFSET, its score to the gates with GATES."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < R
    src = s_ptr + rows * s_row
    x = tl.load(src[:, None] + cols[None, :], mask=rmask[:, None] & (cols[None, :] < E), other=-float("inf"))
    x = tl.where(x == x, x, -float("inf"))  # NaN scores lose (torch's sort ranks them first: no such routing)
    t = rows // PH
    h = rows % H
    p = (rows - t * PH) // H
    base = h * E if OFFSET else 0
    for j in tl.static_range(K):
        best = tl.minimum(tl.argmax(x, axis=1, tie_break_left=True), E - 1)
        tl.store(idx_ptr + p * s_ip + t * s_it + h * K + j, (best + base).to(tl.int64), mask=rmask)
        if GATES:  # the score itself (a NaN one too), as torch.gather gives it
            tl.store(g_ptr + p * s_gp + t * s_gt + h * K + j, tl.load(src + best, mask=rmask), mask=rmask)
        x = tl.where(cols[None, :] == best[:, None], -float("inf"), x)


@triton.jit
def _top_k_grad_kernel(dg_ptr, idx_ptr, ds_ptr, R, E, PH, H, s_ip, s_it, s_gp, s_gt, s_gk, s_drow, K: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, OFFSET: tl.constexpr):
    """The scores' gradient of `_top_k_kernel`'s gates: row r of ds is zero but at its K picks, which get
    their gates' gradients (summed where a column was picked twice; dg with any strides, e.g. expanded)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < R
    t = rows // PH
    h = rows % H
    p = (rows - t * PH) // H
    base = h * E if OFFSET else 0
    acc = tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.load(idx_ptr + p * s_ip + t * s_it + h * K + j, mask=rmask, other=0) - base
        d = tl.load(dg_ptr + p * s_gp + t * s_gt + (h * K + j) * s_gk, mask=rmask, other=0.0).to(tl.float32)
        acc += tl.where(cols[None, :] == e[:, None], d[:, None], 0.0)
    tl.store(ds_ptr + rows[:, None] * s_drow + cols[None, :], acc, mask=rmask[:, None] & (cols[None, :] < E))


def _top_k_tiles(E: int) -> tuple:
    block_e = next_pow2(max(E, 1))
    return max(1, min(256, 4096 // block_e)), block_e


def _top_k(scores: torch.Tensor, k: int, gates: bool, offset: bool):
    """(idx int64 [P, T, H k], gates fp32 [P, T, H k] or None) of scores [T, P, H, E] (fp32)."""
    T, P, H, E = scores.shape
    s2 = _rows(scores)
    idx = new_output((P, T, H * k), torch.int64, scores.device)
    g = new_output((P, T, H * k), torch.float32, scores.device) if gates else idx
    block_r, block_e = _top_k_tiles(E)
    if s2.shape[0] and k:
        launch(_top_k_kernel, (-(-s2.shape[0] // block_r),), (s2, idx, g),
               (s2.shape[0], E, P * H, H, s2.stride(0), *idx.stride()[:2], *g.stride()[:2]),
               dict(K=k, BLOCK_R=block_r, BLOCK_E=block_e, GATES=gates, OFFSET=offset), _WARPS4)
    return idx, (g if gates else None)


class _TopKGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, k, offset):
        idx, gates = _top_k(scores, k, True, offset)
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(idx)
        ctx.shape, ctx.offset = scores.shape, offset
        return idx, gates

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_idx, d_gates):
        (idx,) = ctx.saved_tensors
        T, P, H, E = ctx.shape
        ds = new_output((T, P, H, E), torch.float32, idx.device)
        R, k = T * P * H, idx.shape[2] // max(H, 1)
        if d_gates is None:
            return ds.zero_(), None, None
        block_r, block_e = _top_k_tiles(E)
        if R:
            launch(_top_k_grad_kernel, (-(-R // block_r),), (d_gates, idx, ds),
                   (R, E, P * H, H, *idx.stride()[:2], *d_gates.stride(), E),
                   dict(K=k, BLOCK_R=block_r, BLOCK_E=block_e, OFFSET=ctx.offset), _WARPS4)
        return ds, None, None


def top_k_gates(scores: torch.Tensor, k: int, offset: bool = False):
    """The routers' choice and gates in one launch: scores [T, P, H, E] (fp32; P routings of H heads,
    e.g. SwitchHead's value and output routers) -> (idx int64 [P, T, H k], gates fp32 [P, T, H k]), slot
    h k + j holding head h's j-th pick (a stable descending sort's order), as id h E + e with `offset`, else e, and its
    score. Differentiable in the gates (the backward, one launch, puts each gate's gradient at its pick)."""
    return _TopKGates.apply(scores, k, offset)
