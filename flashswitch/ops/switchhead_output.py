"""SwitchHead's fused output projection (`switchhead_output`): op 3's SwitchHead O case as one dense GEMM over
every expert of each head, declared once as an OpDef (ops/_opdef.py). SPEC.md, "SwitchHead's output
projection (fused)", defines the math; kernels_triton/switchhead_output(_bwd).py holds the kernels, which
only the triton backend has (the others: named, they raise; through FLASHSWITCH_BACKEND, the reference).
"""
from __future__ import annotations

import torch

from flashswitch import _common as C
from flashswitch.autotune import space
from flashswitch.ops import call_plan
from flashswitch.ops._opdef import OpDef

OP = "switchhead_output"
OP_BWD = OP + ".bwd"
GRAD_INPUTS = ("a", "gates", "weight")  # the differentiable inputs, in run_backward's order
INDEX_DTYPES = (torch.int32, torch.int64)


def _validate(a, ids, gates, weight, num_experts, check):
    C.check_tensor("a", a, ndim=3)
    E = C.check_positive_int("num_experts", num_experts)
    T, H, D = a.shape
    if H < 1:
        raise ValueError(f"a must have at least one head, got shape {tuple(a.shape)}")
    C.check_tensor("weight", weight, ndim=3, device=a.device, last_contiguous=False)
    if weight.dtype != a.dtype and not (weight.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)):
        raise TypeError(f"weight has dtype {weight.dtype} but a has {a.dtype}; weight must match a "
                        f"(or be float32 master weights with fp16/bf16 a)")
    if weight.shape[0] != H * E:
        raise ValueError(f"weight has {weight.shape[0]} experts (shape {tuple(weight.shape)}) but a has H = {H} "
                         f"heads of num_experts = {E}: expected H * num_experts = {H * E}")
    if weight.shape[1] != D:
        raise ValueError(f"weight has d_head = {weight.shape[1]} (shape {tuple(weight.shape)}) but a has "
                         f"d_head = {D}")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"ids has dtype {ids.dtype}; expected int32 or int64")
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"ids must be [T, S] with T = {T} (a's tokens), got shape {tuple(ids.shape)}")
    if ids.device != a.device:
        raise ValueError(f"ids is on {ids.device}, expected {a.device} (all inputs must share one device)")
    C.check_tensor("gates", gates, ndim=2, device=a.device, last_contiguous=False)
    C.check_shape("gates", gates, ids.shape)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")


def _check_ids(ids: torch.Tensor, num_columns: int) -> None:
    """Every id in [0, H·E): the one host sync, on every call that asks (values make no plan key)."""
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()
        if lo < 0 or hi >= num_columns:
            raise ValueError(f"ids values {lo}..{hi} out of range [0, H * num_experts) = [0, {num_columns})")


# ---------------------------------------------------------------- the op's own parts of its OpDef
# the call's arguments (also the custom op's): a, ids, gates, weight (E = weight's experts / a's heads); the
# plan's: a, ids, gates, weight, num_experts, check, backend
def _normalize(a, ids, gates, weight, num_experts, check=True):
    _validate(a, ids, gates, weight, num_experts, check)
    return a, ids, gates, weight


def _key(a, ids, gates, weight, num_experts, check, backend):
    T, S = call_plan.tensor_key, call_plan.scalar_key
    return (T(a), T(ids), T(gates), T(weight), S(num_experts), S(check), S(backend))


def _features(table: str, a, ids, gates, weight) -> dict:
    """The autotune bucket of `table` (OP or OP_BWD)."""
    T, H, D = a.shape
    HE, _, d = weight.shape
    return space.features(table, dtype=C.DTYPE_NAMES[a.dtype], wdtype=C.DTYPE_NAMES[weight.dtype], H=H, E=HE // H,
                          D=D, d=d, tokens=T)


