"""Op 3: the grouped expert matmul (`expert_matmul`) over a `Route` (ops/routing.py: `route`).

`expert_matmul` runs the gather -> per-expert GEMM -> scatter over the route's sorted pairs. Declared
once as an OpDef (ops/_opdef.py), the only module that knows every backend of this op. SPEC.md,
"Op 3", defines the math.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.autotune import space
from flashswitch.ops import call_plan
from flashswitch.ops._opdef import OpDef
from flashswitch.ops.routing import ROUTE_ENV, Route, _trusted, route  # noqa: F401  (ROUTE_ENV: bench/tools)
from flashswitch.reference.expert_matmul import torch_expert_matmul_op  # the reference of traced calls

OP = "expert_matmul"
OP_BWD = OP + ".bwd"  # the backward kernels' table in the tuned-config store and key in autotune/space.py
GRAD_INPUTS = ("x", "weight", "gates")  # the differentiable inputs, in run_backward's order


def _groups(route: Route, x: torch.Tensor, out_groups) -> tuple[int, int]:
    S = route.S
    G_in = 1 if x.dim() == 2 else x.shape[1]
    if G_in < 1 or S % G_in:
        raise ValueError(f"x has G_in = {G_in} input groups (shape {tuple(x.shape)}), which must divide "
                         f"the S = {S} slots of the route")
    if out_groups is None:
        G_out = S
    else:
        G_out = C.check_positive_int("out_groups", out_groups)
        if S % G_out:
            raise ValueError(f"out_groups = {G_out} must divide the S = {S} slots of the route")
    return G_in, G_out


def _validate(x, route, weight, gates, out_groups, deterministic):
    if not isinstance(route, Route):
        raise TypeError(f"route must be a flashswitch Route (from flashswitch.route), got {type(route).__name__}")
    C.check_tensor("x", x)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, d_in] or [T, G_in, d_in], got shape {tuple(x.shape)}")
    if route.device != x.device:
        raise ValueError(f"route is on {route.device} but x is on {x.device}; they must share one device")
    if x.shape[0] != route.T:
        raise ValueError(f"x has T = {x.shape[0]} tokens but the route has T = {route.T}")
    C.check_tensor("weight", weight, ndim=3, device=x.device, last_contiguous=False)
    if weight.dtype != x.dtype and not (weight.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}; weight must match x "
                        f"(or be float32 master weights with fp16/bf16 x)")
    if weight.shape[0] != route.E:
        raise ValueError(f"weight has {weight.shape[0]} experts (shape {tuple(weight.shape)}) but the route "
                         f"has num_experts = {route.E}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight has d_in = {weight.shape[1]} (shape {tuple(weight.shape)}) but x has "
                         f"d_in = {x.shape[-1]}")
    if gates is not None:
        C.check_tensor("gates", gates, ndim=2, device=x.device, last_contiguous=False)
        C.check_shape("gates", gates, (route.T, route.S))
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return _groups(route, x, out_groups)


def _features(table: str, x3: torch.Tensor, weight: torch.Tensor, S: int, G_out: int, flag: bool) -> dict:
    """The autotune bucket of `table`; `flag`: the forward's `deterministic`, the backward's gated (OP_BWD)."""
    T, G_in, d_in = x3.shape
    E, _, d_out = weight.shape
    flag = {"gated" if table == OP_BWD else "deterministic": bool(flag)}
    return space.features(table, dtype=C.DTYPE_NAMES[x3.dtype], wdtype=C.DTYPE_NAMES[weight.dtype], d_in=d_in,
                          d_out=d_out, E=E, S=S, G_in=G_in, G_out=G_out, tokens=T, **flag)


def _x3(x: torch.Tensor) -> torch.Tensor:
    """Kernels read x through a [T, G_in, d_in] view."""
    return x.unsqueeze(1) if x.dim() == 2 else x


# ---------------------------------------------------------------- the op's own parts of its OpDef
# the call's arguments: (x3, weight, gates, route, G_out, deterministic); the plan's: (x, weight, gates,
# route, out_groups, deterministic, backend); the custom op's: the route as its tensors and S
def _normalize(x, weight, gates, route, out_groups, deterministic):
    G_in, G_out = _validate(x, route, weight, gates, out_groups, deterministic)
    return _x3(x), weight, gates, route, G_out, deterministic


def _key(x, weight, gates, route, out_groups, deterministic, backend):
    """The route by its class, sizes and device: its tensors' dtypes and lengths are checked when it is
    made, its values by route.validate() on every call."""
    T, S = call_plan.tensor_key, call_plan.scalar_key
    rt = (route.__class__, route.T, route.S, route.E, route.offsets.device)
    return (T(x), T(weight), call_plan.optional_tensor_key(gates), rt, S(out_groups), S(deterministic), S(backend))


def _grad_call(args, outs, ups, needs):
    """(dx3, dweight, dgates) from the Triton backward kernels (every kernel backend uses them), None where
    not asked for (or gates None); prepared per wanted set. dweight is exactly zero for experts with no
    pairs; bitwise reproducible (no float atomics, fixed-order sums)."""
    x3, weight, gates, rt, G_out, deterministic = args
    dx, dw, dg = C.new_outputs(((x3.shape, x3.dtype) if needs[0] else None, (weight.shape, weight.dtype) if needs[1]
                                else None, (gates.shape, gates.dtype) if needs[2] and gates is not None else None),
                               x3.device)
    want = (dx is not None and dx.numel() > 0, dw is not None and dw.numel() > 0, dg is not None and dg.numel() > 0)
    if not (want[0] or want[1] or want[2]):
        return (dx, dw, dg), None, None
    dy = ups[0].to(x3.dtype).contiguous()  # e.g. the expanded (stride 0) gradient of y.sum()
    return (dx, dw, dg), want, (x3, weight, gates, rt, dy, dx if want[0] else None, dw if want[1] else None,
                                dg if want[2] else None)


def _grad_prepare(args, want, tensors):
    """The backward's prepare reads dy's metadata only (a meta tensor) and the wanted set."""
    dy = tensors[4]
    return (*tensors[:4], torch.empty(dy.shape, dtype=dy.dtype, device="meta"), *want), \
        dict(G_in=args[0].shape[1], G_out=args[4])


def _reference(x3, weight, gates, rt, G_out, deterministic):
    from flashswitch.reference.expert_matmul import torch_expert_matmul
    return torch_expert_matmul(x3, rt.expert_idx, weight, gates=gates, out_groups=G_out, check=False)


OPDEF = OpDef(
    name=OP, outputs=("y",), key=_key, normalize=_normalize, grads=("x3", "weight", "gates"),
    grad_inputs=GRAD_INPUTS, keep=("G_out",), partial=True, reference=_reference, grad_call=_grad_call,
    grad_prepare=_grad_prepare, args=("x3", "weight", "gates", "route", "G_out", "deterministic"),
    schema="Tensor x3, Tensor weight, Tensor? gates, Tensor token, Tensor slot, Tensor offsets, SymInt S, "
           "SymInt G_out, bool deterministic",
    inputs=("x3", "weight", "gates", "route"),
    shapes=lambda x3, weight, gates, rt, G_out, det: [((x3.shape[0], G_out, weight.shape[2]), x3.dtype)],
    features=lambda table, x3, weight, gates, rt, G_out, det: _features(
        table, x3, weight, rt.S, G_out, gates is not None if table == OP_BWD else det),
    scalars=lambda x3, weight, gates, rt, G_out, det: dict(G_in=x3.shape[1], G_out=G_out, deterministic=det),
    problem=lambda x, expert_idx, num_experts, weight, gates=None, out_groups=None, deterministic=False: _normalize(
        x, weight, gates, route(expert_idx, num_experts, check=False), out_groups, deterministic),
    to_op=lambda x3, weight, gates, rt, G_out, det: (x3, weight, gates, rt.token, rt.slot, rt.offsets, rt.S, G_out,
                                                     det),
    from_op=lambda x3, weight, gates, token, slot, offsets, S, G_out, det: (x3, weight, gates, _trusted(Route(
        token=token, slot=slot, offsets=offsets, expert_idx=None, T=x3.shape[0], S=S, E=offsets.numel() - 1)),
        G_out, det),
).register()
# the tooling (routing without its range check: no host sync, what a CUDA-graph-captured step pays)
problem_features, problem_features_bwd, run_kernel, run_backward = OPDEF.tooling()


def expert_matmul(x: torch.Tensor, route: Route, weight: torch.Tensor, *, gates: Optional[torch.Tensor] = None,
                  out_groups: Optional[int] = None, deterministic: bool = False, backend: str = "auto") -> torch.Tensor:
    """Grouped expert matmul over the routed pairs of `route`; see SPEC.md, op 3.

    x: [T, d_in] (every slot of token t reads row t) or [T, G_in, d_in] (slot s reads row
    (t, s // (S / G_in))). weight: [E, d_in, d_out], any strides, x's dtype or float32 (master
    weights, cast in the kernel) with fp16/bf16 x. gates: None or [T, S] (float). out_groups: G_out
    dividing S (default S). Returns y [T, G_out, d_out] in x's dtype:
    y[t, g] = Σ_{s: s // (S / G_out) = g} gates[t, s] · x_row(t, s) @ weight[expert_idx[t, s]].

    `deterministic=True` makes the slot reduction (G_out < S) run in a fixed order, so repeated
    calls give bitwise-identical results (slower: per-pair fp32 rows go through memory). Without it
    a tuned config may round each pair's gated product to x's dtype before the slot sum, as a
    grouped_mm pipeline does (config PARTIALS, kernels_triton/expert_matmul.py); the products
    themselves always accumulate in fp32.
    `backend`: "auto", "reference", "triton", "cuda" or "cupy".

    Differentiable in x, weight and gates (SPEC.md, "Backward"): every kernel backend runs the Triton
    backward kernels (kernels_triton/expert_matmul_bwd.py), deterministic whatever `deterministic`
    says; dweight has weight's dtype (fp32 master weights get fp32 gradients) and is zero for experts
    with no pairs; the reference backend differentiates the torch reference.
    """
    plan = OPDEF.plan(x, weight, gates, route, out_groups, deterministic, backend)
    if not torch.compiler.is_compiling():
        route.validate()  # a hand-built route, once (routes from route() are known good)
    if plan.kernels:
        y = OPDEF.run(plan, backend, (_x3(x), weight, gates, route, plan.G_out, deterministic))
        if y is not None:
            return y
    if route.expert_idx is None:
        raise ValueError("the reference backend needs a route built by flashswitch.route (with expert_idx)")
    if torch.compiler.is_compiling():
        return torch_expert_matmul_op(x, route.expert_idx, weight, gates, plan.G_out)  # one opaque op
    from flashswitch.reference.expert_matmul import torch_expert_matmul
    # ids outside [0, E) dropped, as the kernels do: route(check=True) has already refused them
    return torch_expert_matmul(x, route.expert_idx, weight, gates=gates, out_groups=out_groups, check=False)


__all__ = ["Route", "route", "expert_matmul"]
