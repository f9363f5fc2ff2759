"""Op 3 kernels (every kernel backend that can run here) and `route`, against the fp64 NumPy oracle.

A kernel output must be within 2x the error of the PyTorch reference in the same precision plus the
dtype's rounding floor (the SPEC rule). Outputs start as NaN
(FLASHSWITCH_POISON), so a row a kernel forgets to write fails. Small explicit configs (16-wide
tiles) make the tile logic (tiles per expert, schedules, masks) show on small problems; `None` is the
heuristic / tuned config.
"""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, cuda_graph_capture, dtypes_here, kernel_backends
from flashswitch.backends import available as backend_available
from flashswitch.ops import expert_matmul as op
from flashswitch.ops.expert_matmul import Route, expert_matmul, route
from flashswitch.reference.expert_matmul import ROUTINGS, numpy_expert_matmul, random_problem, torch_expert_matmul
from flashswitch.testing import assert_close

GPU = DEVICE == "cuda"
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])

_SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
CONFIGS = {
    "default": None,
    "interleaved": {**_SMALL, "GROUP_N": 1, "INTERLEAVE": True},
    "expert-major": {**_SMALL, "GROUP_N": 2, "INTERLEAVE": False},
    "ordered-sum": {**_SMALL, "GROUP_N": 2, "INTERLEAVE": False, "REDUCE": "ordered"},
    # partials rounded to y's dtype: atomics straight into y, a half-size ordered scratch
    "out-atomic": {**_SMALL, "GROUP_N": 1, "INTERLEAVE": True, "PARTIALS": "out"},
    "out-ordered": {**_SMALL, "GROUP_N": 2, "INTERLEAVE": False, "REDUCE": "ordered", "PARTIALS": "out"},
    # y = Z · W_cat over a dense Z of gated x rows per output group (the Triton backend; the others ignore it)
    "dense-z": {**_SMALL, "GROUP_N": 1, "INTERLEAVE": False, "DENSE_Z": True},
    # the CUDA backend's variant 2 (where d_in, d_out are multiples of 8; the other backends ignore it)
    "cuda-v2": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2, GROUP_N=1, INTERLEAVE=False,
                    variant=2),
}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _call(backend, p, config=None, deterministic=False, check=True):
    """y from the public API (config None) or from run_kernel with an explicit config."""
    if config is None:
        rt = route(p["expert_idx"], p["num_experts"], check=check)
        return expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], out_groups=p["out_groups"],
                             deterministic=deterministic, backend=backend)
    return op.run_kernel(backend, config, **p, deterministic=deterministic)


def _check(y, p):
    x = p["x"]
    args = dict(gates=p["gates"], out_groups=p["out_groups"])
    ref = numpy_expert_matmul(x, p["expert_idx"], p["weight"], **args)
    base = torch_expert_matmul(x, p["expert_idx"], p["weight"], **args)
    assert tuple(y.shape) == ref.shape
    assert y.dtype == x.dtype and y.device.type == DEVICE
    assert_close("y", y, ref, x.dtype, baseline=base)


@st.composite
def problems(draw):
    S = draw(st.sampled_from([1, 2, 3, 4, 6]))
    dtype = draw(st.sampled_from(dtypes_here()))
    half = dtype in (torch.float16, torch.bfloat16)
    return dict(T=draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, 40))), S=S, E=draw(st.integers(1, 9)),
                d_in=draw(st.sampled_from([1, 7, 16, 33, 50])), d_out=draw(st.sampled_from([1, 5, 16, 19, 40])),
                G_in=draw(st.sampled_from([None] + _divisors(S))), G_out=draw(st.sampled_from([None] + _divisors(S))),
                gated=draw(st.booleans()), routing=draw(st.sampled_from(ROUTINGS)), dtype=dtype,
                weight_dtype=draw(st.sampled_from([None, torch.float32])) if half else None,
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 999)))


# ---------------------------------------------------------------- kernel vs oracle
@with_fixture
@given(case=problems(), config=st.sampled_from(sorted(CONFIGS)), deterministic=st.booleans())
def test_kernel_matches_reference(backend, case, config, deterministic):
    p = random_problem(**case, device=DEVICE)
    _check(_call(backend, p, CONFIGS[config], deterministic), p)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", ["store", "groups", "sum", "sum-det"])
