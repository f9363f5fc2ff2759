"""Op 3 references: torch vs the fp64 NumPy oracle over group/gate modes and routings, SPEC property 8,
edge cases (T = 0, T = 1, empty experts, fp32 weights with half-precision x), and the paper shapes."""
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, dtypes_here
from flashswitch.reference.expert_matmul import (ROUTINGS, numpy_expert_matmul, paper_shapes, random_problem,
                                                 torch_expert_matmul)
from flashswitch.testing import assert_close, rel_error

F64 = torch.float64


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def problems(draw, max_t=24, dtypes=None):
    """Keyword arguments of random_problem covering every group/gate mode and routing."""
    S = draw(st.sampled_from([1, 2, 3, 4, 6]))
    G_in = draw(st.sampled_from([None] + _divisors(S)))
    G_out = draw(st.sampled_from([None] + _divisors(S)))
    dtype = draw(st.sampled_from(dtypes or dtypes_here() + [F64]))
    weight_dtype = draw(st.sampled_from([None, torch.float32])) if dtype in (torch.float16, torch.bfloat16) else None
    return dict(T=draw(st.integers(0, max_t)), S=S, E=draw(st.integers(1, 7)), d_in=draw(st.sampled_from([1, 5, 16])),
                d_out=draw(st.sampled_from([1, 7, 12])), G_in=G_in, G_out=G_out, gated=draw(st.booleans()),
                routing=draw(st.sampled_from(ROUTINGS)), dtype=dtype, weight_dtype=weight_dtype, device=DEVICE,
                seed=draw(st.integers(0, 99)),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])))


def _args(p):
    return {k: v for k, v in p.items() if k != "num_experts"}


def _check(p):
    args = _args(p)
    ref = numpy_expert_matmul(**args)
    y = torch_expert_matmul(**args)
    T, S = p["expert_idx"].shape
    G_out = S if p["out_groups"] is None else p["out_groups"]
    assert y.shape == (T, G_out, p["weight"].shape[2]) == ref.shape
    assert y.dtype == p["x"].dtype
    assert_close("y", y, ref, p["x"].dtype)


