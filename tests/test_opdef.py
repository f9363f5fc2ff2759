"""An op is declared once (flashswitch/ops/_opdef.py): a new op, a scaled add out = x + alpha·y, added the
way the OpDef docstring walks through it: its own files (here modules built in the test: its reference,
its Triton kernels under kernels_triton/, its ops module declaring an OpDef) plus one line in a table
(its OpSpec in registry.OPS). Its custom ops, autograd, dispatch, call plans and tooling come from the
OpDef; it differentiates in fp64 against its reference, torch.compile(fullgraph=True) traces through
it, and it is removed again."""
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

import flashswitch
from conftest import DEVICE, kernel_backends
from flashswitch import _common as C
from flashswitch import backends, registry
from flashswitch.autotune import space
from flashswitch.ops import call_plan
from flashswitch.ops._opdef import OpDef

TOY = "toy_scaled_add"
BLOCK = 64


# ---------------------------------------------------------------- its kernels: kernels_triton/toy_scaled_add(_bwd).py
@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask)
    y = tl.load(y_ptr + i, mask=mask)
    tl.store(out_ptr + i, x + alpha * y, mask=mask)


def _launch_one(a, b, out, alpha):
    n = out.numel()
    _scaled_add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, alpha, BLOCK=BLOCK)


def _kernels() -> tuple:
    """The forward module (prepare, launch) and the backward module (prepare) of the op, as the backends
    table finds them by the op's name: dx = 0 + 1·dout, dy = 0 + alpha·dout by the same kernel."""
    fwd = types.ModuleType(f"flashswitch.kernels_triton.{TOY}")

    def prepare(x, y, out, *, alpha, config, fast=False):
        assert config == {}  # no config space: the store and the defaults give {}
        return lambda x, y, out: _launch_one(x, y, out, alpha)

    fwd.prepare = prepare
    fwd.launch = lambda x, y, out, *, alpha, config: prepare(x, y, out, alpha=alpha, config=config)(x, y, out)
    bwd = types.ModuleType(f"flashswitch.kernels_triton.{TOY}_bwd")

    def prepare_bwd(dout, dx, dy, *, alpha, config, fast=False):
        def enqueue(dout, dx, dy):
            zero = torch.zeros_like(dout)
            _launch_one(zero, dout, dx, 1.0)
            _launch_one(zero, dout, dy, alpha)
        return enqueue

    bwd.prepare = prepare_bwd
    return fwd, bwd


# ---------------------------------------------------------------- its reference: reference/toy_scaled_add.py
def _reference_module():
    ref = types.ModuleType(f"{TOY}_reference")
    ref.torch_toy_scaled_add = lambda x, y, alpha=1.0: x + alpha * y
    ref.numpy_toy_scaled_add = lambda x, y, alpha=1.0: x.detach().double().numpy() + alpha * y.detach().double().numpy()

    def random_problem(n=100, *, dtype=torch.float32, device="cpu", seed=0, alpha=0.5):
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(n, generator=g).to(dtype=dtype, device=device),
                "y": torch.randn(n, generator=g).to(dtype=dtype, device=device), "alpha": alpha}

    ref.random_problem = random_problem
    return ref


# ---------------------------------------------------------------- its ops module: ops/toy_scaled_add.py
def _ops_module(ref):
    mod = types.ModuleType(f"{TOY}_ops")

    def normalize(x, y, alpha=1.0):
        C.check_tensor("x", x, dtypes=C.FLOAT_DTYPES + (torch.float64,))
        C.check_tensor("y", y, dtypes=(x.dtype,), device=x.device)
        C.check_shape("y", y, x.shape)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a float, got {type(alpha).__name__}")
        return x.reshape(-1), y.reshape(-1), float(alpha)

    def grad_call(args, outs, ups, needs):
        x, y, alpha = args
        dx, dy = torch.empty_like(x), torch.empty_like(y)
        dout = ups[0].contiguous()
        return (dx, dy), dout.stride(), (dout, dx, dy)

    mod.OPDEF = OpDef(
        name=TOY, schema="Tensor x, Tensor y, float alpha", outputs=("out",), grads=("x", "y"), keep=("alpha",),
        key=lambda x, y, alpha, backend: (call_plan.tensor_key(x), call_plan.tensor_key(y),
                                          call_plan.scalar_key(alpha), call_plan.scalar_key(backend)),
        normalize=normalize, shapes=lambda x, y, alpha: [(tuple(x.shape), x.dtype)],
        features=lambda table, x, y, alpha: space.features(table, dtype=str(x.dtype), n=x.numel()),
        scalars=lambda x, y, alpha: dict(alpha=alpha), reference=ref.torch_toy_scaled_add, grad_call=grad_call,
    ).register()
    (mod.problem_features, mod.problem_features_bwd, mod.run_kernel, mod.run_backward) = mod.OPDEF.tooling()
    mod.GRAD_INPUTS = mod.OPDEF.grad_inputs

    def scaled_add(x, y, *, alpha=1.0, backend="auto"):
        plan = mod.OPDEF.plan(x, y, alpha, backend)
        args = (x.reshape(-1), y.reshape(-1), plan.alpha)
        out = mod.OPDEF.run(plan, backend, args)
        return (ref.torch_toy_scaled_add(*args) if out is None else out).view(x.shape)

    mod.scaled_add = scaled_add
    return mod