def test_routings_and_modes(backend, routing, mode):
    """Every routing (empty experts, one expert with all pairs, duplicates) in each output mode."""
    G_out, det = {"store": (None, False), "groups": (2, False), "sum": (1, False), "sum-det": (1, True)}[mode]
    p = random_problem(T=37, S=4, E=6, d_in=20, d_out=24, G_out=G_out, routing=routing, device=DEVICE, seed=5)
    for config in CONFIGS.values():
        _check(_call(backend, p, config, det), p)


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("T", [0, 1, 2])
def test_tiny_token_counts(backend, dtype, T):
    for G_in, G_out in ((None, None), (2, 1), (None, 2)):
        p = random_problem(T=T, S=4, E=5, d_in=12, d_out=9, G_in=G_in, G_out=G_out, dtype=dtype, device=DEVICE)
        y = _call(backend, p)
        assert y.shape == (T, 4 if G_out is None else G_out, 9)
        _check(y, p)


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("shape", ["47m_v", "47m_o"])
def test_odd_paper_sizes(backend, dtype, shape):
    """SwitchHead-47M sizes (d_model 412, d_head 76): no 16-byte alignment of rows anywhere."""
    kw = {"47m_v": dict(S=6, E=10, d_in=412, d_out=76, G_out=2),
          "47m_o": dict(S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1)}[shape]
    p = random_problem(T=9, **kw, dtype=dtype, device=DEVICE, seed=1)
    _check(_call(backend, p), p)


@pytest.mark.parametrize("dtype", [d for d in dtypes_here() if d != torch.float32])
def test_fp32_master_weights(backend, dtype):
    p = random_problem(T=30, S=4, E=5, d_in=24, d_out=20, G_out=2, dtype=dtype, weight_dtype=torch.float32,
                       device=DEVICE, seed=2)
    for det in (False, True):
        _check(_call(backend, p, deterministic=det), p)
    q = dict(p, gates=p["gates"].float())  # gates in another float dtype than x
    _check(_call(backend, q), q)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G_out,det", [(None, False), (2, False), (2, True)])
def test_cast_w_runs_on_16bit_weights(dtype, G_out, det, monkeypatch):
    """Config CAST_W: the tile kernel gets a 16-bit copy of fp32 master weights, made once per call
    (fp16 also under the CPU interpreter, whose bf16 dots are wrong)."""
    if "triton" not in kernel_backends() or dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("triton cannot run this here")
    from flashswitch.kernels_triton import expert_matmul as K
    casts = []
    monkeypatch.setattr(K, "weights_in", lambda w, dt: casts.append(dt) or w.to(dt).contiguous())
    p = random_problem(T=30, S=4, E=5, d_in=24, d_out=20, G_out=G_out, dtype=dtype, weight_dtype=torch.float32,
                       device=DEVICE, seed=3)
    _check(_call("triton", p, config={"CAST_W": True}, deterministic=det), p)
    assert casts == [dtype]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtypes(backend, index_dtype):
    p = random_problem(T=25, S=3, E=7, G_in=3, G_out=1, index_dtype=index_dtype, device=DEVICE, seed=4)
    _check(_call(backend, p), p)


def test_strided_inputs(backend):
    """x with padded rows, weight transposed in memory or sliced, gates column-major: any strides work."""
    p = random_problem(T=21, S=4, E=5, d_in=18, d_out=14, G_in=2, G_out=2, device=DEVICE, seed=6)
    x = torch.zeros(21, 2, 32, device=DEVICE)
    x[..., :18] = p["x"]
    w_t = p["weight"].transpose(1, 2).contiguous().transpose(1, 2)
    w_big = torch.zeros(5, 18, 40, device=DEVICE)
    w_big[:, :, 3:17] = p["weight"]
    g = p["gates"].t().contiguous().t()
    for w in (w_t, w_big[:, :, 3:17]):
        q = dict(p, x=x[..., :18], weight=w, gates=g)
        for config in CONFIGS.values():
            _check(_call(backend, q, config), q)


def test_large_expert_count(backend):
    """More experts than one scan step of a program's tile search (1024), most of them empty."""
    p = random_problem(T=40, S=2, E=1500, d_in=16, d_out=16, G_out=1, device=DEVICE, seed=8)
    for config in (None, CONFIGS["expert-major"]):
        _check(_call(backend, p, config), p)


