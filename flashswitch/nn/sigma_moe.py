"""sigma-MoE feedforward layer (Csordas et al., "Approximating Two-Layer Feedforward Networks for
Efficient Transformers", 2023): a two-layer ReLU MLP whose hidden units come in experts of
`expert_dim`, k of them chosen per token by a sigmoid router:
    y = sum_{e in topk(s)} s[e] relu(x W1[e]) W2[e],   s = sigmoid(x W_sel)
Up and down projections are one op-3 call each over the same route (no reduction after the up
projection, the gated sum over the k slots fused into the down projection).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashswitch.nn._routing import (check_positive, check_probability, compute_dtype, init_router_, matmul_weight,
                                     sigmoid_top_k)
from flashswitch.ops.expert_matmul import expert_matmul, route


def router_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """Minus the entropy of the router's softmax distribution averaged over all tokens of the batch
    (the sigma-MoE balancing regulariser: minimising it spreads tokens over the experts)."""
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
    log_mean = torch.logsumexp(logp, dim=0) - math.log(max(logp.shape[0], 1))
    return (log_mean.exp() * log_mean).sum()


class SigmaMoE(nn.Module):
    """Mixture-of-experts MLP with a sigmoid top-k router (sigma-MoE).

    embed_dim: d_model. num_experts: N_E. expert_dim: hidden units per expert (G). experts_per_token: k.
    expert_dropout: probability of dropping a router score in training (the paper's expert dropout).
    entropy_reg: weight of `router_entropy_loss` returned by forward(..., return_aux_loss=True) in
    training (0: none). backend: the flashswitch backend of op 3 ("auto": kernels on the GPU, the
    differentiable reference on the CPU).

    forward(x [..., embed_dim]) -> same shape (plus the auxiliary loss when asked); no host
    synchronisation. Init (the sigma-MoE paper's): up [N_E, d, G] ~ N(0, 1/d), down [N_E, G, d] ~
    N(0, 1/(N_E G)) as for a dense MLP of N_E G hidden units, router [N_E, d] N(0, 1/d) rows rescaled to
    unit norm.
    """

    def __init__(self, embed_dim: int, num_experts: int, expert_dim: int, experts_per_token: int, *,
                 expert_dropout: float = 0.0, entropy_reg: float = 0.0, backend: str = "auto", device=None,
                 dtype=None):
        super().__init__()
        self.embed_dim = check_positive("embed_dim", embed_dim)
        self.num_experts = check_positive("num_experts", num_experts)
        self.expert_dim = check_positive("expert_dim", expert_dim)
        self.experts_per_token = check_positive("experts_per_token", experts_per_token)
        if experts_per_token > num_experts:
            raise ValueError(f"experts_per_token = {experts_per_token} must be <= num_experts = {num_experts}")
        self.expert_dropout = check_probability("expert_dropout", expert_dropout)
        if isinstance(entropy_reg, bool) or not isinstance(entropy_reg, (int, float)) or entropy_reg < 0:
            raise ValueError(f"entropy_reg must be a float >= 0, got {entropy_reg!r}")
        self.entropy_reg = float(entropy_reg)
        self.backend = backend
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Parameter(torch.empty(num_experts, embed_dim, **kw))
        self.up = nn.Parameter(torch.empty(num_experts, embed_dim, expert_dim, **kw))
        self.down = nn.Parameter(torch.empty(num_experts, expert_dim, embed_dim, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.up.normal_(0.0, self.embed_dim ** -0.5)
            self.down.normal_(0.0, (self.num_experts * self.expert_dim) ** -0.5)
        init_router_(self.router)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_experts={self.num_experts}, expert_dim={self.expert_dim}, "
                f"experts_per_token={self.experts_per_token}")

    def forward(self, x: torch.Tensor, *, return_aux_loss: bool = False):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [..., {self.embed_dim}], got shape {tuple(x.shape)}")
        dt = compute_dtype(x)
        x2 = x.reshape(-1, self.embed_dim).to(dt)
        logits = F.linear(x2, self.router.to(dt))
        idx, gates = sigmoid_top_k(logits, self.experts_per_token, expert_dropout=self.expert_dropout,
                                   training=self.training)
        rt = route(idx, self.num_experts, check=False)
        h = F.relu(expert_matmul(x2, rt, matmul_weight(self.up, dt), backend=self.backend))  # [T, k, G]
        y = expert_matmul(h, rt, matmul_weight(self.down, dt), gates=gates, out_groups=1,
                          backend=self.backend).view(x.shape)
        if not return_aux_loss:
            return y
        if self.training and self.entropy_reg > 0:
            return y, self.entropy_reg * router_entropy_loss(logits)
        return y, torch.zeros((), device=x.device)

    def macs_per_token(self, seq_len: int = 0) -> float:
        """Multiply-accumulates per token: the router and k experts' up and down projections."""
        d, E, G, k = self.embed_dim, self.num_experts, self.expert_dim, self.experts_per_token
        return E * d + 2 * k * d * G
