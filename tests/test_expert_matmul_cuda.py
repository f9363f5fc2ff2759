"""Op 3's CUDA kernel (kernels_cuda/expert_matmul.cu) through both of its loaders: the AOT extension
(backend "cuda") and NVRTC through CuPy (backend "cupy").

CPU: the launch plan (C function vs its Python mirror when the extension is built, and its invariants)
and an NVRTC compile of the source for sm_90. GPU: smoke tests of the load paths the kernel picks at
run time (16-byte vectors, scalar loads for misaligned or odd rows, weight read along k or n), tile
shapes, output modes and agreement of the two loaders. Correctness over many shapes and routings is
in test_expert_matmul_kernels.py (via the `backend` fixture).
"""
import itertools

import numpy as np
import pytest
import torch

from conftest import DEVICE
from cuda_helpers import extension_op, nvrtc_compile
from flashswitch.ops import expert_matmul as op, routing
from flashswitch.ops.expert_matmul import expert_matmul, route
from flashswitch.reference.expert_matmul import numpy_expert_matmul, random_problem, torch_expert_matmul
from flashswitch.testing import assert_close


# ---------------------------------------------------------------- launch plan
def _plan_cases():
    for T, S, E, d_out, det, bm, bn, gn in itertools.product(
            (0, 1, 7, 300, 16384), (1, 2, 6, 8), (1, 5, 512), (0, 1, 19, 76, 112, 1024), (False, True),
            (0, 16, 32, 48, 64, 128, 256), (0, 16, 32, 100, 128, 256), (0, 1, 3, 100)):
        for G_out in (g for g in range(1, S + 1) if S % g == 0):
            yield T, S, E, G_out, d_out, det, bm, bn, gn


