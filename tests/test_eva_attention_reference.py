"""Op 2 references: torch vs the fp64 NumPy oracle, the visibility rule, and SPEC properties
1, 3, 5, 6, 7 (plus block/sliding agreement at t = W - 1 mod W)."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, dense_causal, dtypes_here
from flashswitch.reference.chunk_summaries import torch_chunk_summaries
from flashswitch.reference.eva_attention import (numpy_eva_attention, random_problem, start_position,
                                                 torch_eva_attention, visible_masks, visible_pairs)
from flashswitch.testing import assert_close, rel_error

F64 = torch.float64
WINDOW = st.sampled_from(["block", "sliding"])
BIAS = st.sampled_from([None, "log_count", "tensor"])


@st.composite
def shapes(draw, max_n=40):
    """(B, H, Hkv, Nk, D, C, W) with W a multiple of C."""
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    C = draw(st.sampled_from([1, 2, 3, 4]))
    W = C * draw(st.integers(1, 4))
    return draw(st.integers(1, 2)), H, Hkv, draw(st.integers(1, max_n)), draw(st.sampled_from([4, 8, 13])), C, W


def _compare(p, dtype, scale=None):
    ref_o, ref_l = numpy_eva_attention(**p, scale=scale, return_lse=True)
    o, lse = torch_eva_attention(**p, scale=scale, return_lse=True)
    assert o.dtype == p["q"].dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert tuple(o.shape) == ref_o.shape and tuple(lse.shape) == ref_l.shape
    assert_close("o", o, ref_o, dtype)
    assert_close("lse", lse, ref_l, dtype if dtype == F64 else torch.float32)


# ---------------------------------------------------------------- torch vs numpy
@given(shape=shapes(), window=WINDOW, bias=BIAS, dtype=st.sampled_from(dtypes_here() + [F64]),
       layout=st.sampled_from(["contiguous", "strided"]), scale=st.sampled_from([None, 0.2]),
       seed=st.integers(0, 99))
def test_prefill_matches_numpy(shape, window, bias, dtype, layout, scale, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=dtype,
                       device=DEVICE, seed=seed, layout=layout)
    _compare(p, dtype, scale)


@given(shape=shapes(), window=WINDOW, bias=BIAS, dtype=st.sampled_from(dtypes_here()), data=st.data())
def test_decode_and_chunked_prefill_match_numpy(shape, window, bias, dtype, data):
    B, H, Hkv, Nk, D, C, W = shape
    Nq = data.draw(st.integers(1, Nk), label="Nq")
    explicit = data.draw(st.booleans(), label="explicit q_offset")
    q_offset = data.draw(st.integers(0, Nk - Nq), label="q_offset") if explicit else None
    p = random_problem(B, H, Hkv, Nq, Nk, D, C, W, window=window, summary_bias=bias, q_offset=q_offset,
                       dtype=dtype, device=DEVICE, seed=Nk)
    _compare(p, dtype)


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_queries_are_rows_of_the_full_prefill(window):
    """Decode (Nq = 1), chunked prefill and an explicit q_offset give the matching rows of prefill."""
    full = random_problem(1, 4, 2, None, 37, 8, 3, 9, window=window, summary_bias="log_count", dtype=F64,
                          device=DEVICE)
    o_full, l_full = torch_eva_attention(**full, return_lse=True)
    for Nq, off in [(1, None), (5, None), (37, None), (1, 0), (4, 10), (9, 20)]:
        start = 37 - Nq if off is None else off
        p = dict(full, q=full["q"][:, :, start:start + Nq], q_offset=off)
        o, lse = torch_eva_attention(**p, return_lse=True)
        assert rel_error(o, o_full[:, :, start:start + Nq]) < 1e-13
        assert rel_error(lse, l_full[:, :, start:start + Nq]) < 1e-13
        assert rel_error(numpy_eva_attention(**p), o) < 1e-13


# ---------------------------------------------------------------- visibility rule
@given(Nk=st.integers(1, 60), C=st.sampled_from([1, 2, 3, 4, 8]), m=st.integers(1, 4), window=WINDOW)
def test_every_past_token_counted_once(Nk, C, m, window):
    W = C * m
    Nc = -(-Nk // C)
    exact, summ = visible_masks(Nk, Nk, Nc, chunk_size=C, window_size=W, window=window)
    for t in range(Nk):
        covered = exact[t].long() + summ[t].long().repeat_interleave(C)[:Nk]
        assert torch.all(covered[: t + 1] == 1) and torch.all(covered[t + 1:] == 0)
        n_exact = int(exact[t].sum())
        assert exact[t, t] and n_exact <= (W if window == "block" else W + C - 1)
        assert start_position(t, chunk_size=C, window_size=W, window=window) == t + 1 - n_exact
    assert visible_pairs(Nk, Nk, Nc, chunk_size=C, window_size=W, window=window) == int(exact.sum() + summ.sum())
    for Nq in (1, max(1, Nk // 3)):
        e, s = visible_masks(Nq, Nk, Nc, chunk_size=C, window_size=W, window=window)
        assert torch.equal(e, exact[Nk - Nq:]) and torch.equal(s, summ[Nk - Nq:])
        assert visible_pairs(Nq, Nk, Nc, chunk_size=C, window_size=W, window=window) == int(e.sum() + s.sum())


def test_start_positions_match_spec_examples():
    # block, W = 8: t in [8, 15] starts at 8; sliding, W = 8, C = 4: t = 11 -> 4, t = 12 -> 4, t = 15 -> 8
    assert [start_position(t, chunk_size=4, window_size=8, window="block") for t in (0, 7, 8, 15, 16)] == \
        [0, 0, 8, 8, 16]
    assert [start_position(t, chunk_size=4, window_size=8, window="sliding") for t in (0, 7, 8, 11, 12, 15)] == \
        [0, 0, 0, 4, 4, 8]


@pytest.mark.parametrize("bad", [dict(window="global"), dict(window_size=6), dict(window_size=2)])
def test_bad_window_arguments(bad):
    p = random_problem(1, 2, 1, None, 10, 4, 4, 8)
    p.update(bad)
    with pytest.raises(ValueError):
        torch_eva_attention(**p)
    with pytest.raises(ValueError):
        numpy_eva_attention(**p)


# ---------------------------------------------------------------- property 1
@given(shape=shapes(), window=WINDOW, bias=st.sampled_from([None, "log_count"]), data=st.data())
def test_chunk_size_one_is_exact_causal(shape, window, bias, data):
    B, H, Hkv, Nk, D, _, _ = shape
    W = data.draw(st.integers(1, 6), label="W")
    Nq = data.draw(st.integers(1, Nk), label="Nq")
    p = random_problem(B, H, Hkv, Nq, Nk, D, 1, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=W)
    assert torch.allclose(p["k_sum"], p["k"]) and torch.allclose(p["v_sum"], p["v"])
    o, lse = torch_eva_attention(**p, return_lse=True)
    o_ref, l_ref = dense_causal(p["q"], p["k"], p["v"])
    assert rel_error(o, o_ref) < 1e-12 and rel_error(lse, l_ref) < 1e-12


@given(shape=shapes(), window=WINDOW, bias=BIAS, extra=st.integers(0, 3), seed=st.integers(0, 99))
def test_window_covering_everything_is_exact_causal(shape, window, bias, extra, seed):
    B, H, Hkv, Nk, D, C, _ = shape
    W = C * (-(-Nk // C) + extra)  # W >= Nk: no summary is ever visible, whatever it holds
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64,
                       device=DEVICE, seed=seed)
    o, lse = torch_eva_attention(**p, return_lse=True)
    o_ref, l_ref = dense_causal(p["q"], p["k"], p["v"])
    assert rel_error(o, o_ref) < 1e-12 and rel_error(lse, l_ref) < 1e-12


def test_exact_causal_matches_sdpa():
    p = random_problem(2, 4, 2, None, 23, 8, 1, 4, dtype=F64, device=DEVICE)
    k = p["k"].repeat_interleave(2, 1)
    v = p["v"].repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(p["q"], k, v, is_causal=True)
    assert rel_error(torch_eva_attention(**p), sdpa) < 1e-12
    assert rel_error(numpy_eva_attention(**p), sdpa) < 1e-12


# ---------------------------------------------------------------- property 3
@given(shape=shapes(), window=WINDOW, bias=BIAS, data=st.data())
def test_causality(shape, window, bias, data):
    B, H, Hkv, Nk, D, C, W = shape
    tau = data.draw(st.integers(0, Nk - 1), label="tau")
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=tau)
    g = torch.Generator().manual_seed(tau)
    q, k, v = (x.clone() for x in (p["q"], p["k"], p["v"]))
    for x in (q, k, v):
        x[:, :, tau:] = torch.randn(x[:, :, tau:].shape, generator=g, dtype=F64).to(DEVICE) * 10
    p["k_sum"], p["v_sum"] = torch_chunk_summaries(p["k"], p["v"], C)  # the fp64 summaries of p
    k_sum, v_sum = torch_chunk_summaries(k, v, C)  # summaries of chunks reaching tau change too
    o_a, l_a = torch_eva_attention(**p, return_lse=True)
    o_b, l_b = torch_eva_attention(**dict(p, q=q, k=k, v=v, k_sum=k_sum, v_sum=v_sum), return_lse=True)
    assert torch.allclose(o_a[:, :, :tau], o_b[:, :, :tau], rtol=1e-13, atol=1e-13)
    assert torch.allclose(l_a[:, :, :tau], l_b[:, :, :tau], rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------- property 5
@given(shape=shapes(), window=WINDOW, omega=st.booleans(), seed=st.integers(0, 99))
def test_equal_keys_in_chunks_with_log_count_is_exact_causal(shape, window, omega, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias="log_count", dtype=F64,
                       device=DEVICE, seed=seed)
    Nc = -(-Nk // C)
    k = p["k"][:, :, ::C].repeat_interleave(C, 2)[:, :, :Nk].contiguous()  # one key per chunk
    om = torch.randn(B, Hkv, Nc, D, dtype=F64, device=DEVICE) if omega else None
    k_sum, v_sum = torch_chunk_summaries(k, p["v"], C, omega=om)  # equal logits: v_sum = mean of values
    p.update(k=k, k_sum=k_sum, v_sum=v_sum)
    o, lse = torch_eva_attention(**p, return_lse=True)
    o_ref, l_ref = dense_causal(p["q"], k, p["v"])
    assert rel_error(o, o_ref) < 1e-12 and rel_error(lse, l_ref) < 1e-12
    assert rel_error(numpy_eva_attention(**p), o_ref) < 1e-12


# ---------------------------------------------------------------- property 6
def _partial(p, keep_exact, keep_summ):
    """Softmax attention over a subset of the visible keys (fp64): (o, lse), lse = -inf where empty."""
    q, k, v, k_sum, v_sum = (p[n].to(F64) for n in ("q", "k", "v", "k_sum", "v_sum"))
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    rep = H // Hkv
    keys = torch.cat([k, k_sum], 2).repeat_interleave(rep, 1)
    vals = torch.cat([v, v_sum], 2).repeat_interleave(rep, 1)
    bias = p["summary_bias"]
    if bias is None:
        b = torch.zeros(B, Hkv, Nc, dtype=F64, device=q.device)
    elif isinstance(bias, str):
        C = p["chunk_size"]
        n = torch.tensor([min(C, Nk - c * C) for c in range(Nc)], dtype=F64)
        b = torch.log(n).to(q.device).expand(B, Hkv, Nc)
    else:
        b = bias.to(F64)
    b = torch.cat([torch.zeros(B, Hkv, Nk, dtype=F64, device=q.device), b], 2).repeat_interleave(rep, 1)
    logits = D ** -0.5 * q @ keys.transpose(-1, -2) + b[:, :, None, :]
    logits = logits.masked_fill(~torch.cat([keep_exact, keep_summ], -1), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    w = torch.exp(logits - lse.nan_to_num(neginf=0.0)[..., None])
    return w @ vals, lse


@given(shape=shapes(), window=WINDOW, bias=BIAS, how=st.sampled_from(["exact|summaries", "random"]),
       seed=st.integers(0, 99))
def test_split_and_merge_by_lse(shape, window, bias, how, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=seed)
    Nc = p["k_sum"].shape[2]
    exact, summ = visible_masks(Nk, Nk, Nc, chunk_size=C, window_size=W, window=window, device=DEVICE)
    if how == "exact|summaries":
        a_e, a_s = exact, torch.zeros_like(summ)
    else:
        g = torch.Generator().manual_seed(seed)
        a_e = exact & (torch.rand(exact.shape, generator=g) < 0.5).to(DEVICE)
        a_s = summ & (torch.rand(summ.shape, generator=g) < 0.5).to(DEVICE)
    o1, l1 = _partial(p, a_e, a_s)
    o2, l2 = _partial(p, exact & ~a_e, summ & ~a_s)
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse)[..., None]
    w2 = torch.exp(l2 - lse)[..., None]
    merged = w1 * o1 + w2 * o2
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert rel_error(merged, ref_o) < 1e-12 and rel_error(lse, ref_l) < 1e-12
    o, l = torch_eva_attention(**p, return_lse=True)
    assert rel_error(o, merged) < 1e-12 and rel_error(l, lse) < 1e-12


# ---------------------------------------------------------------- property 7
@given(shape=shapes(), window=WINDOW, bias=BIAS, alpha=st.sampled_from([0.25, 3.0, -2.0]), seed=st.integers(0, 99))
def test_scale_invariance(shape, window, bias, alpha, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=seed)
    o, l = torch_eva_attention(**p, scale=0.3, return_lse=True)
    o2, l2 = torch_eva_attention(**dict(p, q=alpha * p["q"]), scale=0.3 / alpha, return_lse=True)
    assert rel_error(o2, o) < 1e-12 and rel_error(l2, l) < 1e-12


@given(shape=shapes(), window=WINDOW, bias=BIAS, seed=st.integers(0, 99))
def test_gqa_equals_repeated_kv_heads(shape, window, bias, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=seed)
    rep = H // Hkv
    r = {n: p[n].repeat_interleave(rep, 1) for n in ("k", "v", "k_sum", "v_sum")}
    if isinstance(p["summary_bias"], torch.Tensor):
        r["summary_bias"] = p["summary_bias"].repeat_interleave(rep, 1)
    o, l = torch_eva_attention(**p, return_lse=True)
    o2, l2 = torch_eva_attention(**dict(p, **r), return_lse=True)
    assert rel_error(o2, o) < 1e-13 and rel_error(l2, l) < 1e-13
    assert rel_error(numpy_eva_attention(**dict(p, **r)), o) < 1e-12


@given(shape=shapes(), window=WINDOW, bias=BIAS, seed=st.integers(0, 99))
def test_batch_and_head_permutation(shape, window, bias, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, window=window, summary_bias=bias, dtype=F64, device=DEVICE,
                       seed=seed)
    g = torch.Generator().manual_seed(seed)
    pb = torch.randperm(B, generator=g).to(DEVICE)
    pk = torch.randperm(Hkv, generator=g).to(DEVICE)
    rep = H // Hkv
    ph = (pk[:, None] * rep + torch.randperm(rep, generator=g).to(DEVICE)[None, :]).reshape(-1)  # groups stay
    perm = {n: p[n][pb][:, pk] for n in ("k", "v", "k_sum", "v_sum")}
    perm["q"] = p["q"][pb][:, ph]
    if isinstance(p["summary_bias"], torch.Tensor):
        perm["summary_bias"] = p["summary_bias"][pb][:, pk]
    o, l = torch_eva_attention(**p, return_lse=True)
    o2, l2 = torch_eva_attention(**dict(p, **perm), return_lse=True)
    assert rel_error(o2, o[pb][:, ph]) < 1e-13 and rel_error(l2, l[pb][:, ph]) < 1e-13


# ---------------------------------------------------------------- block vs sliding
@given(shape=shapes(max_n=50), bias=BIAS, seed=st.integers(0, 99))
def test_block_and_sliding_agree_at_window_ends(shape, bias, seed):
    B, H, Hkv, Nk, D, C, W = shape
    p = random_problem(B, H, Hkv, None, Nk, D, C, W, summary_bias=bias, dtype=F64, device=DEVICE, seed=seed)
    o_b, l_b = torch_eva_attention(**dict(p, window="block"), return_lse=True)
    o_s, l_s = torch_eva_attention(**dict(p, window="sliding"), return_lse=True)
    rows = [t for t in range(Nk) if t % W == W - 1]
    assert rel_error(o_s[:, :, rows], o_b[:, :, rows]) < 1e-13
    assert rel_error(l_s[:, :, rows], l_b[:, :, rows]) < 1e-13
    if 1 < C < W < Nk - 1:  # elsewhere sliding sees more exact keys, so the outputs differ
        assert rel_error(o_s, o_b) > 1e-6


# ---------------------------------------------------------------- random_problem and autograd
def test_random_problem_layouts_and_bias():
    p = random_problem(2, 4, 2, 5, 19, 6, 3, 6, summary_bias="tensor", layout="strided", dtype=torch.float16,
                       device=DEVICE)
    assert p["q"].shape == (2, 4, 5, 6) and p["k"].shape == (2, 2, 19, 6) and p["k_sum"].shape == (2, 2, 7, 6)
    for n in ("q", "k", "v", "k_sum", "v_sum"):
        assert p[n].dtype == torch.float16 and p[n].stride(-1) == 1 and not p[n].is_contiguous()
        assert torch.all(p[n] != 0)
    assert p["summary_bias"].shape == (2, 2, 7) and p["summary_bias"].dtype == torch.float32
    assert p["q_offset"] is None and p["window"] == "block"
    assert p["chunk_size"] == 3 and p["window_size"] == 6


def test_log_count_matches_explicit_tensor():
    p = random_problem(1, 2, 1, None, 22, 4, 4, 8, summary_bias="log_count", dtype=F64, device=DEVICE)
    n = torch.tensor([4, 4, 4, 4, 4, 2], dtype=F64, device=DEVICE)
    o = torch_eva_attention(**p)
    o2 = torch_eva_attention(**dict(p, summary_bias=torch.log(n).expand(1, 1, 6)))
    assert rel_error(o2, o) < 1e-14


@pytest.mark.parametrize("bias", [None, "tensor"])
def test_differentiable(bias):
    p = random_problem(1, 2, 1, 5, 9, 3, 2, 4, window="sliding", summary_bias=bias, dtype=F64, device=DEVICE)
    names = ["q", "k", "v", "k_sum", "v_sum"] + (["summary_bias"] if bias else [])
    args = [p[n].to(F64).clone().requires_grad_() for n in names]

    def f(*xs):
        return torch_eva_attention(**dict(p, **dict(zip(names, xs))), return_lse=True)

    assert torch.autograd.gradcheck(f, args)


def test_numpy_oracle_accepts_arrays():
    p = random_problem(1, 2, 2, None, 11, 4, 2, 4, dtype=F64)
    arrays = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in p.items()}
    assert np.allclose(numpy_eva_attention(**arrays), numpy_eva_attention(**p), rtol=0, atol=0)


@pytest.mark.parametrize("Nq,Nk", [(0, 0), (0, 10), (1, 1)])
def test_empty_and_tiny_sizes(Nq, Nk):
    p = random_problem(1, 2, 1, Nq, Nk, 76, 4, 8, summary_bias="log_count", device=DEVICE)
    o, lse = torch_eva_attention(**p, return_lse=True)
    assert o.shape == (1, 2, Nq, 76) and lse.shape == (1, 2, Nq)
    _compare(p, torch.float32)
