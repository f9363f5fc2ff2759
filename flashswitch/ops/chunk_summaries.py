"""Op 1: chunked control-variate key/value summaries (EVA).

validate -> normalize -> pick backend -> torch.library op. The only module that knows every backend
of this op. SPEC.md, "Op 1", defines the math.

Backward: the custom op's autograd formula calls a second custom op, `chunk_summaries_backward`,
which runs the Triton backward kernels (kernels_triton/chunk_summaries_bwd.py) for every kernel
backend (triton, cuda, cupy); the reference backend is differentiated by autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch import backends
from flashswitch.autotune import space
from flashswitch.ops import call_plan

OP = "chunk_summaries"
OP_BWD = OP + ".bwd"
MAX_KERNEL_D = 256
GRAD_INPUTS = ("k", "v", "omega", "key_weight")  # what run_backward returns, in this order


def _features(table: str, k: torch.Tensor, chunk_size: int) -> dict:
    """The autotune bucket of `table` (OP or OP_BWD)."""
    B, H, N, D = k.shape
    return space.features(table, dtype=C.DTYPE_NAMES[k.dtype], D=D, C=chunk_size, rows=B * H * N)


def _run_backend(backend: str, k, v, chunk_size, omega, key_weight, valid, scale, config=None, enqueue=None):
    """(k_sum, v_sum, lse) from `backend`'s launcher, or from `enqueue` (a call plan's prepared launch);
    config: complete (call_plan), None: looked up."""
    B, H, N, D = k.shape
    omega = _kernel_view(k, chunk_size, omega)
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
    if enqueue is None:
        if config is None:
            config = call_plan.config(OP, backend, _features(OP, k, chunk_size))
        enqueue = call_plan.forward_launch(OP, backend, config, dict(chunk_size=chunk_size, scale=scale))
    enqueue(k, v, omega, key_weight, valid, k_sum, v_sum, lse)
    return k_sum, v_sum, lse


@torch.library.custom_op("flashswitch::chunk_summaries", mutates_args=())
def _chunk_summaries_op(k: torch.Tensor, v: torch.Tensor, chunk_size: int, omega: Optional[torch.Tensor],
                        key_weight: Optional[torch.Tensor], valid: Optional[torch.Tensor], scale: float,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # a traced caller's call runs the eager calls' plan: the prepared launch, no per-call config lookup
    plan = _cached_plan(k, v, chunk_size, omega, key_weight, valid, scale, backend)
    return _run_backend(plan.backend, k, v, chunk_size, omega, key_weight, valid, scale, plan.config, plan.enqueue)


@_chunk_summaries_op.register_fake
def _(k, v, chunk_size, omega, key_weight, valid, scale, backend):
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    return (k.new_empty((B, H, Nc, D)), v.new_empty((B, H, Nc, D)),
            k.new_empty((B, H, Nc), dtype=torch.float32))


# ---------------------------------------------------------------- backward
def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """Gradients may come as expanded views (loss = out.sum()): kernels need a unit last stride."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _run_backward(backend: str, dk_sum, dv_sum, dlse, k, v, chunk_size, omega, key_weight, valid, scale,
                  config=None, plan: Optional["_Plan"] = None):
    """(dk, dv, domega, dkey_weight), None where omega / key_weight is None. Every kernel backend runs
    the Triton backward kernels. omega: None, [Hkv, D] or [B, Hkv, Nc, D]; dlse: None = no gradient
    into lse. config: complete (call_plan), None: looked up; plan: the call plan whose prepared
    launches to use."""
    dk = C.new_output(tuple(k.shape), k.dtype, k.device)
    dv = C.new_output(tuple(v.shape), v.dtype, v.device)
    domega = None if omega is None else C.new_output(tuple(omega.shape), omega.dtype, omega.device)
    dkw = None if key_weight is None else C.new_output(tuple(key_weight.shape), key_weight.dtype, k.device)
    dk_sum, dv_sum = _unit_last(dk_sum), _unit_last(dv_sum)
    tensors = (k, v, omega, key_weight, valid, dk_sum, dv_sum, dlse, dk, dv, domega, dkw)
    # the prepared launch per layout of the upstream gradients
    key = (dk_sum.stride(), dv_sum.stride(), None if dlse is None else (dlse.dtype, dlse.stride()))
    enqueue = None if plan is None else plan.backward.get(key)
    if enqueue is None:
        enqueue = call_plan.backward_launch(OP, backend, plan, key, config, (_features, k, chunk_size), *tensors,
                                            chunk_size=chunk_size, scale=scale)
    enqueue(*tensors)
    return dk, dv, domega, dkw


