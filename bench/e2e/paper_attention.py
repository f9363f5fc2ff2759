"""Attention layers written the way the SwitchHead paper's public code writes them, on the same
parameters as the flashswitch layers, so a benchmark can time what the library's layers change.

The paper's code, per step and layer: q and k (and, for the dense layer, v) from separate projections;
q and k scaled by d_head^-1/4 each (SwitchHead) before attention; rotary embeddings as rotate-half
products with cached fp32 sin/cos tables, the rotated and the pass-through dims joined with torch.cat;
a boolean causal mask built every step and passed to SDPA as attn_mask (which keeps SDPA off its causal
flash path, and off every fused path for head dims it cannot take); heads gathered back with
transpose + contiguous. The value/output experts and sigma-MoE still run through op 3 (the paper's
code has its own grouped-matmul kernel there).

`to_paper_style(model)` switches every attention layer of a DecoderLM in place; the math is the same
(tests/test_e2e_training.py checks it in fp32), only the way it runs differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashswitch.nn._routing import compute_dtype
from flashswitch.nn.models import DenseAttention
from flashswitch.nn.switchhead import SwitchHeadAttention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _sin_cos(module, n: int, n_rot: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [n, n_rot] tables, cached on the module per length (as the paper's RotaryPosEncoding does)."""
    cache = module.__dict__.setdefault("_paper_sin_cos", {})
    key = (n, n_rot, str(device))
    if key not in cache:
        inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2, device=device).float() / n_rot))
        freqs = torch.arange(n, device=device).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cache[key] = (emb.sin(), emb.cos())
    return cache[key]


def paper_rotary(module, q: torch.Tensor, k: torch.Tensor, n_rot: int, base: float):
    """Rotate the first n_rot dims of q, k [B, H, N, D]; the rest joined back with torch.cat."""
    if n_rot == 0:
        return q, k
    sin, cos = _sin_cos(module, q.shape[-2], n_rot, base, q.device)

    def rot(x):
        return x * cos + _rotate_half(x) * sin

    if n_rot == q.shape[-1]:
        return rot(q), rot(k)
    return (torch.cat([rot(q[..., :n_rot]), q[..., n_rot:]], dim=-1),
            torch.cat([rot(k[..., :n_rot]), k[..., n_rot:]], dim=-1))


def paper_causal_sdpa(q, k, v, *, scale=None):
    """SDPA over q, k, v [B, H, N, D] with a boolean causal mask built for this call."""
    N = q.shape[-2]
    masked = torch.triu(torch.ones(N, N, dtype=torch.bool, device=q.device), diagonal=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=scale)


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:  # [B, N, H D] -> [B, H, N, D]
    return t.view(*t.shape[:-1], H, -1).transpose(-2, -3)


class PaperSwitchHeadAttention(SwitchHeadAttention):
    """SwitchHeadAttention's parameters, the paper code's attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, d = x.shape
        T, H, D = B * N, self.num_heads, self.head_dim
        v, output = self.values(x.reshape(T, d).to(compute_dtype(x)))
        v = v.view(B, N, H, D).transpose(1, 2)
        s = D ** -0.25
        q = F.linear(x, self.qk[: H * D]) * s
        k = F.linear(x, self.qk[H * D:]) * s
        q, k = paper_rotary(self, _heads(q, H), _heads(k, H), self.n_rot, self.rope_base)
        a = paper_causal_sdpa(q, k, v, scale=1.0).transpose(1, 2).contiguous().view(T, H, D)
        return output(a).view(B, N, d)


class PaperDenseAttention(DenseAttention):
    """DenseAttention's parameters, the paper code's dense attention (its FastRopeAttention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, HD = self.num_heads, self.num_heads * self.head_dim
        q = F.linear(x, self.qkv[:HD])
        k, v = F.linear(x, self.qkv[HD:]).split(HD, dim=-1)
        q, k = paper_rotary(self, _heads(q, H), _heads(k, H), self.n_rot, self.rope_base)
        a = paper_causal_sdpa(q, k, _heads(v, H))
        return F.linear(a.transpose(1, 2).contiguous().view(*x.shape[:-1], HD), self.out)


_PAPER_CLASS = {SwitchHeadAttention: PaperSwitchHeadAttention, DenseAttention: PaperDenseAttention}


def to_paper_style(module: torch.nn.Module) -> torch.nn.Module:
    """Switch every SDPA attention layer in `module` (a DecoderLM, or one layer) to the paper code's
    way of running it, in place; parameters, buffers and state are untouched."""
    for m in module.modules():
        cls = _PAPER_CLASS.get(type(m))
        if cls is None:
            continue
        if m.attention != "sdpa":
            raise ValueError(f"paper-style attention is SDPA attention; this layer uses {m.attention!r}")
        m.__class__ = cls
    return module
