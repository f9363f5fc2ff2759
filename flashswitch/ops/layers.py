"""The fused kernels the layers and the cache call around the three ops, as they reach them: the
decoder layers' rotary, RMSNorm (with its residual add), SwiGLU product, routers' top-k with gates and packed
rotary (kernels_triton/layer_ops.py), and EvaCache's bookkeeping (kernels_triton/eva_cache.py).

Whether a fused kernel serves a call is asked of the backend table (backends.py: Triton runs on the
tensors' device) and of the call (CUDA tensors, unit last stride, eager; the inference kernels also
need no gradient). The CPU keeps the torch paths. The kernel modules load on first use (importing
flashswitch loads none).
"""
from __future__ import annotations

import functools
import importlib

import torch

from flashswitch import backends
from flashswitch._common import eager_autograd_path, eager_fast_path

@functools.lru_cache(maxsize=None)
def _triton_on_cuda() -> bool:
    return backends.available("triton", torch.device("cuda"))


def _on_kernels(tensors) -> bool:
    """CUDA tensors with unit last stride, where the table says Triton runs."""
    return all(t.is_cuda and t.stride(-1) == 1 for t in tensors) and _triton_on_cuda()


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused inference kernels serve a call on `tensors`: they run there, and the call is
    eager and needs no gradient (the torch versions keep autograd)."""
    return _on_kernels(tensors) and eager_fast_path(*tensors)


def packed_rotary(t: torch.Tensor) -> bool:
    """Whether the packed rotary kernel (differentiable) serves t [B, N, ..., D]: it runs there, the
    call is eager (not traced; a plain tensor), and t views as rows of D (the layers' packed
    projections)."""
    if not (_on_kernels((t,)) and eager_autograd_path(t)):
        return False
    try:
        t.view(t.shape[0], t.shape[1], -1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def routing_kernel(scores: torch.Tensor) -> bool:
    """Whether the routers' top-k kernel (differentiable in its gates) serves scores: it runs there and the
    call is eager (not traced, plain tensors)."""
    return _on_kernels((scores,)) and eager_autograd_path(scores)


def cache_kernels(device: torch.device, backend: str):
    """The module of EvaCache's step kernels for a cache on `device` whose ops run on `backend`, or None
    (torch ops): on a GPU whatever the ops' backend, and under the interpreter for the Triton one."""
    if backends.available("triton", device) and (device.type == "cuda" or backend == "triton"):
        return importlib.import_module("flashswitch.kernels_triton.eva_cache")
    return None


@functools.lru_cache(maxsize=None)
def _layer_ops():
    return importlib.import_module("flashswitch.kernels_triton.layer_ops")


# the kernels (kernels_triton/layer_ops.py has their contracts)
def rotary_qk(q, k, inv_freq, offsets=None):
    return _layer_ops().rotary_qk(q, k, inv_freq, offsets)


def add_rms_norm(x, residual, weight, eps):
    return _layer_ops().add_rms_norm(x, residual, weight, eps)


def silu_mul(gate, up):
    return _layer_ops().silu_mul(gate, up)


def rotary_packed(t, inv_freq, n_rot):
    return _layer_ops().rotary_packed(t, inv_freq, n_rot)


def top_k_gates(scores, k, offset=False):
    return _layer_ops().top_k_gates(scores, k, offset)


__all__ = ["fused", "packed_rotary", "routing_kernel", "cache_kernels", "rotary_qk", "add_rms_norm", "silu_mul",
           "rotary_packed", "top_k_gates"]
