"""Non-finite isolation: an inf or NaN in one key, value or summary reaches only the outputs that
depend on it. Op 2: every query row that cannot see the bad position is bitwise equal to the same
call on clean inputs (a masked key has weight 0, and 0 * inf = NaN must not reach that row); rows
that see it may be anything. Op 1: the summaries (and lse) of every other chunk are bitwise equal.
Checked on every backend that runs here (the reference, Triton under the interpreter on the CPU;
CUDA, CuPy and the Gluon kernel on the GPU), with configs that make masked tiles of every kind.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE, gpu_spread, kernel_backends
from flashswitch.ops import chunk_summaries as op1
from flashswitch.ops import eva_attention as op2
from flashswitch.reference.chunk_summaries import random_problem as cs_problem
from flashswitch.reference.eva_attention import random_problem, visible_masks

GPU = DEVICE == "cuda"
BAD = st.sampled_from([float("inf"), float("-inf"), float("nan")])
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # many masked tiles on tiny problems
# explicit Triton configs (None: the tuned/default one): five loops, one loop, key splits, TMA
TRITON_CONFIGS = [None, SMALL, dict(SMALL, FUSE=True), dict(SMALL, NUM_SPLITS=3), dict(SMALL, FUSE=True, TMA=True),
                  dict(SMALL, TMA=True)]


def _backends():
    return ["reference"] + kernel_backends()


def _cases(backend):
    """(backend, config) pairs to run: every Triton config above; the others' own choice."""
    if backend == "triton":
        return [("triton", c) for c in TRITON_CONFIGS]
    return [(backend, None)]


# ---------------------------------------------------------------- op 2
def _eva(backend, config, p):
    if config is None:
        return op2.eva_attention(**p, return_lse=True, backend=backend)
    return op2.run_kernel(backend, config, **p)


def _seen_by(p, name, pos):
    """[B, H, Nq] bool: the query rows that see position `pos` of kv head p's `name` in batch b."""
    b, hk, j = pos
    q, k, ks = p["q"], p["k"], p["k_sum"]
    B, H, Nq, _ = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], ks.shape[2]
    exact, summ = visible_masks(Nq, Nk, Nc, chunk_size=p["chunk_size"], window_size=p["window_size"],
                                window=p["window"], q_offset=p.get("q_offset"))
    col = (exact if name in ("k", "v") else summ)[:, j]
    seen = torch.zeros(B, H, Nq, dtype=torch.bool)
    G = H // Hkv
    seen[b, hk * G:(hk + 1) * G] = col.cpu()
    return seen


def _poison(p, name, pos, d, value):
    """A copy of p with p[name][b, hk, j, d] = value (p[name][b, hk, j] for the summary bias)."""
    p = dict(p)
    t = p[name].clone()
    t[pos + ((d,) if t.dim() == 4 else ())] = value
    p[name] = t
    return p


def _assert_isolated(clean, dirty, seen, what):
    """Rows not in `seen` are bitwise equal in o and lse (and finite where the clean run is)."""
    o0, l0 = clean
    o1, l1 = dirty
    keep = ~seen.to(o0.device)
    assert torch.equal(o1[keep], o0[keep]), f"{what}: o changed in rows that cannot see the bad value"
    assert torch.equal(l1[keep], l0[keep]), f"{what}: lse changed in rows that cannot see the bad value"


def _check_op2(p, name, pos, d, value, backend, config):
    clean = _eva(backend, config, p)
    assert torch.isfinite(clean[0]).all()
    dirty = _eva(backend, config, _poison(p, name, pos, d, value))
    _assert_isolated(clean, dirty, _seen_by(p, name, pos), f"{backend} {config} {name}{pos}={value}")


