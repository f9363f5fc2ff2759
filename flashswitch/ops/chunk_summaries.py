"""Op 1: chunked control-variate key/value summaries (EVA).

validate -> normalize -> pick backend -> torch.library op. The only module that knows every backend
of this op. SPEC.md, "Op 1", defines the math.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.autotune import space, store

OP = "chunk_summaries"
MAX_KERNEL_D = 256


def _features(k: torch.Tensor, chunk_size: int, key_weight, valid) -> dict:
    B, H, N, D = k.shape
    return space.features(OP, dtype=C.DTYPE_NAMES[k.dtype], D=D, C=chunk_size, rows=B * H * N)


def _run_backend(backend: str, k, v, chunk_size, omega, key_weight, valid, scale, config=None):
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    k_sum = C.new_output((B, H, Nc, D), k.dtype, k.device)
    v_sum = C.new_output((B, H, Nc, D), v.dtype, v.device)
    lse = C.new_output((B, H, Nc), torch.float32, k.device)
    if B * H * Nc == 0:
        return k_sum, v_sum, lse
    if D == 0:  # nothing to read: lse = log n_c, which the reference computes without a launch
        from flashswitch.reference.chunk_summaries import torch_chunk_summaries
        lse.copy_(torch_chunk_summaries(k, v, chunk_size, valid=valid, return_lse=True)[2])
        return k_sum, v_sum, lse
    if config is None:
        config = store.lookup(OP, backend, _features(k, chunk_size, key_weight, valid))
    if backend == "triton":
        from flashswitch.kernels_triton.chunk_summaries import launch
    elif backend == "cuda":
        from flashswitch.bindings.cuda import chunk_summaries as launch
    elif backend == "cupy":
        from flashswitch.bindings.cupy import chunk_summaries as launch
    else:
        raise ValueError(f"unknown kernel backend {backend!r}")
    launch(k, v, omega, key_weight, valid, k_sum, v_sum, lse, chunk_size=chunk_size, scale=scale, config=config)
    return k_sum, v_sum, lse


@torch.library.custom_op("flashswitch::chunk_summaries", mutates_args=())
def _chunk_summaries_op(k: torch.Tensor, v: torch.Tensor, chunk_size: int, omega: Optional[torch.Tensor],
                        key_weight: Optional[torch.Tensor], valid: Optional[torch.Tensor], scale: float,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backend(backend, k, v, chunk_size, omega, key_weight, valid, scale)


@_chunk_summaries_op.register_fake
def _(k, v, chunk_size, omega, key_weight, valid, scale, backend):
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    return (k.new_empty((B, H, Nc, D)), v.new_empty((B, H, Nc, D)),
            k.new_empty((B, H, Nc), dtype=torch.float32))


def _validate(k, v, chunk_size, omega, key_weight, valid, scale):
    C.check_tensor("k", k, ndim=4)
    C.check_tensor("v", v, ndim=4, device=k.device)
    if v.dtype != k.dtype:
        raise TypeError(f"v has dtype {v.dtype} but k has {k.dtype}; they must match")
    C.check_shape("v", v, k.shape)
    C.check_positive_int("chunk_size", chunk_size)
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    if omega is not None:
        C.check_tensor("omega", omega, device=k.device)
        if omega.dim() == 2:
            C.check_shape("omega", omega, (H, D))
        elif omega.dim() == 4:
            C.check_shape("omega", omega, (B, H, Nc, D))
        else:
            raise ValueError(f"omega must be [Hkv, D] or [B, Hkv, Nc, D] = {[H, D]} or {[B, H, Nc, D]}, "
                             f"got shape {tuple(omega.shape)}")
    if key_weight is not None:
        C.check_tensor("key_weight", key_weight, ndim=2, device=k.device)
        C.check_shape("key_weight", key_weight, (H, D))
    if valid is not None:
        C.check_tensor("valid", valid, ndim=2, dtypes=(torch.bool,), device=k.device, last_contiguous=False)
        C.check_shape("valid", valid, (B, N))
    return C.check_scale(scale, D)


def _kernel_view(k, chunk_size, omega):
    """Kernels read omega through a [B, Hkv, Nc, D] view (stride 0 where it is shared)."""
    B, H, N, D = k.shape
    if omega is not None and omega.dim() == 2:
        omega = omega[None, :, None, :].expand(B, H, -(-N // chunk_size), D)
    return omega


def problem_features(k, v, chunk_size, omega=None, key_weight=None, valid=None, scale=None) -> dict:
    """The autotune bucket of a problem (keyword arguments as `chunk_summaries` takes them)."""
    return _features(k, chunk_size, key_weight, valid)


def run_kernel(backend: str, config: dict, k, v, chunk_size, omega=None, key_weight=None, valid=None,
               scale=None):
    """One kernel call with an explicit config, for the tuner and the benchmarks: (k_sum, v_sum, lse)."""
    scale = _validate(k, v, chunk_size, omega, key_weight, valid, scale)
    return _run_backend(backend, k, v, chunk_size, _kernel_view(k, chunk_size, omega), key_weight, valid,
                        scale, config)


def chunk_summaries(k: torch.Tensor, v: torch.Tensor, chunk_size: int, *, omega: Optional[torch.Tensor] = None,
                    key_weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto"):
    """Per-chunk summary keys and values of `k, v` ([B, Hkv, N, D]); see SPEC.md, op 1.

    Returns `(k_sum, v_sum)` of shape [B, Hkv, ceil(N / chunk_size), D], plus the fp32 per-chunk
    log-normaliser `lse` [B, Hkv, Nc] when `return_lse`. `backend` is "auto", "reference",
    "triton", "cuda" or "cupy".
    """
    scale = _validate(k, v, chunk_size, omega, key_weight, valid, scale)
    bucket = _features(k, chunk_size, key_weight, valid) if k.is_cuda else None
    if k.shape[-1] > MAX_KERNEL_D and backend == "auto":
        backend = "reference"
    backend = C.resolve_backend(OP, backend, k.device, bucket)
    if backend != "reference" and k.shape[-1] > MAX_KERNEL_D:
        raise ValueError(f"k has head dim D={k.shape[-1]}; the {backend} kernels support D <= {MAX_KERNEL_D} "
                         f"(use backend='reference')")
    if backend == "reference":
        from flashswitch.reference.chunk_summaries import torch_chunk_summaries
        out = torch_chunk_summaries(k, v, chunk_size, omega=omega, key_weight=key_weight, valid=valid,
                                    scale=scale, return_lse=True)
    else:
        omega = _kernel_view(k, chunk_size, omega)
        if C.eager_fast_path(k, v, omega, key_weight):
            out = _run_backend(backend, k, v, chunk_size, omega, key_weight, valid, scale)
        else:
            out = _chunk_summaries_op(k, v, chunk_size, omega, key_weight, valid, scale, backend)
    return tuple(out) if return_lse else (out[0], out[1])


__all__ = ["chunk_summaries"]
