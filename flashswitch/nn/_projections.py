"""The q/k/v projections the Llama-style attention layers share (SdpaAttention, EvaAttention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashswitch.ops import layers


def qkv_projection(layer: torch.nn.Module, x: torch.Tensor):
    """q [B, H, N, D] and k, v [B, Hkv, N, D] of x [B, N, d] through layer.q_proj, k_proj, v_proj
    (views of the projections' outputs). In inference on CUDA one GEMM over the three weights
    concatenated, kept on the layer while the weights are unchanged: a decode step runs one small
    GEMM instead of three, for a second copy of the attention's input weights."""
    B, N, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    fused = _fused_weight(layer, x)
    if fused is not None:
        q, k, v = F.linear(x, *fused).view(B, N, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
    else:
        q = layer.q_proj(x).view(B, N, H, D)
        k = layer.k_proj(x).view(B, N, Hkv, D)
        v = layer.v_proj(x).view(B, N, Hkv, D)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _fused_weight(layer: torch.nn.Module, x: torch.Tensor):
    """(weight, bias) of the three projections stacked, or None where it does not serve (gradients
    wanted, traced, mixed dtypes, some biases only, inference tensors without a version counter)."""
    mods = (layer.q_proj, layer.k_proj, layer.v_proj)
    params = [m.weight for m in mods]
    biases = [m.bias for m in mods]
    if any(b is not None for b in biases):
        if any(b is None for b in biases):
            return None
        params += biases
    if any(p.dtype != x.dtype or p.device != x.device for p in params) or not layers.fused(x, *params):
        return None
    try:
        key = tuple((p.data_ptr(), p._version) for p in params)
    except RuntimeError:  # inference tensors have no version counter: the weights may change unseen
        return None
    cached = layer.__dict__.get("_qkv_fused")
    if cached is None or cached[0] != key:
        w = torch.cat([m.weight for m in mods])
        b = torch.cat(biases) if biases[0] is not None else None
        cached = (key, (w, b))
        layer.__dict__["_qkv_fused"] = cached
    return cached[1]


__all__ = ["qkv_projection"]