@st.composite
def op2_cases(draw):
    C = draw(st.sampled_from([1, 2, 3, 4] + ([16] if GPU else [])))
    W = C * draw(st.sampled_from([1, 2, 4]))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2]))
    Nk = draw(st.integers(2, 200 if GPU else 48))
    mode = draw(st.sampled_from(["prefill", "chunked", "decode"]))
    if mode == "prefill":
        Nq, q_offset = Nk, None
    else:
        Nq = draw(st.integers(1, Nk if mode == "chunked" else min(16, Nk)))
        q_offset = draw(st.integers(0, Nk - Nq))
    D = draw(st.sampled_from([3, 16] + ([64, 128] if GPU else [])))
    dtypes = [torch.float32, torch.float16, torch.bfloat16] if GPU else [torch.float32]
    kw = dict(B=draw(st.integers(1, 2)), H=Hkv * G, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, C=C, W=W, window=draw(
        st.sampled_from(["block", "sliding"])), summary_bias=draw(st.sampled_from([None, "log_count", "tensor"])),
        q_offset=q_offset, dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 999)))
    name = draw(st.sampled_from(["k", "v", "k_sum", "v_sum"] + (["summary_bias"] if kw["summary_bias"] else [])))
    if name == "summary_bias" and kw["summary_bias"] != "tensor":
        name = "v_sum"
    n = Nk if name in ("k", "v") else -(-Nk // C)
    pos = (draw(st.integers(0, kw["B"] - 1)), draw(st.integers(0, Hkv - 1)), draw(st.integers(0, n - 1)))
    return kw, name, pos, draw(st.integers(0, D - 1)), draw(BAD)


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=6 if not GPU else 20)
@given(case=op2_cases())
def test_eva_attention_isolates_nonfinite(backend, case):
    """Hypothesis over shapes, windows, GQA, decode, bias modes: one bad element in one row."""
    kw, name, pos, d, value = case
    p = random_problem(device=DEVICE, **kw)
    for be, cfg in _cases(backend):
        _check_op2(p, name, pos, d, value, be, cfg)


# one poisoned position per case that some rows of its tiles see and others do not (the leak before):
# a value on the causal diagonal, a summary visible to the second window only, a key past a window
FIXED = [("v", 5, "block"), ("v", 21, "sliding"), ("v_sum", 1, "block"), ("v_sum", 2, "sliding"),
         ("k", 5, "block"), ("k_sum", 1, "sliding"), ("summary_bias", 1, "block"), ("summary_bias", 2, "sliding")]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name,j,window", FIXED)
def test_eva_attention_isolates_nonfinite_fixed(backend, name, j, window):
    p = random_problem(1, 2, 1, None, 40, 16, 2, 8, window=window, summary_bias="tensor", device=DEVICE, seed=j)
    seen = _seen_by(p, name, (0, 0, j))
    assert seen.any() and not seen.all()  # a case where isolation matters
    for be, cfg in _cases(backend):
        for value in (float("inf"), float("nan")):
            _check_op2(p, name, (0, 0, j), 7, value, be, cfg)


TUNED_DTYPES = [torch.float16, torch.bfloat16]
TUNED_NAMES = ["k", "v", "k_sum", "v_sum"]
TUNED_WINDOWS = [("block", 16, 256), ("sliding", 8, 72)]
TUNED_TILES = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
               dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, FUSE=True, TMA=True),
               dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True),
               dict(GLUON=True, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)]


