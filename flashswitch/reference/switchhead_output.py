"""References of SwitchHead's fused output projection (ops/switchhead_output.py): `numpy_switchhead_output`
(fp64 oracle, one (token, slot) pair at a time), `torch_switchhead_output` (the dense gate table and one
matmul, differentiable), and `random_problem` for tests, check, bench and tune."""
from __future__ import annotations

import numpy as np
import torch

from flashswitch.testing import to_numpy64


def numpy_switchhead_output(a, ids, gates, weight, num_experts: int) -> np.ndarray:
    """y[t] = Σ_s gates[t, s] · a[t, ids[t, s] // E] @ weight[ids[t, s]] in fp64; ids outside [0, H·E)
    are dropped."""
    a, gates, weight = to_numpy64(a), to_numpy64(gates), to_numpy64(weight)
    ids = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    T, S = ids.shape
    y = np.zeros((T, weight.shape[2]))
    for t in range(T):
        for s in range(S):
            e = int(ids[t, s])
            if 0 <= e < weight.shape[0]:
                y[t] += gates[t, s] * (a[t, e // num_experts] @ weight[e])
    return y


def torch_switchhead_output(a, ids, gates, weight, num_experts: int) -> torch.Tensor:
    """The torch version (differentiable, any device and float dtype): the dense gate table (fp32, fp64
    for fp64 a) and one matmul of Z in a's dtype; ids outside [0, H·E) are dropped, duplicates add."""
    T, H, D = a.shape
    HE, _, d = weight.shape
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    valid = (ids >= 0) & (ids < HE)
    table = torch.zeros(T, HE, dtype=acc, device=a.device).scatter_add(
        1, torch.where(valid, ids, 0).long(), torch.where(valid, gates.to(acc), 0))
    z = (a.to(acc).unsqueeze(2) * table.view(T, H, num_experts, 1)).to(a.dtype)
    return z.reshape(T, HE * D) @ weight.to(a.dtype).reshape(HE * D, d)


def random_problem(T=37, H=3, E=5, k=2, D=12, d=20, *, dtype=torch.float32, weight_dtype=None, device="cpu",
                   seed=0, index_dtype=torch.int64):
    """SwitchHead's output routing: per head k distinct experts of E (slot h·k + j, global id h·E + e),
    sigmoid-like gates in (0, 1) in fp32 (the router's), a [T, H, D] in `dtype`, weight [H·E, D, d] in
    `weight_dtype` (None: dtype; fp32: master weights). dict(a, ids, gates, weight, num_experts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, H, E, generator=g)
    ids = (scores.topk(k, -1).indices + torch.arange(H)[:, None] * E).reshape(T, H * k)
    gates = torch.rand(T, H * k, generator=g)
    a = torch.randn(T, H, D, generator=g)
    weight = torch.randn(H * E, D, d, generator=g) * max(H * D, 1) ** -0.5
    return dict(a=a.to(device, dtype), ids=ids.to(device, index_dtype), gates=gates.to(device),
                weight=weight.to(device, dtype if weight_dtype is None else weight_dtype), num_experts=E)


__all__ = ["numpy_switchhead_output", "torch_switchhead_output", "random_problem"]
