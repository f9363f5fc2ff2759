"""Op 3: routing (`route`) and the grouped expert matmul (`expert_matmul`).

`route` sorts the (token, slot) pairs of a routing decision by expert on the device, with no host
synchronisation (optional range check aside); `expert_matmul` runs the gather -> per-expert GEMM ->
scatter over a `Route`. The only module that knows every backend of this op. SPEC.md, "Op 3",
defines the math.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch import backends
from flashswitch.autotune import space
from flashswitch.ops import call_plan

OP = "expert_matmul"
OP_BWD = OP + ".bwd"  # the backward kernels' table in the tuned-config store and key in autotune/space.py
GRAD_INPUTS = ("x", "weight", "gates")  # the differentiable inputs, in run_backward's order
INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_PAIRS = 2 ** 31 - 1


# ---------------------------------------------------------------- routing
@dataclass(frozen=True, eq=False)
class Route:
    """The pairs p = (t, s) of an `expert_idx` [T, S], stably sorted by expert (ties keep p = t·S + s order).

    Tensors (all on expert_idx's device, computed without a host sync):
    - `token`, `slot`: int32 [P] (P = T·S): the token and slot of the i-th pair in expert order.
      Within one expert the pairs are in increasing (t, s) order.
    - `offsets`: int64 [E+1]: expert e owns sorted positions [offsets[e], offsets[e+1]).
    - `expert_idx`: the [T, S] tensor the route was built from (the reference backend reads it;
      None in routes rebuilt from the sorted tensors alone).
    Sizes: `T`, `S`, `E` (= num_experts).

    The backward pass needs `token`, `slot` and `offsets` (d weight[e] = Σ over expert e's rows of
    x_rowᵀ·dy_row, exactly zero for an empty expert; d x and d gates gather the same rows) and
    `position` (the inverse permutation: sorted position of pair t·S + s), computed lazily.

    A Route built by hand is checked when it is made (dtypes, devices, lengths: TypeError / ValueError
    naming the field) and its values once, the first time `expert_matmul` uses it (`validate()`: one
    host sync; call it beforehand to keep the sync out of a CUDA-graph capture). Routes from `route()`
    need no value check.
    """
    token: torch.Tensor
    slot: torch.Tensor
    offsets: torch.Tensor
    expert_idx: Optional[torch.Tensor]
    T: int
    S: int
    E: int

    def __post_init__(self):
        for name in ("T", "S", "E"):
            v = getattr(self, name)
            if isinstance(v, torch.SymInt):  # traced with dynamic shapes: checked when it runs
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "T" else 1):
                raise ValueError(f"Route.{name} must be an int >= {0 if name == 'T' else 1}, got {v!r}")
        P = self.T * self.S
        for name, dtype, n in (("token", torch.int32, P), ("slot", torch.int32, P), ("offsets", torch.int64, self.E + 1)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Route.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"Route.{name} has dtype {t.dtype}; expected {dtype}")
            if tuple(t.shape) != (n,):
                raise ValueError(f"Route.{name} has shape {tuple(t.shape)}; expected ({n},)")
            if t.device != self.offsets.device:
                raise ValueError(f"Route.{name} is on {t.device} but offsets is on {self.offsets.device}")
        if self.expert_idx is not None and (not isinstance(self.expert_idx, torch.Tensor)
                                            or tuple(self.expert_idx.shape) != (self.T, self.S)):
            raise ValueError(f"Route.expert_idx must be None or a [T, S] = [{self.T}, {self.S}] tensor")

    def validate(self) -> "Route":
        """Check the values (one host sync): offsets start at 0, never decrease and end within the pairs;
        tokens and slots are in range. Raises ValueError naming the field; returns the route."""
        if not getattr(self, "_values_ok", False):
            P = self.T * self.S
            off = self.offsets
            bad = None
            if off.numel() and (int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()) or int(off[-1]) > P):
                bad = f"Route.offsets must start at 0, never decrease and end at most at the {P} pairs"
            elif P and (bool(((self.token < 0) | (self.token >= self.T)).any())
                        or bool(((self.slot < 0) | (self.slot >= self.S)).any())):
                bad = f"Route.token / Route.slot hold values outside [0, T) = [0, {self.T}) / [0, S) = [0, {self.S})"
            if bad:
                raise ValueError(bad)
            object.__setattr__(self, "_values_ok", True)
        return self

    @property
    def num_pairs(self) -> int:
        return self.T * self.S

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def counts(self) -> torch.Tensor:
        """int64 [E]: pairs per expert (device tensor, no sync)."""
        return self.offsets[1:] - self.offsets[:-1]

    @functools.cached_property
    def position(self) -> torch.Tensor:
        """int32 [T·S]: the sorted position of pair p = t·S + s (device, no sync)."""
        P = self.num_pairs
        pos = torch.empty(P, dtype=torch.int32, device=self.device)
        pair = self.token.to(torch.int64) * self.S + self.slot.to(torch.int64)
        pos[pair] = torch.arange(P, dtype=torch.int32, device=self.device)
        return pos


def _sort_key_dtype(E: int) -> torch.dtype:
    """The narrowest signed dtype holding [0, E]: fewer radix passes in the device sort."""
    if E + 1 <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def route(expert_idx: torch.Tensor, num_experts: int, *, check: bool = True) -> Route:
    """Sort the routed (token, slot) pairs of `expert_idx` [T, S] (int32/int64, values in [0, E)) by expert.

    Runs on expert_idx's device with no host synchronisation, except the range check of
    `check=True` (one sync; raises ValueError when an id is outside [0, num_experts)). Pass
    `check=False` inside CUDA-graph capture and torch.compile(fullgraph=True): out-of-range ids are
    then dropped from the route (pairs below 0 or at/above E belong to no expert) and their outputs
    are unspecified.
    """
    if not isinstance(expert_idx, torch.Tensor):
        raise TypeError(f"expert_idx must be a torch.Tensor, got {type(expert_idx).__name__}")
    if expert_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"expert_idx has dtype {expert_idx.dtype}; expected int32 or int64")
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [T, S] (2 dims), got shape {tuple(expert_idx.shape)}")
    E = C.check_positive_int("num_experts", num_experts)
    if E >= 2 ** 31 - 1:
        raise ValueError(f"num_experts must be < 2**31 - 1, got {E}")
    T, S = expert_idx.shape
    if S < 1:
        raise ValueError(f"expert_idx must have at least one slot per token, got shape {tuple(expert_idx.shape)}")
    P = T * S
    if P > _MAX_PAIRS:
        raise ValueError(f"expert_idx has {P} pairs; at most 2**31 - 1 are supported")
    dev = expert_idx.device
    if check and P:
        lo, hi = torch.stack(torch.aminmax(expert_idx)).tolist()  # the one sync
        if lo < 0 or hi >= E:
            raise ValueError(f"expert_idx values {lo}..{hi} out of range [0, num_experts) = [0, {E})")

    # is_compiling first: the availability check imports the extension, which a traced graph cannot
    if dev.type == "cuda" and not torch.compiler.is_compiling() and _device_route_wanted():
        token, slot, offsets = torch.ops.flashswitch_C.route_fwd(expert_idx, E)  # one call, no sync
    else:
        token, slot, offsets = _torch_route(expert_idx, E, clamp=not check)
    if torch.compiler.is_compiling():
        # dynamo (torch 2.11) cannot trace the __dict__ update below; the constructor's checks run at trace time only
        return _trusted(Route(token=token, slot=slot, offsets=offsets, expert_idx=expert_idx, T=T, S=S, E=E))
    # every field right by construction: Route's checks (__post_init__, several microseconds) skipped
    rt = Route.__new__(Route)
    rt.__dict__.update(token=token, slot=slot, offsets=offsets, expert_idx=expert_idx, T=T, S=S, E=E)
    return _trusted(rt)


def _trusted(rt: Route) -> Route:
    """A route whose values are right by construction (route(), or rebuilt inside the custom ops)."""
    object.__setattr__(rt, "_values_ok", True)
    return rt


ROUTE_ENV = "FLASHSWITCH_ROUTE"  # "device" (default): the extension's one-call sort; "torch": torch ops


def _device_route_wanted() -> bool:
    """The extension has the device routing op (kernels_cuda/route.cu) and FLASHSWITCH_ROUTE is not
    "torch": one C++ call instead of ~8 torch launches, most of route()'s cost on a slow host. Both
    give the same route (bitwise, tests/test_expert_matmul_cuda.py)."""
    return C.env_get(ROUTE_ENV) != "torch" and _device_route_available()


@functools.lru_cache(maxsize=None)
def _device_route_available() -> bool:
    from flashswitch.bindings import cuda as B
    return B.available() and hasattr(torch.ops.flashswitch_C, "route_fwd")


def _torch_route(expert_idx: torch.Tensor, E: int, *, clamp: bool = True):
    """(token, slot, offsets) with torch ops: the same order as route_fwd (a stable sort of the ids
    clamped to [-1, E]). `clamp=False` when the ids are known to lie in [0, E)."""
    S = expert_idx.shape[1]
    key_dtype = _sort_key_dtype(E)
    flat = expert_idx.reshape(-1)
    if clamp:
        flat = flat.clamp(-1, E)  # out-of-range ids stay outside [0, E) once narrowed: dropped, never wrapped in
    keys = flat.to(key_dtype)
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(E + 1, dtype=key_dtype, device=expert_idx.device)
    offsets = torch.searchsorted(sorted_keys, bounds)  # int64 [E+1], offsets[e] = #pairs with id < e
    pair = order.to(torch.int32)
    token = torch.div(pair, S, rounding_mode="floor")
    slot = pair % S
    return token, slot, offsets


# ---------------------------------------------------------------- expert matmul
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


def _run_backend(backend: str, x3, weight, gates, rt: Route, G_out: int, deterministic: bool, config=None,
                 enqueue=None):
    """y from `backend`'s launcher, or from `enqueue` (a call plan's prepared launch); config: complete
    (call_plan), None: looked up."""
    T, G_in, d_in = x3.shape
    d_out = weight.shape[2]
    y = C.new_output((T, G_out, d_out), x3.dtype, x3.device)
    if y.numel() == 0:
        return y
    if enqueue is None:
        if config is None:
            config = call_plan.config(OP, backend, _features(OP, x3, weight, rt.S, G_out, deterministic))
        enqueue = call_plan.forward_launch(OP, backend, config, dict(G_in=G_in, G_out=G_out,
                                                                     deterministic=deterministic))
    enqueue(x3, weight, gates, rt, y)
    return y


@torch.library.custom_op("flashswitch::expert_matmul", mutates_args=())
def _expert_matmul_op(x3: torch.Tensor, weight: torch.Tensor, gates: Optional[torch.Tensor], token: torch.Tensor,
                      slot: torch.Tensor, offsets: torch.Tensor, S: int, G_out: int, deterministic: bool,
                      backend: str) -> torch.Tensor:
    rt = _trusted(Route(token=token, slot=slot, offsets=offsets, expert_idx=None, T=x3.shape[0], S=S,
               E=offsets.numel() - 1))
    return _run_backend(backend, x3, weight, gates, rt, G_out, deterministic)


@_expert_matmul_op.register_fake
def _(x3, weight, gates, token, slot, offsets, S, G_out, deterministic, backend):
    return x3.new_empty((x3.shape[0], G_out, weight.shape[2]))


# ---------------------------------------------------------------- backward
def _run_backward(backend: str, dy, x3, weight, gates, rt: Route, G_out: int, need_x: bool, need_weight: bool,
                  need_gates: bool, config=None, plan: Optional["_Plan"] = None):
    """(dx3, dweight, dgates) from the Triton backward kernels (every kernel backend uses them); a
    gradient not asked for (or gates None) is an empty tensor. dweight is exactly zero for experts
    with no pairs; the result is bitwise reproducible (no float atomics, fixed-order sums).
    config: complete (call_plan), None: looked up; plan: the call plan whose prepared launches to use."""
    T, G_in, d_in = x3.shape
    dev = x3.device
    dx = C.new_output(x3.shape, x3.dtype, dev) if need_x else call_plan.absent(x3)
    dw = C.new_output(weight.shape, weight.dtype, dev) if need_weight else call_plan.absent(weight)
    need_gates = need_gates and gates is not None
    dg = C.new_output(gates.shape, gates.dtype, dev) if need_gates else call_plan.absent(x3)
    want = (dx.numel() > 0, dw.numel() > 0, dg.numel() > 0)
    if not any(want):
        return dx, dw, dg
    dy = dy.to(x3.dtype).contiguous()  # e.g. the expanded (stride 0) gradient of y.sum()
    enqueue = None if plan is None else plan.backward.get(want)  # prepared per wanted set of gradients
    if enqueue is None:
        dy_meta = torch.empty(dy.shape, dtype=dy.dtype, device="meta")  # the launch reads dy's metadata only
        enqueue = call_plan.backward_launch(OP, backend, plan, want, config,
                                            (_features, x3, weight, rt.S, G_out, gates is not None),
                                            x3, weight, gates, rt, dy_meta, *want, G_in=G_in, G_out=G_out)
    enqueue(x3, weight, gates, rt, dy, *(g if w else None for g, w in zip((dx, dw, dg), want)))
    return dx, dw, dg


@torch.library.custom_op("flashswitch::expert_matmul_backward", mutates_args=())
def _expert_matmul_backward_op(dy: torch.Tensor, x3: torch.Tensor, weight: torch.Tensor, gates: Optional[torch.Tensor],
                               token: torch.Tensor, slot: torch.Tensor, offsets: torch.Tensor, S: int, G_out: int,
                               need_x: bool, need_weight: bool, need_gates: bool,
                               backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rt = _trusted(Route(token=token, slot=slot, offsets=offsets, expert_idx=None, T=x3.shape[0], S=S,
               E=offsets.numel() - 1))
    return _run_backward(backend, dy, x3, weight, gates, rt, G_out, need_x, need_weight, need_gates)


@_expert_matmul_backward_op.register_fake
def _(dy, x3, weight, gates, token, slot, offsets, S, G_out, need_x, need_weight, need_gates, backend):
    dg = gates.new_empty(gates.shape) if need_gates and gates is not None else x3.new_empty(0)
    return (x3.new_empty(x3.shape) if need_x else x3.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0), dg)


def _setup_context(ctx, inputs, output):
    x3, weight, gates, token, slot, offsets, S, G_out, deterministic, backend = inputs
    ctx.save_for_backward(x3, weight, gates, token, slot, offsets)
    ctx.S, ctx.G_out, ctx.backend = S, G_out, backend


def _backward(ctx, dy):
    x3, weight, gates, token, slot, offsets = ctx.saved_tensors
    need_x, need_weight, need_gates = ctx.needs_input_grad[:3]
    dx, dw, dg = _expert_matmul_backward_op(dy, x3, weight, gates, token, slot, offsets, ctx.S, ctx.G_out,
                                            need_x, need_weight, need_gates and gates is not None, ctx.backend)
    return (dx if need_x else None, dw if need_weight else None, dg if need_gates and gates is not None else None,
            None, None, None, None, None, None, None)


_expert_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def _x3(x: torch.Tensor) -> torch.Tensor:
    """Kernels read x through a [T, G_in, d_in] view."""
    return x.unsqueeze(1) if x.dim() == 2 else x


def problem_features(x, expert_idx, num_experts, weight, gates=None, out_groups=None, deterministic=False) -> dict:
    """The autotune bucket of a problem (keyword arguments as `random_problem` returns them)."""
    T, S = expert_idx.shape
    G_out = S if out_groups is None else int(out_groups)
    return _features(OP, _x3(x), weight, S, G_out, deterministic)


def problem_features_bwd(x, expert_idx, num_experts, weight, gates=None, out_groups=None,
                         deterministic=False) -> dict:
    """The backward pass's autotune bucket of a problem (keyword arguments as `random_problem` returns them)."""
    T, S = expert_idx.shape
    return _features(OP_BWD, _x3(x), weight, S, S if out_groups is None else int(out_groups), gates is not None)


