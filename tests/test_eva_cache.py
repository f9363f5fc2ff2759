"""EvaCache: prefill of P tokens then single- and multi-token steps reproduce the full-sequence op 2
(fp64 oracle over op 1's fp64 summaries) at every position: both windows, GQA, ragged prompts, every
summary option, every backend that runs here (reference; Triton under the interpreter on the CPU).
Also: the state after prefill, beam reordering, the allocation size, argument checks and (GPU only)
CUDA-graph capture of a step.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, dtypes_here, kernel_backends
from flashswitch import EvaCache
from flashswitch.reference.chunk_summaries import numpy_chunk_summaries
from flashswitch.reference.eva_attention import numpy_eva_attention
from flashswitch.testing import REL_TOL, assert_close, rel_error

GPU = DEVICE == "cuda"
BACKENDS = ["reference"] + kernel_backends()
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])


def full_sequence_oracle(k_all, v_all, q_all, b, L, p):
    """fp64 op 2 over the whole sequence b (its first L tokens), as the cache must reproduce it."""
    k, v, q = k_all[b:b + 1, :, :L], v_all[b:b + 1, :, :L], q_all[b:b + 1, :, :L]
    k_sum, v_sum = numpy_chunk_summaries(k, v, p["C"], omega=p["omega"], key_weight=p["key_weight"], scale=p["scale"])
    bias = p["bias"]
    if isinstance(bias, torch.Tensor):
        bias = bias[b:b + 1, :, :k_sum.shape[2]]
    return numpy_eva_attention(q, k, v, k_sum, v_sum, chunk_size=p["C"], window_size=p["W"], window=p["window"],
                               scale=p["scale"], summary_bias=bias)


@st.composite
def cases(draw):
    C = draw(st.sampled_from([1, 2, 3, 4]))
    return dict(B=draw(st.integers(1, 2)), Hkv=draw(st.integers(1, 2)), G=draw(st.sampled_from([1, 2])),
                D=draw(st.sampled_from([3, 8, 16])), C=C, W=C * draw(st.sampled_from([1, 2, 3])),
                window=draw(st.sampled_from(["block", "sliding"])), P=draw(st.integers(0, 14)),
                steps=draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=6)),
                ragged=draw(st.booleans()), summaries=draw(st.sampled_from(["mean", "weighted"])),
                bias=draw(st.sampled_from([None, "log_count", "tensor"])), scale=draw(st.sampled_from([None, 0.4])),
                dtype=draw(st.sampled_from(dtypes_here())), seed=draw(st.integers(0, 999)))


def run_and_check(backend, case):
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, H, D, P = case["B"], case["Hkv"], case["Hkv"] * case["G"], case["D"], case["P"]
    N = P + sum(case["steps"])
    rnd = lambda *s, a=1.0: (torch.randn(*s, generator=g) * a).to(case["dtype"]).to(DEVICE)  # noqa: E731
    q, k, v = rnd(B, H, N, D), rnd(B, Hkv, N, D), rnd(B, Hkv, N, D)
    S = -(-N // case["C"])
    p = dict(C=case["C"], W=case["W"], window=case["window"], scale=case["scale"], omega=None, key_weight=None,
             bias=rnd(B, Hkv, S, a=0.5).float() if case["bias"] == "tensor" else case["bias"])
    if case["summaries"] == "weighted":
        p["omega"], p["key_weight"] = rnd(Hkv, D, a=0.5), rnd(Hkv, D, a=0.5)
    lengths = torch.randint(0, P + 1, (B,), generator=g) if case["ragged"] else torch.full((B,), P)
    cache = EvaCache(B, Hkv, D, chunk_size=p["C"], window_size=p["W"], window=p["window"], max_seq_len=N,
                     dtype=case["dtype"], device=DEVICE, key_weight=p["key_weight"], omega=p["omega"],
                     summary_bias=p["bias"], scale=p["scale"], backend=backend)
    # sequence b: its prompt's first lengths[b] tokens, then the step tokens (stored after P)
    o_pre = cache.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], lengths=lengths.to(DEVICE) if case["ragged"] else None)
    outs, at = [], P
    for n in case["steps"]:
        outs.append(cache.step(q[:, :, at:at + n], k[:, :, at:at + n], v[:, :, at:at + n]))
        at += n
    o_steps = torch.cat(outs, dim=2)
    assert torch.equal(cache.lengths.cpu(), lengths + (N - P))
    for b in range(B):
        L = int(lengths[b])
        order = list(range(L)) + list(range(P, N))  # the positions of sequence b inside q/k/v
        ref = full_sequence_oracle(k[:, :, order], v[:, :, order], q[:, :, order], b, len(order), p)
        got = torch.cat([o_pre[b:b + 1, :, :L], o_steps[b:b + 1]], dim=2)
        assert_close(f"o (sequence {b})", got, ref, case["dtype"])


@pytest.mark.parametrize("backend", BACKENDS)
@with_fixture
@given(case=cases())
def test_prefill_then_steps_match_full_sequence(backend, case):
    run_and_check(backend, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_long_decode_fills_many_chunks(backend, window):
    """Token-by-token from an empty cache past several windows: every summary slot and ring wrap."""
    steps = [1] * 12 if backend != "reference" else [1] * 30
    run_and_check(backend, dict(B=2, Hkv=2, G=2, D=8, C=2, W=4, window=window, P=0, steps=steps, ragged=False,
                                summaries="mean", bias="log_count", scale=None, dtype=torch.float32, seed=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("P, lengths", [(11, [11, 6]), (11, None), (3, None)])
def test_state_after_prefill(backend, P, lengths):
    """Summaries of the completed chunks, ring rows at position % R, lengths: as the design says (the
    kernel backends write them in one launch)."""
    B, Hkv, D, C, W = 2, 2, 4, 2, 4
    g = torch.Generator().manual_seed(P)
    k, v = (torch.randn(B, Hkv, P, D, generator=g).to(DEVICE) for _ in range(2))
    cache = EvaCache(B, Hkv, D, chunk_size=C, window_size=W, window="sliding", max_seq_len=20, dtype=torch.float32,
                     device=DEVICE, backend=backend)
    cache.k.fill_(float("nan"))  # poisoned: a row the prefill should write and did not shows
    cache.v.fill_(float("nan"))
    given = None if lengths is None else torch.tensor(lengths, device=DEVICE)
    cache.prefill(torch.randn(B, Hkv, P, D, generator=g).to(DEVICE), k, v, lengths=given)
    S, R = cache.num_summaries, cache.ring_size
    assert (S, R) == (10, 5)
    ks, vs = numpy_chunk_summaries(k, v, C)
    Ls = lengths or [P] * B
    for b, L in enumerate(Ls):
        done = L // C  # completed chunks
        assert rel_error(cache.summaries[0][b, :, :done], ks[b, :, :done]) < 1e-6
        assert rel_error(cache.summaries[1][b, :, :done], vs[b, :, :done]) < 1e-6
        for pos in range(max(0, L - R), L):
            assert torch.equal(cache.k[b, :, S + pos % R], k[b, :, pos])
            assert torch.equal(cache.v[b, :, S + pos % R], v[b, :, pos])
        assert not cache.k[b, :, S:S + R].isnan().any()  # rows of no position hold finite values
    assert cache.lengths.tolist() == Ls


def test_nbytes_is_the_compressed_size():
    B, Hkv, D, C, W, N = 3, 2, 16, 4, 8, 1000
    for window, R in (("block", W), ("sliding", W + C - 1)):
        cache = EvaCache(B, Hkv, D, chunk_size=C, window_size=W, window=window, max_seq_len=N, dtype=torch.float16)
        rows = R + math.ceil(N / C) + 1
        assert cache.nbytes == B * Hkv * (rows * 2 * D * 2 + (rows - 1) * 4) + B * 8
        assert cache.nbytes < B * Hkv * N * 2 * D * 2 / 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_reorder_follows_beams(backend):
    """After reorder(beam_idx), each sequence continues as the one it copied."""
    B, Hkv, D, C, W, P = 3, 1, 8, 2, 4, 7
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, Hkv, P + 2, D, generator=g).to(DEVICE) for _ in range(3))
    kw = dict(chunk_size=C, window_size=W, max_seq_len=P + 2, dtype=torch.float32, device=DEVICE, backend=backend)
    a, ref = EvaCache(B, Hkv, D, **kw), EvaCache(B, Hkv, D, **kw)
    beam = torch.tensor([2, 0, 0], device=DEVICE)
    a.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], lengths=torch.tensor([7, 5, 6], device=DEVICE))
    a.step(q[:, :, P:P + 1], k[:, :, P:P + 1], v[:, :, P:P + 1])
    a.reorder(beam)
    ref.prefill(q[beam, :, :P], k[beam, :, :P], v[beam, :, :P], lengths=torch.tensor([6, 7, 7], device=DEVICE))
    ref.step(q[beam, :, P:P + 1], k[beam, :, P:P + 1], v[beam, :, P:P + 1])
    s = slice(P + 1, P + 2)
    assert_close("o", a.step(q[:, :, s], k[:, :, s], v[:, :, s]), ref.step(q[:, :, s], k[:, :, s], v[:, :, s]),
                 torch.float32)
    assert torch.equal(a.lengths, ref.lengths)


def test_bad_arguments():
    kw = dict(chunk_size=2, window_size=4, max_seq_len=8)
    with pytest.raises(ValueError, match="window_size"):
        EvaCache(1, 1, 4, chunk_size=3, window_size=4, max_seq_len=8)
    with pytest.raises(ValueError, match="window"):
        EvaCache(1, 1, 4, window="banded", **kw)
    with pytest.raises(TypeError, match="max_seq_len"):
        EvaCache(1, 1, 4, chunk_size=2, window_size=4, max_seq_len=8.0)
    with pytest.raises(ValueError, match="omega"):
        EvaCache(1, 2, 4, omega=torch.zeros(1, 4), **kw)
    with pytest.raises(ValueError, match="summary_bias"):
        EvaCache(1, 1, 4, summary_bias="log", **kw)
    cache = EvaCache(1, 2, 4, dtype=torch.float32, **kw)
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="q"):
        cache.step(x.double(), x, x)
    with pytest.raises(ValueError, match="k"):
        cache.step(x, x[:, :1], x)
    with pytest.raises(ValueError, match="heads"):
        cache.step(torch.randn(1, 3, 3, 4), x, x)
    with pytest.raises(ValueError, match="at least one"):
        cache.step(x[:, :, :0], x[:, :, :0], x[:, :, :0])
    with pytest.raises(ValueError, match="lengths"):
        cache.prefill(x, x, x, lengths=torch.tensor([1, 2]))
    cache.prefill(x, x, x)
    with pytest.raises(ValueError, match="empty cache"):
        cache.prefill(x, x, x)
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.step(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    with pytest.raises(ValueError, match="beam_idx"):
        cache.reorder(torch.tensor([0, 0]))


# ---------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference"] + kernel_backends())
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_graph_captured_steps_match_eager(backend, window):
    """One captured step replayed token after token equals eager steps (positions advance on the device)."""
    B, Hkv, H, D, C, W, P, T = 2, 2, 8, 64, 4, 16, 37, 40
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, P + T, D, generator=g).to("cuda", torch.bfloat16) for h in (H, Hkv, Hkv))
    kw = dict(chunk_size=C, window_size=W, window=window, max_seq_len=P + T, dtype=torch.bfloat16, device="cuda",
              backend=backend)
    eager, graphed = EvaCache(B, Hkv, D, **kw), EvaCache(B, Hkv, D, **kw)
    lengths = torch.tensor([P, P - 9], device="cuda")
    for c in (eager, graphed):
        c.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], lengths=lengths)
    want = [eager.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(P, P + T)]
    sq, sk, sv = q[:, :, P:P + 1].clone(), k[:, :, P:P + 1].clone(), v[:, :, P:P + 1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = [graphed.step(sq, sk, sv).clone()]  # warm-up (compiles) is the first real token
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.step(sq, sk, sv)
    for t in range(P + 1, P + T):
        sq.copy_(q[:, :, t:t + 1]), sk.copy_(k[:, :, t:t + 1]), sv.copy_(v[:, :, t:t + 1])
        graph.replay()
        got.append(out.clone())
    torch.testing.assert_close(torch.cat(got, 2).float(), torch.cat(want, 2).float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(graphed.lengths, eager.lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference"] + kernel_backends())
def test_steps_do_not_sync(backend):
    """Single- and multi-token steps never wait for the device (torch's sync debug mode raises)."""
    B, Hkv, H, D = 2, 2, 4, 64
    cache = EvaCache(B, Hkv, D, chunk_size=4, window_size=8, window="sliding", max_seq_len=64, dtype=torch.bfloat16,
                     device="cuda", backend=backend)
    x = lambda h, n: torch.randn(B, h, n, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    cache.prefill(x(H, 9), x(Hkv, 9), x(Hkv, 9), lengths=torch.tensor([9, 4], device="cuda"))
    cache.step(x(H, 1), x(Hkv, 1), x(Hkv, 1)), cache.step(x(H, 2), x(Hkv, 2), x(Hkv, 2))  # compile first
    q1, k1, v1, q2, k2, v2 = x(H, 1), x(Hkv, 1), x(Hkv, 1), x(H, 2), x(Hkv, 2), x(Hkv, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.step(q1, k1, v1)
        cache.step(q2, k2, v2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", kernel_backends())
def test_half_precision_decode_on_gpu(backend, dtype):
    run_and_check(backend, dict(B=2, Hkv=2, G=4, D=64, C=16, W=64, window="sliding", P=150, steps=[1] * 20 + [3, 5],
                                ragged=True, summaries="weighted", bias="log_count", scale=None, dtype=dtype,
                                seed=5))
