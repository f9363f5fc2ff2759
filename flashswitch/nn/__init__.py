"""Layers built on the ops: EvaAttention (EVA causal self-attention with an EvaCache for generation).
Hugging Face transformers glue lives in flashswitch.nn.hf (imported on demand; transformers optional)."""
from flashswitch.nn.eva_attention import EvaAttention
from flashswitch.nn.rotary import Rotary, apply_rotary

__all__ = ["EvaAttention", "Rotary", "apply_rotary"]