@pytest.fixture
def toy(monkeypatch):
    """The toy op added (its files, then one line in registry.OPS) and, after the test, removed."""
    fwd, bwd = _kernels()
    monkeypatch.setitem(sys.modules, fwd.__name__, fwd)
    monkeypatch.setitem(sys.modules, bwd.__name__, bwd)
    ref = _reference_module()
    monkeypatch.setitem(sys.modules, ref.__name__, ref)
    mod = _ops_module(ref)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(registry.OPS, TOY, registry.OpSpec(  # the one line in a table
        name=TOY, ops_module=mod.__name__, reference_module=ref.__name__, cost=lambda p: {"bytes": 0}))
    yield mod
    mod.OPDEF.remove()
    backends._location.cache_clear()  # the launchers it looked up by name


def _backends():
    return ["reference"] + [b for b in kernel_backends() if b == "triton"]


def test_toy_op_forward_backward_and_tooling(toy):
    assert hasattr(torch.ops.flashswitch, TOY) and hasattr(torch.ops.flashswitch, TOY + "_backward")
    assert str(torch.ops.flashswitch.toy_scaled_add.default._schema).endswith(
        "(Tensor x, Tensor y, float alpha, str backend) -> Tensor")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 40, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))
    for backend in _backends():
        out = toy.scaled_add(x, y, alpha=0.25, backend=backend)
        assert torch.equal(out, x + 0.25 * y) or torch.allclose(out, x + 0.25 * y, rtol=1e-12, atol=1e-12)
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: toy.scaled_add(a, b, alpha=0.25, backend=backend), (xs, ys))
        dx, dy = torch.autograd.grad(toy.scaled_add(xs, ys, alpha=0.25, backend=backend).square().sum(), (xs, ys))
        rx, ry = torch.autograd.grad((xs + 0.25 * ys).square().sum(), (xs, ys))
        torch.testing.assert_close((dx, dy), (rx, ry), rtol=1e-12, atol=1e-12)
    if "triton" not in _backends():
        return
    # the plan of a signature is made once; a bad argument is refused on a hit as on a miss
    toy.OPDEF.plans.clear()
    for _ in range(3):
        toy.scaled_add(x, y, alpha=0.5, backend="triton")
    assert len(toy.OPDEF.plans) == 1
    with pytest.raises(TypeError, match="^alpha"):
        toy.scaled_add(x, y, alpha=True, backend="triton")
    with pytest.raises(TypeError, match="^y "):
        toy.scaled_add(x, y.float(), alpha=0.5, backend="triton")
    # eager gradients without the custom op (the OpDef's torch.autograd.Function), bitwise those through it
    calls, real = [], toy.OPDEF.op
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(toy.OPDEF, "op", lambda *a: calls.append(1) or real(*a))
        eager = torch.autograd.grad(toy.scaled_add(xs, ys, alpha=0.5, backend="triton").sin().sum(), (xs, ys))
        assert not calls
        mp.setattr(C, "eager_autograd_path", lambda *tensors: False)
        through = torch.autograd.grad(toy.scaled_add(xs, ys, alpha=0.5, backend="triton").sin().sum(), (xs, ys))
        assert calls
    assert all(torch.equal(a, b) for a, b in zip(eager, through))
    # the custom op itself (traced callers, tensor subclasses) and its fake implementation
    torch.library.opcheck(torch.ops.flashswitch.toy_scaled_add.default,
                          (x.reshape(-1).requires_grad_(), y.reshape(-1), 0.5, "triton"))
    # the tooling, through the registry's table
    spec = registry.get(TOY)
    p = spec.random_problem(n=77, device=DEVICE)
    torch.testing.assert_close(spec.kernel_outputs("triton", None, p)[0], spec.torch_outputs(p)[0])
    dout = torch.randn(77, generator=g).to(DEVICE)
    kernel = toy.run_backward("triton", None, dout, **p)
    reference = toy.run_backward("reference", None, dout, **p)
    torch.testing.assert_close(kernel, reference)
    assert toy.problem_features(**p) == space.features(TOY, dtype="torch.float32", n=77)


@pytest.mark.skipif("triton" not in kernel_backends(), reason="triton is not usable here")
def test_toy_op_compiles_fullgraph(toy):
    """torch.compile(fullgraph=True) traces the public call into the custom op and AOTAutograd its
    backward op: outputs and gradients equal the eager ones."""
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(50, generator=g).to(DEVICE).requires_grad_() for _ in range(2))

    def f(a, b):
        return toy.scaled_add(a, b, alpha=-1.5, backend="triton").sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got = compiled(x, y)
    grads = torch.autograd.grad(got, (x, y))
    want = f(x, y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads, torch.autograd.grad(want, (x, y)))
    torch._dynamo.reset()


def test_toy_op_is_removed_again(toy):
    toy.OPDEF.remove()
    assert not hasattr(torch.ops.flashswitch, TOY) and not hasattr(torch.ops.flashswitch, TOY + "_backward")
    assert hasattr(torch.ops.flashswitch, "chunk_summaries")  # the other ops stay
    toy.OPDEF.remove()  # twice: nothing left to remove
    assert flashswitch.chunk_summaries is not None