def _reference(a, ids, gates, weight):
    from flashswitch.reference.switchhead_output import torch_switchhead_output
    return torch_switchhead_output(a, ids, gates, weight, weight.shape[0] // a.shape[1])


def _grad_call(args, outs, ups, needs):
    """(da, dgates, dweight) from the Triton backward kernels, None where not asked for; prepared per
    layout of dy and wanted set. Deterministic (no float atomics); dweight in weight's dtype."""
    a, ids, gates, weight = args
    grads = C.new_outputs(((a.shape, a.dtype) if needs[0] else None, (gates.shape, gates.dtype) if needs[1] else None,
                           (weight.shape, weight.dtype) if needs[2] else None), a.device)
    want = tuple(bool(n) for n in needs)
    if not any(want):
        return grads, None, None
    dy = ups[0].to(a.dtype)
    if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
        dy = dy.contiguous()
    return grads, (dy.stride(), want), (a, ids, gates, weight, dy, *grads)


def _grad_prepare(args, key, tensors):
    """The backward's prepare reads dy's metadata only (a meta tensor) and the wanted set."""
    dy = tensors[4]
    return (*tensors[:4], torch.empty(dy.shape, dtype=dy.dtype, device="meta"), *key[1]), {}


OPDEF = OpDef(
    name=OP, schema="Tensor a, Tensor ids, Tensor gates, Tensor weight", outputs=("y",), key=_key,
    normalize=_normalize, grads=GRAD_INPUTS, partial=True, reference=_reference, grad_call=_grad_call,
    grad_prepare=_grad_prepare, kernel_backends=("triton",),
    shapes=lambda a, ids, gates, weight: [((a.shape[0], weight.shape[2]), a.dtype)],
    features=_features, scalars=lambda *args: {},
    # the custom op's calls plan as an eager call without the ids check (the caller has made it)
    replan=lambda a, ids, gates, weight, backend: (a, ids, gates, weight, weight.shape[0] // a.shape[1], False,
                                                   backend),
).register()
problem_features, problem_features_bwd, run_kernel, run_backward = OPDEF.tooling()


@torch.compiler.assume_constant_result  # an environment read: torch.compile takes the answer as a constant
def runs_kernels(backend: str, device: str) -> bool:
    """Whether a call with `backend` on `device` runs this op's kernels rather than its torch reference:
    the calls' own backend choice (call_plan.resolve_backend, FLASHSWITCH_BACKEND included); False for a
    backend that cannot run it here."""
    try:
        return call_plan.resolve_backend(OP, backend, torch.device(device), None, OPDEF.kernel_backends) != "reference"
    except ValueError:
        return False


def switchhead_output(a: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor,
                      num_experts: int, *, check: bool = True, backend: str = "auto") -> torch.Tensor:
    """SwitchHead's gated output projection over the routed experts of each head, as one dense GEMM.

    a: [T, H, D] attention output (fp16 / bf16 / fp32, unit last stride). weight: [H·E, D, d]
    (E = num_experts per head; a's dtype, or fp32 master weights with 16-bit a, cast in the kernel).
    ids: int32/int64 [T, S], global expert ids h·E + e. gates: float [T, S]. Returns y [T, d] in a's
    dtype:
        y[t] = Σ_s gates[t, s] · a[t, ids[t, s] // E] @ weight[ids[t, s]]
    (duplicate ids of a token add up). With SwitchHeadAttention's routing (slot s = h·k + j holds an
    expert of head h) this is expert_matmul(a, route(ids, H·E), weight, gates=gates, out_groups=1),
    computed as y = Z · W_cat over all H·E·D rows of weight with zero gates where a token picked no
    expert: E / k times the routed multiply-adds as one dense GEMM, no slot reduction, no routing.

    check=True: one host sync checks that every id lies in [0, H·E) (ValueError naming ids); pass
    False for CUDA-graph capture and torch.compile, where out-of-range ids are dropped. backend: "auto",
    "triton" (also on the CPU under TRITON_INTERPRET=1) or "reference"; the cuda and cupy backends have
    no kernels of this op.

    Differentiable in a, gates and weight (the kernels' backward is deterministic: no float atomics);
    weight's gradient has weight's dtype.
    """
    plan = OPDEF.plan(a, ids, gates, weight, num_experts, check, backend)
    if check:
        _check_ids(ids, weight.shape[0])
    args = (a, ids, gates, weight)
    y = OPDEF.run(plan, backend, args)
    return _reference(*args) if y is None else y


__all__ = ["switchhead_output", "runs_kernels"]
