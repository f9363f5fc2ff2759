"""Fused inference kernels of the decoder layers around attention: rotary embedding of q and k in one
launch, and RMSNorm in one launch. The torch versions (flashswitch/nn/rotary.py, nn/llama.py) take
7 to 14 elementwise kernels each, fp32 copies of their inputs included; in a decode step those small
kernels, not the attention, set the time per layer, and in a long prefill their memory traffic does.
Same math as the torch versions (fp32 angles and products, one rounding to the input dtype); used
where no gradient is needed (the torch versions keep autograd).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch._common import eager_fast_path, next_pow2


def fused_wanted(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels serve a call: CUDA tensors with unit last stride, eager, no gradient."""
    return all(t.is_cuda and t.stride(-1) == 1 for t in tensors) and eager_fast_path(*tensors)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, freq_ptr,
                   H, Hkv, n, s_pb, s_pn,
                   sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sqo_b, sqo_h, sqo_n, sko_b, sko_h, sko_n,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    """One program per (sequence b, token i): every head of q and then of k at position pos[b, i]."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n
    i = pid - b * n
    offs_f = tl.arange(0, BLOCK_F)
    fmask = offs_f < HALF
    angle = tl.load(pos_ptr + b * s_pb + i * s_pn).to(tl.float32) * tl.load(freq_ptr + offs_f, mask=fmask, other=0.0)
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


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q [B, H, n, D], k [B, Hkv, n, D] (unit last stride) rotated at positions ([n] or [B, n]
    integers, on the device) by the angles positions * inv_freq ([D / 2] fp32), rotate-half pairing:
    new tensors with the inputs' strides."""
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if B * n == 0 or D == 0:
        return qo, ko
    pos = positions if positions.dim() == 2 else positions[None]
    s_pb = pos.stride(0) if pos.shape[0] > 1 else 0
    half = D // 2
    block_f = next_pow2(max(half, 1))
    block_h = max(1, min(next_pow2(H + Hkv), 4096 // block_f))
    _rotary_kernel[(B * n,)](
        q, k, qo, ko, pos, inv_freq, H, Hkv, n, s_pb, pos.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        HALF=half, BLOCK_H=block_h, BLOCK_F=block_f, num_warps=4)
    return qo, ko


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, d, s_x, s_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
    normed = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)  # the Llama convention: round, then the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x)) rounded to x's dtype, times weight: x [..., d] with unit last stride, one program
    per row."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, d, x2.stride(0), y.stride(0), float(eps),
                                         BLOCK=next_pow2(d), num_warps=4 if d <= 2048 else 8)
    return y.view(x.shape)
