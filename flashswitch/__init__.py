"""flashswitch: kernels for FlashEVA attention and SwitchHead / sigma-MoE expert matmuls.

Public API (SPEC.md): chunk_summaries (op 1), eva_attention (op 2), route + expert_matmul (op 3).
EvaCache: one layer's compressed cache for decoding with op 2.
Each op takes `backend=` "auto" | "reference" | "triton" | "cuda" | "cupy".
Layers and models: `flashswitch.nn` (imported on first access: `import flashswitch; flashswitch.nn.EvaAttention`).
"""
import importlib

from flashswitch.cache import EvaCache
from flashswitch.ops.chunk_summaries import chunk_summaries
from flashswitch.ops.eva_attention import eva_attention
from flashswitch.ops.expert_matmul import Route, expert_matmul, route

__version__ = "0.1.0"
__all__ = ["chunk_summaries", "eva_attention", "route", "Route", "expert_matmul", "EvaCache"]

_LAZY = ("nn",)  # imported on first access (PEP 562), so `import flashswitch` does not load the layers


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