@torch.library.custom_op("flashswitch::chunk_summaries_backward", mutates_args=())
def _chunk_summaries_backward_op(dk_sum: torch.Tensor, dv_sum: torch.Tensor, dlse: Optional[torch.Tensor],
                                 k: torch.Tensor, v: torch.Tensor, chunk_size: int, omega: Optional[torch.Tensor],
                                 key_weight: Optional[torch.Tensor], valid: Optional[torch.Tensor], scale: float,
                                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _cached_plan(k, v, chunk_size, omega, key_weight, valid, scale, backend)
    dk, dv, domega, dkw = _run_backward(plan.backend, dk_sum, dv_sum, dlse, k, v, chunk_size, omega, key_weight,
                                        valid, scale, plan=plan)
    return dk, dv, call_plan.absent(k) if domega is None else domega, call_plan.absent(k) if dkw is None else dkw


@_chunk_summaries_backward_op.register_fake
def _(dk_sum, dv_sum, dlse, k, v, chunk_size, omega, key_weight, valid, scale, backend):
    return (torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            k.new_empty(0) if omega is None else omega.new_empty(omega.shape),
            k.new_empty(0) if key_weight is None else key_weight.new_empty(key_weight.shape))


def _setup_context(ctx, inputs, output):
    k, v, chunk_size, omega, key_weight, valid, scale, backend = inputs
    ctx.save_for_backward(k, v, omega, key_weight, valid)  # the backward recomputes the softmaxes
    ctx.chunk_size, ctx.scale, ctx.backend = chunk_size, scale, backend


def _upstream(k, v, chunk_size, dk_sum, dv_sum):
    """The summaries' gradients, zeros for an unused one (autograd passes None)."""
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    return (k.new_zeros((B, H, Nc, D)) if dk_sum is None else dk_sum,
            v.new_zeros((B, H, Nc, D)) if dv_sum is None else dv_sum)


def _backward(ctx, dk_sum, dv_sum, dlse):
    k, v, omega, key_weight, valid = ctx.saved_tensors
    dk_sum, dv_sum = _upstream(k, v, ctx.chunk_size, dk_sum, dv_sum)
    dk, dv, domega, dkw = _chunk_summaries_backward_op(dk_sum, dv_sum, dlse, k, v, ctx.chunk_size, omega,
                                                       key_weight, valid, ctx.scale, ctx.backend)
    return (dk, dv, None, None if omega is None else domega, None if key_weight is None else dkw,
            None, None, None)


_chunk_summaries_op.register_autograd(_backward, setup_context=_setup_context)


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
    return _features(OP, k, chunk_size)


def problem_features_bwd(k, v, chunk_size, omega=None, key_weight=None, valid=None, scale=None) -> dict:
    """The backward pass's autotune bucket of a problem (keyword arguments as `chunk_summaries` takes them)."""
    return _features(OP_BWD, k, chunk_size)


def run_kernel(backend: str, config: dict, k, v, chunk_size, omega=None, key_weight=None, valid=None,
               scale=None):
    """One kernel call with an explicit config, for the tuner and the benchmarks: (k_sum, v_sum, lse)."""
    scale = _validate(k, v, chunk_size, omega, key_weight, valid, scale)
    if config is not None:
        config = call_plan.complete_config(OP, backend, _features(OP, k, chunk_size), config)
    return _run_backend(backend, k, v, chunk_size, omega, key_weight, valid, scale, config)


def run_backward(backend: str, config, grad_outputs, k, v, chunk_size, omega=None, key_weight=None, valid=None,
                 scale=None) -> tuple:
    """The forward (tuned or default config), then the backward kernels with an explicit `config`
    (None: the tuned one), for the tuner and the benchmarks: one training step of the op. Returns the
    gradients named by GRAD_INPUTS, None for inputs absent from the problem.

    grad_outputs: (dk_sum, dv_sum) or (dk_sum, dv_sum, dlse). The backward kernels use no forward
    output (they recompute the softmaxes from the inputs); the forward runs so that a timed call
    costs what a training step does. The reference backend differentiates the torch reference.
    """
    scale = _validate(k, v, chunk_size, omega, key_weight, valid, scale)
    dk_sum, dv_sum, dlse = (tuple(grad_outputs) + (None,))[:3]
    if not backends.TABLE[backend].kernels:
        from flashswitch.reference.chunk_summaries import torch_chunk_summaries
        inputs = {"k": k, "v": v, "omega": omega, "key_weight": key_weight}
        leaves = {n: t.detach().requires_grad_(True) for n, t in inputs.items() if t is not None}
        with torch.enable_grad():
            out = torch_chunk_summaries(chunk_size=chunk_size, valid=valid, scale=scale, return_lse=True,
                                        **{**inputs, **leaves})
            pairs = [(o, g) for o, g in zip(out, (dk_sum, dv_sum, dlse)) if g is not None]
            grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs],
                                        allow_unused=True)
        got = dict(zip(leaves, grads))
        return tuple(got.get(n) for n in GRAD_INPUTS)
    with torch.no_grad():
        _run_backend(backend, k, v, chunk_size, omega, key_weight, valid, scale)
        return _run_backward(backend, dk_sum, dv_sum, dlse, k, v, chunk_size, omega, key_weight, valid, scale,
                             config)


