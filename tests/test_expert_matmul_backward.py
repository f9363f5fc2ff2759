"""Op 3 backward: d x, d weight, d gates of every kernel backend against autograd of the torch
reference run in fp64.

A kernel gradient must be within 2x the error of the torch reference's gradient in the same precision
plus the dtype's rounding floor (the SPEC rule), widened by what rounding the inputs moves it
(testing.conditioning_tol: fp32 master weights cast to 16 bits). Gradients come from
`new_output`, which the tests poison with NaN, so an element a kernel forgets fails. Small explicit
configs (16-wide tiles, SPLIT_K > 1) make the tile logic show on small problems; `None` is the
heuristic / tuned config.
"""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, cuda_graph_capture, dtypes_here, kernel_backends
from flashswitch.kernels_triton import expert_matmul_bwd as K
from flashswitch.ops import expert_matmul as op
from flashswitch.ops.expert_matmul import expert_matmul, route
from flashswitch.reference.expert_matmul import (ROUTINGS, random_problem, torch_expert_matmul,
                                                  torch_expert_matmul_dweight_op, torch_expert_matmul_op)
from flashswitch.testing import assert_close, conditioning_tol

GPU = DEVICE == "cuda"
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])

_SMALL = dict(DX_BLOCK_M=16, DX_BLOCK_N=16, DX_BLOCK_K=16, DX_INTERLEAVE=False, DX_PARTIALS="fp32",
              DX_num_warps=4, DX_num_stages=2, DW_BLOCK_M=16, DW_BLOCK_N=16, DW_BLOCK_K=16, SPLIT_K=1,
              DW_num_warps=4, DW_num_stages=2, DENSE_Z=False)
CONFIGS = {
    "default": None,
    "small": _SMALL,
    # interleaved row tiles for dx; each expert's pairs split over 3 dW programs (partials summed in order)
    "interleaved-split": {**_SMALL, "DX_INTERLEAVE": True, "SPLIT_K": 3},
    # dx slot partials in x's dtype; wider tiles than the problems (masks)
    "out-partials": {**_SMALL, "DX_PARTIALS": "out", "DX_BLOCK_N": 32, "DW_BLOCK_M": 32, "DW_BLOCK_K": 32,
                     "SPLIT_K": 2},
    # dx and dW as dense GEMMs over the per-token expert sums Z (d gates from the dx kernel)
    "dense-z": {**_SMALL, "DENSE_Z": True},
    # dW and dZ = dy · W_catᵀ as dense GEMMs over the forward's Z of gated x rows per output group
    "dense-x": {**_SMALL, "DENSE_X": True},
    # the dx kernel on a 16-bit copy of fp32 master weights (a no-op for weights in x's dtype)
    "cast-w": {**_SMALL, "CAST_W": True},
}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _leaves(p, want=("x", "weight", "gates")):
    return {k: (p[k].detach().clone().requires_grad_(k in want) if p[k] is not None else None)
            for k in ("x", "weight", "gates")}


def _dy(p, seed=7):
    T, S = p["expert_idx"].shape
    G_out = S if p["out_groups"] is None else p["out_groups"]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, G_out, p["weight"].shape[2], generator=g).to(dtype=p["x"].dtype, device=DEVICE)


def _grads(backend, p, dy, config=None, want=("x", "weight", "gates")):
    """Gradients of GRAD_INPUTS through autograd of the public API (config None) or run_backward."""
    if config is not None:
        return op.run_backward(backend, config, (dy,), **p)
    leaves = _leaves(p, want)
    y = expert_matmul(leaves["x"], route(p["expert_idx"], p["num_experts"]), leaves["weight"],
                      gates=leaves["gates"], out_groups=p["out_groups"], backend=backend)
    used = [leaves[k] for k in op.GRAD_INPUTS if leaves[k] is not None and leaves[k].requires_grad]
    grads = iter(torch.autograd.grad(y, used, dy))
    return tuple(next(grads) if leaves[k] is not None and leaves[k].requires_grad else None
                 for k in op.GRAD_INPUTS)


