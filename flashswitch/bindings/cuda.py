"""AOT backend: the compiled extension `flashswitch._C` (ops under `torch.ops.flashswitch_C`).

Launchers take torch tensors (outputs preallocated by the op module) and write into the outputs;
their Python signatures match the Triton and CuPy launchers of the same op.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# Defaults of the op-1 kernel's knobs (autotune/space.py declares the searched values).
CS_DEFAULTS = {"threads": 128, "unroll": 4, "split": 0}


@functools.lru_cache(maxsize=None)
def _load_error() -> Optional[str]:
    try:
        import flashswitch._C  # noqa: F401  (importing runs the op registrations)
    except Exception as err:  # not built, or built against another torch/CUDA
        return f"{type(err).__name__}: {err}"
    if not hasattr(torch.ops.flashswitch_C, "chunk_summaries_fwd"):
        return "flashswitch._C imported but registered no chunk_summaries_fwd op"
    return None


def available() -> bool:
    """Whether the extension imported and registered its ops (cached; never raises)."""
    try:
        return _load_error() is None
    except Exception:
        return False


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True)."""
    try:
        return _load_error()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def chunk_summaries_config(config: Optional[dict]) -> tuple[int, int, int]:
    """(threads, unroll, split) of an op-1 config dict; missing keys take CS_DEFAULTS. The launchers
    round them to supported values (threads: power of two in [32, 256]; unroll: 1, 2 or 4; split: 0
    = automatic, else a power of two)."""
    cfg = dict(CS_DEFAULTS)
    cfg.update(config or {})
    return int(cfg["threads"]), int(cfg["unroll"]), int(cfg["split"])


def chunk_summaries(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config=None):
    """Op 1 (SPEC.md): write k_sum, v_sum [B, H, Nc, D] and lse [B, H, Nc] for k, v [B, H, N, D].

    omega: None or a [B, H, Nc, D] view (stride 0 where shared); key_weight: None or [H, D];
    valid: None or bool [B, N]. Last dims contiguous, other strides free."""
    threads, unroll, split = chunk_summaries_config(config)
    torch.ops.flashswitch_C.chunk_summaries_fwd(k, v, omega, key_weight, valid, k_sum, v_sum, lse,
                                                int(chunk_size), float(scale), threads, unroll, split)


__all__ = ["available", "unavailable_reason", "chunk_summaries", "chunk_summaries_config", "CS_DEFAULTS"]
