"""An op declared once: an `OpDef` holds what is an op's own; everything an op does alike is built here.

An op module (ops/<op>.py) declares its OpDef: its name, its custom op's arguments (torch.library
schema), its outputs and their shapes, its validation, its autotune features, its launchers' scalars,
which arguments take gradients and how its backward kernels are called, and its torch reference.
Built from it, once for every op:

- the custom ops `flashswitch::<name>` and `flashswitch::<name>_backward`, with their fake
  implementations (torch.compile, tensor subclasses such as DTensor, vmap);
- one autograd wiring (`_save` / `_gradients`), used by the custom op's `register_autograd` (the
  gradients come from the backward custom op) and by `_EagerAutograd`, the torch.autograd.Function of
  eager calls that need gradients (the plan's prepared backward, without the dispatcher's layers);
- the call plans (`plan`: a `call_plan.PlanCache` keyed by the op's `key`; `make_plan` on a miss) and
  the dispatch of a planned call (`run`): the reference, the eager fast path, `_EagerAutograd`, the
  custom op;
- `forward` and `backward`, one kernel call of each pass, and for the tuner and the benchmarks
  `problem_features`, `problem_features_bwd`, `run_kernel` and `run_backward`.

Two forms of an op's arguments: the call's (`args`: validated and normalized, as its kernels read them)
and the custom op's (the same unless `to_op` / `from_op` say otherwise: op 3 passes its Route's
tensors and sizes). A cache hit runs `plan` (key, lookup) and `run`, then the plan's prepared launch.

Adding an op `toy` (tests/test_opdef.py follows these steps with a scaled add):
1. reference/toy.py: `torch_toy` (differentiable) and `numpy_toy`, `random_problem`;
2. kernels_triton/toy.py `prepare` / `launch`, kernels_triton/toy_bwd.py `prepare` (named by
   backends.TABLE from the op's name), plus bindings for the cuda and cupy backends;
3. ops/toy.py: `OPDEF = OpDef(name="toy", ...).register()`, its public function (`plan = OPDEF.plan(...)`,
   `OPDEF.run(plan, backend, args)`, the reference where that returns None) and the tooling's names
   (`problem_features, problem_features_bwd, run_kernel, run_backward = OPDEF.tooling()`);
4. one line in a table: its OpSpec in registry.OPS, which the tuner, the benchmarks and `flashswitch
   check` read (a BackwardSpec beside it for the backward's tables; config spaces in autotune/space.py
   are optional: without one a launcher gets {}).
`OPDEF.remove()` takes its custom ops out of torch.library again.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from flashswitch import _common as C
from flashswitch import backends
from flashswitch.ops import call_plan


def _written(params: str, items) -> Callable:
    """`lambda params: (items...)` written out once: the argument shuffles of the hot paths, as fast as
    hand-written code (operator.itemgetter is no faster, and torch.compile cannot trace it)."""
    return eval(f"lambda {params}: ({''.join(f'{item}, ' for item in items)})")  # noqa: S307


def _getter(positions: tuple):
    """What takes the arguments at `positions` from an argument tuple (`_take`): a slice where they are the
    first ones, else a written-out function."""
    if positions == tuple(range(len(positions))):
        return slice(0, len(positions))
    return _written("args", [f"args[{int(i)}]" for i in positions])


def _take(getter, args) -> tuple:
    """The arguments `getter` (from `_getter`) names; the hot paths write this out inline."""
    return args[getter] if getter.__class__ is slice else getter(args)


class _Form:
    """One form of an op's arguments (the call's, or the custom op's) as its autograd node keeps them:
    the tensors saved, the others on the context, put together again for the backward. The custom op's
    node takes its arguments, then the backend; the eager node (`_EagerAutograd`) the plan, the call's
    arguments as one object, then their tensors."""
    __slots__ = ("n", "tensors", "grad_pos", "take_tensors", "take_others", "rebuild", "needs", "spread")

    def __init__(self, names: tuple, types: dict, grads: tuple, eager: bool):
        self.n = len(names)
        self.tensors = tuple(i for i, n in enumerate(names) if types.get(n, "").startswith("Tensor"))
        others = tuple(i for i in range(self.n) if i not in self.tensors)
        self.grad_pos = tuple(names.index(g) for g in grads)
        self.take_tensors, self.take_others = _getter(self.tensors), _getter(others)
        self.rebuild = _written("t, o", [f"t[{self.tensors.index(i)}]" if i in self.tensors else
                                         f"o[{others.index(i)}]" for i in range(self.n)])
        # the node's inputs that take gradients (ctx.needs_input_grad's positions)
        inputs = [2 + self.tensors.index(i) for i in self.grad_pos] if eager else list(self.grad_pos)
        self.needs = _getter(tuple(inputs))
        self.spread = None  # the eager node's gradients from the backward's (the custom op's: masked)
        if eager:
            spread = ["None"] * (2 + len(self.tensors))
            for k, i in enumerate(inputs):
                spread[i] = f"g[{k}]"
            self.spread = _written("g", spread)


def library_op(name: str, fake: Callable, schema: Optional[str] = None, backward: Optional[Callable] = None,
               setup_context: Optional[Callable] = None) -> Callable:
    """A decorator: the function as the torch.library custom op `name` (its schema from `schema`, else its
    annotations), with `fake` as its fake implementation and, where given, its autograd formula."""
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=(), schema=schema)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op
    return wrap


@dataclass(eq=False)
class OpDef:
    """One op, declared by what is its own. Hooks take the call's arguments (`*args`) unless said otherwise."""
    name: str  # custom ops flashswitch::<name>(_backward); config tables <name>, <name>.bwd; launchers by name
    schema: str  # the custom op's arguments in torch.library syntax, without the trailing `str backend`
    outputs: tuple  # the outputs' names (the backward op takes d<name> for each)
    shapes: Callable  # (*args) -> [(shape, dtype)] of the outputs
    key: Callable  # (*public, backend) -> the plan cache key (call_plan.tensor_key, scalar_key)
    normalize: Callable  # (*public) -> args: every check (TypeError / ValueError), the scalars normalized
    features: Callable  # (table, *args) -> the autotune bucket of table <name> or <name>.bwd
    scalars: Callable  # (*args) -> the launchers' keyword arguments (forward; the backward's by default)
    reference: Callable  # (*args) -> the outputs of the differentiable torch reference
    grads: tuple  # the arguments that take gradients, by name, in the order of `grad_call`'s gradients
    grad_call: Callable  # (args, outs, upstream, needs) -> (gradients, key, tensors): the gradients (None: not
    # computed), the layout key of the prepared launch and the launch's tensors (None: nothing to launch)
    args: Optional[tuple] = None  # the call arguments' names where they are not the schema's
    grad_inputs: Optional[tuple] = None  # the problem's names of `grads` (run_backward's order)
    keep: tuple = ()  # call arguments the plan keeps, as plan.<name>
    inputs: Union[tuple, Callable, None] = None  # what the forward launch reads: names, or (*args) -> tensors;
    # default: the tensor arguments
    optional_grads: tuple = ()  # outputs whose upstream gradient may be None (the others get zeros)
    save_outputs: bool = False  # the backward reads the outputs
    partial: bool = False  # the backward computes only the wanted gradients (its op takes need_<name> flags)
    problem: Optional[Callable] = None  # (**problem) -> args, for the tooling (default: normalize)
    replan: Optional[Callable] = None  # (*args, backend) -> the public arguments of the call's plan
    to_op: Optional[Callable] = None  # (*args) -> the custom op's arguments
    from_op: Optional[Callable] = None  # (*op_args) -> args
    launches: Optional[Callable] = None  # (*args) -> whether the kernels run (default: an output is not empty)
    fill: Optional[Callable] = None  # (args, outs): the outputs of a problem the kernels are not launched on
    unfit: Optional[Callable] = None  # (backend, *args) -> why the kernels do not take the problem, or None
    grad_prepare: Optional[Callable] = None  # (args, key, tensors) -> (arguments, scalars) of the backward's
    # prepare (default: the launch's tensors and `scalars`)
    kernel_backends: tuple = backends.KERNELS  # the kernel backends with launchers of this op (named others raise;
    # FLASHSWITCH_BACKEND naming another sends 'auto' to the reference)

    def __post_init__(self):
        decl = [a.strip().rsplit(" ", 1) for a in self.schema.split(",")]
        types, op_names = {n: t for t, n in decl}, tuple(n for _, n in decl)
        call_names = tuple(self.args or op_names)
        self.grad_inputs = tuple(self.grad_inputs or self.grads)
        # the custom op's node takes its arguments, then the backend; the eager one the plan, then the call's
        self._op_form = _Form(op_names, types, self.grads, False)
        self._call_form = _Form(call_names, types, self.grads, True)
        self._call_tensors = self._call_form.take_tensors
        self._required = tuple(i for i, o in enumerate(self.outputs) if o not in self.optional_grads)
        self._all = (True,) * len(self.grads)  # a backward that computes every gradient
        inputs = self.inputs if self.inputs is not None else [call_names[i] for i in self._call_form.tensors]
        # what the forward launch reads: the op's function of the call's arguments (self.inputs), or these
        self._inputs = None if callable(inputs) else _getter(tuple(call_names.index(n) for n in inputs))
        self._keep = tuple((n, call_names.index(n)) for n in self.keep)
        self._single = len(self.outputs) == 1
        self._problem = self.problem or self.normalize
        self._plan_type = dataclasses.make_dataclass(f"{self.name}_plan", [(n, object) for n in self.keep],
                                                     bases=(call_plan.Plan,), frozen=True, kw_only=True)
        self.plans = call_plan.PlanCache()
        ups = ", ".join(f"Tensor{'?' if o in self.optional_grads else ''} d{o}" for o in self.outputs)
        saved = "".join(f", Tensor {o}" for o in self.outputs) if self.save_outputs else ""
        needs = "".join(f", bool need_{g}" for g in self.grads) if self.partial else ""
        results = "Tensor" if self._single else f"({', '.join(['Tensor'] * len(self.outputs))})"
        grads = ", ".join(["Tensor"] * len(self.grads))
        self._schemas = (f"({self.schema}, str backend) -> {results}",
                         f"({ups}, {self.schema}{saved}{needs}, str backend) -> ({grads})")
        self.op = self.backward_op = None

    # ------------------------------------------------------------ torch.library
    def register(self) -> "OpDef":
        """Define the custom ops `flashswitch::<name>` and `flashswitch::<name>_backward`."""
        forward, backward = self._schemas
        self.op = library_op(f"flashswitch::{self.name}", self._fake, forward, self._op_backward,
                             self._op_setup)(self._op_impl)
        self.backward_op = library_op(f"flashswitch::{self.name}_backward", self._backward_fake,
                                      backward)(self._backward_impl)
        return self

    def remove(self) -> None:
        """Take the custom ops out of torch.library again (and forget the plans)."""
        from torch._library import custom_ops
        for op in (self.op, self.backward_op):
            lib = custom_ops.OPDEF_TO_LIB.pop(op._qualname, None) if op is not None else None
            if lib is not None:
                lib._destroy()
        self.op = self.backward_op = None
        self.plans.clear()

    def _read(self, args) -> tuple:
        """What the forward launch reads of the call's arguments."""
        return self.inputs(*args) if self._inputs is None else _take(self._inputs, args)

    def _from_op(self, op_args) -> tuple:
        return self.from_op(*op_args) if self.from_op else tuple(op_args)

    def _op_impl(self, *a):
        # a traced caller's call runs the eager calls' plan: the prepared launch, no per-call config lookup
        args = self._from_op(a[:-1])
        plan = self.plan(*(self.replan(*args, a[-1]) if self.replan else (*args, a[-1])))
        return self.forward(plan.backend, args, plan.config, plan.enqueue, plan.outputs)

    def _fake(self, *a):
        args = self._from_op(a[:-1])
        outs = tuple(args[0].new_empty(shape, dtype=dtype) for shape, dtype in self.shapes(*args))
        return outs[0] if self._single else outs

    def _split(self, a) -> tuple:
        """The backward op's arguments: (upstream, op arguments, outputs, needs, backend)."""
        n, m, g = len(self.outputs), self._op_form.n, len(self.grads)
        outs = a[n + m:n + m + n] if self.save_outputs else ()
        needs = a[-1 - g:-1] if self.partial else self._all
        return a[:n], a[n:n + m], outs, needs, a[-1]

    def _placeholders(self, op_args, grads) -> tuple:
        """Each gradient as the backward op returns it: an empty tensor where none was computed."""
        out = []
        for i, g in zip(self._op_form.grad_pos, grads):
            t = op_args[i]
            if g is None:
                g = (t if t is not None else op_args[self._op_form.tensors[0]]).new_empty(0)
            out.append(g)
        return tuple(out)

    def _backward_impl(self, *a):
        ups, op_args, outs, needs, backend = self._split(a)
        args = self._from_op(op_args)
        plan = self.plan(*(self.replan(*args, backend) if self.replan else (*args, backend)))
        grads = self.backward(plan.backend, args, outs, ups, needs, plan=plan)
        return self._placeholders(op_args, grads)

    def _backward_fake(self, *a):
        ups, op_args, outs, needs, backend = self._split(a)
        grads = [None if op_args[i] is None or not need else op_args[i].new_empty(op_args[i].shape)
                 for i, need in zip(self._op_form.grad_pos, needs)]
        return self._placeholders(op_args, grads)

    # ------------------------------------------------------------ autograd: one wiring, two callers
    def _save(self, ctx, form: _Form, args, tensors, outs, plan, backend) -> None:
        """What the backward reads: the tensor arguments (and the outputs) saved, the others on ctx."""
        if self.save_outputs:
            ctx.save_for_backward(*tensors, *((outs,) if self._single else outs))
        else:
            ctx.save_for_backward(*tensors)
        take = form.take_others
        ctx.form, ctx.plan, ctx.backend, ctx.others = form, plan, backend, args[take] if take.__class__ is slice \
            else take(args)

    def _gradients(self, ctx, ups):
        """The gradient of each input of the autograd node (None for the others) from the saved context:
        eager (a plan), by the plan's prepared backward; traced, by the backward custom op."""
        form, saved, plan = ctx.form, ctx.saved_tensors, ctx.plan
        args = form.rebuild(saved, ctx.others)
        outs = saved[len(form.tensors):]
        for i in self._required:
            if ups[i] is None:
                ups = self._zeros(plan is None, args, ups)
                break
        if plan is not None:  # None where no gradient was computed
            needs = _take(form.needs, ctx.needs_input_grad) if self.partial else self._all
            return form.spread(self.backward(plan.backend, args, outs, ups, needs, plan=plan))
        # the backward op: an empty placeholder where no gradient was computed
        needs = _take(form.needs, ctx.needs_input_grad)
        grads = self.backward_op(*ups, *args, *outs, *(needs if self.partial else ()), ctx.backend)
        result = [None] * (form.n + 1)  # and the backend's
        for i, g, need in zip(form.grad_pos, grads, needs):
            if need and args[i] is not None:
                result[i] = g
        return tuple(result)

    def _zeros(self, op_args: bool, args, ups) -> tuple:
        """The outputs' gradients, zeros for an unused output (autograd passes None) unless optional."""
        call = self._from_op(args) if op_args else args
        dev = call[0].device
        return tuple(torch.zeros(shape, dtype=dtype, device=dev) if u is None and o not in self.optional_grads else u
                     for u, o, (shape, dtype) in zip(ups, self.outputs, self.shapes(*call)))

    def _op_setup(self, ctx, inputs, output) -> None:
        args = inputs[:-1]
        self._save(ctx, self._op_form, args, _take(self._op_form.take_tensors, args), output, None, inputs[-1])

    def _op_backward(self, ctx, *ups):
        return self._gradients(ctx, ups)

    # ------------------------------------------------------------ plans and dispatch
    def plan(self, *public):
        """The plan of a call (its public arguments, then the backend), kept for the next call with the
        same metadata."""
        key = call_plan.key_or_none(self.key, *public)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.make_plan(*public)
            self.plans.put(key, plan)
        return plan

    def make_plan(self, *public):
        """Every check, the backend, the config and the forward launch: the uncached part of a call."""
        *public, backend = public
        args = self.normalize(*public)
        if self.unfit is not None and backend == "auto" and self.unfit("auto", *args):
            backend = "reference"
        features = lambda table: self.features(table, *args)  # noqa: E731
        backend, bucket = call_plan.resolve(self.name, backend, args[0].device, features, self.kernel_backends)
        kernels = backends.TABLE[backend].kernels
        why = self.unfit(backend, *args) if kernels and self.unfit is not None else None
        if why:
            raise ValueError(why)
        config = enqueue = None
        shapes = self.shapes(*args)
        if kernels and not torch.compiler.is_compiling() and (
                self.launches(*args) if self.launches else any(math.prod(s) for s, _ in shapes)):
            config = call_plan.config(self.name, backend, bucket or features(self.name))
            outs = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes)
            enqueue = call_plan.forward_launch(self.name, backend, config, self.scalars(*args), self._read(args), outs)
        return self._plan_type(opdef=self, backend=backend, kernels=kernels, config=config, enqueue=enqueue,
                               outputs=shapes, **{n: args[i] for n, i in self._keep})

    def run(self, plan, backend: str, args: tuple):
        """The outputs of a planned call, or None where the torch reference serves it: the reference
        backend, or torch.func's grad / jvp and forward-mode AD (C.kernels_serve)."""
        get = self._call_tensors
        tensors = args[get] if get.__class__ is slice else get(args)
        if not plan.kernels or not C.kernels_serve(backend, *tensors):
            return None
        if C.eager_fast_path(*tensors):
            return self.forward(plan.backend, args, plan.config, plan.enqueue, plan.outputs)
        if C.eager_autograd_path(*tensors):
            return _EagerAutograd.apply(plan, args, *tensors)
        return self.op(*(self.to_op(*args) if self.to_op else args), plan.backend)

    # ------------------------------------------------------------ kernel calls
    def forward(self, backend: str, args, config=None, enqueue=None, shapes=None):
        """The outputs from `backend`'s launcher, or from `enqueue` (a plan's prepared launch); config:
        complete (call_plan), None: looked up; shapes: the outputs' (shape, dtype), None: from `shapes`."""
        outs = C.new_outputs(shapes or self.shapes(*args), args[0].device)
        if enqueue is None:
            if not (self.launches(*args) if self.launches else any(o.numel() for o in outs)):
                if self.fill is not None:
                    self.fill(args, outs)
                return outs[0] if self._single else outs
            if config is None:
                config = call_plan.config(self.name, backend, self.features(self.name, *args))
            enqueue = call_plan.forward_launch(self.name, backend, config, self.scalars(*args))
        get = self._inputs
        enqueue(*(self.inputs(*args) if get is None else args[get] if get.__class__ is slice else get(args)), *outs)
        return outs[0] if self._single else outs

    def backward(self, backend: str, args, outs, ups, needs, config=None, plan=None) -> tuple:
        """The gradients of `grads` by the backward kernels that serve `backend` (None where not
        computed); config: complete, None: looked up; plan: the call plan whose prepared launches to use."""
        grads, key, tensors = self.grad_call(args, outs, ups, needs)
        if tensors is not None:
            enqueue = None if plan is None else plan.backward.get(key)
            if enqueue is None:  # prepared per layout of the upstream gradients
                prepare, scalars = (self.grad_prepare(args, key, tensors) if self.grad_prepare
                                    else (tensors, self.scalars(*args)))
                enqueue = call_plan.backward_launch(self.name, backend, plan, key, config,
                                                    lambda table: self.features(table, *args), *prepare, **scalars)
            enqueue(*tensors)
        return grads

    # ------------------------------------------------------------ the tooling: tuner, benchmarks, compile checks
    def tooling(self) -> tuple:
        """(problem_features, problem_features_bwd, run_kernel, run_backward), as each op module names them."""
        return self.problem_features, self.problem_features_bwd, self.run_kernel, self.run_backward

    def problem_features(self, *a, **problem) -> dict:
        """The autotune bucket of a problem (its arguments as the op's reference.random_problem gives them)."""
        return self.features(self.name, *self._problem(*a, **problem))

    def problem_features_bwd(self, *a, **problem) -> dict:
        """The backward pass's autotune bucket of a problem."""
        return self.features(self.name + ".bwd", *self._problem(*a, **problem))

    def run_kernel(self, backend: str, config, *a, **problem):
        """One kernel call with an explicit config (None: tuned or default), for the tuner and the
        benchmarks; the reference backend runs the torch reference."""
        args = self._problem(*a, **problem)
        if backend in backends.TABLE and not backends.TABLE[backend].kernels:
            return self.reference(*args)
        if config is not None:
            config = call_plan.complete_config(self.name, backend, self.features(self.name, *args), config)
        return self.forward(backend, args, config)

    def run_backward(self, backend: str, config, grad_outputs, *a, **problem) -> tuple:
        """The forward (tuned or default config), then the backward kernels with an explicit `config`
        (None: tuned or default), for the tuner and the benchmarks: one training step of the op; the
        reference backend differentiates the torch reference. grad_outputs: the outputs' gradients (a
        tensor for the first alone; a missing or None optional one: no gradient into it). Returns the
        gradients named by grad_inputs, each like its input, None for an input the problem lacks."""
        named = inspect.signature(self._problem).bind(*a, **problem)
        named.apply_defaults()
        args = self._problem(*named.args, **named.kwargs)
        if isinstance(grad_outputs, torch.Tensor):
            grad_outputs = (grad_outputs,)
        ups = self._zeros(False, args, (tuple(grad_outputs) + (None,) * len(self.outputs))[:len(self.outputs)])
        if not backends.TABLE[backend].kernels:
            grads = self._reference_gradients(args, ups)
        else:
            with torch.no_grad():
                outs = self.forward(backend, args)
                outs = (outs,) if self._single else outs
                grads = self.backward(backend, args, outs, ups, self._all, config)
        out = []
        for name, g in zip(self.grad_inputs, grads):
            t = named.arguments.get(name)
            out.append(g.to(t.dtype).reshape(t.shape) if isinstance(t, torch.Tensor) and g is not None else None)
        return tuple(out)

    def _reference_gradients(self, args, ups) -> list:
        call = list(args)
        present = [i for i in self._call_form.grad_pos if args[i] is not None]
        for i in present:
            call[i] = args[i].detach().requires_grad_(True)
        leaves = [call[i] for i in present]
        with torch.enable_grad():
            outs = self.reference(*call)
            outs = (outs,) if isinstance(outs, torch.Tensor) else outs
            pairs = [(o, g) for o, g in zip(outs, ups) if g is not None and o.requires_grad]
            got = (torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True,
                                       materialize_grads=True) if pairs else [torch.zeros_like(t) for t in leaves])
        by = dict(zip(present, got))
        return [by.get(i) for i in self._call_form.grad_pos]


class _EagerAutograd(torch.autograd.Function):
    """An eager call that needs gradients (C.eager_autograd_path): the custom op's forward and backward
    with the call plan's prepared launches and backward config, without the dispatcher layers."""

    @staticmethod
    def forward(ctx, plan, args, *tensors):
        """args: the call's arguments; tensors: theirs (the node's inputs)."""
        opdef = plan.opdef
        if not opdef._single:
            ctx.set_materialize_grads(False)  # an unused output gets no gradient tensor
        outs = opdef.forward(plan.backend, args, plan.config, plan.enqueue, plan.outputs)
        opdef._save(ctx, opdef._call_form, args, tensors, outs, plan, None)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *ups):
        return ctx.plan.opdef._gradients(ctx, ups)


__all__ = ["OpDef", "library_op"]