def run_kernel(backend: str, config, x, expert_idx, num_experts, weight, gates=None, out_groups=None,
               deterministic=False):
    """Routing + one kernel call with an explicit config (None: tuned/default), for the tuner and the
    benchmarks: y [T, G_out, d_out]. The routing runs without its range check (no host sync), so the
    time measured is what a CUDA-graph-captured step pays."""
    if not backends.TABLE[backend].kernels:
        from flashswitch.reference.expert_matmul import torch_expert_matmul
        return torch_expert_matmul(x, expert_idx, weight, gates=gates, out_groups=out_groups)
    rt = route(expert_idx, num_experts, check=False)
    G_in, G_out = _validate(x, rt, weight, gates, out_groups, deterministic)
    if config is not None:
        config = call_plan.complete_config(OP, backend, _features(OP, _x3(x), weight, rt.S, G_out, deterministic),
                                           config)
    return _run_backend(backend, _x3(x), weight, gates, rt, G_out, deterministic, config)


def run_backward(backend: str, config, grad_outputs, x, expert_idx, num_experts, weight, gates=None,
                 out_groups=None, deterministic=False) -> tuple:
    """Routing + the backward kernels with an explicit config (None: tuned/default), for the tuner and
    the benchmarks: the gradients of GRAD_INPUTS (dx shaped like x, dweight, dgates; None for absent
    gates). `grad_outputs`: dy [T, G_out, d_out] (or a 1-tuple of it). The forward runs first (tuned or
    default config), so that a timed call is what a training step pays, although the backward reads none
    of its output; the reference backend differentiates the torch reference."""
    dy = grad_outputs[0] if isinstance(grad_outputs, (tuple, list)) else grad_outputs
    if not backends.TABLE[backend].kernels:
        from flashswitch.reference.expert_matmul import torch_expert_matmul
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, gates)]
        with torch.enable_grad():
            y = torch_expert_matmul(leaves[0], expert_idx, leaves[1], gates=leaves[2], out_groups=out_groups)
            used = [t for t in leaves if t is not None]
            if y.requires_grad:
                grads = torch.autograd.grad(y, used, dy, allow_unused=True, materialize_grads=True)
            else:  # no pair (T = 0): y depends on no input
                grads = tuple(torch.zeros_like(t) for t in used)
        return tuple(grads) if gates is not None else (*grads, None)
    rt = route(expert_idx, num_experts, check=False)
    G_in, G_out = _validate(x, rt, weight, gates, out_groups, deterministic)
    x3 = _x3(x)
    _run_backend(backend, x3, weight, gates, rt, G_out, deterministic)  # the step's forward
    dx, dw, dg = _run_backward(backend, dy, x3, weight, gates, rt, G_out, True, True, gates is not None, config)
    return dx.view(x.shape), dw, (dg if gates is not None else None)


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
    key = call_plan.key_or_none(_call_key, x, route, weight, gates, out_groups, deterministic, backend)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(x, route, weight, gates, out_groups, deterministic, backend)
        _PLANS.put(key, plan)
    if not torch.compiler.is_compiling():
        route.validate()  # a hand-built route, once (routes from route() are known good)
    if not plan.kernels or not C.kernels_serve(backend, x, weight, gates):
        if route.expert_idx is None:
            raise ValueError("the reference backend needs a route built by flashswitch.route (with expert_idx)")
        if torch.compiler.is_compiling():
            return _reference_op(x, route.expert_idx, weight, gates, plan.G_out)
        from flashswitch.reference.expert_matmul import torch_expert_matmul
        # ids outside [0, E) dropped, as the kernels do: route(check=True) has already refused them
        return torch_expert_matmul(x, route.expert_idx, weight, gates=gates, out_groups=out_groups, check=False)
    x3 = _x3(x)
    if C.eager_fast_path(x3, weight, gates):
        return _run_backend(plan.backend, x3, weight, gates, route, plan.G_out, deterministic, plan.config,
                            plan.enqueue)
    if C.eager_autograd_path(x3, weight, gates):
        return _EagerAutograd.apply(x3, weight, gates, route, plan, deterministic)
    return _expert_matmul_op(x3, weight, gates, route.token, route.slot, route.offsets, route.S, plan.G_out,
                             deterministic, plan.backend)