@pytest.mark.parametrize("counts", [[16, 0, 32, 15, 17, 1], [0, 0, 81, 0], [1] * 9 + [40]])
def test_tile_boundaries(backend, counts):
    """Experts whose pair counts sit on, just below and just above 16-row tile edges, and empty ones."""
    E = len(counts)
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    p = random_problem(T=len(ids), S=1, E=E, d_in=24, d_out=20, device=DEVICE, seed=13)
    p["expert_idx"] = ids.reshape(-1, 1).to(DEVICE)
    for config in CONFIGS.values():
        _check(_call(backend, p, config), p)


def test_d_in_zero(backend):
    p = random_problem(T=6, S=2, E=3, d_in=0, d_out=5, G_out=1, device=DEVICE)
    y = _call(backend, p)
    assert y.shape == (6, 1, 5) and torch.equal(y, torch.zeros_like(y))


# ---------------------------------------------------------------- SPEC property 8 on the kernel
def test_token_permutation_permutes_outputs(backend):
    p = random_problem(T=33, S=4, E=5, d_in=20, d_out=12, G_in=2, G_out=2, device=DEVICE, seed=9)
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    q = dict(p, x=p["x"][perm], expert_idx=p["expert_idx"][perm], gates=p["gates"][perm])
    for config in CONFIGS.values():
        y, yq = _call(backend, p, config), _call(backend, q, config)
        torch.testing.assert_close(yq, y[perm], rtol=1e-5, atol=1e-6)


def test_linear_in_gates_x_and_weight(backend):
    p = random_problem(T=29, S=4, E=4, d_in=16, d_out=12, G_out=1, device=DEVICE, seed=10)
    q = random_problem(T=29, S=4, E=4, d_in=16, d_out=12, G_out=1, device=DEVICE, seed=11)
    a, b = 0.7, -1.3
    y = _call(backend, p)
    for name in ("gates", "x", "weight"):
        mix = dict(p, **{name: a * p[name] + b * q[name]})
        other = dict(p, **{name: q[name]})
        torch.testing.assert_close(_call(backend, mix), a * y + b * _call(backend, other), rtol=1e-4, atol=1e-5)


def test_duplicate_experts_add_up(backend):
    """A token picking expert e in two slots of one group gets twice that expert's (ungated) output."""
    T, E = 17, 4
    x = torch.randn(T, 12, device=DEVICE)
    w = torch.randn(E, 12, 8, device=DEVICE)
    e = torch.randint(0, E, (T,), device=DEVICE)
    y2 = expert_matmul(x, route(torch.stack([e, e], 1), E), w, out_groups=1, backend=backend)
    y1 = expert_matmul(x, route(e[:, None], E), w, backend=backend)
    torch.testing.assert_close(y2, 2 * y1, rtol=1e-5, atol=1e-5)


def test_matches_dense_loop(backend):
    """Equals, per expert, a dense matmul of all rows masked to the pairs routed there (fp64 loop)."""
    p = random_problem(T=23, S=4, E=5, d_in=10, d_out=7, G_in=2, G_out=2, device=DEVICE, seed=12)
    y = _call(backend, p)
    x64, w64 = p["x"].double(), p["weight"].double()
    rows = x64.repeat_interleave(2, 1)  # [T, S, d_in]: slot s reads group s // 2
    full = torch.zeros(23, 4, 7, dtype=torch.float64, device=DEVICE)
    for e in range(5):
        full += ((p["expert_idx"] == e).double() * p["gates"].double())[..., None] * (rows @ w64[e])
    torch.testing.assert_close(y.double(), full.reshape(23, 2, 2, 7).sum(2), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- route
def _np_route(idx: np.ndarray, E: int):
    order = np.argsort(idx.reshape(-1), kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(idx.reshape(-1), minlength=E))])
    return order, offsets


@given(T=st.integers(0, 50), S=st.integers(1, 5), E=st.integers(1, 12), seed=st.integers(0, 999),
       index_dtype=st.sampled_from([torch.int32, torch.int64]), check=st.booleans())
