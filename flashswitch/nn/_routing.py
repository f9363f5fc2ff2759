"""What the SwitchHead and sigma-MoE layers share: the sigmoid top-k router, its initialisation, and
the dtype rules of their expert matmuls."""
from __future__ import annotations

import torch

from flashswitch.ops import layers


def router_scores(logits: torch.Tensor, *, expert_dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """The routers' sigmoid scores in fp32. Sigmoid gates are non-competitive (Csordas et al.): a gate does
    not depend on the other experts' scores and the k gates are not renormalised. Expert dropout
    (training only) zeroes each score with probability `expert_dropout` before the choice, so a dropped
    expert is only picked when fewer than k survive, and then with gate 0 (the sigma-MoE rule)."""
    scores = torch.sigmoid(logits.float())
    if training and expert_dropout > 0:
        scores = scores.masked_fill(torch.rand_like(scores) < expert_dropout, 0.0)
    return scores


def top_k(scores: torch.Tensor, k: int):
    """The k experts with the largest scores along the last dim and their scores as gates: (idx int64
    [..., k], gates fp32 [..., k]); gradients reach the scores through the gates. Ties: the lower expert
    id first among up to SORT_MAX_EXPERTS experts, else wherever torch.topk puts them."""
    E = scores.shape[-1]
    if E <= SORT_MAX_EXPERTS and layers.routing_kernel(scores):  # choice and gates in one launch
        idx, gates = layers.top_k_gates(scores.reshape(-1, 1, 1, E), k)
        return idx.view(*scores.shape[:-1], k), gates.view(*scores.shape[:-1], k)
    with torch.no_grad():
        if E <= SORT_MAX_EXPERTS:
            idx = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        else:
            idx = scores.topk(k, dim=-1, sorted=False).indices
    return idx, torch.gather(scores, -1, idx)


def sigmoid_top_k(logits: torch.Tensor, k: int, *, expert_dropout: float = 0.0, training: bool = False):
    """`top_k` of the router scores of logits [..., E] (`router_scores`): (idx int64 [..., k], gates fp32
    [..., k]); gradients reach the logits through the gates."""
    return top_k(router_scores(logits, expert_dropout=expert_dropout, training=training), k)


def head_top_k(logits: torch.Tensor, k: int, *, expert_dropout: float = 0.0, training: bool = False):
    """P routings of H heads at once, logits [T, P, H, E] -> (ids int64 [P, T, H k], gates fp32 [P, T, H k]):
    slot h k + j holds head h's j-th pick as the global id h E + e (SwitchHead's value and output
    routers). One launch where the kernel serves (no gather, offset or transposes)."""
    scores = router_scores(logits, expert_dropout=expert_dropout, training=training)
    T, P, H, E = scores.shape
    if E <= SORT_MAX_EXPERTS and layers.routing_kernel(scores):
        return layers.top_k_gates(scores, k, offset=True)
    idx, gates = top_k(scores, k)
    idx = idx + torch.arange(H, device=idx.device)[:, None] * E
    return idx.transpose(0, 1).reshape(P, T, H * k), gates.transpose(0, 1).reshape(P, T, H * k)


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
