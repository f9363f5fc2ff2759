"""EvaCache's decode step bookkeeping (kernels_triton/eva_cache.py on the GPU and for the Triton backend;
torch ops for CPU tensors otherwise) leaves the cache exactly (bitwise: k, v, bias, lengths; the
one-launch step's own op-1 summaries within the dtype's rounding) as the torch step it replaced,
`previous_step` below: random cache contents and ragged lengths, near and on
chunk boundaries, both windows, every summary_bias mode, omega / key_weight, strided inputs, beam
reordering between steps. GPU only: the launches of one step, without op 1's and op 2's own.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, dtypes_here, kernel_backends
from flashswitch import EvaCache
from flashswitch import cache as cache_module
from flashswitch.cache import MASKED, window_start
from flashswitch.ops.chunk_summaries import chunk_summaries

BACKENDS = ["reference"] + (["triton"] if "triton" in kernel_backends() else [])
# (backend, cache.FUSED_STEP): the one-launch step runs where op 1 may run in Triton
STEP_PATHS = [("reference", False)] + ([("triton", False), ("triton", True)] if "triton" in BACKENDS else [])


@pytest.fixture
def fused_step(monkeypatch, request):
    """Sets cache.FUSED_STEP for the caches the test builds (indirect parametrization)."""
    monkeypatch.setattr(cache_module, "FUSED_STEP", request.param)
    return request.param
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])


def previous_step(c: EvaCache, k, v) -> None:
    """The cache state of one token before the step had kernels of its own (EvaCache._step_one, less
    its attention, as it was): about 40 torch ops."""
    B, Hkv, D = c.batch_size, c.num_kv_heads, c.head_dim
    Cs, W, R, S = c.chunk_size, c.window_size, c.ring_size, c.num_summaries
    t = c.lengths
    done = (torch.remainder(t, Cs) == 0) & (t >= Cs)
    c_done = torch.div(t, Cs, rounding_mode="floor") - 1
    rows = S + torch.remainder(c_done[:, None] * Cs + torch.arange(Cs, device=t.device)[None, :], R)
    idx = rows[:, None, :, None].expand(B, Hkv, Cs, D)
    ks, vs = chunk_summaries(torch.gather(c.k, 2, idx), torch.gather(c.v, 2, idx), Cs, omega=c.omega,
                             key_weight=c.key_weight, scale=c.scale, backend=c.backend)
    slot = c_done.clamp(min=0)[:, None, None, None].expand(B, Hkv, 1, D)
    keep = ~done[:, None, None, None]
    c.k.scatter_(2, slot, torch.where(keep, torch.gather(c.k, 2, slot), ks))
    c.v.scatter_(2, slot, torch.where(keep, torch.gather(c.v, 2, slot), vs))
    ring_row = (S + torch.remainder(t, R))[:, None, None, None].expand(B, Hkv, 1, D)
    c.k.scatter_(2, ring_row, k)
    c.v.scatter_(2, ring_row, v)
    c.k[:, :, S + R:] = k
    c.v[:, :, S + R:] = v
    start = window_start(t, Cs, W, c.window)
    sum_on = torch.arange(S, device=t.device)[None, :] < torch.div(start, Cs, rounding_mode="floor")[:, None]
    pos = t[:, None] - torch.remainder(t[:, None] - torch.arange(R, device=t.device)[None, :], R)
    ring_on = (pos >= start[:, None]) & (pos < t[:, None])
    if c.user_bias is not None:
        on_bias = c.user_bias.to(torch.float32)
    else:
        on_bias = math.log(Cs) if c.log_count else 0.0
    c.bias[:, :, :S] = torch.where(sum_on[:, None, :], on_bias, MASKED)
    c.bias[:, :, S:] = torch.where(ring_on[:, None, :], 0.0, MASKED)
    c.lengths += 1


@st.composite
def cases(draw):
    C = draw(st.sampled_from([1, 2, 3, 4]))
    steps = draw(st.integers(1, C + 2))  # at least one chunk boundary for every sequence when >= C
    B = draw(st.integers(1, 3))
    # lengths on (near) a boundary or anywhere; the window and ring sizes around them
    near = st.builds(lambda m, o: max(m * C + o, 0), st.integers(0, 6), st.sampled_from([-1, 0, 1]))
    lengths = draw(st.lists(st.one_of(near, st.integers(0, 30)), min_size=B, max_size=B))
    return dict(B=B, Hkv=draw(st.integers(1, 2)), D=draw(st.sampled_from([1, 3, 8])), C=C,
                W=C * draw(st.sampled_from([1, 2, 3])), window=draw(st.sampled_from(["block", "sliding"])),
                lengths=lengths, steps=steps, spare=draw(st.integers(0, 5)),
                bias=draw(st.sampled_from([None, "log_count", "fp32", "fp64-strided"])),
                summaries=draw(st.sampled_from(["mean", "weighted"])), scale=draw(st.sampled_from([None, 0.4])),
                reorder=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes_here())), seed=draw(st.integers(0, 999)))


def twin_caches(backend, case):
    """Two caches of one configuration holding the same random contents: the step under test, and the
    previous step's state (both run op 1 on `backend`, so its summaries are the same bits)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, D, Cs = case["B"], case["Hkv"], case["D"], case["C"]
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    N = max(case["lengths"]) + case["steps"] + case["spare"]
    S = -(-N // Cs)
    bias = {"fp32": lambda: rnd(B, Hkv, S).float(),
            "fp64-strided": lambda: rnd(B, S, Hkv).double().transpose(1, 2)}.get(case["bias"], lambda: case["bias"])()
    omega = kw = None
    if case["summaries"] == "weighted":
        omega, kw = rnd(Hkv, D).to(case["dtype"]), rnd(Hkv, D).to(case["dtype"])
    make = lambda: EvaCache(B, Hkv, D, chunk_size=Cs, window_size=case["W"], window=case["window"],  # noqa: E731
                            max_seq_len=N, dtype=case["dtype"], device=DEVICE, key_weight=kw, omega=omega,
                            summary_bias=bias, scale=case["scale"], backend=backend)
    lean, old = make(), make()
    state = dict(k=rnd(*lean.k.shape).to(case["dtype"]), v=rnd(*lean.v.shape).to(case["dtype"]),
                 bias=rnd(*lean.bias.shape), lengths=torch.tensor(case["lengths"], device=DEVICE))
    for c in (lean, old):
        for name, value in state.items():
            getattr(c, name).copy_(value)
        c._max_len = max(case["lengths"])
    return lean, old, g


# op 1 in the one-launch step (eva_cache.step) against op 1's own kernel: the same math, its sums maybe
# in another order; the summaries are held to the rounding of the cache's dtype there
SUMMARY_TOL = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def assert_same_state(lean, old, where):
    S = lean.num_summaries
    for name in ("k", "v", "bias", "lengths"):
        a, b = getattr(lean, name), getattr(old, name)
        if lean._fused and name in ("k", "v"):
            tol = SUMMARY_TOL[a.dtype]
            torch.testing.assert_close(a[:, :, :S], b[:, :, :S], rtol=tol, atol=tol, equal_nan=True,
                                       msg=lambda m: f"{name} summaries differ {where}: {m}")
            a, b = a[:, :, S:], b[:, :, S:]
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        assert bool(same.all()), f"{name} differs {where}: {(~same).nonzero()[:8].tolist()}"


@pytest.mark.parametrize("backend,fused_step", STEP_PATHS, indirect=["fused_step"])
@with_fixture
@given(case=cases())
def test_step_state_is_the_previous_steps_bitwise(backend, fused_step, case):
    lean, old, g = twin_caches(backend, case)
    assert (lean._kernels is not None) == (DEVICE == "cuda" or backend == "triton")
    assert lean._fused == fused_step
    B, Hkv, D = case["B"], case["Hkv"], case["D"]
    x = torch.randn(B, Hkv, 2 * case["steps"] + 1, D, generator=g).to(case["dtype"]).to(DEVICE)
    for i in range(case["steps"]):
        k, v = x[:, :, 2 * i:2 * i + 1], x[:, :, 2 * i + 1:2 * i + 2]  # strided, as a multi-token step's slices
        lean._append_token(k, v)
        previous_step(old, k, v)
        assert_same_state(lean, old, f"after step {i}")
        if case["reorder"] and i == 0:
            beam = torch.randint(0, B, (B,), generator=g).to(DEVICE)
            lean.reorder(beam), old.reorder(beam)


@pytest.mark.parametrize("backend,fused_step", STEP_PATHS, indirect=["fused_step"])
def test_step_over_several_bias_blocks(backend, fused_step):
    """Sequences whose bias row spans several programs of the one-launch step (S + R > one block): the
    last program of each sequence moves its length on after the others read it, and leaves the
    counter at zero for the next step."""
    case = dict(B=2, Hkv=3, D=8, C=4, W=8, window="block", lengths=[7, 4095], steps=6, spare=3000, bias="fp32",
                summaries="weighted", scale=0.4, reorder=False, dtype=torch.float32, seed=2)
    lean, old, g = twin_caches(backend, case)
    assert lean.bias.shape[-1] > 1024
    x = torch.randn(2, 3, 2 * case["steps"], 8, generator=g).to(DEVICE)
    for i in range(case["steps"]):
        lean._append_token(x[:, :, 2 * i:2 * i + 1], x[:, :, 2 * i + 1:2 * i + 2])
        previous_step(old, x[:, :, 2 * i:2 * i + 1], x[:, :, 2 * i + 1:2 * i + 2])
        assert_same_state(lean, old, f"after step {i}")
        assert int(lean._done_programs.abs().sum()) == 0


@pytest.mark.parametrize("backend,fused_step", STEP_PATHS, indirect=["fused_step"])
def test_public_step_advances_like_the_previous_step(backend, fused_step):
    """step() itself (one- and multi-token) leaves the previous step's state, across a chunk boundary."""
    case = dict(B=2, Hkv=2, D=8, C=2, W=4, window="sliding", lengths=[3, 6], steps=3, spare=0, bias="log_count",
                summaries="weighted", scale=None, reorder=False, dtype=torch.float32, seed=4)
    lean, old, g = twin_caches(backend, case)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=g).to(DEVICE) for _ in range(3))
    lean.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    lean.step(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:])
    for i in range(3):
        previous_step(old, k[:, :, i:i + 1], v[:, :, i:i + 1])
    assert_same_state(lean, old, "after 1 + 2 tokens")
    assert lean.lengths.tolist() == [6, 9]


