"""Layers built on the flashswitch ops: EvaAttention (EVA causal self-attention, generation through an
EvaCache), SwitchHeadAttention and SigmaMoE (mixture-of-experts projections through route +
expert_matmul). Models: `flashswitch.nn.models`, `flashswitch.nn.llama`; pretrained weights from GGUF
files: `flashswitch.nn.pretrained` (imported on first use; it needs gguf and tokenizers only when it
loads a file). `convert` turns an exact Llama model into a FlashEVA one, with attention transfer
(nn/transfer.py). Hugging Face transformers glue lives in `flashswitch.nn.hf` (imported on demand;
transformers is optional)."""
import importlib

from flashswitch.nn.eva_attention import EvaAttention
from flashswitch.nn.rotary import Rotary, apply_rotary
from flashswitch.nn.sigma_moe import SigmaMoE
from flashswitch.nn.switchhead import SwitchHeadAttention
from flashswitch.nn.transfer import attention_transfer, convert

_LAZY = ("pretrained",)


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EvaAttention", "Rotary", "apply_rotary", "SwitchHeadAttention", "SigmaMoE", "attention_transfer",
           "convert", "pretrained"]
