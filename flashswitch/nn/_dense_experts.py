"""SwitchHead's output projection through a dense Z: where each head picks k of few experts (E <= 4 k),
a zero-filled Z [T, H E d_head] holding each picked slot's gated input, times every expert's weight
stacked [H E d_head, d_model], is one dense GEMM of E / k times the routed multiply-adds. That GEMM runs
near the matmul roof, while the grouped kernel's small-K, slot-summing direction does not; and it
needs no route (no counting sort).

Z is rebuilt in the backward instead of saved (one scatter), so the layer keeps only its input.
Each token's slots name distinct experts (top-k per head, heads offset by h E), so the scatter never
adds two values into one place: the result is deterministic.
"""
from __future__ import annotations

import torch

DENSE_MAX_EXPERTS_PER_PICK = 4  # dense when E <= this x k: at most 4x the routed MACs on a GEMM at the roof


def dense_wanted(num_experts: int, experts_per_head: int) -> bool:
    return num_experts <= DENSE_MAX_EXPERTS_PER_PICK * experts_per_head


def _scatter_z(a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Z [T, num_experts * D]: row t holds gate(t, s) * a[t, group(s)] at expert ids[t, s]'s block."""
    T, G, D = a.shape
    S = ids.shape[1]
    src = gates.to(a.dtype)[..., None] * a.repeat_interleave(S // G, dim=1)  # [T, S, D]
    z = a.new_zeros(T, num_experts, D)
    return z.scatter_(1, ids[..., None].expand(T, S, D), src).view(T, num_experts * D)


class _DenseExpertOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, ids, gates, weight):
        E, D, d = weight.shape
        ctx.save_for_backward(a, ids, gates, weight)
        return _scatter_z(a, ids, gates, E) @ weight.to(a.dtype).view(E * D, d)

    @staticmethod
    def backward(ctx, dy):
        a, ids, gates, weight = ctx.saved_tensors
        E, D, d = weight.shape
        T, G, _ = a.shape
        S = ids.shape[1]
        dy = dy.to(a.dtype)
        da = dgates = dweight = None
        if ctx.needs_input_grad[3]:
            dweight = (_scatter_z(a, ids, gates, E).t() @ dy).view(E, D, d).to(weight.dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            dz = (dy @ weight.to(a.dtype).view(E * D, d).t()).view(T, E, D)
            dsrc = dz.gather(1, ids[..., None].expand(T, S, D))  # [T, S, D]: dZ at each slot's block
            if ctx.needs_input_grad[2]:
                a_slots = a.repeat_interleave(S // G, dim=1)
                acc = torch.promote_types(a.dtype, torch.float32)  # 16-bit products summed in fp32
                dgates = torch.einsum("tsd,tsd->ts", dsrc.to(acc), a_slots.to(acc)).to(gates.dtype)
            if ctx.needs_input_grad[0]:
                da = (dsrc * gates.to(a.dtype)[..., None]).view(T, G, S // G, D).sum(2)
        return da, None, dgates, dweight


def dense_expert_output(a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [T, d] = sum over slots s of gates[t, s] * a[t, s // (S / G)] @ weight[ids[t, s]].

    a [T, G, D] (G input groups, S % G == 0), ids int64 [T, S] with distinct ids per row, gates
    [T, S], weight [E, D, d] (any float dtype: cast to a's, the gradient returned in its own)."""
    return _DenseExpertOutput.apply(a, ids, gates, weight)