def dense_loop(x, expert_idx, weight, gates=None, out_groups=None):
    """Property 8: for each expert, a dense matmul of every input row, masked and gated per slot (fp64)."""
    T, S = expert_idx.shape
    E = weight.shape[0]
    x = x.to(F64)
    rows = x[:, None, :].expand(T, S, x.shape[-1]) if x.dim() == 2 else x.repeat_interleave(S // x.shape[1], 1)
    g = torch.ones(T, S, dtype=F64, device=x.device) if gates is None else gates.to(F64)
    G_out = S if out_groups is None else out_groups
    y = torch.zeros(T, S, weight.shape[2], dtype=F64, device=x.device)
    for e in range(E):
        y = y + ((expert_idx == e).to(F64) * g)[..., None] * (rows @ weight[e].to(F64))
    return y.reshape(T, G_out, S // G_out, weight.shape[2]).sum(2)


# ---------------------------------------------------------------- torch vs numpy
@given(p=problems())
def test_torch_matches_numpy(p):
    _check(random_problem(**p))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("G_in,G_out", [(None, None), (None, 1), (None, 2), (4, 1), (2, 4), (4, 4)])
@pytest.mark.parametrize("gated", [False, True])
def test_all_modes(routing, G_in, G_out, gated):
    _check(random_problem(T=13, S=4, E=5, d_in=9, d_out=11, G_in=G_in, G_out=G_out, gated=gated, routing=routing,
                          device=DEVICE))


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize("T", [0, 1])
@pytest.mark.parametrize("G_in,G_out", [(None, None), (2, 1)])
def test_tiny_token_counts(T, G_in, G_out):
    p = random_problem(T=T, S=4, E=3, d_in=6, d_out=5, G_in=G_in, G_out=G_out, device=DEVICE)
    _check(p)
    y = torch_expert_matmul(**_args(p))
    assert y.shape == (T, 4 if G_out is None else G_out, 5)


def test_empty_experts():
    p = random_problem(T=10, S=2, E=40, d_in=8, d_out=4, routing="sparse", device=DEVICE)
    used = torch.bincount(p["expert_idx"].reshape(-1), minlength=40)
    assert (used == 0).sum() >= 20
    _check(p)
    # weights of experts nobody picked do not matter
    w = p["weight"].clone()
    w[used == 0] = float("nan")
    y = torch_expert_matmul(**dict(_args(p), weight=w))
    assert rel_error(y, numpy_expert_matmul(**_args(p))) < 1e-5


def test_one_expert_takes_all_and_duplicates():
    p = random_problem(T=9, S=3, E=4, d_in=7, d_out=6, routing="one_hot", device=DEVICE)
    assert torch.all(p["expert_idx"] == p["expert_idx"][0, 0])
    _check(p)
    p = random_problem(T=9, S=3, E=4, d_in=7, d_out=6, routing="duplicates", device=DEVICE)
    assert torch.any(p["expert_idx"][:, 0] == p["expert_idx"][:, 1])
    _check(p)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_master_weights_with_half_x(dtype):
    if dtype not in dtypes_here():
        pytest.skip(f"{dtype} is tested on the GPU")
    p = random_problem(T=20, S=4, E=5, d_in=33, d_out=19, G_in=2, G_out=2, dtype=dtype,
                       weight_dtype=torch.float32, device=DEVICE)
    assert p["weight"].dtype == torch.float32 and p["x"].dtype == dtype
    _check(p)


def test_strided_weight_and_x():
    p = random_problem(T=11, S=4, E=3, d_in=8, d_out=6, G_in=2, device=DEVICE)
    w = p["weight"].transpose(1, 2).contiguous().transpose(1, 2)  # [E, d_in, d_out] with d_in fastest
    x = torch.cat([p["x"], p["x"]], -1)[..., :8]
    assert not w.is_contiguous() and not x.is_contiguous()
    y = torch_expert_matmul(**dict(_args(p), weight=w, x=x))
    assert rel_error(y, numpy_expert_matmul(**_args(p))) < 1e-5


def test_out_of_range_ids():
    p = random_problem(T=4, S=2, E=3, device=DEVICE)
    for bad in (3, -1):
        idx = p["expert_idx"].clone()
        idx[2, 1] = bad
        with pytest.raises(ValueError, match="expert_idx"):
            torch_expert_matmul(**dict(_args(p), expert_idx=idx))
        with pytest.raises(ValueError, match="expert_idx"):
            numpy_expert_matmul(**dict(_args(p), expert_idx=idx))
        # check=False (route(check=False)'s reference): the pair belongs to no expert, as with gate 0
        gates = p["gates"].clone()
        gates[2, 1] = 0
        y = torch_expert_matmul(**dict(_args(p), expert_idx=idx, check=False))
        assert_close("y", y, numpy_expert_matmul(**dict(_args(p), expert_idx=idx.clamp(0, 2), gates=gates)),
                     p["x"].dtype)


def test_bad_groups():
    p = random_problem(T=4, S=4, E=3, device=DEVICE)
    with pytest.raises(ValueError, match="out_groups"):
        torch_expert_matmul(**dict(_args(p), out_groups=3))
    with pytest.raises(ValueError, match="x"):
        torch_expert_matmul(**dict(_args(p), x=torch.randn(4, 3, 40, device=DEVICE)))


# ---------------------------------------------------------------- property 8
@given(p=problems(dtypes=[F64]))
def test_equals_dense_loop(p):
    q = random_problem(**p)
    args = _args(q)
    ref = dense_loop(**args)
    assert rel_error(torch_expert_matmul(**args), ref) < 1e-12
    assert rel_error(numpy_expert_matmul(**args), ref) < 1e-12


@given(p=problems(dtypes=[F64]))
def test_token_permutation(p):
    args = _args(random_problem(**p))
    T = args["x"].shape[0]
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    permuted = dict(args, x=args["x"][perm], expert_idx=args["expert_idx"][perm])
    if args["gates"] is not None:
        permuted["gates"] = args["gates"][perm]
    assert rel_error(torch_expert_matmul(**permuted), torch_expert_matmul(**args)[perm]) < 1e-13


@given(p=problems(dtypes=[F64]), a=st.sampled_from([0.5, -2.0]), b=st.sampled_from([1.5, 3.0]))
def test_linearity(p, a, b):
    args = _args(random_problem(**p))
    other = _args(random_problem(**dict(p, seed=p["seed"] + 1)))
    f = torch_expert_matmul
    for name in ("x", "weight", "gates"):
        if args[name] is None:
            continue
        mixed = dict(args, **{name: a * args[name] + b * other[name]})
        lhs = f(**mixed)
        rhs = a * f(**args) + b * f(**dict(args, **{name: other[name]}))
        assert rel_error(lhs, rhs) < 1e-12, name


@given(T=st.integers(1, 12), S=st.sampled_from([2, 3, 4]), G_in=st.booleans(), seed=st.integers(0, 99))
def test_duplicate_experts_add_up(T, S, G_in, seed):
    """Slots 0 and 1 pick the same expert: with one output group, moving slot 1's gate onto slot 0
    (gate 0 on slot 1) changes nothing when both read the same input row."""
    p = random_problem(T=T, S=S, E=4, d_in=6, d_out=5, G_in=1 if G_in else None, G_out=1, routing="duplicates",
                       dtype=F64, device=DEVICE, seed=seed)
    args = _args(p)
    args["expert_idx"][:, 1] = args["expert_idx"][:, 0]
    g = args["gates"].clone()
    g[:, 0] += g[:, 1]
    g[:, 1] = 0
    assert rel_error(torch_expert_matmul(**dict(args, gates=g)), torch_expert_matmul(**args)) < 1e-13
    # without reduction, the two slots hold their own terms
    y = torch_expert_matmul(**dict(args, out_groups=S))
    assert rel_error(y.sum(1, keepdim=True), torch_expert_matmul(**args)) < 1e-13


# ---------------------------------------------------------------- random_problem / paper shapes
def test_random_problem_contents():
    p = random_problem(T=8, S=6, E=5, d_in=7, d_out=3, G_in=3, G_out=2, dtype=torch.float16,
                       weight_dtype=torch.float32, index_dtype=torch.int32, device=DEVICE)
    assert p["x"].shape == (8, 3, 7) and p["x"].dtype == torch.float16
    assert p["weight"].shape == (5, 7, 3) and p["weight"].dtype == torch.float32
    assert p["expert_idx"].shape == (8, 6) and p["expert_idx"].dtype == torch.int32
    assert p["gates"].shape == (8, 6) and p["gates"].dtype == torch.float16
    assert p["num_experts"] == 5 and p["out_groups"] == 2
    assert torch.all(p["x"] != 0) and torch.all(p["weight"] != 0) and torch.all(p["gates"] > 0)
    assert random_problem(gated=False)["gates"] is None
    with pytest.raises(ValueError):
        random_problem(routing="zipf")


def test_paper_shapes():
    shapes = paper_shapes(T=3)
    assert set(shapes) == {"switchhead262m_v", "switchhead262m_o", "sigma_moe_up", "sigma_moe_down",
                           "switchhead47m_v", "switchhead47m_o"}
    expect = {  # name: (x shape, weight shape, y shape, gated)
        "switchhead262m_v": ((3, 1024), (16, 1024, 112), (3, 4, 112), True),
        "switchhead262m_o": ((3, 4, 112), (16, 112, 1024), (3, 1, 1024), True),
        "sigma_moe_up": ((3, 1024), (512, 1024, 128), (3, 8, 128), False),
        "sigma_moe_down": ((3, 8, 128), (512, 128, 1024), (3, 1, 1024), True),
        "switchhead47m_v": ((3, 412), (10, 412, 76), (3, 2, 76), True),
        "switchhead47m_o": ((3, 2, 76), (10, 76, 412), (3, 1, 412), True),
    }
    for name, kw in shapes.items():
        assert kw["T"] == 3
        x_shape, w_shape, y_shape, gated = expect[name]
        d_in, d_out, E, S = w_shape[1], w_shape[2], w_shape[0], kw["S"]
        assert (kw["E"], kw["d_in"], kw["d_out"], kw["gated"]) == (E, d_in, d_out, gated), name
        G_in = kw.get("G_in")
        assert ((3, d_in) if G_in is None else (3, G_in, d_in)) == x_shape, name
        G_out = kw.get("G_out") or S
        assert (3, G_out, d_out) == y_shape and S % G_out == 0 and (G_in is None or S % G_in == 0), name
        if E * d_in * d_out <= 2_000_000:  # the 512-expert weights are too large for a CPU unit test
            _check(random_problem(**dict(kw, device=DEVICE)))


def test_differentiable():
    p = random_problem(T=5, S=4, E=3, d_in=3, d_out=2, G_in=2, G_out=2, routing="duplicates", dtype=F64,
                       device=DEVICE)
    names = ("x", "weight", "gates")
    args = [p[n].clone().requires_grad_() for n in names]

    def f(*xs):
        return torch_expert_matmul(**dict(_args(p), **dict(zip(names, xs))))

    assert torch.autograd.gradcheck(f, args)