def _tuned_tiles_spread(dtype, name, window, C, W, cfg):
    """Every (tile, poisoned input) pair once, window and dtype chosen so that every pair of values of
    any two of the four parameters occurs (16 of the 64 combinations)."""
    i, j = TUNED_TILES.index(cfg), TUNED_NAMES.index(name)
    return (TUNED_WINDOWS.index((window, C, W)) == (i + j) % 2
            and TUNED_DTYPES.index(dtype) == (i // 2 + j // 2 + j) % 2)


@pytest.mark.gpu
@gpu_spread(_tuned_tiles_spread)
@pytest.mark.parametrize("dtype", TUNED_DTYPES)
@pytest.mark.parametrize("name", TUNED_NAMES)
@pytest.mark.parametrize("window,C,W", TUNED_WINDOWS)
@pytest.mark.parametrize("cfg", TUNED_TILES)
def test_eva_attention_isolates_nonfinite_tuned_tiles(dtype, name, window, C, W, cfg, monkeypatch):
    """The tiles the H200 tuner picks (including the Gluon kernel) and the CUDA/CuPy kernels, at
    D = 128 on a prefill with ragged tiles: a bad element on the diagonal / in a window-edge summary.
    The GPU runs the pairwise spread `_tuned_tiles_spread`, not all 64 combinations."""
    if cfg.get("GLUON"):
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Gluon kernel is for sm_90")
        from flashswitch.kernels_triton import eva_attention_gluon as glu
        ran = []
        real = glu.launch
        monkeypatch.setattr(glu, "launch", lambda *a, **kw: (ran.append(1), real(*a, **kw)))
    Nk = 700
    p = random_problem(2, 4, 2, None, Nk, 128, C, W, window=window, summary_bias="log_count", dtype=dtype,
                       device=DEVICE, seed=C)
    j = 301 if name in ("k", "v") else 17
    seen = _seen_by(p, name, (1, 1, j))
    assert seen.any() and not seen.all()
    for value in (float("inf"), float("nan")):
        _check_op2(p, name, (1, 1, j), 5, value, "triton", cfg)
        for be in kernel_backends():
            if be != "triton":
                _check_op2(p, name, (1, 1, j), 5, value, be, None)
    if cfg.get("GLUON"):
        assert ran, "the Gluon kernel did not take the problem"


# ---------------------------------------------------------------- op 1
def _cs(backend, p):
    return op1.chunk_summaries(**p, return_lse=True, backend=backend)


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=6 if not GPU else 20)
@given(N=st.integers(1, 60), C=st.sampled_from([1, 3, 4, 16]), D=st.sampled_from([3, 16]),
       omega=st.sampled_from(["none", "head", "chunk"]), key_weight=st.booleans(), valid=st.booleans(),
       name=st.sampled_from(["k", "v"]), value=BAD, seed=st.integers(0, 999), data=st.data())
def test_chunk_summaries_isolates_nonfinite(backend, N, C, D, omega, key_weight, valid, name, value, seed, data):
    """A bad element in one token's key or value changes only its own chunk's k_sum, v_sum and lse."""
    p = cs_problem(2, 2, N, D, C, omega=omega, key_weight=key_weight, valid=valid, device=DEVICE, seed=seed)
    b, h, j, d = (data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1)), data.draw(st.integers(0, N - 1)),
                  data.draw(st.integers(0, D - 1)))
    clean = _cs(backend, p)
    bad = dict(p)
    bad[name] = p[name].clone()
    bad[name][b, h, j, d] = value
    dirty = _cs(backend, bad)
    keep = torch.ones(clean[2].shape, dtype=torch.bool, device=clean[2].device)
    keep[b, h, j // C] = False
    for what, x0, x1 in zip(("k_sum", "v_sum", "lse"), clean, dirty):
        assert torch.equal(x1[keep], x0[keep]), f"{backend}: {what} of another chunk changed"


# ---------------------------------------------------------------- op 2: summary capacity (SPEC "Op 2")
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_summary_capacity_is_never_read(backend, window):
    """k_sum / v_sum / bias with more rows than ceil(Nk / C) (a preallocated summary buffer): the rows
    past the summaries any query can see hold NaN / inf, and the output is bitwise that of the call
    on the first ceil(Nk / C) rows; their gradients are exactly 0 and every gradient is finite."""
    C, Nk, cap = 2, 37, 40
    p = random_problem(1, 4, 2, None, Nk, 16, C, 8, window=window, summary_bias="tensor", device=DEVICE, seed=5)
    Nc = p["k_sum"].shape[2]
    big = dict(p)
    for name, fill in (("k_sum", float("nan")), ("v_sum", float("inf")), ("summary_bias", float("nan"))):
        t = p[name]
        buf = torch.full(t.shape[:2] + (cap,) + t.shape[3:], fill, dtype=t.dtype, device=t.device)
        buf[:, :, :Nc] = t
        big[name] = buf
    cases = _cases(backend)
    for be, cfg in (cases[:1] + cases[-2:] if backend == "triton" else cases):
        o1, l1 = _eva(be, cfg, big)
        o0, l0 = _eva(be, cfg, p)
        assert torch.equal(o1, o0) and torch.equal(l1, l0), (be, cfg)
    grads = {n: big[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "k_sum", "v_sum")}
    o, lse = op2.eva_attention(**{**big, **grads}, return_lse=True, backend=backend)
    (o.square().sum() + lse.sum()).backward()
    for n, t in grads.items():
        assert torch.isfinite(t.grad).all(), n
    for n in ("k_sum", "v_sum"):
        assert torch.equal(grads[n].grad[:, :, Nc:], torch.zeros_like(grads[n].grad[:, :, Nc:])), n
