"""What the SwitchHead and sigma-MoE layers share: the sigmoid top-k router, its initialisation, and
the dtype rules of their expert matmuls."""
from __future__ import annotations

import torch

from flashswitch.ops import layers


def sigmoid_top_k(logits: torch.Tensor, k: int, *, expert_dropout: float = 0.0, training: bool = False):
    """The k experts with the largest router logits along the last dim, and their sigmoid gates.

    Sigmoid gates are non-competitive (Csordas et al.): a gate does not depend on the other experts'
    scores and the k gates are not renormalised. Expert dropout (training only) zeroes each score with
    probability `expert_dropout` before the choice, so a dropped expert is only picked when fewer than
    k survive, and then with gate 0 (the sigma-MoE rule). Ties: the lower expert id first among up to
    SORT_MAX_EXPERTS experts, else wherever torch.topk puts them.
    Returns (idx int64 [..., k], gates fp32 [..., k]); gradients reach the logits through the gates.
    """
    scores = torch.sigmoid(logits.float())
    if training and expert_dropout > 0:
        scores = scores.masked_fill(torch.rand_like(scores) < expert_dropout, 0.0)
    with torch.no_grad():
        if scores.shape[-1] <= SORT_MAX_EXPERTS and layers.fused(scores):
            idx = layers.top_k_rows(scores, k)
        elif scores.shape[-1] <= SORT_MAX_EXPERTS:
            idx = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        else:
            idx = scores.topk(k, dim=-1, sorted=False).indices
    return idx, torch.gather(scores, -1, idx)


# Rows of at most this many experts take k argmax rounds in registers (CUDA, ops/layers.py) or
# are sorted whole instead of torch.topk'ed: topk's CUDA kernel is made for long rows (a radix select per
# row). Ties: the lower id first either way.
SORT_MAX_EXPERTS = 64


def init_router_(weight: torch.Tensor) -> torch.Tensor:
    """N(0, 1/d_in) rows rescaled to norm 1, the expected norm of such a row (the papers' normalised
    selection init): no expert starts with a larger score scale than another."""
    with torch.no_grad():
        weight.normal_(0.0, weight.shape[-1] ** -0.5)
        weight.div_(weight.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return weight


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layer computes in: the autocast dtype inside autocast, else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def matmul_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert weights for expert_matmul with `dtype` inputs: fp32 master weights are read and cast inside
    the kernel, so only other mismatches cost a cast."""
    if w.dtype == dtype or (w.dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16)):
        return w
    return w.to(dtype)


def check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must lie in [0, 1), got {value}")
    return float(value)
