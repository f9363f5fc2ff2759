"""SwitchHead attention (Csordas et al., "SwitchHead: Accelerating Transformers with Mixture-of-Experts
Attention", NeurIPS 2024) and the causal-attention pieces the dense baseline shares with it.

Per head h: dense q and k; the value and output projections are mixtures of E experts, each token
picking k of them per head with a sigmoid router (one router for V on the source side, one for O on
the destination side; in self-attention both read the layer input x):
    V_h = sum_{e in topk(s_V,h)} s_V,h[e] x W_V[h, e],   O = sum_h sum_{e in topk(s_O,h)} s_O,h[e] A_h W_O[h, e]
with A_h the causal attention output of head h. Both projections run as one op-3 call each
(`flashswitch.route` + `flashswitch.expert_matmul`, gates fused, global expert id = h * E + e). With
fused_output=True, the output projection on the Triton kernels with E / k <= FUSED_OUTPUT_MAX_MAC_RATIO is
one dense GEMM over all experts with zero gates where a token picked none (ops/switchhead_output.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from flashswitch._common import FLOAT_DTYPES, _under_functorch
from flashswitch.nn._routing import (check_positive, check_probability, compute_dtype, head_top_k, init_router_,
                                     matmul_weight)
from flashswitch.ops.chunk_summaries import chunk_summaries
from flashswitch.ops.eva_attention import eva_attention
from flashswitch.ops import layers, switchhead_output as fused
from flashswitch.ops.expert_matmul import expert_matmul, route

ATTENTIONS = ("sdpa", "eva")
_SDPA_HEAD_MULTIPLE = 8  # SDPA's flash kernels take head dims that are multiples of 8
# The fused output projection (ops/switchhead_output.py) multiplies every expert of a head,
# E / k times the routed multiply-adds, but as one dense GEMM at tensor-core rate with no gather and no
# slot sum; past E / k = 2 op 3's routed kernel runs. Opt-in (fused_output): its forward + backward beats
# op 3's alone, but not yet inside the model's training step.
FUSED_OUTPUT_MAX_MAC_RATIO = 2


# ---------------------------------------------------------------- rotary embeddings
def rotary_dims(head_dim: int, fraction: float) -> int:
    """How many leading head dims rotate (even; the rest pass through, as in the paper's RoPE models)."""
    return 2 * int(fraction * head_dim / 2)


def rotary_frequencies(n_rot: int, base: float, device, dtype: torch.dtype) -> torch.Tensor:
    """[n_rot / 2] angles per position: base ** (-2i / n_rot)."""
    return base ** (-torch.arange(0, n_rot, 2, dtype=dtype, device=device) / n_rot)


def rotary_tables(seq_len: int, n_rot: int, base: float, device, dtype: torch.dtype):
    """cos, sin [seq_len, n_rot / 2] of the angles of positions 0..seq_len-1."""
    angle = torch.arange(seq_len, dtype=dtype, device=device)[:, None] * rotary_frequencies(n_rot, base, device,
                                                                                            dtype)
    return angle.cos(), angle.sin()


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """t with its first n_rot dims rotated (rotate-half pairing: dim i pairs with i + n_rot/2) by cos,
    sin (broadcast against t[..., :n_rot/2]); math in cos's dtype, t's dtype out."""
    r = t[..., :n_rot].to(cos.dtype)
    r1, r2 = r[..., : n_rot // 2], r[..., n_rot // 2:]
    out = torch.cat([r1 * cos - r2 * sin, r2 * cos + r1 * sin], -1).to(t.dtype)
    return torch.cat([out, t[..., n_rot:]], -1) if n_rot < t.shape[-1] else out


def _angle_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rotate_packed(t: torch.Tensor, n_rot: int, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of a packed projection t [B, N, P, H, D] (positions along dim 1; q and k as
    two of the P parts): one rotation for all parts instead of one per tensor; on CUDA one kernel
    forward and one backward (ops/layers.py) instead of some 25 small ones."""
    if n_rot == 0:
        return t
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        if layers.packed_rotary(t):
            return layers.rotary_packed(t, _inv_freq(n_rot, base, t.device), n_rot)
    cos, sin = rotary_tables(t.shape[1], n_rot, base, t.device, _angle_dtype(t))
    return rotate(t, cos[:, None, None], sin[:, None, None], n_rot)


_INV_FREQ: dict = {}


def _inv_freq(n_rot: int, base: float, device) -> torch.Tensor:
    """The fp32 rotary_frequencies, made once per (n_rot, base, device) outside graph capture."""
    key = (n_rot, float(base), device)
    freq = _INV_FREQ.get(key)
    if freq is None:
        freq = rotary_frequencies(n_rot, base, device, torch.float32)
        if torch.device(device).type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _INV_FREQ[key] = freq
    return freq


def apply_rotary(q: torch.Tensor, k: torch.Tensor, n_rot: int, base: float = 10000.0):
    """Rotate the first n_rot dims of q, k [B, H, N, D] by position (rotate-half pairing: dim i pairs
    with i + n_rot/2; angles in fp32, fp64 for fp64 inputs)."""
    if n_rot == 0:
        return q, k
    cos, sin = rotary_tables(q.shape[-2], n_rot, base, q.device, _angle_dtype(q))
    return rotate(q, cos, sin, n_rot), rotate(k, cos, sin, n_rot)


# ---------------------------------------------------------------- causal attention
def causal_attention(q, k, v, *, attention: str = "sdpa", scale=None, eva_chunk_size: int = 64,
                     eva_window_size: int = 256, eva_window: str = "block", backend: str = "auto"):
    """Causal attention of q, k, v [B, H, N, D] -> [B, H, N, D].

    "sdpa": torch's scaled_dot_product_attention with is_causal=True (its flash path), head dims padded
    with zeros to a multiple of 8 (zero q/k columns leave the logits unchanged, zero v columns are cut).
    "eva": EVA attention (ops 1-2): summaries of every chunk of `eva_chunk_size` keys, then exact keys
    in the window and one summary per earlier chunk.
    """
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    if attention == "sdpa":
        pad = (-D) % _SDPA_HEAD_MULTIPLE
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o[..., :D] if pad else o
    if attention == "eva":
        k_sum, v_sum = chunk_summaries(k, v, eva_chunk_size, scale=scale, backend=backend)
        return eva_attention(q, k, v, k_sum, v_sum, chunk_size=eva_chunk_size, window_size=eva_window_size,
                             window=eva_window, scale=scale, backend=backend)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


def attention_macs_per_token(num_heads: int, head_dim: int, seq_len: int, *, attention: str = "sdpa",
                             eva_chunk_size: int = 64, eva_window_size: int = 256, eva_window: str = "block") -> float:
    """Multiply-accumulates per token of causal attention over a sequence of seq_len tokens, averaged
    over positions: q.k and p.v for every visible (query, key) pair; EVA adds its summaries (about 3
    per key and head dim: |k|^2, the key mean, the weighted value sum)."""
    N = seq_len
    if N <= 0:
        return 0.0
    if attention == "sdpa":
        pairs = N * (N + 1) // 2
        extra = 0
    else:
        from flashswitch.reference.eva_attention import visible_pairs
        Nc = -(-N // eva_chunk_size)
        pairs = visible_pairs(N, N, Nc, chunk_size=eva_chunk_size, window_size=eva_window_size, window=eva_window)
        extra = 3 * N
    return num_heads * head_dim * (2 * pairs + extra) / N


# ---------------------------------------------------------------- the layer
class SwitchHeadAttention(nn.Module):
    """Causal self-attention with mixture-of-experts value and output projections (SwitchHead).

    embed_dim: d_model. num_heads: H attention heads (H attention matrices). head_dim: d_head.
    num_experts: E experts per head for each of V and O (H * E in each weight tensor; global expert id
    h * E + e). experts_per_head: k experts each token uses per head and projection.
    attention: "sdpa" (torch's flash attention) or "eva" (flashswitch ops 1-2, with eva_chunk_size,
    eva_window_size, eva_window). rope_fraction: share of each head's dims rotated by RoPE (the paper's
    RoPE models rotate half; 0 turns it off). expert_dropout: probability of dropping a router score in
    training. backend: the flashswitch backend of every op the layer calls ("auto": kernels on the GPU,
    the differentiable reference on the CPU). fused_output: the output projection as one dense GEMM over
    every expert of a head (ops/switchhead_output.py) where E / k <= 2 on the Triton kernels.

    forward(x [B, N, embed_dim]) -> [B, N, embed_dim]; no host synchronisation (routing runs with
    check=False), so it can run under torch.compile and CUDA-graph capture. Inside autocast the expert
    matmuls and attention run in the autocast dtype with fp32 master weights read by the kernels.

    Parameters (the paper's init): qk [2 H d_head, d] and v_experts [H E, d, d_head] ~ N(0, 1/d);
    o_experts [H E, d_head, d] ~ N(0, 1/(H d_head)); router [2 H E, d] (value-router rows first, then
    output-router rows) N(0, 1/d) rows rescaled to unit norm.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, num_experts: int, experts_per_head: int, *,
                 attention: str = "sdpa", rope_fraction: float = 0.5, rope_base: float = 10000.0,
                 expert_dropout: float = 0.0, eva_chunk_size: int = 64, eva_window_size: int = 256,
                 eva_window: str = "block", backend: str = "auto", fused_output: bool = False, device=None,
                 dtype=None):
        super().__init__()
        if not isinstance(fused_output, bool):
            raise TypeError(f"fused_output must be a bool, got {type(fused_output).__name__}")
        self.fused_output = fused_output
        self.embed_dim = check_positive("embed_dim", embed_dim)
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_dim = check_positive("head_dim", head_dim)
        self.num_experts = check_positive("num_experts", num_experts)
        self.experts_per_head = check_positive("experts_per_head", experts_per_head)
        if experts_per_head > num_experts:
            raise ValueError(f"experts_per_head = {experts_per_head} must be <= num_experts = {num_experts}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if isinstance(rope_fraction, bool) or not isinstance(rope_fraction, (int, float)) \
                or not 0 <= rope_fraction <= 1:
            raise ValueError(f"rope_fraction must be a float in [0, 1], got {rope_fraction!r}")
        self.attention = attention
        self.n_rot = rotary_dims(head_dim, rope_fraction)
        self.rope_base = float(rope_base)
        self.expert_dropout = check_probability("expert_dropout", expert_dropout)
        self.eva_chunk_size = check_positive("eva_chunk_size", eva_chunk_size)
        self.eva_window_size = check_positive("eva_window_size", eva_window_size)
        if attention == "eva" and eva_window_size % eva_chunk_size:
            raise ValueError(f"eva_window_size = {eva_window_size} must be a multiple of eva_chunk_size = "
                             f"{eva_chunk_size}")
        if eva_window not in ("block", "sliding"):
            raise ValueError(f"eva_window must be 'block' or 'sliding', got {eva_window!r}")
        self.eva_window = eva_window
        self.backend = backend
        H, E, D, d = num_heads, num_experts, head_dim, embed_dim
        kw = dict(device=device, dtype=dtype)
        self.qk = nn.Parameter(torch.empty(2 * H * D, d, **kw))
        self.router = nn.Parameter(torch.empty(2 * H * E, d, **kw))
        self.v_experts = nn.Parameter(torch.empty(H * E, d, D, **kw))
        self.o_experts = nn.Parameter(torch.empty(H * E, D, d, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d, HD = self.embed_dim, self.num_heads * self.head_dim
        with torch.no_grad():
            self.qk.normal_(0.0, d ** -0.5)
            self.v_experts.normal_(0.0, d ** -0.5)
            self.o_experts.normal_(0.0, HD ** -0.5)
        init_router_(self.router)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_experts={self.num_experts}, experts_per_head={self.experts_per_head}, "
                f"attention={self.attention!r}, rotary_dims={self.n_rot}")

    def select(self, x2: torch.Tensor):
        """Routing of x2 [T, d]: (expert ids int64 [2, T, H k], gates fp32 [2, T, H k]) for V (index 0) and
        O (index 1); slot s = h k + j holds head h's j-th pick, as global id h E + e."""
        T = x2.shape[0]
        H, E, k = self.num_heads, self.num_experts, self.experts_per_head
        logits = F.linear(x2, self.router.to(x2.dtype)).view(T, 2, H, E)
        return head_top_k(logits, k, expert_dropout=self.expert_dropout, training=self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [B, N, {self.embed_dim}], got shape {tuple(x.shape)}")
        B, N, d = x.shape
        T, H, D = B * N, self.num_heads, self.head_dim
        dt = compute_dtype(x)
        x2 = x.reshape(T, d).to(dt)
        v, output = self.values(x2)
        qk = rotate_packed(F.linear(x2, self.qk.to(dt)).view(B, N, 2, H, D), self.n_rot, self.rope_base)
        q, k = (t.transpose(1, 2) for t in qk.unbind(2))  # unbind: one gradient kernel (stack), not two scatters
        a = causal_attention(q, k, v.view(B, N, H, D).transpose(1, 2), attention=self.attention,
                             eva_chunk_size=self.eva_chunk_size, eva_window_size=self.eva_window_size,
                             eva_window=self.eva_window, backend=self.backend)
        return output(a.transpose(1, 2).reshape(T, H, D)).view(B, N, d)

    def values(self, x2: torch.Tensor):
        """Both routings of x2 [T, d] (in the compute dtype), the value experts' output [T, H, D], and the
        output projection: a function of the attention output [T, H, D] -> [T, 1, d]."""
        H, E = self.num_heads, self.num_experts
        dt = x2.dtype
        ids, gates = self.select(x2)
        v_route = route(ids[0], H * E, check=False)
        v_gates, o_gates = gates.unbind(0)
        v = expert_matmul(x2, v_route, matmul_weight(self.v_experts, dt), gates=v_gates, out_groups=H,
                          backend=self.backend)
        o_weight = matmul_weight(self.o_experts, dt)
        if self.fused_output_wanted(x2, o_weight):
            def output(a: torch.Tensor) -> torch.Tensor:
                y = fused.switchhead_output(a, ids[1], o_gates, o_weight, E, check=False, backend=self.backend)
                return y.view(a.shape[0], 1, -1)
            return v, output
        o_route = route(ids[1], H * E, check=False)

        def output(a: torch.Tensor) -> torch.Tensor:
            return expert_matmul(a, o_route, o_weight, gates=o_gates, out_groups=1, backend=self.backend)

        return v, output

    def fused_output_wanted(self, x2: torch.Tensor, o_weight: torch.Tensor) -> bool:
        """Whether the output projection runs the fused kernels (ops/switchhead_output.py): asked for
        (fused_output), the op runs its kernels on the layer's backend (its own choice: "triton", or "auto"
        on CUDA unless FLASHSWITCH_BACKEND names another backend), E / k is at most
        FUSED_OUTPUT_MAX_MAC_RATIO, the kernels take the dtypes, and no torch.func transform or
        forward-mode AD is active (their batching and tangents only op 3's paths carry)."""
        if not self.fused_output or self.num_experts > FUSED_OUTPUT_MAX_MAC_RATIO * self.experts_per_head:
            return False
        if x2.dtype not in FLOAT_DTYPES or not (o_weight.dtype == x2.dtype or o_weight.dtype == torch.float32):
            return False
        if not torch.compiler.is_compiling() and (_under_functorch() or forward_ad._current_level >= 0):
            return False
        return fused.runs_kernels(self.backend, str(x2.device))

    def macs_per_token(self, seq_len: int) -> float:
        """Multiply-accumulates per token: routers, dense q/k, k experts of V and O per head, and causal
        attention averaged over a sequence of seq_len tokens."""
        d, H, D, E, k = self.embed_dim, self.num_heads, self.head_dim, self.num_experts, self.experts_per_head
        projections = 2 * H * E * d + 2 * d * H * D + H * k * d * D + H * k * D * d
        return projections + attention_macs_per_token(H, D, seq_len, attention=self.attention,
                                                      eva_chunk_size=self.eva_chunk_size,
                                                      eva_window_size=self.eva_window_size,
                                                      eva_window=self.eva_window)
