"""Op 1 references: torch vs the fp64 NumPy oracle, and SPEC properties 2 and 4."""
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, dtypes_here
from flashswitch.reference.chunk_summaries import numpy_chunk_summaries, random_problem, torch_chunk_summaries
from flashswitch.testing import assert_close, rel_error

F64 = torch.float64


def _compare(problem, dtype, scale=None):
    """torch reference vs NumPy oracle for all three outputs."""
    ref = numpy_chunk_summaries(**problem, scale=scale, return_lse=True)
    out = torch_chunk_summaries(**problem, scale=scale, return_lse=True)
    assert out[0].dtype == problem["k"].dtype and out[1].dtype == problem["v"].dtype
    assert out[2].dtype == (F64 if dtype == F64 else torch.float32)
    for name, o, r in zip(("k_sum", "v_sum", "lse"), out, ref):
        assert tuple(o.shape) == r.shape, name
        # lse is computed in fp32 from the same (rounded) inputs: fp32 accuracy whatever the input dtype
        assert_close(name, o, r, dtype if name != "lse" or dtype == F64 else torch.float32)


@given(B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(0, 40), D=st.sampled_from([1, 5, 16, 33]),
       C=st.sampled_from([1, 2, 3, 5, 8]), omega=st.sampled_from(["none", "head", "chunk"]),
       key_weight=st.booleans(), valid=st.booleans(), layout=st.sampled_from(["contiguous", "strided"]),
       dtype=st.sampled_from(dtypes_here() + [F64]), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 99))
def test_torch_matches_numpy(B, H, N, D, C, omega, key_weight, valid, layout, dtype, scale, seed):
    p = random_problem(B, H, N, D, C, dtype=dtype, device=DEVICE, omega=omega, key_weight=key_weight,
                       valid=valid, seed=seed, layout=layout)
    _compare(p, dtype, scale)