def _reference_grads(p, dy, dtype=None):
    """Autograd of the torch reference on copies of the inputs in `dtype` (None: fp64)."""
    cast = (lambda t: t.to(torch.float64)) if dtype is None else (lambda t: t)
    leaves = {k: (cast(p[k]).detach().clone().requires_grad_() if p[k] is not None else None)
              for k in op.GRAD_INPUTS}
    y = torch_expert_matmul(leaves["x"], p["expert_idx"], leaves["weight"], gates=leaves["gates"],
                            out_groups=p["out_groups"])
    used = [leaves[k] for k in op.GRAD_INPUTS if leaves[k] is not None]
    if y.requires_grad:
        grads = iter(torch.autograd.grad(y, used, cast(dy), allow_unused=True, materialize_grads=True))
    else:  # no pair (T = 0): y does not depend on any input
        grads = iter([torch.zeros_like(t) for t in used])
    return tuple(next(grads) if leaves[k] is not None else None for k in op.GRAD_INPUTS)


def _input_rounding_tols(p, dy):
    """Per gradient, testing.conditioning_tol over the float inputs and dy: fp32 master weights that a
    kernel casts to x's dtype ("cast-w"; the baseline keeps them fp32) move the gradients by about that
    rounding, which the baseline rule alone does not cover."""
    inputs = {k: p[k] for k in op.GRAD_INPUTS if p[k] is not None} | {"dy": dy}

    def fp64(moved):
        grads = _reference_grads({**p, **moved}, moved["dy"])
        return {k: g for k, g in zip(op.GRAD_INPUTS, grads) if g is not None}
    return conditioning_tol(fp64, inputs, p["x"].dtype)


def _check(grads, p, dy, want=("x", "weight", "gates")):
    ref = _reference_grads(p, dy)
    base = _reference_grads(p, dy, dtype=p["x"].dtype)
    tols = _input_rounding_tols(p, dy)
    for name, g, r, b in zip(op.GRAD_INPUTS, grads, ref, base):
        if r is None or name not in want:
            assert g is None, name
            continue
        src = p[name]
        assert g is not None and g.shape == src.shape and g.dtype == src.dtype and g.device == src.device, name
        assert_close(f"d{name}", g, r, p["x"].dtype, baseline=b, tol=tols[name])


@st.composite
def problems(draw):
    S = draw(st.sampled_from([1, 2, 3, 4, 6]))
    dtype = draw(st.sampled_from(dtypes_here()))
    half = dtype in (torch.float16, torch.bfloat16)
    return dict(T=draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, 24))), S=S, E=draw(st.integers(1, 7)),
                d_in=draw(st.sampled_from([1, 7, 16, 33])), d_out=draw(st.sampled_from([1, 5, 16, 19])),
                G_in=draw(st.sampled_from([None] + _divisors(S))), G_out=draw(st.sampled_from([None] + _divisors(S))),
                gated=draw(st.booleans()), routing=draw(st.sampled_from(ROUTINGS)), dtype=dtype,
                weight_dtype=draw(st.sampled_from([None, torch.float32])) if half else None,
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 999)))


# ---------------------------------------------------------------- kernels vs fp64 autograd
@with_fixture
@given(case=problems(), config=st.sampled_from(sorted(CONFIGS)))
def test_gradients_match_reference(backend, case, config):
    p = random_problem(**case, device=DEVICE)
    dy = _dy(p, case["seed"])
    _check(_grads(backend, p, dy, CONFIGS[config]), p, dy)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("groups", [(None, None), (None, 2), (2, 1), (4, 4)])
def test_routings_and_groups(backend, routing, groups):
    """Every routing (empty experts, one expert with all pairs, duplicates) with 2-D / 3-D x and
    G_out = S, < S, 1; the public API (autograd) and an explicit split config."""
    G_in, G_out = groups
    p = random_problem(T=21, S=4, E=5, d_in=18, d_out=20, G_in=G_in, G_out=G_out, routing=routing, device=DEVICE,
                       seed=3)
    dy = _dy(p)
    _check(_grads(backend, p, dy), p, dy)
    _check(_grads(backend, p, dy, CONFIGS["interleaved-split"]), p, dy)
    _check(_grads(backend, p, dy, CONFIGS["dense-z"]), p, dy)


