"""A pretrained Llama-style model (flashswitch.nn.llama.LlamaLM with exact attention) turned into a
FlashEVA model, with an attention-transfer stage before the usual fine-tune, as LoLCATs converts
models to linear attention.

`convert(model, ..., transfer=batches, steps=n)` swaps every layer's attention for EvaAttention (the
projection weights shared, `set_attention`), then fits EVA's own parameters (the summary weights and
logit biases of summaries="weighted" / summary_bias="learned", which start at plain mean summaries
under log C) and, with `train_qk`, the q and k projections, so that each layer's attention output
matches the exact attention of the model it was converted from. The teacher is a frozen copy of the
exact attention modules; each step runs it once over a batch of tokens (the exact model's own residual
stream, so every layer gets the inputs it saw in pretraining) and fits all layers at once, each to
its own target: loss = mean over layers of |eva(x_l) - exact(x_l)|^2 / |exact(x_l)|^2. Nothing else
changes: embeddings, norms, MLPs and the v / o projections stay as they were.
"""
from __future__ import annotations

import copy
import itertools
from typing import Iterable, Optional

import torch
from torch import nn

from flashswitch import _common as C

EVA_PARAMS = ("key_weight", "omega", "summary_logit_bias")  # EvaAttention's own, zeros at the start


def exact_teacher(model: nn.Module) -> list[nn.Module]:
    """Frozen copies of the model's exact attention modules, one per layer (the transfer's targets)."""
    if getattr(model, "attention", None) != "sdpa":
        raise ValueError(f"the teacher is the exact model: model.attention must be 'sdpa', got "
                         f"{getattr(model, 'attention', None)!r}")
    teacher = []
    for block in model.layers:
        t = copy.deepcopy(block.attn).eval()
        t.requires_grad_(False)
        teacher.append(t)
    return teacher


def transfer_parameters(model: nn.Module, train_qk: bool = False) -> list[nn.Parameter]:
    """What attention transfer fits: each layer's EVA parameters, and with `train_qk` its q / k projections."""
    params = []
    for block in model.layers:
        attn = block.attn
        params += [p for p in (getattr(attn, n, None) for n in EVA_PARAMS) if isinstance(p, nn.Parameter)]
        if train_qk:
            params += list(attn.q_proj.parameters()) + list(attn.k_proj.parameters())
    return params


@torch.no_grad()
def _teacher_io(model: nn.Module, teacher: list[nn.Module], tokens: torch.Tensor, amp: Optional[torch.dtype]):
    """Each layer's attention input on the exact model's residual stream, and the exact output there."""
    student = [block.attn for block in model.layers]
    inputs, outputs = [], []

    def keep(module, args, out) -> None:  # a hook that returned a value would replace the output
        inputs.append(args[0])
        outputs.append(out)

    hooks = [t.register_forward_hook(keep) for t in teacher]
    regions, model._regions = model._regions, None  # the hooks need the eager blocks
    try:
        for block, t in zip(model.layers, teacher):
            block.attn = t
        with torch.autocast(tokens.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            model.hidden(tokens)
    finally:
        for block, s in zip(model.layers, student):
            block.attn = s
        for h in hooks:
            h.remove()
        model._regions = regions
    return inputs, outputs


def attention_transfer(model: nn.Module, teacher: list[nn.Module], batches: Iterable[torch.Tensor], *, steps: int,
                       lr: float = 1e-3, train_qk: bool = False, amp: Optional[torch.dtype] = None) -> list[float]:
    """Fit the EVA model's transfer_parameters (AdamW, `lr`) for `steps` steps over `batches` (token
    tensors [B, N], cycled if they run out) to the `teacher` (exact_teacher of the model before it was
    converted): per step the mean over layers of the relative squared error of each layer's attention
    output. Returns the loss of each step. Every other parameter keeps its value and its requires_grad."""
    C.check_positive_int("steps", steps)
    if len(teacher) != len(model.layers):
        raise ValueError(f"teacher has {len(teacher)} layers, the model {len(model.layers)}")
    params = transfer_parameters(model, train_qk)
    if not params:
        raise ValueError("nothing to fit: EVA with summaries='mean' and a fixed summary_bias has no parameters "
                         "of its own; use summaries='weighted', summary_bias='learned' or train_qk=True")
    wanted = {id(p) for p in params}
    was = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in was:
        p.requires_grad_(id(p) in wanted)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    source = itertools.cycle(batches) if isinstance(batches, (list, tuple)) else iter(batches)
    try:
        for _ in range(steps):
            tokens = next(source, None)
            if tokens is None:
                break
            inputs, targets = _teacher_io(model, teacher, tokens, amp)
            total = torch.zeros((), device=tokens.device)
            for block, x, y in zip(model.layers, inputs, targets):  # one backward per layer: one layer's graph alive
                with torch.autocast(tokens.device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    out = block.attn(x)
                err = (out.float() - y.float()).pow(2).sum() / y.float().pow(2).sum().clamp(min=1e-30)
                (err / len(targets)).backward()
                total += err.detach() / len(targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
    finally:
        for p, flag in was:
            p.requires_grad_(flag)
    return [float(x) for x in losses]  # one sync, at the end


def convert(model: nn.Module, *, chunk_size: int = 32, window_size: int = 256, window: str = "sliding",
            summaries: str = "weighted", summary_bias: Optional[str] = "learned", backend: str = "auto",
            transfer: Optional[Iterable[torch.Tensor]] = None, steps: int = 0, lr: float = 1e-3,
            train_qk: bool = False, amp: Optional[torch.dtype] = None) -> nn.Module:
    """The exact model `model` (LlamaLM, attention "sdpa") as a FlashEVA model, in place: EvaAttention with
    these settings in every layer (set_attention), then, where `transfer` gives token batches and `steps`
    > 0, attention_transfer to the exact layers it had (lr, train_qk, amp as there; the losses are
    kept in `model.transfer_losses`). Returns the model."""
    if steps < 0 or isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if steps and transfer is None:
        raise ValueError("steps > 0 needs transfer: token batches to fit the attention on")
    teacher = exact_teacher(model) if steps else None
    model.set_attention("eva", chunk_size=chunk_size, window_size=window_size, window=window, summaries=summaries,
                        summary_bias=summary_bias, backend=backend)
    model.transfer_losses = []
    if steps:
        model.transfer_losses = attention_transfer(model, teacher, transfer, steps=steps, lr=lr, train_qk=train_qk,
                                                   amp=amp)
    return model


__all__ = ["EVA_PARAMS", "attention_transfer", "convert", "exact_teacher", "transfer_parameters"]
