"""Layers built on the flashswitch ops: EvaAttention (EVA causal self-attention, generation through an
EvaCache), SwitchHeadAttention and SigmaMoE (mixture-of-experts projections through route +
expert_matmul). Models: `flashswitch.nn.models`. Hugging Face transformers glue lives in
`flashswitch.nn.hf` (imported on demand; transformers is optional)."""
from flashswitch.nn.eva_attention import EvaAttention
from flashswitch.nn.rotary import Rotary, apply_rotary
from flashswitch.nn.sigma_moe import SigmaMoE
from flashswitch.nn.switchhead import SwitchHeadAttention

__all__ = ["EvaAttention", "Rotary", "apply_rotary", "SwitchHeadAttention", "SigmaMoE"]
