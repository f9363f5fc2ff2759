"""Rotary position embedding (the Llama / GPT-NeoX convention: rotate the two halves of each head)."""
from __future__ import annotations

from typing import Optional

import torch

from flashswitch.ops import layers


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] rotated by cos, sin ([B or 1, 1, n, D], fp32); fp32 math, x's dtype out."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class Rotary(torch.nn.Module):
    """cos/sin tables computed from positions on the fly (positions may live on the device, so a
    decode step needs no host value): inv_freq[i] = base ** (-2i / D)."""

    def __init__(self, head_dim: int, base: float = 10000.0, inv_freq: Optional[torch.Tensor] = None, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        if inv_freq is None:
            inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float32).clone(), persistent=False)

    def cos_sin(self, positions: torch.Tensor):
        """positions: [n] or [B, n] integers -> (cos, sin) [1 or B, 1, n, D] fp32."""
        if positions.dim() == 1:
            positions = positions[None]
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cache=None):
        """q, k [B, H, n, D] of n new tokens rotated at their positions: 0..n-1 without a cache or with an
        empty one, else after each sequence's length (`cache.lengths`, on the device: no host value)."""
        offsets = None if cache is None or cache.empty else cache.lengths
        if q.dtype == k.dtype and layers.fused(q, k):  # inference on CUDA: one kernel for q and k
            return layers.rotary_qk(q, k, self.inv_freq, offsets)
        steps = torch.arange(q.shape[-2], device=q.device)
        cos, sin = self.cos_sin(steps if offsets is None else offsets[:, None] + steps)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