def test_empty_experts_get_zero_weight_gradient(backend):
    p = random_problem(T=10, S=2, E=6, d_in=9, d_out=7, routing="sparse", device=DEVICE, seed=1)
    dy = _dy(p)
    for config in (None, CONFIGS["interleaved-split"], CONFIGS["dense-z"]):
        _, dw, _ = _grads(backend, p, dy, config)
        assert dw is not None and torch.equal(dw[1::2], torch.zeros_like(dw[1::2]))  # no NaN, exactly 0
        assert dw[0::2].abs().sum() > 0


def test_gradients_of_single_inputs(backend):
    """Only one input requires grad: the others get None, the asked one is right."""
    p = random_problem(T=11, S=4, E=3, d_in=10, d_out=6, G_in=2, G_out=2, device=DEVICE, seed=2)
    dy = _dy(p)
    for want in (("x",), ("weight",), ("gates",), ("x", "gates")):
        _check(_grads(backend, p, dy, want=want), p, dy, want=want)


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("T", [0, 1])
def test_tiny_token_counts(backend, dtype, T):
    for G_in, G_out in ((None, None), (2, 1)):
        p = random_problem(T=T, S=4, E=5, d_in=12, d_out=9, G_in=G_in, G_out=G_out, dtype=dtype, device=DEVICE)
        dy = _dy(p)
        grads = _grads(backend, p, dy)
        _check(grads, p, dy)
        if T == 0:  # no pairs: every expert's d weight is exactly zero
            assert torch.equal(grads[1], torch.zeros_like(grads[1]))


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("shape", ["47m_v", "47m_o"])
def test_odd_paper_sizes(backend, dtype, shape):
    """SwitchHead-47M sizes (d_model 412, d_head 76): no 16-byte alignment of rows anywhere."""
    kw = {"47m_v": dict(S=6, E=10, d_in=412, d_out=76, G_out=2),
          "47m_o": dict(S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1)}[shape]
    p = random_problem(T=5, **kw, dtype=dtype, device=DEVICE, seed=1)
    dy = _dy(p)
    _check(_grads(backend, p, dy), p, dy)


@pytest.mark.parametrize("dtype", [d for d in dtypes_here() if d != torch.float32])
def test_fp32_master_weights(backend, dtype):
    """16-bit x with fp32 weights: d weight is fp32."""
    p = random_problem(T=14, S=4, E=5, d_in=24, d_out=20, G_out=2, dtype=dtype, weight_dtype=torch.float32,
                       device=DEVICE, seed=2)
    dy = _dy(p)
    for config in (None, CONFIGS["cast-w"]):
        grads = _grads(backend, p, dy, config)
        assert grads[1].dtype == torch.float32
        _check(grads, p, dy)


def test_strided_inputs(backend):
    """Weight with transposed strides, x a strided view, gates a transposed view, dy non-contiguous."""
    p = random_problem(T=9, S=4, E=4, d_in=14, d_out=11, G_in=2, G_out=2, device=DEVICE, seed=4)
    p["weight"] = p["weight"].transpose(1, 2).contiguous().transpose(1, 2)
    p["x"] = torch.cat([p["x"], p["x"]], -1)[..., :14]
    p["gates"] = p["gates"].t().contiguous().t()
    dy = _dy(p).transpose(0, 1).contiguous().transpose(0, 1)
    assert p["weight"].stride(2) != 1 and not dy.is_contiguous()
    _check(_grads(backend, p, dy), p, dy)
    _check(_grads(backend, p, dy, CONFIGS["small"]), p, dy)


def test_d_out_zero_and_d_in_zero(backend):
    for d_in, d_out in ((6, 0), (0, 5)):
        p = random_problem(T=4, S=2, E=3, d_in=d_in, d_out=d_out, G_out=1, device=DEVICE)
        dy = _dy(p)
        dx, dw, dg = _grads(backend, p, dy)
        assert dx.shape == p["x"].shape and dw.shape == p["weight"].shape and dg.shape == p["gates"].shape
        for g in (dx, dw, dg):
            assert torch.equal(g, torch.zeros_like(g))