class _EagerAutograd(torch.autograd.Function):
    """An eager call that needs gradients (C.eager_autograd_path): the custom op's forward and backward
    with the call plan's prepared launch and backward config, without the dispatcher layers."""

    @staticmethod
    def forward(ctx, x3, weight, gates, route, plan, deterministic):
        ctx.save_for_backward(x3, weight, gates)
        ctx.route, ctx.plan = route, plan
        return _run_backend(plan.backend, x3, weight, gates, route, plan.G_out, deterministic, plan.config,
                            plan.enqueue)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x3, weight, gates = ctx.saved_tensors
        need_x, need_weight, need_gates = ctx.needs_input_grad[:3]
        need_gates = need_gates and gates is not None
        plan = ctx.plan
        dx, dw, dg = _run_backward(plan.backend, dy, x3, weight, gates, ctx.route, plan.G_out, need_x, need_weight,
                                   need_gates, plan=plan)
        return (dx if need_x else None, dw if need_weight else None, dg if need_gates else None, None, None, None)


# ---------------------------------------------------------------- the reference, traced
# A traced graph cannot hold the reference's per-expert split (its sizes are the ids' counts, read on the
# host), so a traced call runs it as one opaque op. Eager calls run the torch code itself, which
# torch.func and forward-mode AD differentiate; the op's backward is written with the op and a d weight
# op of the same kind.
@torch.library.custom_op("flashswitch::expert_matmul_reference", mutates_args=())
def _reference_op(x: torch.Tensor, expert_idx: torch.Tensor, weight: torch.Tensor, gates: Optional[torch.Tensor],
                  G_out: int) -> torch.Tensor:
    from flashswitch.reference.expert_matmul import torch_expert_matmul
    return torch_expert_matmul(x, expert_idx, weight, gates=gates, out_groups=G_out, check=False)


