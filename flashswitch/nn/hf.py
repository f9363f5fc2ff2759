"""Hugging Face transformers glue (optional: import this module only where transformers is installed).

    from flashswitch.nn import hf
    hf.use_eva(model, chunk_size=16, window_size=256)          # any Llama-style model: EVA attention
    cache = hf.EvaHFCache(model.config, max_cache_len=4096)    # compressed cache, one EvaCache per layer
    out = model.generate(input_ids, **{hf.cache_kwarg(model): cache}, max_new_tokens=256)

`use_eva` registers the attention function "fs_eva" with transformers' AttentionInterface
and selects it in the model's config (the model's own projections and rotary embedding stay in use).
Without a cache the function runs ops 1 and 2 over the whole sequence; with an EvaHFCache, the
cache's `update` hands the new keys to the function tagged with their layer's EvaCache, which
prefills or steps. Prompts of one batch must have the same length (no padding mask is applied).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from flashswitch.cache import EvaCache
from flashswitch.ops.chunk_summaries import chunk_summaries
from flashswitch.ops.eva_attention import check_window, eva_attention

ATTN_NAME = "fs_eva"  # no "flash" in it: transformers takes such names for flash-attention kernels
_LAYER_TAG = "_flashswitch_eva_layer"  # attribute of the key tensor that `update` returns


def _eva_settings(config) -> dict:
    try:
        return dict(chunk_size=config.eva_chunk_size, window_size=config.eva_window_size, window=config.eva_window,
                    summary_bias=config.eva_summary_bias, backend=config.eva_backend)
    except AttributeError:
        raise ValueError("the model's config has no EVA settings: call flashswitch.nn.hf.use_eva(model, ...) "
                         "first") from None


def _centres(module):
    """Learnable summary parameters a fine-tuned model carries on its attention modules, if any."""
    return getattr(module, "eva_key_weight", None), getattr(module, "eva_omega", None)


def eva_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: query [B, H, N, D], key/value [B, Hkv, N, D] -> ([B, N, H, D], None)."""
    layer = getattr(key, _LAYER_TAG, None)
    if layer is not None:
        o = layer.attend(module, query, key, value, scaling)
    else:
        s = _eva_settings(module.config)
        key_weight, omega = _centres(module)
        k_sum, v_sum = chunk_summaries(key, value, s["chunk_size"], key_weight=key_weight, omega=omega, scale=scaling,
                                       backend=s["backend"])
        o = eva_attention(query, key, value, k_sum, v_sum, chunk_size=s["chunk_size"], window_size=s["window_size"],
                          window=s["window"], scale=scaling, summary_bias=s["summary_bias"], backend=s["backend"])
    return o.transpose(1, 2).contiguous(), None


def cache_kwarg(model) -> str:
    """The keyword a model's forward / generate takes its cache by: "cache" in recent transformers,
    "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def register() -> None:
    """Make "fs_eva" a name transformers' attention dispatch knows (idempotent)."""
    AttentionInterface.register(ATTN_NAME, eva_attention_forward)


def use_eva(model, *, chunk_size: int, window_size: int, window: str = "block", summary_bias: Optional[str] = None,
            summaries: str = "mean", backend: str = "auto"):
    """Switch every attention layer of a transformers model to EVA (in place; returns the model).
    summaries="weighted" adds learnable `eva_key_weight` and `eva_omega` [Hkv, D] (zeros) to each
    attention module that has a `layer_idx`, for fine-tuning."""
    check_window(chunk_size, window_size, window)
    if summaries not in ("mean", "weighted"):
        raise ValueError(f"summaries must be 'mean' or 'weighted', got {summaries!r}")
    if summary_bias not in (None, "log_count"):
        raise ValueError(f"summary_bias must be None or 'log_count' here (EvaAttention has 'learned' and 'off'), "
                         f"got {summary_bias!r}")
    register()
    cfg = model.config
    cfg.eva_chunk_size, cfg.eva_window_size, cfg.eva_window = chunk_size, window_size, window
    cfg.eva_summary_bias, cfg.eva_backend = summary_bias, backend
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:
        cfg._attn_implementation = ATTN_NAME
    if summaries == "weighted":
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and not hasattr(m, "eva_key_weight"):
                w = m.k_proj.weight
                m.eva_key_weight = torch.nn.Parameter(torch.zeros(Hkv, D, device=w.device, dtype=w.dtype))
                m.eva_omega = torch.nn.Parameter(torch.zeros(Hkv, D, device=w.device, dtype=w.dtype))
    return model


class EvaLayerCache(CacheLayerMixin):
    """One layer's EvaCache behind transformers' cache-layer interface (allocated at the first update,
    when the batch size, heads, dtype and device are known)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, max_cache_len: int, settings: dict):
        super().__init__()
        self.max_cache_len, self.settings = max_cache_len, settings
        self.cache: Optional[EvaCache] = None
        self.seen = 0  # positions held, counted on the host

    def lazy_initialization(self, key_states, value_states) -> None:
        B, Hkv, _, D = key_states.shape
        s = self.settings
        self.device = key_states.device
        self.cache = EvaCache(B, Hkv, D, chunk_size=s["chunk_size"], window_size=s["window_size"], window=s["window"],
                              max_seq_len=self.max_cache_len, dtype=key_states.dtype, device=key_states.device,
                              summary_bias=s["summary_bias"], backend=s["backend"])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        setattr(key_states, _LAYER_TAG, self)
        return key_states, value_states

    def attend(self, module, q, k, v, scaling):
        cache = self.cache
        cache.key_weight, cache.omega = (None if t is None else t.detach() for t in _centres(module))
        cache.scale = cache.scale if scaling is None else float(scaling)
        o = cache.prefill(q, k, v) if cache.empty else cache.step(q, k, v)
        self.seen += q.shape[2]
        return o

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def offload(self):  # the compressed cache is small: it stays where it is
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.cache is not None:
            self.cache.reorder(beam_idx.to(self.cache.device))


class EvaHFCache(Cache):
    """A transformers Cache of one EvaCache per decoder layer, for `model.generate(past_key_values=...)`
    on a model switched with `use_eva`. max_cache_len: prompt + new tokens, at most."""

    def __init__(self, config, max_cache_len: int, **kwargs):
        settings = _eva_settings(config)
        n_layers = config.num_hidden_layers
        super().__init__(layers=[EvaLayerCache(max_cache_len, settings) for _ in range(n_layers)], **kwargs)
        if not isinstance(getattr(type(self), "max_cache_len", None), property):  # some versions derive it
            self.max_cache_len = max_cache_len                                      # from the layers

    @property
    def nbytes(self) -> int:
        return sum(layer.cache.nbytes for layer in self.layers if layer.cache is not None)


__all__ = ["ATTN_NAME", "EvaHFCache", "EvaLayerCache", "cache_kwarg", "eva_attention_forward", "register",
           "use_eva"]
