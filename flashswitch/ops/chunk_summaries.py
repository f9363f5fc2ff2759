"""Op 1: chunked control-variate key/value summaries (EVA).

validate -> normalize -> pick backend -> torch.library op, declared once as an OpDef (ops/_opdef.py).
The only module that knows every backend of this op. SPEC.md, "Op 1", defines the math.

Backward: the custom op's autograd formula calls a second custom op, `chunk_summaries_backward`,
which runs the Triton backward kernels (kernels_triton/chunk_summaries_bwd.py) for every kernel
backend (triton, cuda, cupy); the reference backend is differentiated by autograd.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.autotune import space
from flashswitch.ops import call_plan
from flashswitch.ops._opdef import OpDef

OP = "chunk_summaries"
OP_BWD = OP + ".bwd"
MAX_KERNEL_D = 256
GRAD_INPUTS = ("k", "v", "omega", "key_weight")  # what run_backward returns, in this order


def _features(table: str, k: torch.Tensor, chunk_size: int) -> dict:
    """The autotune bucket of `table` (OP or OP_BWD)."""
    B, H, N, D = k.shape
    return space.features(table, dtype=C.DTYPE_NAMES[k.dtype], D=D, C=chunk_size, rows=B * H * N)


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


def _kernel_inputs(k, v, chunk_size, omega, key_weight, valid, scale):
    """What the forward kernels read: omega through a [B, Hkv, Nc, D] view (stride 0 where it is shared)."""
    if omega is not None and omega.dim() == 2:
        B, H, N, D = k.shape
        omega = omega[None, :, None, :].expand(B, H, -(-N // chunk_size), D)
    return k, v, omega, key_weight, valid


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """Gradients may come as expanded views (loss = out.sum()): kernels need a unit last stride."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------- the op's own parts of its OpDef
# the call's arguments (also the plan's and the custom op's): k, v, chunk_size, omega, key_weight, valid, scale
def _normalize(k, v, chunk_size, omega=None, key_weight=None, valid=None, scale=None):
    return k, v, chunk_size, omega, key_weight, valid, _validate(k, v, chunk_size, omega, key_weight, valid, scale)


def _key(k, v, chunk_size, omega, key_weight, valid, scale, backend):
    T, O, S = call_plan.tensor_key, call_plan.optional_tensor_key, call_plan.scalar_key
    return (T(k), T(v), S(chunk_size), O(omega), O(key_weight), O(valid), S(scale), S(backend))


def _shapes(k, v, chunk_size, omega, key_weight, valid, scale):
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    return [((B, H, Nc, D), k.dtype), ((B, H, Nc, D), v.dtype), ((B, H, Nc), torch.float32)]


def _reference(k, v, chunk_size, omega, key_weight, valid, scale):
    from flashswitch.reference.chunk_summaries import torch_chunk_summaries
    return torch_chunk_summaries(k, v, chunk_size, omega=omega, key_weight=key_weight, valid=valid, scale=scale,
                                 return_lse=True)


def _fill(args, outs):
    """D = 0: nothing to read; lse = log n_c, which the reference computes without a launch."""
    if outs[2].numel():
        from flashswitch.reference.chunk_summaries import torch_chunk_summaries
        k, v, chunk_size, omega, key_weight, valid, scale = args
        outs[2].copy_(torch_chunk_summaries(k, v, chunk_size, valid=valid, return_lse=True)[2])


def _grad_call(args, outs, ups, needs):
    """(dk, dv, domega, dkey_weight), None where omega / key_weight is None, by the Triton backward kernels
    (every kernel backend), which recompute the softmaxes (no forward output); dlse None: no gradient
    into lse. Prepared per layout of the upstream gradients."""
    k, v, chunk_size, omega, key_weight, valid, scale = args
    dk, dv, domega, dkw = C.new_outputs(((k.shape, k.dtype), (v.shape, v.dtype),
                                         None if omega is None else (omega.shape, omega.dtype),
                                         None if key_weight is None else (key_weight.shape, key_weight.dtype)), k.device)
    dk_sum, dv_sum, dlse = _unit_last(ups[0]), _unit_last(ups[1]), ups[2]
    key = (dk_sum.stride(), dv_sum.stride(), None if dlse is None else (dlse.dtype, dlse.stride()))
    return (dk, dv, domega, dkw), key, (k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkw)


def _unfit(backend, k, *args):
    D = k.shape[3]
    if D > MAX_KERNEL_D:
        return f"k has head dim D={D}; the {backend} kernels support D <= {MAX_KERNEL_D} (use backend='reference')"
    return None


OPDEF = OpDef(
    name=OP, outputs=("k_sum", "v_sum", "lse"), optional_grads=("lse",), keep=("scale",), key=_key,
    normalize=_normalize, shapes=_shapes, reference=_reference, grad_call=_grad_call, unfit=_unfit, fill=_fill,
    schema="Tensor k, Tensor v, SymInt chunk_size, Tensor? omega, Tensor? key_weight, Tensor? valid, float scale",
    grads=GRAD_INPUTS, launches=lambda k, *args: k.numel() > 0,
    inputs=_kernel_inputs,
    features=lambda table, k, v, chunk_size, *args: _features(table, k, chunk_size),
    scalars=lambda k, v, chunk_size, omega, key_weight, valid, scale: dict(chunk_size=chunk_size, scale=scale),
).register()
# the tooling: run_backward's grad_outputs are (dk_sum, dv_sum) or (dk_sum, dv_sum, dlse); the forward runs
# so that a timed call costs what a training step does
problem_features, problem_features_bwd, run_kernel, run_backward = OPDEF.tooling()


def chunk_summaries(k: torch.Tensor, v: torch.Tensor, chunk_size: int, *, omega: Optional[torch.Tensor] = None,
                    key_weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto"):
    """Per-chunk summary keys and values of `k, v` ([B, Hkv, N, D]); see SPEC.md, op 1.

    Returns `(k_sum, v_sum)` of shape [B, Hkv, ceil(N / chunk_size), D], plus the fp32 per-chunk
    log-normaliser `lse` [B, Hkv, Nc] when `return_lse`. `backend` is "auto", "reference",
    "triton", "cuda" or "cupy". Differentiable in k, v, omega and key_weight (and through lse); the
    kernel backends' gradients come from the Triton backward kernels.
    """
    plan = OPDEF.plan(k, v, chunk_size, omega, key_weight, valid, scale, backend)
    args = (k, v, chunk_size, omega, key_weight, valid, plan.scale)
    out = OPDEF.run(plan, backend, args)
    if out is None:
        out = _reference(*args)
    return tuple(out) if return_lse else (out[0], out[1])


__all__ = ["chunk_summaries"]