def chunk_summaries(k: torch.Tensor, v: torch.Tensor, chunk_size: int, *, omega: Optional[torch.Tensor] = None,
                    key_weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto"):
    """Per-chunk summary keys and values of `k, v` ([B, Hkv, N, D]); see SPEC.md, op 1.

    Returns `(k_sum, v_sum)` of shape [B, Hkv, ceil(N / chunk_size), D], plus the fp32 per-chunk
    log-normaliser `lse` [B, Hkv, Nc] when `return_lse`. `backend` is "auto", "reference",
    "triton", "cuda" or "cupy". Differentiable in k, v, omega and key_weight (and through lse); the
    kernel backends' gradients come from the Triton backward kernels.
    """
    plan = _cached_plan(k, v, chunk_size, omega, key_weight, valid, scale, backend)
    if not plan.kernels or not C.kernels_serve(backend, k, v, omega, key_weight):
        from flashswitch.reference.chunk_summaries import torch_chunk_summaries
        out = torch_chunk_summaries(k, v, chunk_size, omega=omega, key_weight=key_weight, valid=valid,
                                    scale=plan.scale, return_lse=True)
    elif C.eager_fast_path(k, v, omega, key_weight, valid):
        out = _run_backend(plan.backend, k, v, chunk_size, omega, key_weight, valid, plan.scale, plan.config,
                           plan.enqueue)
    elif C.eager_autograd_path(k, v, omega, key_weight, valid):
        out = _EagerAutograd.apply(plan, k, v, chunk_size, omega, key_weight, valid)
    else:
        out = _chunk_summaries_op(k, v, chunk_size, omega, key_weight, valid, plan.scale, plan.backend)
    return tuple(out) if return_lse else (out[0], out[1])


class _EagerAutograd(torch.autograd.Function):
    """An eager call that needs gradients (C.eager_autograd_path): the custom op's forward and backward
    with the call plan's prepared launch and backward config, without the dispatcher layers."""

    @staticmethod
    def forward(ctx, plan, k, v, chunk_size, omega, key_weight, valid):
        ctx.set_materialize_grads(False)  # an unused output gets no gradient tensor
        ctx.save_for_backward(k, v, omega, key_weight, valid)  # the backward recomputes the softmaxes
        ctx.plan, ctx.chunk_size = plan, chunk_size
        return _run_backend(plan.backend, k, v, chunk_size, omega, key_weight, valid, plan.scale, plan.config,
                            plan.enqueue)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dk_sum, dv_sum, dlse):
        k, v, omega, key_weight, valid = ctx.saved_tensors
        dk_sum, dv_sum = _upstream(k, v, ctx.chunk_size, dk_sum, dv_sum)
        plan = ctx.plan
        dk, dv, domega, dkw = _run_backward(plan.backend, dk_sum, dv_sum, dlse, k, v, ctx.chunk_size, omega,
                                            key_weight, valid, plan.scale, plan=plan)
        return None, dk, dv, None, domega, dkw, None


# ---------------------------------------------------------------- call plans
@dataclass(frozen=True, kw_only=True)
class _Plan(call_plan.Plan):
    scale: float


_PLANS = call_plan.PlanCache()


def _call_key(k, v, chunk_size, omega, key_weight, valid, scale, backend):
    T, O, S = call_plan.tensor_key, call_plan.optional_tensor_key, call_plan.scalar_key
    return (T(k), T(v), S(chunk_size), O(omega), O(key_weight), O(valid), S(scale), S(backend))


def _cached_plan(k, v, chunk_size, omega, key_weight, valid, scale, backend) -> _Plan:
    """The plan of a call, kept for the next call with the same metadata."""
    key = call_plan.key_or_none(_call_key, k, v, chunk_size, omega, key_weight, valid, scale, backend)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(k, v, chunk_size, omega, key_weight, valid, scale, backend)
        _PLANS.put(key, plan)
    return plan


def _plan(k, v, chunk_size, omega, key_weight, valid, scale, backend) -> _Plan:
    """Every check, the backend, the config and the forward launch: the uncached part of a call."""
    scale = _validate(k, v, chunk_size, omega, key_weight, valid, scale)
    B, H, N, D = k.shape
    if D > MAX_KERNEL_D and backend == "auto":
        backend = "reference"
    backend, bucket = call_plan.resolve(OP, backend, k.device, _features, k, chunk_size)
    if backends.TABLE[backend].kernels and D > MAX_KERNEL_D:
        raise ValueError(f"k has head dim D={D}; the {backend} kernels support D <= {MAX_KERNEL_D} "
                         f"(use backend='reference')")
    Nc = -(-N // chunk_size)
    outputs = [torch.empty(shape, dtype=dtype, device="meta")  # only their shapes, strides and dtypes are read
               for shape, dtype in (((B, H, Nc, D), k.dtype), ((B, H, Nc, D), v.dtype), ((B, H, Nc), torch.float32))]
    launch = (dict(chunk_size=chunk_size, scale=scale), (k, v, _kernel_view(k, chunk_size, omega), key_weight, valid),
              outputs) if B * H * N and D else None
    return call_plan.kernel_plan(_Plan, OP, backend, bucket, (_features, k, chunk_size), launch, scale=scale)


__all__ = ["chunk_summaries"]
