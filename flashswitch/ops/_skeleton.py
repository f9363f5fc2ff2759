"""What every op module does the same way, written once: its call plan (call_plan.py: what a call
decides from its arguments' metadata), the forward launch a plan holds, the backward launches it
prepares on first use, and the custom ops' placeholder for an absent gradient. An op module keeps
what is its own: validation, features, output shapes, its custom ops and its kernel calls.

Nothing here runs on a cached call's fast path except the plan's fields and the launch it holds.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from flashswitch import backends, call_plan


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a call decides from its arguments' metadata; an op's plan adds its normalized arguments."""
    backend: str
    kernels: bool  # the backend launches kernels (else the torch reference runs)
    config: Optional[Mapping] = None  # None: the reference, an empty problem, a traced call (looked up per call)
    enqueue: Optional[Callable] = None  # the forward launch of this signature: enqueue(inputs..., outputs...)
    backward: dict = field(default_factory=dict, compare=False)  # the backward's config and prepared launches


def resolve(op: str, backend: str, device: torch.device, features: Callable, *args) -> tuple[str, Optional[dict]]:
    """(the backend that runs this call, the forward's features or None): `auto` on a GPU picks by the
    problem's bucket, computed once here and handed on to the config lookup."""
    bucket = features(op, *args) if device.type == "cuda" else None
    return call_plan.resolve_backend(op, backend, device, bucket), bucket


def forward_launch(op: str, backend: str, config: Mapping, scalars: dict, inputs: Optional[tuple] = None,
                   outputs: Optional[tuple] = None) -> Callable:
    """enqueue(inputs..., outputs...) of one signature: the backend's launch prepared from the arguments'
    metadata where it has one and `inputs` are given (outputs may be meta tensors), else its launcher with
    the scalars and config bound."""
    if inputs is not None and backends.TABLE[backend].prepare:
        from flashswitch.kernels_triton.kernel_call import fast_launch_wanted
        return backends.launcher(backend, op, "prepare")(*inputs, *outputs, **scalars, config=config,
                                                           fast=fast_launch_wanted(inputs[0].device))
    return functools.partial(backends.launcher(backend, op), **scalars, config=config)


def kernel_plan(plan_type, op: str, backend: str, bucket: Optional[dict], features: tuple, launch: Optional[tuple],
                **fields) -> Plan:
    """A plan: on a kernel backend with a problem to launch (`launch` = (scalars, inputs, outputs), else
    None) and outside tracing, its config (`features` = (function, *args), unless `bucket` holds them)
    and its forward launch."""
    kernels = backends.TABLE[backend].kernels
    config = enqueue = None
    if kernels and launch is not None and not torch.compiler.is_compiling():
        config = call_plan.config(op, backend, bucket or features[0](op, *features[1:]))
        enqueue = forward_launch(op, backend, config, *launch)
    return plan_type(backend=backend, kernels=kernels, config=config, enqueue=enqueue, **fields)


def backward_launch(op: str, backend: str, plan: Optional[Plan], key, config: Optional[Mapping], features: tuple,
                    *args, **scalars) -> Callable:
    """enqueue(...) of the backward kernels that serve `backend` (backends.py), prepared from `args`'
    metadata: kept in `plan` under `key` (the layout of the upstream gradients) where a plan is given,
    its config looked up once per plan (`features` = (function, *args)); else with `config` (None:
    looked up)."""
    table, by = op + ".bwd", backends.TABLE[backend].gradients
    if by is None:
        raise ValueError(f"unknown kernel backend {backend!r}")
    if plan is not None:
        config = plan.backward.get("config")
    if config is None:
        config = call_plan.config(table, by, features[0](table, *features[1:]))
        if plan is not None:
            plan.backward["config"] = config
    fast = {}
    if plan is not None:
        from flashswitch.kernels_triton.kernel_call import fast_launch_wanted
        fast = {"fast": fast_launch_wanted(args[0].device)}
    enqueue = backends.launcher(by, op, "backward")(*args, **scalars, config=config, **fast)
    if plan is not None:
        plan.backward[key] = enqueue
    return enqueue


def absent(t: torch.Tensor) -> torch.Tensor:
    """A custom op returns tensors only: an empty one stands for the gradient of an absent input."""
    return t.new_empty(0)


__all__ = ["Plan", "resolve", "forward_launch", "kernel_plan", "backward_launch", "absent"]