@pytest.mark.parametrize("N,C", [(0, 4), (1, 4), (4, 4), (7, 3), (12, 1), (9, 10)])
def test_edge_lengths(N, C):
    p = random_problem(2, 2, N, 7, C, device=DEVICE, omega="chunk", valid=True)
    _compare(p, torch.float32)
    k_sum, v_sum = torch_chunk_summaries(**p)
    assert k_sum.shape == (2, 2, -(-N // C), 7)


def test_empty_chunks_give_zero_and_neg_inf():
    p = random_problem(1, 2, 12, 4, 4, device=DEVICE, dtype=F64, key_weight=True)
    p["valid"] = torch.tensor([[False] * 4 + [True] * 3 + [False] * 5], device=DEVICE)
    k_sum, v_sum, lse = torch_chunk_summaries(**p, return_lse=True)
    for c in (0, 2):
        assert torch.all(k_sum[:, :, c] == 0) and torch.all(v_sum[:, :, c] == 0)
        assert torch.all(torch.isneginf(lse[:, :, c]))
    assert torch.isfinite(lse[:, :, 1]).all()


# ---------------------------------------------------------------- SPEC property 2
def _chunk_permutation(N, C, g):
    perm = []
    for c0 in range(0, N, C):
        n = min(C, N - c0)
        perm += (torch.randperm(n, generator=g) + c0).tolist()
    return torch.tensor(perm, dtype=torch.long)


@given(N=st.integers(1, 30), C=st.sampled_from([1, 3, 4, 7]), omega=st.sampled_from(["none", "head", "chunk"]),
       key_weight=st.booleans(), valid=st.booleans(), seed=st.integers(0, 99))
def test_permutation_inside_chunk(N, C, omega, key_weight, valid, seed):
    p = random_problem(2, 2, N, 6, C, dtype=F64, device=DEVICE, omega=omega, key_weight=key_weight,
                       valid=valid, seed=seed)
    perm = _chunk_permutation(N, C, torch.Generator().manual_seed(seed)).to(DEVICE)
    q = dict(p, k=p["k"][:, :, perm], v=p["v"][:, :, perm])
    if valid:
        q["valid"] = p["valid"][:, perm]
    a = torch_chunk_summaries(**p, return_lse=True)
    b = torch_chunk_summaries(**q, return_lse=True)
    for x, y in zip(a, b):
        assert rel_error(y, x) < 1e-12


@given(N=st.integers(1, 30), C=st.sampled_from([1, 3, 4]), per_chunk=st.booleans(), valid=st.booleans(),
       seed=st.integers(0, 99))
def test_shift_invariance(N, C, per_chunk, valid, seed):
    """k_j -> k_j + u and omega -> omega + u: every logit of a chunk moves by the same constant."""
    p = random_problem(2, 2, N, 6, C, dtype=F64, device=DEVICE, omega="chunk" if per_chunk else "head",
                       valid=valid, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    Nc = -(-N // C)
    if per_chunk:  # a different shift for every chunk
        u = torch.randn(2, 2, Nc, 6, generator=g, dtype=F64).to(DEVICE)
        u_tok = u.repeat_interleave(C, dim=2)[:, :, :N]
    else:
        u = torch.randn(2, 6, generator=g, dtype=F64).to(DEVICE)
        u_tok = u[None, :, None, :]
    q = dict(p, k=p["k"] + u_tok, omega=p["omega"] + u)
    _, v_a = torch_chunk_summaries(**p)
    _, v_b = torch_chunk_summaries(**q)
    assert rel_error(v_b, v_a) < 1e-10
    _, v_n = numpy_chunk_summaries(**q)
    assert rel_error(v_n, v_a) < 1e-10


@given(N=st.integers(1, 30), C=st.sampled_from([1, 3, 8]), omega=st.sampled_from(["none", "head", "chunk"]),
       valid=st.booleans(), seed=st.integers(0, 99))
def test_convex_hull(N, C, omega, valid, seed):
    """Every coordinate of v_sum lies between the chunk's min and max over its valid values."""
    p = random_problem(2, 2, N, 5, C, dtype=F64, device=DEVICE, omega=omega, valid=valid, seed=seed)
    _, v_sum = torch_chunk_summaries(**p, scale=2.0)  # a larger scale: sharper weights
    v = p["v"]
    mask = p.get("valid", torch.ones(2, N, dtype=torch.bool, device=DEVICE))
    for c in range(-(-N // C)):
        sl = slice(c * C, min(N, (c + 1) * C))
        for b in range(2):
            m = mask[b, sl]
            if not m.any():
                assert torch.all(v_sum[b, :, c] == 0)
                continue
            vc = v[b, :, sl][:, m]
            assert torch.all(v_sum[b, :, c] >= vc.min(1).values - 1e-12)
            assert torch.all(v_sum[b, :, c] <= vc.max(1).values + 1e-12)


@given(N=st.integers(1, 30), C=st.sampled_from([1, 2, 5]), valid=st.booleans(), seed=st.integers(0, 99))
def test_zero_omega_equal_norm_keys_is_mean(N, C, valid, seed):
    p = random_problem(2, 3, N, 8, C, dtype=F64, device=DEVICE, valid=valid, seed=seed)
    p["k"] = 1.7 * p["k"] / p["k"].norm(dim=-1, keepdim=True)
    _, v_sum = torch_chunk_summaries(**p)
    mask = p.get("valid", torch.ones(2, N, dtype=torch.bool, device=DEVICE))
    Nc = -(-N // C)
    pad = Nc * C - N
    mf = torch.nn.functional.pad(mask, (0, pad)).view(2, 1, Nc, C, 1).to(F64)
    vc = torch.nn.functional.pad(p["v"], (0, 0, 0, pad)).view(2, 3, Nc, C, 8)
    mean = (vc * mf).sum(3) / mf.sum(3).clamp_min(1)
    assert rel_error(v_sum, mean) < 1e-12


# ---------------------------------------------------------------- SPEC property 4
@given(N=st.integers(1, 30), extra=st.integers(1, 12), C=st.sampled_from([1, 3, 4]),
       omega=st.sampled_from(["none", "head"]), key_weight=st.booleans(), seed=st.integers(0, 99))
def test_right_padding(N, extra, C, omega, key_weight, seed):
    p = random_problem(2, 2, N, 6, C, dtype=F64, device=DEVICE, omega=omega, key_weight=key_weight,
                       valid=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    junk = lambda: torch.randn(2, 2, extra, 6, generator=g, dtype=F64).to(DEVICE) * 50  # noqa: E731
    q = dict(p, k=torch.cat([p["k"], junk()], 2), v=torch.cat([p["v"], junk()], 2),
             valid=torch.cat([p["valid"], torch.zeros(2, extra, dtype=torch.bool, device=DEVICE)], 1))
    a = torch_chunk_summaries(**p, return_lse=True)
    b = torch_chunk_summaries(**q, return_lse=True)
    Nc = -(-N // C)
    for x, y in zip(a, b):
        assert rel_error(y[:, :, :Nc], x) < 1e-12
    assert torch.all(b[0][:, :, Nc:] == 0) and torch.all(b[1][:, :, Nc:] == 0)
    assert torch.all(torch.isneginf(b[2][:, :, Nc:]))
    ref = numpy_chunk_summaries(**q, return_lse=True)
    for x, y in zip(b, ref):
        assert rel_error(x, y) < 1e-12


def test_all_valid_mask_equals_no_mask():
    p = random_problem(2, 2, 13, 6, 4, dtype=F64, device=DEVICE, omega="chunk", key_weight=True)
    a = torch_chunk_summaries(**p, return_lse=True)
    b = torch_chunk_summaries(**p, valid=torch.ones(2, 13, dtype=torch.bool, device=DEVICE), return_lse=True)
    for x, y in zip(a, b):
        assert rel_error(y, x) < 1e-14


def test_differentiable():
    p = random_problem(1, 2, 7, 3, 3, dtype=F64, device=DEVICE, omega="chunk", key_weight=True, valid=True)
    p["valid"][0, :] = True
    p["valid"][0, 4] = False
    p["valid"][0, 6] = False  # an empty chunk: its gradients must stay finite (zero)
    names = ("k", "v", "omega", "key_weight")
    args = [p[n].clone().requires_grad_() for n in names]

    def f(*xs):
        k_sum, v_sum, lse = torch_chunk_summaries(**dict(p, **dict(zip(names, xs))), return_lse=True)
        return k_sum, v_sum, lse[:, :, :2]  # lse of the empty chunk is the constant -inf

    assert torch.autograd.gradcheck(f, args)


def test_assert_close_ignores_a_nan_baseline():
    """A baseline that is itself NaN (e.g. a masked-out NaN key times 0) must not open the bound."""
    ref = torch.randn(64, dtype=torch.float64)
    bad = ref.to(torch.float16).clone()
    bad[3] = float("nan")
    assert_close("ok", ref.to(torch.float16), ref, torch.float16, baseline=bad)
    with pytest.raises(AssertionError):
        assert_close("out", bad, ref, torch.float16, baseline=bad)
    with pytest.raises(AssertionError):
        assert_close("out", ref.to(torch.float16) + 1.0, ref, torch.float16, baseline=bad)