# ---------------------------------------------------------------- GPU only
def _cuda_launches(fn) -> list[str]:
    """Names of the device activities (kernels, copies, fills) that fn() causes."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,fused_step,launches", [("auto", True, 1), ("auto", False, 2), ("cuda", True, 2)],
                         indirect=["fused_step"])
@pytest.mark.parametrize("summary_bias", [None, "log_count", "tensor"])
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_step_bookkeeping_launches(monkeypatch, window, summary_bias, backend, fused_step, launches):
    """One decode step launches 1 kernel besides op 2's (stubbed out here) where op 1 may run in Triton
    (op 1 inside it), else 2 around op 1's own (stubbed too): the chunk gather and the append. The torch
    step it replaced launched about 40."""
    if backend != "auto" and backend not in kernel_backends():
        pytest.skip(f"backend {backend} is not available here")
    monkeypatch.setenv("FLASHSWITCH_POISON", "0")  # a poisoned output would add a fill
    B, Hkv, H, D, Cs, W, N = 16, 3, 9, 64, 16, 64, 4096
    bias = torch.zeros(B, Hkv, N // Cs, device="cuda") if summary_bias == "tensor" else summary_bias
    cache = EvaCache(B, Hkv, D, chunk_size=Cs, window_size=W, window=window, max_seq_len=N, dtype=torch.bfloat16,
                     device="cuda", summary_bias=bias, backend=backend)
    x = lambda h, n: torch.randn(B, h, n, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    cache.prefill(x(H, 100), x(Hkv, 100), x(Hkv, 100))
    q, k, v = x(H, 1), x(Hkv, 1), x(Hkv, 1)
    sums, o = (torch.zeros(B, Hkv, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(cache_module, "chunk_summaries", lambda *a, **kw: (sums, sums))
    monkeypatch.setattr(cache_module, "eva_attention", lambda *a, **kw: o)
    cache.step(q, k, v)  # compiles
    names = _cuda_launches(lambda: cache.step(q, k, v))
    assert len(names) <= launches, names
    assert int(cache.lengths[0]) == 102


@pytest.mark.gpu
@pytest.mark.parametrize("fused_step", [False, True], indirect=True)
def test_captured_step_replays_bookkeeping_of_eager_steps(fused_step):
    """A CUDA graph of one step replayed over chunk boundaries leaves the eager steps' state bitwise."""
    B, Hkv, H, D, Cs, W, P, T = 3, 2, 4, 64, 4, 8, 13, 11
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, P + T, D, generator=g).to("cuda", torch.bfloat16) for h in (H, Hkv, Hkv))
    kw = dict(chunk_size=Cs, window_size=W, window="sliding", max_seq_len=P + T, dtype=torch.bfloat16, device="cuda",
              summary_bias="log_count")
    eager, graphed = EvaCache(B, Hkv, D, **kw), EvaCache(B, Hkv, D, **kw)
    lengths = torch.tensor([P, P - 5, 2], device="cuda")
    for c in (eager, graphed):
        c.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], lengths=lengths)
    for t in range(P, P + T):
        eager.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    sq, sk, sv = q[:, :, P:P + 1].clone(), k[:, :, P:P + 1].clone(), v[:, :, P:P + 1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed.step(sq, sk, sv)  # warm-up (compiles) is the first real token
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(sq, sk, sv)
    for t in range(P + 1, P + T):
        sq.copy_(q[:, :, t:t + 1]), sk.copy_(k[:, :, t:t + 1]), sv.copy_(v[:, :, t:t + 1])
        graph.replay()
    assert_same_state(graphed, eager, "after the replays")