@_reference_op.register_fake
def _(x, expert_idx, weight, gates, G_out):
    return x.new_empty((x.shape[0], G_out, weight.shape[2]))


@torch.library.custom_op("flashswitch::expert_matmul_reference_dweight", mutates_args=())
def _reference_dweight_op(x: torch.Tensor, expert_idx: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                          gates: Optional[torch.Tensor]) -> torch.Tensor:
    from flashswitch.reference.expert_matmul import torch_expert_matmul_dweight
    return torch_expert_matmul_dweight(x, expert_idx, dy, weight.shape[0], gates=gates).to(weight.dtype)


@_reference_dweight_op.register_fake
def _(x, expert_idx, weight, dy, gates):
    return weight.new_empty(weight.shape)


def _reference_setup_context(ctx, inputs, output):
    x, expert_idx, weight, gates, G_out = inputs
    ctx.save_for_backward(x, expert_idx, weight, gates)


def _reference_backward(ctx, dy):
    x, expert_idx, weight, gates = ctx.saved_tensors
    need_x, _, need_weight, need_gates = ctx.needs_input_grad[:4]
    acc = torch.promote_types(x.dtype, torch.float32)  # the reference's math: fp32, fp64 for fp64 x
    S = expert_idx.shape[1]
    dx = dw = dg = None
    if need_x:  # y is linear in x: dx is the op over dy and the transposed experts, summed per input group
        G_in = 1 if x.dim() == 2 else x.shape[1]
        dx = _reference_op(dy.to(acc), expert_idx, weight.transpose(1, 2), gates, G_in).view(x.shape).to(x.dtype)
    if need_weight:
        dw = _reference_dweight_op(x, expert_idx, weight, dy, gates)
    if need_gates and gates is not None:  # dgates[t, s] = <x_row(t, s) @ W[id], dy[t, s // (S / G_out)]>
        pairs = _reference_op(x.to(acc), expert_idx, weight, None, S)  # ungated, one output group per slot
        dg = (pairs * dy.to(acc).repeat_interleave(S // dy.shape[1], 1)).sum(-1).to(gates.dtype)
    return dx, None, dw, dg, None


_reference_op.register_autograd(_reference_backward, setup_context=_reference_setup_context)


# ---------------------------------------------------------------- call plans
@dataclass(frozen=True, kw_only=True)
class _Plan(call_plan.Plan):
    G_out: int


_PLANS = call_plan.PlanCache()


def _call_key(x, route, weight, gates, out_groups, deterministic, backend):
    """The route by its class, sizes and device: its tensors' dtypes and lengths are checked when it is
    made, its values by route.validate() on every call."""
    T, S = call_plan.tensor_key, call_plan.scalar_key
    rt = (route.__class__, route.T, route.S, route.E, route.offsets.device)
    return (T(x), rt, T(weight), call_plan.optional_tensor_key(gates), S(out_groups), S(deterministic), S(backend))


def _plan(x, route, weight, gates, out_groups, deterministic, backend) -> _Plan:
    """Every check, the backend, the config and the forward launch: the uncached part of a call."""
    G_in, G_out = _validate(x, route, weight, gates, out_groups, deterministic)
    x3 = _x3(x)
    features = (_features, x3, weight, route.S, G_out, deterministic)
    backend, bucket = call_plan.resolve(OP, backend, x.device, *features)
    # y as a meta tensor (only its metadata is read), of the route only its sizes
    y = torch.empty((x3.shape[0], G_out, weight.shape[2]), dtype=x3.dtype, device="meta")
    launch = (dict(G_in=G_in, G_out=G_out, deterministic=deterministic), (x3, weight, gates, route), (y,)) \
        if x.shape[0] * weight.shape[2] else None
    return call_plan.kernel_plan(_Plan, OP, backend, bucket, features, launch, G_out=G_out)


__all__ = ["Route", "route", "expert_matmul"]