def test_plan_invariants():
    from flashswitch.bindings.cupy import (EM_ATOMIC, EM_FINISH_MAX_GRID, EM_FINISH_THREADS, EM_MAX_TILE_ELEMS,
                                           EM_STORE, EM_STORE_F32, expert_matmul_plan)
    for T, S, E, G_out, d_out, det, bm, bn, gn in list(_plan_cases())[::11]:
        p = expert_matmul_plan(T, S, E, G_out, d_out, det, bm, bn, gn)
        assert p.block_m in (32, 64, 128) and p.block_n in (32, 64, 128)
        assert p.block_m * p.block_n <= EM_MAX_TILE_ELEMS
        P = T * S
        # any split of P pairs over E experts needs at most grid_m row tiles
        assert p.grid_m >= -(-P // p.block_m) + min(E, P) and p.grid_m * p.block_m >= P
        assert p.n_tiles_n * p.block_n >= d_out > (p.n_tiles_n - 1) * p.block_n or d_out == p.n_tiles_n == 0
        assert 1 <= p.group_n and (p.group_n <= p.n_tiles_n or p.n_tiles_n == 0)
        assert p.tiles == p.grid_m * p.n_tiles_n and p.grid == min(p.tiles, 2 ** 31 - 1)
        mode = EM_STORE if G_out == S else EM_STORE_F32 if det else EM_ATOMIC
        assert p.mode == mode
        assert p.workspace_elems == {EM_STORE: 0, EM_STORE_F32: P * d_out, EM_ATOMIC: T * G_out * d_out}[mode]
        if mode == EM_STORE:
            assert p.finish_grid == 0
        else:
            assert p.finish_grid == min(-(-T * G_out * d_out // EM_FINISH_THREADS), EM_FINISH_MAX_GRID)
    with pytest.raises(ValueError):
        expert_matmul_plan(4, 6, 3, 4, 8, False, 0, 0, 0)  # G_out does not divide S


def test_plan_defaults():
    from flashswitch.bindings.cupy import expert_matmul_plan
    assert expert_matmul_plan(100, 6, 10, 2, 76, False, 0, 0, 0)[:2] == (64, 128)
    assert expert_matmul_plan(100, 6, 10, 2, 19, False, 0, 0, 0)[:2] == (64, 32)
    assert expert_matmul_plan(100, 6, 10, 2, 19, False, 128, 128, 0)[:2] == (128, 32)
    assert expert_matmul_plan(100, 6, 10, 2, 1024, False, 128, 128, 0)[:2] == (128, 64)
    assert expert_matmul_plan(100, 6, 10, 2, 1024, False, 16, 512, 0)[:2] == (32, 128)


def test_plan_mirror_matches_c():
    """bindings/cupy.expert_matmul_plan is a line-for-line mirror of fs_expert_matmul_plan_for."""
    c_plan = extension_op("expert_matmul_plan")
    from flashswitch.bindings.cupy import expert_matmul_plan
    for case in list(_plan_cases())[::13]:
        assert list(expert_matmul_plan(*case)) == list(c_plan(*case)), case


def test_extension_registers_op():
    schema = str(extension_op("expert_matmul_fwd").default._schema)
    for arg in ("Tensor? gates", "Tensor offsets", "Tensor(a!) y", "int S", "int G_out", "bool deterministic",
                "int block_m", "int block_n", "int group_n"):
        assert arg in schema, schema


# ---------------------------------------------------------------- NVRTC (no GPU needed)
NVRTC_NAMES = ["flashswitch::expert_matmul_fwd_kernel<2,2,64,64>",    # bf16
               "flashswitch::expert_matmul_fwd_kernel<1,0,32,128>",   # fp16 x, fp32 master weights
               "flashswitch::expert_matmul_fwd_kernel<0,0,128,32>",   # fp32 (no tensor cores)
               "flashswitch::expert_matmul_finish_kernel<2>",
               "flashswitch::expert_matmul_fwd_v2_kernel<2,64,128>",  # variant 2
               "flashswitch::expert_matmul_fwd_v2_kernel<1,128,64>"]


def test_nvrtc_compiles_expert_matmul():
    lowered, cubin_bytes = nvrtc_compile("expert_matmul.cu", NVRTC_NAMES)
    for name in NVRTC_NAMES:
        assert lowered[name].startswith("_ZN11flashswitch")
    assert cubin_bytes > 1000


# ---------------------------------------------------------------- GPU smoke tests
def _loader_available(name):
    from flashswitch import backends
    return DEVICE == "cuda" and backends.available(name, torch.device("cuda"))


@pytest.fixture(params=["cuda", "cupy"])
def loader(request):
    if not _loader_available(request.param):
        pytest.skip(f"backend {request.param} is not available")
    if request.param == "cuda" and not hasattr(torch.ops.flashswitch_C, "expert_matmul_fwd"):
        pytest.skip("flashswitch._C was built without op 3")
    return request.param


def _check(y, p):
    args = dict(gates=p["gates"], out_groups=p["out_groups"])
    ref = numpy_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)
    base = torch_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)
    assert tuple(y.shape) == ref.shape and y.dtype == p["x"].dtype
    assert_close("y", y, ref, p["x"].dtype, baseline=base)


def _run(backend, p, config=None, deterministic=False):
    return op.run_kernel(backend, config, **p, deterministic=deterministic)


def _misaligned(t):
    """A copy of t whose storage starts one element past a 16-byte boundary (same strides)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = {
    "aligned": dict(T=200, S=8, E=16, d_in=128, d_out=64, G_out=4),          # 16-byte vector loads
    "47m_v": dict(T=33, S=6, E=10, d_in=412, d_out=76, G_out=2),             # odd rows: vector + scalar tails
    "47m_o": dict(T=33, S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1),
    "many_experts": dict(T=150, S=4, E=300, d_in=40, d_out=24, G_out=1),     # tile search over several steps
    "store": dict(T=90, S=3, E=4, d_in=33, d_out=70, G_in=3),                # G_out == S: direct stores
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes(loader, dtype, shape):
    p = random_problem(**SHAPES[shape], dtype=dtype, device=DEVICE, seed=3)
    for det in (False, True):
        _check(_run(loader, p, deterministic=det), p)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_load_paths(loader, dtype):
    """Misaligned x / weight (scalar loads), weight stored k-contiguous (read along k), fp32 master weights."""
    p = random_problem(T=70, S=4, E=5, d_in=96, d_out=64, G_out=2, dtype=dtype, device=DEVICE, seed=4)
    w = p["weight"]
    variants = {
        "x_misaligned": dict(x=_misaligned(p["x"])),
        "w_misaligned": dict(weight=_misaligned(w)),
        "w_k_contiguous": dict(weight=w.transpose(1, 2).contiguous().transpose(1, 2)),
        "w_sliced": dict(weight=torch.cat([w, w], 2)[:, :, 3:67]),
    }
    if dtype != torch.float32:
        w32 = w.float()
        variants["w_fp32"] = dict(weight=w32)
        variants["w_fp32_k_contiguous"] = dict(weight=w32.transpose(1, 2).contiguous().transpose(1, 2))
    for name, change in variants.items():
        q = dict(p, **change)
        _check(_run(loader, q), q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tile_configs(loader, dtype):
    """Every supported tile shape (and values rounded to one) and column-tile grouping."""
    p = random_problem(T=45, S=4, E=3, d_in=50, d_out=150, G_out=2, routing="duplicates", dtype=dtype,
                       device=DEVICE, seed=5)
    for bm, bn, gn in itertools.product((16, 32, 64, 128, 256), (32, 64, 128), (0, 1, 2)):
        _check(_run(loader, p, dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_N=gn)), p)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [0, 1, 2])
def test_tiny(loader, T):
    for G_in, G_out in ((None, None), (2, 1), (None, 2)):
        p = random_problem(T=T, S=4, E=5, d_in=12, d_out=9, G_in=G_in, G_out=G_out, dtype=torch.bfloat16,
                           device=DEVICE)
        y = _run(loader, p)
        assert y.shape == (T, 4 if G_out is None else G_out, 9)
        _check(y, p)


@pytest.mark.gpu
def test_one_hot_expert_many_tiles(loader):
    p = random_problem(T=1000, S=2, E=7, d_in=64, d_out=48, G_out=1, routing="one_hot", dtype=torch.float16,
                       device=DEVICE, seed=6)
    for det in (False, True):
        _check(_run(loader, p, dict(BLOCK_M=32), deterministic=det), p)


@pytest.mark.gpu
@pytest.mark.parametrize("G_out,det", [(None, False), (1, True)])
def test_loaders_agree_bitwise(G_out, det):
    """Same source, same plan: the AOT and NVRTC builds give identical outputs (store and ordered-sum modes)."""
    if not (_loader_available("cuda") and _loader_available("cupy")):
        pytest.skip("needs both the cuda and cupy backends")
    if not hasattr(torch.ops.flashswitch_C, "expert_matmul_fwd"):
        pytest.skip("flashswitch._C was built without op 3")
    p = random_problem(T=300, S=6, E=10, d_in=412, d_out=76, G_out=G_out, dtype=torch.bfloat16,
                       weight_dtype=torch.float32, device=DEVICE, seed=7)
    ya, yb = _run("cuda", p, deterministic=det), _run("cupy", p, deterministic=det)
    assert torch.equal(ya, yb)


@pytest.mark.gpu
def test_extension_rejects_bad_arguments():
    if not _loader_available("cuda") or not hasattr(torch.ops.flashswitch_C, "expert_matmul_fwd"):
        pytest.skip("needs the cuda backend with op 3")
    p = random_problem(T=8, S=2, E=3, d_in=16, d_out=8, dtype=torch.float16, device=DEVICE)
    rt = route(p["expert_idx"], 3)
    x3 = p["x"].unsqueeze(1)
    y = torch.empty(8, 2, 8, dtype=torch.float16, device=DEVICE)
    fwd = torch.ops.flashswitch_C.expert_matmul_fwd
    with pytest.raises(RuntimeError, match="offsets"):
        fwd(x3, p["weight"], p["gates"], rt.token, rt.slot, rt.offsets.int(), y, 2, 2, False, 0, 0, 0)
    with pytest.raises(RuntimeError, match="weight"):
        fwd(x3, p["weight"].bfloat16(), p["gates"], rt.token, rt.slot, rt.offsets, y, 2, 2, False, 0, 0, 0)
    # (formatting the sizes in this message once crashed the process on a toolchain that links
    # libstdc++ statically: see test_cuda_build.py::test_extension_exports_no_private_libstdcxx)
    with pytest.raises(RuntimeError, match="y"):
        fwd(x3, p["weight"], p["gates"], rt.token, rt.slot, rt.offsets, y.new_empty(8, 1, 8), 2, 2, False, 0, 0, 0)
    with pytest.raises(RuntimeError, match="G_out"):
        fwd(x3, p["weight"], p["gates"], rt.token, rt.slot, rt.offsets, y, 2, 3, False, 0, 0, 0)
    fwd(x3, p["weight"], p["gates"], rt.token, rt.slot, rt.offsets, y, 2, 2, False, 0, 0, 0)
    ref = numpy_expert_matmul(p["x"], p["expert_idx"], p["weight"], gates=p["gates"])
    assert_close("y", y, ref, torch.float16)


@pytest.mark.gpu
def test_public_api(loader):
    p = random_problem(T=64, S=4, E=6, d_in=40, d_out=24, G_in=2, G_out=2, dtype=torch.bfloat16, device=DEVICE)
    rt = route(p["expert_idx"], p["num_experts"])
    y = expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], out_groups=2, backend=loader)
    _check(y, p)
    assert np.isfinite(y.float().cpu().numpy()).all()


# ---------------------------------------------------------------- device routing (kernels_cuda/route.cu)
def _route_op():
    if not _loader_available("cuda") or not hasattr(torch.ops.flashswitch_C, "route_fwd"):
        pytest.skip("needs the cuda backend with route_fwd")
    return torch.ops.flashswitch_C.route_fwd


@pytest.mark.gpu
@pytest.mark.parametrize("T,S,E,lo,hi,dtype", [
    (0, 2, 3, 0, 3, torch.int32), (1, 1, 1, 0, 1, torch.int64), (37, 4, 6, 0, 6, torch.int32),
    (300, 8, 16, 0, 16, torch.int64), (16384, 8, 512, 0, 512, torch.int32), (4096, 2, 70000, 0, 70000, torch.int64),
    (500, 3, 5, -3, 9, torch.int32), (500, 3, 5, -(2 ** 40), 2 ** 40, torch.int64),   # out of range: dropped
    (2000, 4, 8, 2, 3, torch.int64),                                                   # one hot expert, others empty
    # the counting sort (E + 2 <= 64 keys, P <= 2^20) at SwitchHead size, at its limits, and just past them
    (16384, 8, 16, 0, 16, torch.int32), (16384, 8, 62, -1, 63, torch.int64), (16384, 8, 63, 0, 63, torch.int32),
    (131072, 8, 10, 0, 10, torch.int64), (131073, 8, 10, 0, 10, torch.int32), (2049, 1, 3, 0, 3, torch.int32),
])
def test_device_route_matches_torch_route(T, S, E, lo, hi, dtype):
    """route_fwd (one C++ call: a counting sort for few experts, else keys, cub radix sort, finish)
    gives exactly the torch route: the same stable order, offsets, and out-of-range ids outside every
    expert's range."""
    fwd = _route_op()
    g = torch.Generator(device="cuda").manual_seed(T + S + E)
    idx = torch.randint(lo, hi, (T, S), generator=g, device="cuda", dtype=torch.int64).to(dtype)
    token, slot, offsets = fwd(idx, E)
    t_ref, s_ref, o_ref = routing._torch_route(idx, E, clamp=True)
    assert token.dtype == slot.dtype == torch.int32 and offsets.dtype == torch.int64
    assert torch.equal(offsets, o_ref)
    assert torch.equal(token, t_ref) and torch.equal(slot, s_ref)
    # and the route is what SPEC says: expert e's pairs, in (t, s) order
    ids = idx.cpu().numpy().reshape(-1)
    off = offsets.cpu().numpy()
    pairs = token.cpu().numpy().astype(np.int64) * S + slot.cpu().numpy()
    for e in range(min(E, 64)):
        want = np.flatnonzero(ids == e)
        np.testing.assert_array_equal(pairs[off[e]:off[e + 1]], want)


@pytest.mark.gpu
def test_device_route_strided_input_and_errors():
    fwd = _route_op()
    idx = torch.randint(0, 5, (64, 6), device="cuda", dtype=torch.int32)
    view = idx[:, ::2]  # not contiguous
    assert all(torch.equal(a, b) for a, b in zip(fwd(view, 5), routing._torch_route(view.contiguous(), 5)))
    with pytest.raises(RuntimeError, match="expert_idx has dtype"):
        fwd(idx.float(), 5)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor|'CPU' backend"):
        fwd(idx.cpu(), 5)
    with pytest.raises(RuntimeError, match="num_experts"):
        fwd(idx, 0)
    with pytest.raises(RuntimeError, match=r"\[T, S\]"):
        fwd(idx.reshape(-1), 5)


@pytest.mark.gpu
def test_route_uses_the_device_op_without_sync(monkeypatch):
    """By default (FLASHSWITCH_ROUTE unset) route() on CUDA is the extension's sort, with no host sync."""
    _route_op()
    monkeypatch.delenv(op.ROUTE_ENV, raising=False)
    assert routing._device_route_wanted()
    idx = torch.randint(0, 16, (1024, 8), device="cuda", dtype=torch.int64)
    route(idx, 16, check=False)  # load outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rt = route(idx, 16, check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    t_ref, s_ref, o_ref = routing._torch_route(idx, 16)
    assert torch.equal(rt.token, t_ref) and torch.equal(rt.slot, s_ref) and torch.equal(rt.offsets, o_ref)


def test_torch_route_switch(monkeypatch):
    """FLASHSWITCH_ROUTE=torch takes the torch route (same result), on any device."""
    idx = torch.randint(0, 5, (33, 3), device=DEVICE)
    monkeypatch.setenv(op.ROUTE_ENV, "torch")
    rt = route(idx, 5, check=False)
    t_ref, s_ref, o_ref = routing._torch_route(idx, 5)
    assert torch.equal(rt.token, t_ref) and torch.equal(rt.slot, s_ref) and torch.equal(rt.offsets, o_ref)


# ---------------------------------------------------------------- variant 2 (cp.async + ldmatrix kernel)
V2_CASES = {
    "store": dict(T=300, S=2, E=5, d_in=96, d_out=128, G_out=None),
    "atomic": dict(T=333, S=8, E=16, d_in=128, d_out=112, G_out=4, gated=True),       # 262M V's shape, small T
    "group-in": dict(T=257, S=8, E=16, d_in=112, d_out=256, G_in=4, G_out=1, gated=True),  # 262M O's
    "many-experts": dict(T=200, S=8, E=512, d_in=64, d_out=128, G_in=8, G_out=1, gated=True),
    "odd-k": dict(T=100, S=4, E=3, d_in=40, d_out=72, G_out=2),                       # k tail, n tail
    "one-hot": dict(T=500, S=2, E=7, d_in=64, d_out=64, routing="one_hot"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("case", sorted(V2_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("det", [False, True])
def test_variant2_matches_reference(loader, tile, case, dtype, det):
    """The variant-2 kernel on every tile it has, in every epilogue mode, against the fp64 oracle."""
    kw = dict(V2_CASES[case])
    routing = kw.pop("routing", "random")
    p = random_problem(**kw, routing=routing, dtype=dtype, device=DEVICE, seed=sorted(V2_CASES).index(case))
    cfg = {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "GROUP_N": 1, "variant": 2}
    _check(_run(loader, p, cfg, deterministic=det), p)


@pytest.mark.gpu
def test_variant2_falls_back_where_it_does_not_apply(loader):
    """fp32 master weights, d_out not a multiple of 8, a misaligned x or a k-contiguous weight: variant 2
    is asked for, the plain kernel runs, the result is right."""
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_N": 1, "variant": 2}
    p = random_problem(T=64, S=4, E=3, d_in=64, d_out=64, G_out=2, dtype=torch.bfloat16,
                       weight_dtype=torch.float32, device=DEVICE)
    _check(_run(loader, p, cfg), p)
    p = random_problem(T=64, S=4, E=3, d_in=64, d_out=76, G_out=2, dtype=torch.bfloat16, device=DEVICE)
    _check(_run(loader, p, cfg), p)
    p = random_problem(T=64, S=4, E=3, d_in=64, d_out=64, G_out=2, dtype=torch.bfloat16, device=DEVICE)
    _check(_run(loader, {**p, "x": _misaligned(p["x"])}, cfg), p)
    wt = p["weight"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, k-contiguous
    _check(_run(loader, {**p, "weight": wt}, cfg), p)


@pytest.mark.gpu
@pytest.mark.parametrize("G_out,det", [(None, False), (1, True), (4, False)])
def test_variant2_loaders_agree_bitwise(G_out, det):
    """Same source, same plan: the AOT and NVRTC builds of variant 2 give identical outputs (the atomic
    mode's sums may differ in order between runs, so it is compared through the ordered sum)."""
    if not (_loader_available("cuda") and _loader_available("cupy")):
        pytest.skip("needs both the cuda and cupy backends")
    p = random_problem(T=300, S=8, E=10, d_in=128, d_out=64, G_out=G_out, dtype=torch.bfloat16, device=DEVICE,
                       seed=11)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_N": 1, "variant": 2, "REDUCE": "ordered"}
    assert torch.equal(_run("cuda", p, cfg, deterministic=det), _run("cupy", p, cfg, deterministic=det))


def test_variant_config_is_checked():
    from flashswitch.bindings.cuda import expert_matmul_variant
    assert expert_matmul_variant(None) == 1 and expert_matmul_variant({"variant": 2}) == 2
    with pytest.raises(ValueError, match="variant must be 1 or 2"):
        expert_matmul_variant({"variant": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [1, 2])
def test_ordered_reduce_config(loader, variant):
    """REDUCE: "ordered" (the tuner's alternative to atomics) gives the deterministic kernel's result."""
    p = random_problem(T=150, S=8, E=6, d_in=64, d_out=64, G_in=4, G_out=1, dtype=torch.bfloat16, device=DEVICE)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_N": 1, "variant": variant}
    y = _run(loader, p, {**cfg, "REDUCE": "ordered"})
    _check(y, p)
    assert torch.equal(y, _run(loader, p, cfg, deterministic=True))


def test_reduce_config_is_checked():
    from flashswitch.bindings.cuda import expert_matmul_ordered
    assert expert_matmul_ordered(None, False) is False and expert_matmul_ordered(None, True) is True
    assert expert_matmul_ordered({"REDUCE": "ordered"}, False) is True
    with pytest.raises(ValueError, match="REDUCE must be"):
        expert_matmul_ordered({"REDUCE": "tree"}, False)
