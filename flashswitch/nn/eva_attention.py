"""EvaAttention: a causal self-attention layer (q/k/v/o projections, GQA, rotary) whose attention
is EVA: exact keys in a local window plus one summary per past chunk (op 1 + op 2), and whose
generation runs on an EvaCache. `from_llama` builds one from a Llama-style attention module."""
from __future__ import annotations

import math

from typing import Optional

import torch
from torch import nn

from flashswitch import _common as C
from flashswitch.cache import MASKED, EvaCache
from flashswitch.nn._projections import qkv_projection
from flashswitch.nn.rotary import Rotary
from flashswitch.ops.chunk_summaries import chunk_summaries
from flashswitch.ops.eva_attention import check_window, eva_attention

SUMMARIES = ("mean", "weighted")
SUMMARY_BIASES = (None, "log_count", "learned", "off")


class EvaAttention(nn.Module):
    """Causal self-attention with EVA (SPEC.md ops 1 and 2). x [B, N, hidden_size] -> [B, N, hidden_size].

    num_heads query heads and num_kv_heads (default num_heads) key/value heads of head_dim (default
    hidden_size // num_heads). Rotary embedding (`rope_base`; `rotary=False` for none) is applied to
    q and k before the chunks are summarised, as in FlashEVA. summaries: "mean" (mean chunk key,
    op 1 with omega = 0) or "weighted" (learnable key_weight and omega [Hkv, D], both starting at 0).
    `summary_bias`: None or "log_count" (op 2's); "learned": log C plus a learnable per-kv-head
    `summary_logit_bias` [Hkv] (fp32, zeros at the start, i.e. "log_count"), so each head can learn how
    much its summaries weigh against its exact keys; or "off": every summary switched off by a bias of
    -1e30 (finite, as EvaCache's masked rows), which leaves exact attention over the local window alone:
    with window="sliding", sliding-window attention over W to W + C - 1 keys (the cost of op 1 and of
    the summaries' reads stays).

    forward(x) attends over the whole sequence (differentiable on the reference backend, and on the
    kernel backends where they have a backward); forward(x, cache) runs generation: an empty cache
    is prefilled with x (`lengths`: per-sequence prompt lengths, right padding), a filled one is
    extended by x's tokens (see EvaCache). `new_cache(batch_size, max_seq_len)` makes a matching cache.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, chunk_size: int, window_size: int,
                 window: str = "block", num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 summaries: str = "mean", summary_bias: Optional[str] = None, rotary: bool = True,
                 rope_base: float = 10000.0, bias: bool = False, out_bias: Optional[bool] = None,
                 backend: str = "auto", device=None, dtype=None):
        super().__init__()
        C.check_positive_int("hidden_size", hidden_size)
        C.check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else C.check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = hidden_size // num_heads if head_dim is None else C.check_positive_int("head_dim", head_dim)
        check_window(chunk_size, window_size, window)
        if summaries not in SUMMARIES:
            raise ValueError(f"summaries must be one of {SUMMARIES}, got {summaries!r}")
        if summary_bias not in SUMMARY_BIASES:
            raise ValueError(f"summary_bias must be one of {SUMMARY_BIASES}, got {summary_bias!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.chunk_size, self.window_size, self.window = chunk_size, window_size, window
        self.summaries, self.summary_bias, self.backend = summaries, summary_bias, backend
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if out_bias is None else out_bias, **kw)
        self.rotary = Rotary(head_dim, rope_base, device=device) if rotary else None
        if summaries == "weighted":
            self.key_weight = nn.Parameter(torch.zeros(num_kv_heads, head_dim, **kw))
            self.omega = nn.Parameter(torch.zeros(num_kv_heads, head_dim, **kw))
        else:
            self.key_weight = self.omega = None
        self.summary_logit_bias = None
        if summary_bias == "learned":
            self.summary_logit_bias = nn.Parameter(torch.zeros(num_kv_heads, device=device, dtype=torch.float32))

    # ------------------------------------------------------------ construction from a Llama layer
    @classmethod
    def from_llama(cls, attn: nn.Module, *, chunk_size: int, window_size: int, window: str = "block",
                   config=None, inv_freq: Optional[torch.Tensor] = None, **kwargs) -> "EvaAttention":
        """An EvaAttention holding a copy of the weights of a Llama-style attention module (q_proj,
        k_proj, v_proj, o_proj Linear layers; heads and rope theta from `config`, default attn.config).
        `inv_freq`: the model's rotary frequencies (e.g. model.model.rotary_emb.inv_freq) where they
        are not the plain base ** (-2i / D) (scaled rope variants)."""
        config = getattr(attn, "config", None) if config is None else config
        if config is None:
            raise ValueError("config is needed (attn has no .config): pass the model's config")
        H = config.num_attention_heads
        Hkv = getattr(config, "num_key_value_heads", None) or H
        D = getattr(config, "head_dim", None) or config.hidden_size // H
        rope = getattr(config, "rope_parameters", None) or {}
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        w = attn.q_proj.weight
        layer = cls(config.hidden_size, H, num_kv_heads=Hkv, head_dim=D, chunk_size=chunk_size, window_size=window_size,
                    window=window, rope_base=base, bias=attn.q_proj.bias is not None,
                    out_bias=attn.o_proj.bias is not None, device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer, name).load_state_dict(getattr(attn, name).state_dict())
            if inv_freq is not None and layer.rotary is not None:
                layer.rotary.inv_freq.copy_(inv_freq)
        return layer

    # ------------------------------------------------------------ forward
    def new_cache(self, batch_size: int, max_seq_len: int, *, dtype=None, device=None) -> EvaCache:
        w = self.q_proj.weight
        device = device or w.device
        return EvaCache(batch_size, self.num_kv_heads, self.head_dim, chunk_size=self.chunk_size,
                        window_size=self.window_size, window=self.window, max_seq_len=max_seq_len,
                        dtype=dtype or w.dtype, device=device, key_weight=self.key_weight, omega=self.omega,
                        summary_bias=_detached(self._bias(batch_size, -(-max_seq_len // self.chunk_size), device)),
                        backend=self.backend)

    def _bias(self, batch_size: int, num_chunks: int, device):
        """op 2's summary_bias: "off" and "learned" as a [B, Hkv, Nc] tensor (expanded; every summary a
        query sees is of a whole chunk, so "learned" is log C + the head's bias), else as given."""
        if self.summary_bias == "learned":
            b = self.summary_logit_bias + math.log(self.chunk_size)
            return b[None, :, None].expand(batch_size, self.num_kv_heads, num_chunks)
        if self.summary_bias != "off":
            return self.summary_bias
        return torch.full((1, 1, 1), MASKED, dtype=torch.float32, device=device).expand(
            batch_size, self.num_kv_heads, num_chunks)

    def forward(self, x: torch.Tensor, cache: Optional[EvaCache] = None,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        C.check_tensor("x", x, ndim=3)
        B, N, _ = x.shape
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x has {x.shape[-1]} features, expected hidden_size={self.hidden_size}")
        q, k, v = qkv_projection(self, x)
        if self.rotary is not None:
            q, k = self.rotary.rotate_qk(q, k, cache)
        if cache is None:
            if lengths is not None:
                raise ValueError("lengths goes with a cache (right-padded prompts); without one every position is real")
            k_sum, v_sum = chunk_summaries(k, v, self.chunk_size, key_weight=self.key_weight, omega=self.omega,
                                           backend=self.backend)
            o = eva_attention(q, k, v, k_sum, v_sum, chunk_size=self.chunk_size, window_size=self.window_size,
                              window=self.window, summary_bias=self._bias(B, k_sum.shape[2], x.device),
                              backend=self.backend)
        elif cache.empty:
            o = cache.prefill(q, k, v, lengths=lengths)
        else:
            if lengths is not None:
                raise ValueError("lengths is only for the prefill of an empty cache")
            o = cache.step(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))


def _detached(bias):
    """A cache holds a snapshot of the summary bias (generation takes no gradient)."""
    return bias.detach() if isinstance(bias, torch.Tensor) else bias