def test_route_is_stable_sort(T, S, E, seed, index_dtype, check):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (T, S), generator=g).to(index_dtype)
    rt = route(idx.to(DEVICE), E, check=check)
    order, offsets = _np_route(idx.numpy(), E)
    assert (rt.T, rt.S, rt.E, rt.num_pairs) == (T, S, E, T * S)
    assert rt.token.dtype == rt.slot.dtype == torch.int32 and rt.offsets.dtype == torch.int64
    assert rt.token.device.type == DEVICE
    np.testing.assert_array_equal(rt.token.cpu().numpy(), order // S)
    np.testing.assert_array_equal(rt.slot.cpu().numpy(), order % S)
    np.testing.assert_array_equal(rt.offsets.cpu().numpy(), offsets)
    np.testing.assert_array_equal(rt.counts.cpu().numpy(), np.diff(offsets))
    pos = rt.position.cpu().numpy()
    np.testing.assert_array_equal(pos[order], np.arange(T * S))


def test_route_wide_expert_ids():
    """Ids past the int16 sort-key range (E > 32766) sort the same way."""
    idx = torch.tensor([[40000, 3], [0, 39999], [40000, 40000]], device=DEVICE)
    rt = route(idx, 40001)
    assert rt.token.tolist() == [1, 0, 1, 0, 2, 2] and rt.slot.tolist() == [0, 1, 1, 0, 0, 1]
    assert rt.offsets[[0, 1, 4, 39999, 40000, 40001]].tolist() == [0, 1, 2, 2, 3, 6]


@pytest.mark.parametrize("bad", [-1, 6, 2 ** 15, 2 ** 16 + 2])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_route_out_of_range(bad, index_dtype):
    idx = torch.tensor([[0, 1], [2, bad], [5, 5]], dtype=index_dtype, device=DEVICE)
    with pytest.raises(ValueError, match=r"out of range \[0, num_experts\)"):
        route(idx, 6)
    rt = route(idx, 6, check=False)  # no check: the bad pair belongs to no expert, never wraps into one
    assert int(rt.offsets[-1] - rt.offsets[0]) == 5
    sel = slice(int(rt.offsets[0]), int(rt.offsets[-1]))
    pairs = set(zip(rt.token[sel].tolist(), rt.slot[sel].tolist()))
    assert (1, 1) not in pairs and len(pairs) == 5


def test_route_is_frozen():
    rt = route(torch.zeros(3, 2, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.T = 4
    assert isinstance(rt, Route) and rt.offsets.tolist() == [0, 6, 6]


@pytest.mark.parametrize("args,err,match", [
    ((torch.zeros(3, 2), 4), TypeError, "expert_idx"),
    ((torch.zeros(3, 2, dtype=torch.int16), 4), TypeError, "expert_idx"),
    ((torch.zeros(6, dtype=torch.int64), 4), ValueError, "expert_idx"),
    ((torch.zeros(3, 0, dtype=torch.int64), 4), ValueError, "expert_idx"),
    (([[0, 1]], 4), TypeError, "expert_idx"),
    ((torch.zeros(3, 2, dtype=torch.int64), 0), ValueError, "num_experts"),
    ((torch.zeros(3, 2, dtype=torch.int64), 2.0), TypeError, "num_experts"),
    ((torch.zeros(3, 2, dtype=torch.int64), True), TypeError, "num_experts"),
])
def test_route_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        route(*args)


# ---------------------------------------------------------------- bad inputs of expert_matmul
def _bad_cases():
    T, S, E = 5, 4, 3
    x = torch.randn(T, 8)
    idx = torch.randint(0, E, (T, S))
    w = torch.randn(E, 8, 6)
    g = torch.rand(T, S)
    rt = route(idx, E)
    return [
        (dict(x=x.long()), TypeError, "x has dtype"),
        (dict(x=torch.randn(T, 2, 2, 8)), ValueError, "x must be"),
        (dict(x=torch.randn(T + 1, 8)), ValueError, "T = 6"),
        (dict(x=torch.randn(T, 3, 8)), ValueError, "G_in = 3"),
        # made on the test device: .to("cuda") of a strided CPU view would come back contiguous
        (dict(x=torch.randn(T, 16, device=DEVICE)[:, ::2]), ValueError, "x must be contiguous"),
        (dict(route=idx), TypeError, "route must be"),
        (dict(route=route(idx, E + 1)), ValueError, "num_experts = 4"),
        (dict(weight=torch.randn(E + 1, 8, 6)), ValueError, "weight has 4 experts"),
        (dict(weight=torch.randn(E, 7, 6)), ValueError, "weight has d_in = 7"),
        (dict(weight=torch.randn(E, 8)), ValueError, "weight must have 3 dims"),
        (dict(weight=w.half()), TypeError, "weight has dtype"),
        (dict(x=x.half(), weight=w.bfloat16()), TypeError, "weight has dtype"),
        (dict(weight=w.to("meta")), ValueError, "weight is on meta"),
        (dict(gates=torch.rand(T, S + 1)), ValueError, "gates has shape"),
        (dict(gates=torch.ones(T, S, dtype=torch.int64)), TypeError, "gates has dtype"),
        (dict(gates=g.to("meta")), ValueError, "gates is on meta"),
        (dict(out_groups=3), ValueError, "out_groups = 3 must divide"),
        (dict(out_groups=0), ValueError, "out_groups must be >= 1"),
        (dict(out_groups=2.0), TypeError, "out_groups must be an int"),
        (dict(deterministic=1), TypeError, "deterministic must be a bool"),
        (dict(backend="nope"), ValueError, "backend must be one of"),
    ], dict(x=x, route=rt, weight=w, gates=g)


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_bad_inputs(case):
    cases, base = _bad_cases()
    change, err, match = cases[case]
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
          for k, v in {**base, **change}.items()}
    if isinstance(kw["route"], Route) and kw["route"].device.type != DEVICE:
        r = kw["route"]
        kw["route"] = route(r.expert_idx.to(DEVICE), r.E)
    x, rt, w = kw.pop("x"), kw.pop("route"), kw.pop("weight")
    with pytest.raises(err, match=match):
        expert_matmul(x, rt, w, **kw)


def test_route_device_mismatch():
    if not GPU:
        pytest.skip("needs two devices")
    rt = route(torch.zeros(4, 2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="route is on cpu"):
        expert_matmul(torch.randn(4, 8, device="cuda"), rt, torch.randn(3, 8, 5, device="cuda"))


# ---------------------------------------------------------------- dispatch plumbing
def test_reference_backend_is_differentiable():
    p = random_problem(T=9, S=2, E=3, d_in=6, d_out=4, G_out=1, device=DEVICE)
    x = p["x"].clone().requires_grad_()
    y = expert_matmul(x, route(p["expert_idx"], 3), p["weight"], gates=p["gates"], out_groups=1, backend="reference")
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_opcheck():
    """Schema, fake-tensor and AOT-dispatch checks of the registered op (kernel backend where one runs)."""
    backends = kernel_backends()
    if not backends:
        pytest.skip("no kernel backend here")
    p = random_problem(T=9, S=4, E=3, d_in=8, d_out=6, G_out=2, device=DEVICE)
    rt = route(p["expert_idx"], 3)
    args = (p["x"].unsqueeze(1), p["weight"], p["gates"], rt.token, rt.slot, rt.offsets, 4, 2, False, backends[0])
    torch.library.opcheck(op.OPDEF.op, args)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x3 = torch.empty(7, 2, 10)
        w = torch.empty(5, 10, 3)
        tok = torch.empty(28, dtype=torch.int32)
        off = torch.empty(6, dtype=torch.int64)
        y = op.OPDEF.op(x3, w, None, tok, tok, off, 4, 2, False, "triton")
    assert tuple(y.shape) == (7, 2, 3) and y.dtype == torch.float32


def test_features_bucket_token_counts():
    a = op.problem_features(**random_problem(T=1000, S=2, E=3, device=DEVICE))
    b = op.problem_features(**random_problem(T=1030, S=2, E=3, device=DEVICE))
    c = op.problem_features(**random_problem(T=1000, S=2, E=3, G_out=1, device=DEVICE))
    assert a == b and a != c
    assert {"dtype", "wdtype", "d_in", "d_out", "E", "S", "G_in", "G_out", "tokens"} <= set(a)


def test_autotune_space_has_default():
    from flashswitch.autotune import space
    from flashswitch.reference.expert_matmul import paper_shapes
    for kw in paper_shapes().values():
        for dtype in (torch.bfloat16, torch.float32):
            f = op.problem_features(**random_problem(**dict(kw, T=16), dtype=dtype))
            f["tokens"] = 16384
            configs = space.config_space("expert_matmul", "triton", f)
            assert 0 < len(configs) <= 100 and space.default_config("expert_matmul", "triton", f) in configs


# ---------------------------------------------------------------- GPU only: sync-free, graphs, determinism
def _gpu_problem(G_out, seed=0, T=300):
    return random_problem(T=T, S=8, E=16, d_in=96, d_out=80, G_out=G_out, dtype=torch.bfloat16,
                          weight_dtype=torch.float32, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("G_out,det", [(None, False), (2, False), (1, True)])
def test_no_host_sync(backend, G_out, det):
    p = _gpu_problem(G_out)
    _call(backend, p, deterministic=det, check=False)  # compile / load outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = _call(backend, p, deterministic=det, check=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _check(y, p)


@pytest.mark.gpu
@pytest.mark.parametrize("G_out,det", [(None, False), (2, False), (1, True)])
def test_cuda_graph_capture(backend, G_out, det):
    p = _gpu_problem(G_out)

    def step():
        return _call(backend, p, deterministic=det, check=False)

    graph, y = cuda_graph_capture(step)
    q = _gpu_problem(G_out, seed=1)  # new routing and inputs, copied into the captured tensors
    for name in ("x", "expert_idx", "weight", "gates"):
        p[name].copy_(q[name])
    graph.replay()
    torch.cuda.synchronize()
    _check(y, p)


@pytest.mark.gpu
@pytest.mark.parametrize("G_out", [1, 2, None])
def test_deterministic_is_bitwise_reproducible(backend, G_out):
    p = random_problem(T=4096, S=8, E=16, d_in=128, d_out=256, G_out=G_out, dtype=torch.bfloat16, device="cuda")
    rt = route(p["expert_idx"], 16)
    runs = [expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], out_groups=G_out, deterministic=True,
                          backend=backend) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    _check(runs[0], p)


@pytest.mark.gpu
def test_out_partials_two_slots_per_group_are_reproducible():
    """PARTIALS "out" with two slots per output group: 0 + a is exact and a + b one rounding in
    either order, so the bf16 atomics give the same bits on every run."""
    p = random_problem(T=4096, S=8, E=16, d_in=128, d_out=112, G_out=4, dtype=torch.bfloat16, device="cuda", seed=3)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_N": 1, "INTERLEAVE": True, "num_warps": 8,
           "num_stages": 3, "PARTIALS": "out"}
    runs = [op.run_kernel("triton", cfg, **p) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    _check(runs[0], p)


@pytest.mark.parametrize("bad,match", [({"REDUCE": "sum"}, "REDUCE must be one of"),
                                       ({"PARTIALS": "bf16"}, "PARTIALS must be one of"),
                                       ({"BLOCK_M": 48}, "BLOCK_M must be a power of two")])
def test_triton_rejects_bad_config(bad, match):
    """A config from a hand-edited file or a caller names the knob it got wrong."""
    if not backend_available("triton", torch.device(DEVICE)):
        pytest.skip("triton is not usable here")
    p = random_problem(T=9, S=4, E=3, d_in=16, d_out=16, G_out=2, device=DEVICE, seed=1)
    with pytest.raises(ValueError, match=match):
        op.run_kernel("triton", {**_SMALL, "GROUP_N": 1, "INTERLEAVE": False, **bad}, **p)


@pytest.mark.parametrize("interleave", [False, True])
def test_tall_row_tiles(interleave):
    """256-row tiles (the Triton kernel's tallest, for few experts with many pairs): an expert that
    fills several, one that ends inside its first, an empty one; slots reduced by atomics."""
    if not backend_available("triton", torch.device(DEVICE)):
        pytest.skip("triton is not available here")
    counts = [600, 0, 100, 250]
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))]
    p = random_problem(T=len(ids) // 2, S=2, E=len(counts), d_in=48, d_out=40, G_out=1, device=DEVICE, seed=21)
    p["expert_idx"] = ids.reshape(-1, 2).to(DEVICE)
    cfg = {"BLOCK_M": 256, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_N": 1, "INTERLEAVE": interleave,
           "num_warps": 8, "num_stages": 2}
    _check(_call("triton", p, cfg), p)
