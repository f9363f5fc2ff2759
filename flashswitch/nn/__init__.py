"""Layers built on the flashswitch ops. Models: `flashswitch.nn.models`."""
from flashswitch.nn.sigma_moe import SigmaMoE
from flashswitch.nn.switchhead import SwitchHeadAttention

__all__ = ["SwitchHeadAttention", "SigmaMoE"]
