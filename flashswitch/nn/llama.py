"""A Llama-style decoder LM (RMSNorm, rotary, GQA attention, SwiGLU MLP, tied or untied embeddings)
whose attention is exact causal softmax (`SdpaAttention`: SDPA, generation on a `StaticKVCache`) or
EVA (`EvaAttention`, generation on an `EvaCache`). Both caches keep every sequence's length on the
device, so a decode step has fixed shapes and can be captured in a CUDA graph.

    model = LlamaLM(LLAMA_SHAPES["smollm2-135m"], device="cuda", dtype=torch.bfloat16)   # SDPA attention
    model.set_attention("eva", chunk_size=32, window_size=256, window="sliding")         # same weights, EVA
    cache = model.new_cache(batch_size, max_seq_len)           # one cache per layer
    logits = model(prompt, cache, last_only=True)              # prefill: [B, 1, vocab]
    logits = model(next_tokens, cache)                         # decode step: next_tokens [B, 1]

`macs_per_token` counts a full-sequence forward's multiply-accumulates per token, split into the
projections, the MLP and the attention (exact or EVA), for ideal-speedup estimates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flashswitch import _common as C
from flashswitch.nn.eva_attention import EvaAttention
from flashswitch.nn._projections import qkv_projection
from flashswitch.nn.rotary import Rotary
from flashswitch.ops import layers

ATTENTIONS = ("sdpa", "eva")
DECODE_KERNELS = ("masked", "gqa", "flash")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context_length: Optional[int] = None  # the context the weights were trained for (None: unknown); not enforced

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.type == "int" or (f.type == "Optional[int]" and getattr(self, f.name) is not None):
                C.check_positive_int(f.name, getattr(self, f.name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def num_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head


# shapes of two public checkpoints (LlamaLM draws random weights; flashswitch.nn.pretrained loads real ones
# from a GGUF file): SmolLM2-135M and Llama 3.2 1B
LLAMA_SHAPES = {
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                head_dim=64, intermediate_size=1536, rope_base=100000.0, context_length=8192),
    "llama-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                            head_dim=64, intermediate_size=8192, rope_base=500000.0, context_length=131072),
}


# ---------------------------------------------------------------- the standard cache
class StaticKVCache:
    """The standard key/value cache of one attention layer, allocated once: k, v [B, max_seq_len, Hkv, D]
    (flash attention's variable-length layout) and `lengths` [B] on the device. A step writes its tokens
    at each sequence's length and attends over the buffer with the positions past it left out: fixed
    shapes and launch arguments, no host sync, so it can be captured in a CUDA graph.

    decode, how a step attends (on CUDA each reads every kv head once per step; the prefill is SDPA's
    causal attention with enable_gqa):
      "masked"  SDPA with the G = H / Hkv query heads of a kv head folded into G * n query rows and a
                boolean key mask: no copy of the cache on any device or backend.
      "gqa"     SDPA over the H query heads with enable_gqa and an additive key bias [B, 1, n, N] (0 up
                to each token's position, -inf past it). On CUDA SDPA hands it to cuDNN's attention,
                which reads the cache at about twice flash's rate at large batch; on the CPU the math
                backend copies each kv head G times.
      "flash"   single-token steps on CUDA through flash attention's variable-length kernel with
                `seqused_k` (SDPA's flash backend takes no mask or lengths; bf16/fp16 only). With one
                query token torch's kernel itself makes the G heads of a kv head G query rows of it
                (flash-attn's seqlenq_ngroups_swapped, with the split-KV kernel at small batch); its
                128-row query tiles, G of them used, make it compute bound at large batch."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *, max_seq_len: int,
                 dtype: Optional[torch.dtype] = None, device=None, scale: Optional[float] = None,
                 decode: str = "masked"):
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_seq_len", max_seq_len)):
            C.check_positive_int(name, value)
        if decode not in DECODE_KERNELS:
            raise ValueError(f"decode must be one of {DECODE_KERNELS}, got {decode!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device = torch.empty(0, device="cpu" if device is None else device).device  # "cuda" -> "cuda:0"
        B, N = batch_size, max_seq_len
        self.batch_size, self.num_kv_heads, self.head_dim, self.max_seq_len = B, num_kv_heads, head_dim, N
        self.dtype, self.device, self.decode = dtype, device, decode
        self.scale = C.check_scale(scale, head_dim)
        # zeros: a masked key still meets the query in SDPA's product, and NaN * 0 is NaN
        self.k = torch.zeros(B, N, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=device)
        self._keys = torch.arange(N, device=device)
        self._cu_q = torch.arange(B + 1, dtype=torch.int32, device=device)       # one query per sequence
        self._cu_k = self._cu_q * N                                                # sequence b's rows start at b * N
        self._max_len = 0  # host-side bound on every length (known without a sync)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.lengths))

    @property
    def empty(self) -> bool:
        return self._max_len == 0

    def reset(self) -> None:
        self.lengths.zero_()
        self._max_len = 0

    def _check(self, q, k, v) -> int:
        B, H, n, D = q.shape
        if B != self.batch_size or D != self.head_dim or H % self.num_kv_heads:
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [{self.batch_size}, a multiple of "
                             f"{self.num_kv_heads}, n, {self.head_dim}]")
        C.check_shape("k", k, (B, self.num_kv_heads, n, D))
        C.check_shape("v", v, k.shape)
        if self._max_len + n > self.max_seq_len:
            raise ValueError(f"the cache holds max_seq_len={self.max_seq_len} positions; {self._max_len} are "
                             f"(at most) used and {n} more were given")
        self._max_len += n
        return n

    def prefill(self, q, k, v, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention over a prompt (q [B, H, P, D], k, v [B, Hkv, P, D]) into an empty cache;
        `lengths` ([B] on the device): right-padded prompts (padding rows are written but never seen)."""
        if self._max_len:
            raise ValueError("prefill needs an empty cache (call reset() first); use step() to extend it")
        P = self._check(q, k, v)
        self.k[:, :P] = k.transpose(1, 2)
        self.v[:, :P] = v.transpose(1, 2)
        if lengths is None:
            self.lengths.fill_(P)
        else:
            C.check_tensor("lengths", lengths, ndim=1, dtypes=(torch.int32, torch.int64), device=self.device)
            C.check_shape("lengths", lengths, (self.batch_size,))
            self.lengths.copy_(lengths)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def step(self, q, k, v) -> torch.Tensor:
        """Append n >= 1 tokens per sequence (at its length) and return their attention [B, H, n, D]."""
        n = self._check(q, k, v)
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        pos = self.lengths[:, None] + self._keys[:n]                                             # [B, n]
        idx = pos[:, :, None, None].expand(B, n, Hkv, D)
        self.k.scatter_(1, idx, k.transpose(1, 2))
        self.v.scatter_(1, idx, v.transpose(1, 2))
        if self.decode == "flash" and n == 1:
            o = self._flash_one(q)
        elif self.decode == "gqa":
            o = self._gqa(q, pos)
        else:
            o = self._masked(q, pos)
        self.lengths += n
        return o

    def _gqa(self, q, pos):
        # one bias row per token, shared by every head: SDPA broadcasts it, nothing is expanded
        see = self._keys[None, None, :] <= pos[:, :, None]                                       # [B, n, N]
        bias = torch.where(see, 0.0, float("-inf")).to(q.dtype)[:, None]                          # [B, 1, n, N]
        return F.scaled_dot_product_attention(q, self.k.transpose(1, 2), self.v.transpose(1, 2), attn_mask=bias,
                                              scale=self.scale, enable_gqa=q.shape[1] != self.num_kv_heads)

    def _masked(self, q, pos):
        B, H, n, D = q.shape
        Hkv, G, N = self.num_kv_heads, q.shape[1] // self.num_kv_heads, self.max_seq_len
        # the G query heads of a kv head become G * n query rows of it (head h reads kv head h // G):
        # GQA without expanding the cache, and every row of one token has the same key mask
        qg = q.reshape(B, Hkv, G * n, D)
        see = self._keys[None, None, :] <= pos[:, :, None]                                       # [B, n, N]
        mask = see[:, None, None].expand(B, 1, G, n, N).reshape(B, 1, G * n, N)
        o = F.scaled_dot_product_attention(qg, self.k.transpose(1, 2), self.v.transpose(1, 2), attn_mask=mask,
                                           scale=self.scale)
        return o.reshape(B, H, n, D)

    def _flash_one(self, q):
        # q [B, H, D] as one query row per sequence; the kernel regroups the heads by kv head itself
        # (doing it here, max_seqlen_q = G, measured slower: it loses the split-KV path at small batch)
        B, H, _, D = q.shape
        N, Hkv = self.max_seq_len, self.num_kv_heads
        used = (self.lengths + 1).to(torch.int32)  # keys [0, length] of each sequence, the new token included
        o = torch.ops.aten._flash_attention_forward(
            q[:, :, 0].contiguous(), self.k.view(B * N, Hkv, D), self.v.view(B * N, Hkv, D), self._cu_q, self._cu_k,
            1, N, 0.0, False, False, scale=self.scale, seqused_k=used)[0]
        return o.view(B, H, 1, D)


# ---------------------------------------------------------------- layers
class SdpaAttention(nn.Module):
    """Causal softmax self-attention (q/k/v/o projections, GQA, rotary) through SDPA, generating on a
    StaticKVCache. Its parameters are named as EvaAttention's, so either can take the other's weights.
    x [B, N, hidden_size] -> [B, N, hidden_size]; forward(x, cache, lengths) as EvaAttention's."""

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, rope_base: float = 10000.0, decode: str = "masked",
                 device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if decode not in DECODE_KERNELS:
            raise ValueError(f"decode must be one of {DECODE_KERNELS}, got {decode!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.decode = decode
        kw = dict(device=device, dtype=dtype, bias=False)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, **kw)
        self.rotary = Rotary(head_dim, rope_base, device=device)

    def new_cache(self, batch_size: int, max_seq_len: int, *, dtype=None, device=None) -> StaticKVCache:
        w = self.q_proj.weight
        return StaticKVCache(batch_size, self.num_kv_heads, self.head_dim, max_seq_len=max_seq_len,
                             dtype=dtype or w.dtype, device=device or w.device, decode=self.decode)

    def forward(self, x: torch.Tensor, cache: Optional[StaticKVCache] = None,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = qkv_projection(self, x)
        q, k = self.rotary.rotate_qk(q, k, cache)
        if cache is None:
            if lengths is not None:
                raise ValueError("lengths goes with a cache (right-padded prompts); without one every position is real")
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        elif cache.empty:
            o = cache.prefill(q, k, v, lengths=lengths)
        else:
            if lengths is not None:
                raise ValueError("lengths is only for the prefill of an empty cache")
            o = cache.step(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (the Llama convention), x's dtype out."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add(x, None)[1]

    def add(self, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """(s, norm(s)) with s = x + residual (x when residual is None): a pre-norm block's residual add
        and the norm after it, one kernel in inference."""
        if x.dtype == self.weight.dtype and (residual is None or residual.dtype == x.dtype) \
                and layers.fused(x, self.weight, *([] if residual is None else [residual])):
            return layers.add_rms_norm(x, residual, self.weight, self.eps)
        s = x if residual is None else x + residual
        sf = s.float()
        return s, (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + self.eps)).to(s.dtype) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); the gate and up projections are one [2 * hidden, dim] matrix (gate
    rows first): one GEMM for both."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype, bias=False)
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, **kw)
        self.down_proj = nn.Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        if layers.fused(g, u):  # inference on CUDA: silu and the product in one kernel
            return self.down_proj(layers.silu_mul(g, u))
        return self.down_proj(F.silu(g) * u)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, attn: nn.Module, device=None, dtype=None):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = attn
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device, dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)

    def forward(self, x, cache=None, lengths=None):
        x, h = self.residual_forward(x, None, cache, lengths)
        return x + h

    def residual_forward(self, x, pending, cache=None, lengths=None):
        """The block on the residual stream x + pending (pending: the previous block's MLP output not
        yet added, or None): returns (that stream after attention, this block's MLP output), so each
        residual add runs fused with the norm after it."""
        x, h = self.input_norm.add(x, pending)
        x, h = self.post_norm.add(x, self.attn(h, cache, lengths))
        return x, self.mlp(h)


# ---------------------------------------------------------------- the model
class LlamaLM(nn.Module):
    """Pre-norm decoder: embedding, num_layers DecoderBlocks, final RMSNorm, logits (the embedding
    matrix when tie_embeddings). attention "sdpa" (exact; `decode` picks the StaticKVCache step kernel)
    or "eva" (EvaAttention with chunk_size, window_size, window, summaries, summary_bias, backend).
    Weights are drawn by `init_weights(seed)` (N(0, 0.02), norms 1) and depend only on the parameter
    names and the seed, so two models of one config and seed are equal whatever their attention."""

    def __init__(self, cfg: LlamaConfig, *, attention: str = "sdpa", seed: int = 0, device=None, dtype=None,
                 **attention_kw):
        super().__init__()
        self.cfg = cfg
        self._kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **self._kw)
        self.layers = nn.ModuleList(DecoderBlock(cfg, self._attention(attention, **attention_kw), **self._kw)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **self._kw)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                 **self._kw)
        self.attention = attention
        self._regions = None  # compile_regions(): (the compiled block step, the compiled loss head)
        self.init_weights(seed)

    def _attention(self, attention: str, *, chunk_size=None, window_size=None, window="block", summaries="mean",
                   summary_bias=None, backend="auto", decode="masked") -> nn.Module:
        cfg = self.cfg
        heads = dict(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_base=cfg.rope_base, **self._kw)
        if attention == "sdpa":
            return SdpaAttention(cfg.hidden_size, cfg.num_heads, decode=decode, **heads)
        if attention == "eva":
            if chunk_size is None or window_size is None:
                raise ValueError("attention='eva' needs chunk_size and window_size")
            return EvaAttention(cfg.hidden_size, cfg.num_heads, chunk_size=chunk_size, window_size=window_size,
                                window=window, summaries=summaries, summary_bias=summary_bias, backend=backend,
                                **heads)
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        for i, (name, p) in enumerate(sorted(self.named_parameters())):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
                p.normal_(0.0, 0.02, generator=g)

    def set_attention(self, attention: str, **attention_kw) -> "LlamaLM":
        """Swap every layer's attention for a new one ("sdpa" or "eva", settings as in the constructor)
        that shares the current projection weights (no copy). Returns the model."""
        for block in self.layers:
            new, old = self._attention(attention, **attention_kw), block.attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(new, name, getattr(old, name))
            block.attn = new
        self.attention = attention
        return self

    def compile_regions(self, enable: bool = True, **compile_kw) -> "LlamaLM":
        """Run full-sequence calls (no cache) through torch.compile, one region at a time: a decoder
        block's step and the loss head (final norm, logits, cross-entropy). Inductor fuses what eager
        runs as many small kernels (RMSNorm, rotary, SwiGLU, the casts of autocast, the loss's fp32
        logits); the op kernels stay custom ops inside the graph. One compiled block serves every
        layer (the parameters are graph inputs; the first block gets exact zeros for its pending MLP
        output), so compiling costs two graphs whatever the depth. Calls with a cache stay eager.
        `compile_regions(False)` goes back to eager. Returns the model."""
        if not enable:
            self._regions = None
            return self
        # static shapes: a new length compiles a graph of its own, whose bucket lookups and launch plans
        # are constants (a dynamic graph would trace into them)
        compile_kw.setdefault("dynamic", False)
        self._regions = (torch.compile(DecoderBlock.residual_forward, **compile_kw),
                         torch.compile(_loss_head, **compile_kw))
        return self

    def new_cache(self, batch_size: int, max_seq_len: int) -> list:
        """One cache per layer (StaticKVCache or EvaCache), on the model's device and dtype."""
        return [block.attn.new_cache(batch_size, max_seq_len) for block in self.layers]

    def forward(self, tokens: torch.Tensor, cache: Optional[list] = None, lengths: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, N] -> logits [B, N, vocab] ([B, 1, vocab] with last_only: each sequence's last
        position, lengths - 1 where right-padded prompt lengths are given). With a cache: an empty
        one is prefilled with the tokens, a filled one extended by them."""
        x, h = self.hidden(tokens, cache, lengths)
        if last_only:
            if lengths is None:
                x, h = x[:, -1:], h[:, -1:]
            else:  # each sequence's last real position, picked on the device
                at = (lengths.long() - 1).clamp(min=0)[:, None, None].expand(x.shape[0], 1, x.shape[2])
                x, h = x.gather(1, at), h.gather(1, at)
        x = self.norm.add(x, h)[1]
        return F.linear(x, self.head_weight)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, tokens: torch.Tensor, cache: Optional[list] = None, lengths: Optional[torch.Tensor] = None):
        """The residual stream after the last block and that block's MLP output, not yet added: (x, h)."""
        C.check_tensor("tokens", tokens, ndim=2, dtypes=(torch.int32, torch.int64))
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the model {len(self.layers)}")
        x = self.embed(tokens)
        if cache is None and self._regions is not None:
            # the first block's pending output as exact zeros of the MLP output's dtype and grad mode:
            # every layer then matches one graph
            dev = x.device.type
            h = torch.zeros_like(x, dtype=torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None)
            h.requires_grad_(x.requires_grad)
            for block in self.layers:
                x, h = self._regions[0](block, x, h)
            return x, h
        h = None
        for i, block in enumerate(self.layers):
            x, h = block.residual_forward(x, h, None if cache is None else cache[i], lengths)
        return x, h

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of tokens [B, N + 1]: positions 0..N-1 predict 1..N."""
        if self._regions is None:
            logits = self(tokens[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        x, h = self.hidden(tokens[:, :-1])
        return self._regions[1](self.norm, x, h, self.head_weight, tokens[:, 1:])


def _loss_head(norm: RMSNorm, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """LlamaLM.loss after the blocks: the last residual add, the final norm, the logits and the mean
    cross-entropy (fp32), as one region for torch.compile."""
    logits = F.linear(norm.add(x, h)[1], weight)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- cost
def keys_seen(t, *, attention: str = "sdpa", chunk_size: Optional[int] = None, window_size: Optional[int] = None,
              window: str = "block") -> np.ndarray:
    """The keys the query at position t (an int or int array) attends to: t + 1 for exact causal
    attention; for EVA (SPEC op 2) the exact keys [start(t), t] plus one summary per chunk before start(t)."""
    t = np.asarray(t, dtype=np.int64)
    if attention == "sdpa":
        return t + 1
    Cs, W = chunk_size, window_size
    if window == "block":
        start = W * (t // W)
    else:
        start = np.where(t >= W, Cs * ((t - W + 1) // Cs), 0)
    return t - start + 1 + start // Cs


def keys_per_query(seq_len: int, *, attention: str = "sdpa", chunk_size: Optional[int] = None,
                   window_size: Optional[int] = None, window: str = "block") -> float:
    """Mean of `keys_seen` over the N positions of a sequence."""
    return float(keys_seen(np.arange(seq_len), attention=attention, chunk_size=chunk_size, window_size=window_size,
                           window=window).mean())


def macs_per_token(cfg: LlamaConfig, seq_len: int, *, attention: str = "sdpa", chunk_size: Optional[int] = None,
                   window_size: Optional[int] = None, window: str = "block", logits: bool = False) -> dict:
    """Multiply-accumulates per token of a full-sequence forward of seq_len tokens, by part (every
    layer summed): projections (q, k, v, o), mlp (SwiGLU), attention (q.k and p.v over the keys of
    `keys_per_query`), summaries (EVA op 1: one key and one value accumulation per token and kv head),
    logits (only when `logits`: a prefill needs the last position's alone). "total" sums them."""
    d, H, Hkv, D, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    keys = keys_per_query(seq_len, attention=attention, chunk_size=chunk_size, window_size=window_size, window=window)
    out = {"projections": L * d * D * (2 * H + 2 * Hkv), "mlp": L * 3 * d * cfg.intermediate_size,
           "attention": L * 2 * H * D * keys, "summaries": L * 2 * Hkv * D if attention == "eva" else 0,
           "logits": d * cfg.vocab_size if logits else 0}
    out["total"] = sum(out.values())
    return out


__all__ = ["LlamaConfig", "LLAMA_SHAPES", "LlamaLM", "SdpaAttention", "StaticKVCache", "RMSNorm", "SwiGLU",
           "DecoderBlock", "keys_seen", "keys_per_query", "macs_per_token"]