def test_deterministic_bitwise(backend):
    """Two backward calls give bitwise-equal gradients (split-K partials and slot sums in fixed order)."""
    p = random_problem(T=30, S=4, E=3, d_in=24, d_out=20, G_out=1, routing="duplicates", device=DEVICE, seed=5)
    dy = _dy(p)
    for config in (None, CONFIGS["interleaved-split"]):
        a = _grads(backend, p, dy, config)
        b = _grads(backend, p, dy, config)
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_run_backward_matches_autograd(backend):
    p = random_problem(T=12, S=4, E=3, d_in=10, d_out=8, G_in=2, G_out=2, device=DEVICE, seed=6)
    dy = _dy(p)
    kernel = op.run_backward(backend, None, (dy,), **p)
    auto = _grads(backend, p, dy)
    ref = op.run_backward("reference", None, dy, **p)
    assert len(kernel) == len(op.GRAD_INPUTS) == len(ref)
    for k, a, r in zip(kernel, auto, ref):
        assert torch.equal(k, a)
        assert_close("run_backward", k, r, p["x"].dtype)
    q = dict(p, gates=None)
    assert op.run_backward(backend, None, dy, **q)[2] is None and op.run_backward("reference", None, dy, **q)[2] is None


# ---------------------------------------------------------------- reference, dispatch plumbing
def test_reference_gradcheck():
    p = random_problem(T=5, S=4, E=3, d_in=4, d_out=3, G_in=2, G_out=2, routing="duplicates", dtype=torch.float64,
                       device=DEVICE)
    x, w, g = (p[k].clone().requires_grad_() for k in ("x", "weight", "gates"))
    torch.autograd.gradcheck(lambda x, w, g: torch_expert_matmul(x, p["expert_idx"], w, gates=g, out_groups=2),
                             (x, w, g))


def test_reference_backend_gradients():
    p = random_problem(T=8, S=2, E=3, d_in=6, d_out=5, G_out=1, device=DEVICE)
    dy = _dy(p)
    _check(_grads("reference", p, dy), p, dy)


def _op_args(p, backend, requires_grad):
    rt = route(p["expert_idx"], p["num_experts"])
    x3 = p["x"].unsqueeze(1).detach().clone().requires_grad_(requires_grad)
    w = p["weight"].detach().clone().requires_grad_(requires_grad)
    g = p["gates"].detach().clone().requires_grad_(requires_grad)
    return x3, w, g, rt


def test_opcheck():
    """Schema, fake-tensor, autograd-registration and AOT-dispatch checks of the forward op (inputs that
    require grad) and of the backward op."""
    backends = kernel_backends()
    if not backends:
        pytest.skip("no kernel backend here")
    p = random_problem(T=7, S=4, E=3, d_in=8, d_out=6, G_out=2, device=DEVICE)
    x3, w, g, rt = _op_args(p, backends[0], True)
    torch.library.opcheck(op.OPDEF.op, (x3, w, g, rt.token, rt.slot, rt.offsets, 4, 2, False, backends[0]))
    dy = _dy(p)
    for need in ((True, True, True), (True, False, False), (False, True, True)):
        args = (dy, x3.detach(), w.detach(), g.detach(), rt.token, rt.slot, rt.offsets, 4, 2, False, *need,
                backends[0])
        torch.library.opcheck(op.OPDEF.backward_op, args)


def test_torch_compile_fullgraph(backend):
    """Gradients through torch.compile(fullgraph=True) equal eager ones (aot_eager traces the backward
    on the CPU; inductor on the GPU)."""
    p = random_problem(T=9, S=4, E=3, d_in=8, d_out=6, G_in=2, G_out=1, device=DEVICE)
    rt = route(p["expert_idx"], 3)
    dy = _dy(p)

    def loss(x, w, g):
        return (expert_matmul(x, rt, w, gates=g, out_groups=1, backend=backend) * dy).sum()

    def grads(fn):
        leaves = [p[k].detach().clone().requires_grad_() for k in ("x", "weight", "gates")]
        return torch.autograd.grad(fn(*leaves), leaves)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if GPU else "aot_eager")
    for a, b in zip(grads(compiled), grads(loss)):
        assert torch.equal(a, b)



