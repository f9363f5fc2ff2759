"""Data-parallel training of models built from the flashswitch layers.

DDP: wrap the model as usual, with `find_unused_parameters=False`. Every parameter of EvaAttention,
SwitchHeadAttention and SigmaMoE gets a gradient on every rank in every step: an expert that no
local token picked gets an exactly-zero gradient (op 3's backward writes the whole weight gradient),
never None, and the routers reach every expert through their dense logits.

FSDP2: `fully_shard_model` shards each block of a DecoderLM (or each layer of another model), then
the root. The expert weights [E, ...] are sharded along the expert dimension and gathered whole for
the forward and backward, so the layers see plain tensors. SwitchHeadAttention and SigmaMoE return a
view of their expert-matmul output: where one of them is an FSDP2 unit itself (FSDP2 warns about the
view), add its output out of place (`x = x + layer(x)`), never `x += ...` on it.

DDP and FSDP2 run a module's forward; `TrainingLoss(model)` makes DecoderLM.loss that forward.

The sigma-MoE entropy regulariser is computed over each rank's own tokens: with entropy_reg > 0 a
data-parallel step differs from a one-process step on the whole batch by that term's nonlinearity.
"""
from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from flashswitch.nn.eva_attention import EvaAttention
from flashswitch.nn.sigma_moe import SigmaMoE
from flashswitch.nn.switchhead import SwitchHeadAttention

LAYERS = (EvaAttention, SwitchHeadAttention, SigmaMoE)


class TrainingLoss(nn.Module):
    """forward(tokens, targets=None) = model.loss(tokens, targets). DDP and FSDP2 hook a module's
    forward, so a DecoderLM trains under them wrapped in this: `DDP(TrainingLoss(model))(tokens)`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets=None):
        return self.model.loss(tokens, targets)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards one by one: the blocks of the first module in `model` that has a
    `blocks` ModuleList (DecoderLM, also inside TrainingLoss), else every flashswitch layer in it
    (outermost first, none nested in another)."""
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return list(blocks)
    units, seen = [], []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(p + ".") for p in seen):
            continue
        if isinstance(module, LAYERS):
            units.append(module)
            seen.append(name)
    return units


def fully_shard_model(model: nn.Module, mesh=None, *, units: Optional[Iterable[nn.Module]] = None,
                      mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) over each of `units` (default `shard_units(model)`),
    then over `model` itself (the embeddings, norms and head that remain). `mesh`: a 1-D DeviceMesh
    (default: every rank on the default process group's device type). `mp_policy`: an FSDP2
    MixedPrecisionPolicy or None. Returns `model` (now an FSDPModule)."""
    from torch.distributed.fsdp import fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for unit in (shard_units(model) if units is None else units):
        fully_shard(unit, **kw)
    return fully_shard(model, **kw)


__all__ = ["TrainingLoss", "fully_shard_model", "shard_units"]