@pytest.mark.parametrize("backend", ["auto", "reference", "triton", "cuda"])
def test_torch_compile_fullgraph_route_inside(backend):
    """The route built inside the compiled function, as the layers build theirs (issue 49: route() once
    built its Route in a way dynamo could not trace, and the reference read the ids' range on the host):
    fullgraph=True traces it and gives eager's output and gradients. "auto" is the issue's call itself
    (the reference on the CPU)."""
    if backend not in ("auto", "reference") and backend not in kernel_backends():
        pytest.skip(f"backend {backend} is not available on {DEVICE}")
    p = random_problem(T=9, S=4, E=16, d_in=8, d_out=6, G_out=2, device=DEVICE)
    if backend == "auto":
        f = lambda x, idx, w, g: expert_matmul(x, route(idx, 16, check=False), w, gates=g, out_groups=2)  # noqa: E731
    else:
        f = lambda x, idx, w, g: expert_matmul(x, route(idx, 16, check=False), w, gates=g, out_groups=2,  # noqa: E731
                                               backend=backend)
    dy = _dy(p)

    def run(fn):
        leaves = [p[k].detach().clone().requires_grad_() for k in ("x", "weight", "gates")]
        y = fn(leaves[0], p["expert_idx"], *leaves[1:])
        return (y, *torch.autograd.grad(y, leaves, dy))

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if GPU else "aot_eager")
    # the forward's slot sum may use atomics (not deterministic=True), the reference's compiled dx sums in
    # another order: close, not bitwise
    for name, a, b in zip(("y", "dx", "dweight", "dgates"), run(compiled), run(f)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_reference_drops_out_of_range_ids():
    """route(check=False) on the reference backend, eager and compiled: a pair whose id lies outside
    [0, E) belongs to no expert, as in the kernels' route: y as if its gate were 0, and a zero gate
    gradient."""
    p = random_problem(T=7, S=4, E=5, d_in=8, d_out=6, G_in=2, G_out=2, device=DEVICE)
    idx = p["expert_idx"].clone()
    idx[1, 0], idx[4, 3] = 5, -2
    dropped = (idx < 0) | (idx >= 5)
    dy = _dy(p)

    def f(x, idx, w, g):
        return expert_matmul(x, route(idx, 5, check=False), w, gates=g, out_groups=2, backend="reference")

    def run(fn):
        leaves = [p[k].detach().clone().requires_grad_() for k in ("x", "weight", "gates")]
        y = fn(leaves[0], idx, *leaves[1:])
        return (y, *torch.autograd.grad(y, leaves, dy))

    torch._dynamo.reset()
    compiled, eager = run(torch.compile(f, fullgraph=True, backend="aot_eager")), run(f)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    expected = torch_expert_matmul(p["x"], idx.clamp(0, 4), p["weight"], gates=p["gates"].masked_fill(dropped, 0),
                                   out_groups=2)
    for y, dg in ((compiled[0], compiled[3]), (eager[0], eager[3])):
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
        assert not dg[dropped].any() and dg[~dropped].all()


def test_reference_op_gradients():
    """The traced reference's custom ops: registrations (opcheck) and the hand-written backward against
    finite differences in fp64, with grouped input rows and output groups."""
    p = random_problem(T=5, S=4, E=3, d_in=4, d_out=3, G_in=2, G_out=2, dtype=torch.float64, device=DEVICE)
    x, w, g = (p[k].detach().clone().requires_grad_() for k in ("x", "weight", "gates"))
    idx = p["expert_idx"].clone()
    idx[2, 1] = 3  # dropped
    torch.library.opcheck(torch_expert_matmul_op, (x, idx, w, g, 2))
    torch.library.opcheck(torch_expert_matmul_dweight_op, (x.detach(), idx, w.detach(), _dy(p).double(), g.detach()))
    torch.autograd.gradcheck(lambda x, w, g: torch_expert_matmul_op(x, idx, w, g, 2), (x, w, g))
    torch.autograd.gradcheck(lambda x, w: torch_expert_matmul_op(x, idx, w, None, 1), (x, w))

def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        dy = torch.empty(7, 2, 3)
        x3 = torch.empty(7, 2, 10)
        w = torch.empty(5, 10, 3)
        g = torch.empty(7, 4)
        tok = torch.empty(28, dtype=torch.int32)
        off = torch.empty(6, dtype=torch.int64)
        dx, dw, dg = op.OPDEF.backward_op(dy, x3, w, g, tok, tok, off, 4, 2, False, True, True, True, "triton")
        e = op.OPDEF.backward_op(dy, x3, w, None, tok, tok, off, 4, 2, False, False, True, False, "triton")
    assert (tuple(dx.shape), tuple(dw.shape), tuple(dg.shape)) == ((7, 2, 10), (5, 10, 3), (7, 4))
    assert e[0].numel() == 0 and tuple(e[1].shape) == (5, 10, 3) and e[2].numel() == 0


def test_backward_space_has_default():
    from flashswitch.autotune import space
    from flashswitch.reference.expert_matmul import paper_shapes
    for kw in paper_shapes().values():
        for dtype in (torch.bfloat16, torch.float32):
            q = random_problem(**dict(kw, T=16), dtype=dtype)
            x3 = op._x3(q["x"])
            f = op._features(op.OP_BWD, x3, q["weight"], q["expert_idx"].shape[1],
                             q["out_groups"] or q["expert_idx"].shape[1], q["gates"] is not None)
            f["tokens"] = 16384
            configs = space.config_space(op.OP_BWD, "triton", f)
            default = space.default_config(op.OP_BWD, "triton", f)
            assert 0 < len(configs) <= 40 and default in configs
            assert all(set(K.CONFIG_KEYS) <= set(c) for c in configs)


@pytest.mark.parametrize("bad,match", [({"DX_BLOCK_M": 24}, "DX_BLOCK_M"), ({"SPLIT_K": 0}, "SPLIT_K"),
                                       ({"DX_PARTIALS": "fp8"}, "DX_PARTIALS"), ({"DW_BLOCK_K": None}, "missing"),
                                       ({"DENSE_Z": 1}, "DENSE_Z")])
def test_triton_rejects_bad_config(bad, match):
    if "triton" not in kernel_backends():
        pytest.skip("triton cannot run here")
    p = random_problem(T=5, S=2, E=3, d_in=8, d_out=6, device=DEVICE)
    config = {**_SMALL, **bad}
    if bad.get("DW_BLOCK_K", 0) is None:
        del config["DW_BLOCK_K"]
    with pytest.raises(ValueError, match=match):
        op.run_backward("triton", config, _dy(p), **p)


# ---------------------------------------------------------------- GPU only: sync-free, graphs, speed shapes
def _gpu_problem(G_in=None, G_out=None, seed=0, T=300):
    return random_problem(T=T, S=8, E=16, d_in=96, d_out=80, G_in=G_in, G_out=G_out, dtype=torch.bfloat16,
                          weight_dtype=torch.float32, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("G_in,G_out", [(None, 2), (4, 1), (8, None)])
def test_no_host_sync(backend, G_in, G_out):
    p = _gpu_problem(G_in, G_out)
    dy = _dy(p)
    op.run_backward(backend, None, dy, **p)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = op.run_backward(backend, None, dy, **p)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _check(grads, p, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("G_in,G_out", [(None, 2), (4, 1)])
def test_cuda_graph_fwd_bwd_step(backend, G_in, G_out):
    """A whole step (routing without its check, forward, backward into .grad) captured and replayed on
    new inputs copied into the captured tensors."""
    p = _gpu_problem(G_in, G_out)
    leaves = {k: p[k].detach().clone().requires_grad_() for k in ("x", "weight", "gates")}
    idx = p["expert_idx"].clone()
    dy = _dy(p)

    def step():
        for t in leaves.values():
            t.grad = None
        y = expert_matmul(leaves["x"], route(idx, 16, check=False), leaves["weight"], gates=leaves["gates"],
                          out_groups=G_out, backend=backend)
        y.backward(dy)

    graph, _ = cuda_graph_capture(step)
    q = _gpu_problem(G_in, G_out, seed=1)
    with torch.no_grad():
        for k, t in leaves.items():
            t.copy_(q[k])
        idx.copy_(q["expert_idx"])
    graph.replay()
    torch.cuda.synchronize()
    _check(tuple(leaves[k].grad for k in op.GRAD_INPUTS), q, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["switchhead262m_v", "switchhead262m_o", "sigma_moe_up", "sigma_moe_down"])
def test_paper_shapes_bf16_deterministic(backend, shape):
    """The speed targets' shapes (fewer tokens) in bf16: right and bitwise reproducible."""
    from flashswitch.reference.expert_matmul import paper_shapes
    p = random_problem(**paper_shapes(T=2048)[shape], dtype=torch.bfloat16, device="cuda")
    dy = _dy(p)
    a = op.run_backward(backend, None, dy, **p)
    b = op.run_backward(backend, None, dy, **p)
    for u, v in zip(a, b):
        assert u is None and v is None or torch.equal(u, v)
    _check(a, p, dy)


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("mode,G_in,G_out,weight_dtype", [("dense-z", 1, 3, None), ("dense-z", 2, 3, None),
                                                          ("dense-z", 1, 3, torch.float32),
                                                          ("dense-x", 3, 1, None), ("dense-x", 3, 2, None),
                                                          ("dense-x", 6, 1, torch.float32)])
def test_dense_modes_sum_slots_sharing_an_expert(backend, dtype, mode, G_in, G_out, weight_dtype):
    """DENSE_Z / DENSE_X: with 2 experts and 6 slots per token, most tokens give one expert several
    slots of a group (their gated dy rows, or x rows, are summed into one Z block); fp32 weights under
    16-bit x get an fp32 dW from the same dense GEMM."""
    if weight_dtype is not None and dtype == torch.float32:
        pytest.skip("master weights only apply to 16-bit x")
    p = random_problem(T=37, S=6, E=2, d_in=24, d_out=10, G_in=G_in, G_out=G_out, dtype=dtype,
                       weight_dtype=weight_dtype, device=DEVICE, seed=4)
    dy = _dy(p)
    got = _grads(backend, p, dy, CONFIGS[mode])
    _check(got, p, dy)
    again = _grads(backend, p, dy, CONFIGS[mode])
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, again))
    # one gradient at a time (d gates alone takes only the U / dZ path), bitwise the same as all together
    rt = route(p["expert_idx"], p["num_experts"])
    x3 = op._x3(p["x"])
    for i, need in enumerate(((True, False, False), (False, True, False), (False, False, True))):
        one = op.OPDEF.backward(backend, (x3, p["weight"], p["gates"], rt, G_out, False), None, (dy,), need,
                                config=CONFIGS[mode])
        assert torch.equal(one[i].view_as(got[i]), got[i])


@pytest.mark.parametrize("G_in,G_out", [(None, 2), (2, 1)])
def test_eager_autograd_path_equals_the_custom_op(backend, G_in, G_out, monkeypatch):
    """Eager calls that need gradients skip the custom op's dispatcher (a torch.autograd.Function over
    the same kernels, with the call plan's prepared backward): bitwise the gradients of the custom op
    path, the custom op never called, and the backward prepared once per signature and wanted set."""
    from flashswitch import _common as Cm
    from flashswitch.ops import call_plan
    call_plan.clear_all()  # a plan of this signature from an earlier test would hide the first prepare
    p = random_problem(T=21, S=4, E=5, d_in=24, d_out=20, G_in=G_in, G_out=G_out, device=DEVICE, seed=11)
    dy = _dy(p)
    calls, prepared = [], []
    real_op, real_prepare = op.OPDEF.op, K.prepare
    monkeypatch.setattr(op.OPDEF, "op", lambda *a: calls.append(1) or real_op(*a))
    monkeypatch.setattr(K, "prepare", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
    fast = [_grads(backend, p, dy) for _ in range(3)]
    assert not calls and len(prepared) == 1
    fast.append(_grads(backend, p, dy, want=("x",)))  # another wanted set: prepared once more
    assert len(prepared) == 2 and torch.equal(fast[-1][0], fast[0][0]) and fast[-1][1] is None
    monkeypatch.setattr(Cm, "eager_autograd_path", lambda *tensors: False)
    slow = _grads(backend, p, dy)
    assert calls
    for a, b in zip(fast[0], slow):
        assert torch.equal(a, b)
    for again in fast[1:3]:
        assert all(torch.equal(a, b) for a, b in zip(again, fast[0]))
