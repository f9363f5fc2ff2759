"""Op 2 backward: gradients of every kernel backend (all run the Triton backward kernels) against
autograd of the torch reference on fp64 copies of the inputs.

A gradient must be within 2x the error of the torch reference's gradient in the same precision
plus the dtype's rounding floor (the SPEC rule), widened by the rounding of O that delta reads and by
the recomputation of P (large logits). Kernel outputs start as NaN
(FLASHSWITCH_POISON), so a gradient element a kernel forgets to write fails. Also: gradcheck of
the reference, opcheck of both custom ops, bitwise determinism, the gradient through lse, rows no
query sees (NaN there must not reach a gradient), explicit configs, torch.compile and CUDA graphs.
"""
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, covering_indices, cuda_graph_capture, dtypes_here, gpu_spread, kernel_backends
from flashswitch.backends import KERNELS
from flashswitch.autotune import space
from flashswitch.kernels_triton.eva_attention_bwd import _kv_walk_range
from flashswitch.ops import eva_attention as op
from flashswitch.ops.eva_attention import eva_attention
from flashswitch.reference.eva_attention import random_problem, torch_eva_attention
from flashswitch.testing import CONDITIONING_FACTOR, assert_close, unit_roundoff

GPU = DEVICE == "cuda"
F32, F64 = torch.float32, torch.float64
TENSORS = ("q", "k", "v", "k_sum", "v_sum")
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
         "BLOCK_M_DQ": 16, "BLOCK_N_DQ": 16, "num_warps_dq": 4, "num_stages_dq": 1}

@pytest.fixture
def bwd_backend():
    """Every backend runs the same Triton backward kernels: the tests of backward tiles and configs
    run them once, through the triton backend."""
    if "triton" not in kernel_backends():
        pytest.skip(f"triton is not available on {DEVICE}")
    return "triton"



def _split(p):
    """(tensor inputs, summary_bias, the other keyword arguments) of a `random_problem`."""
    rest = {k: v for k, v in p.items() if k not in TENSORS and k != "summary_bias"}
    return {n: p[n] for n in TENSORS}, p["summary_bias"], rest


def _upstream(p, seed):
    """Random dO and dlse of the problem's output shapes (fp32 for lse)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, H, Nq, D = p["q"].shape
    do = torch.randn(B, H, Nq, D, generator=g).to(p["q"].dtype).to(DEVICE)
    dlse = torch.randn(B, H, Nq, generator=g).to(DEVICE)
    return do, dlse


def _grads(fn, p, do, dlse, scale=None, dtype=None):
    """Gradients (TENSORS..., bias or None) of sum(o * dO) [+ sum(lse * dlse)] through `fn` (eva_attention
    or the torch reference), with the inputs cast to `dtype` (default: as they are)."""
    ins, bias, rest = _split(p)
    ins = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in ins.items()}
    if isinstance(bias, torch.Tensor):
        bias = bias.detach().to(F64 if dtype == F64 else bias.dtype).requires_grad_()
    o, lse = fn(**ins, **rest, summary_bias=bias, scale=scale, return_lse=True)
    loss = (o * do.to(o.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(lse.dtype)).sum()
    leaves = list(ins.values()) + ([bias] if isinstance(bias, torch.Tensor) else [])
    grads = torch.autograd.grad(loss, leaves)
    return tuple(grads[:5]) + ((grads[5],) if len(grads) > 5 else (None,))


def _kernel(backend):
    return lambda **kw: eva_attention(**kw, backend=backend)


def _rms(t):
    return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0


def _score_path_floors(p, ref, scale):
    """The size dq, dk, dk_sum and d summary_bias have when dS = P * (dP - delta) does not cancel: a row
    whose softmax sits on one key has dS = 0 exactly, and a kernel's delta (a row sum of dO * O) and
    dP (dO @ V^T) then differ by rounding only. With dP entries of size rms(dO) rms(v) sqrt(D), these
    sizes follow from ||dV|| ~ rms(dO) sqrt(D) sqrt(sum P^2), which the fp64 reference gives. A quarter
    of them: estimates, kept below the gradients' norms where nothing cancels."""
    D = p["q"].shape[-1]
    s = scale if scale is not None else D ** -0.5
    dv_all = float(np.hypot(ref[2].double().norm().item(), ref[4].double().norm().item()))
    dp_over_do = max(_rms(p["v"]), _rms(p["v_sum"])) * D ** 0.5  # dP entries / rms(dO)
    bias = 0.25 * dp_over_do * dv_all / D ** 0.5
    by_q = s * D ** 0.5 * max(_rms(p["k"]), _rms(p["k_sum"])) * bias
    by_k = s * D ** 0.5 * _rms(p["q"]) * bias
    return {"q": by_q, "k": by_k, "k_sum": by_k, "summary_bias": bias}


def _underflow_floors(do, dtype):
    """dv and dv_sum are sums of P * dO. Kernels compute P in fp32, where a probability below fp32's
    smallest normal flushes to 0, and with 16-bit inputs P enters the dV product in that dtype (in the
    reference too), where below the dtype's smallest normal it keeps only a subnormal's absolute
    precision (fp16: 6e-8). A key all of whose probabilities lie there (a far logit at a large scale)
    has a true gradient no kernel returns. Sizes below those of ||dO|| are that rounding; nothing
    larger is excused."""
    f32 = torch.finfo(torch.float32)
    floor = max(f32.tiny / f32.eps, torch.finfo(dtype).tiny) * do.double().norm().item()
    return {"v": floor, "v_sum": floor}


def _recompute_tol(p, scale):
    """The backward recomputes P = exp(s - lse) from the forward's lse, as flash attention does. Each of
    s and lse carries an fp32 rounding of its own size, so P (and every gradient through it) is off by
    a few eps |s|, where autograd of the reference reuses the forward's P. Large logits (scale 2 at
    D = 256: |s| ~ 100) make that more than fp32's bound; ordinary ones (|s| ~ 10) leave it below."""
    s = scale if scale is not None else p["q"].shape[-1] ** -0.5
    keys = torch.cat([p["k"], p["k_sum"]], 2).double()
    B, H, Nq, D = p["q"].shape
    Hkv = keys.shape[1]
    if not (B * H * Nq * keys.shape[2] and Hkv):
        return 0.0
    q = p["q"].double().reshape(B, Hkv, H // Hkv, Nq, D)
    max_logit = torch.einsum("bhgqd,bhkd->bhgqk", q, keys).abs().max().item() * s
    return 8 * torch.finfo(torch.float32).eps * max_logit


def _delta_rounding_tols(p, do, ref, floors, scale) -> dict:
    """The backward's delta = rowsum(dO * O) reads O rounded to its dtype (flash attention's; the
    reference's autograd reads no O), and it and dP = dO . v are D-term fp32 sums taken in two different
    orders (a reduction and the dot's accumulation). delta enters every dS entry of its row as an upstream
    lse gradient does (dS = P (dP - delta + dlse)), so its error moves the gradients as a dlse of that size.
    Per row, with random-sign roundings: one rounding of each O element gives u |dO * O|; a sequential fp32
    sum of D terms whose partial sums grow as a random walk (E S_k^2 = k |dO * O|^2 / D) gives
    u32 |dO * O| sqrt((D + 1) / 2), and dP and delta each carry one (a GPU's dot accumulates in order: at
    D = 128 the two sums differed by 31 u32 where the rounding of O alone predicts 13). Where dS cancels (a
    softmax on one key) that is most of a score-path gradient. Per gradient: CONDITIONING_FACTOR x that
    move, relative to max(|ref|, floor)."""
    ins, bias, rest = _split(p)
    wide = {n: t.double() for n, t in ins.items()}
    bias = bias.double() if isinstance(bias, torch.Tensor) else bias
    o = torch_eva_attention(**wide, **rest, summary_bias=bias, scale=scale)
    D = p["q"].shape[-1]
    per_term = math.sqrt(unit_roundoff(p["q"].dtype) ** 2 + (D + 1) * unit_roundoff(torch.float32) ** 2)
    row = per_term * (do.double() * o).pow(2).sum(-1).sqrt()
    sign = torch.randint(0, 2, row.shape, generator=torch.Generator().manual_seed(0)).to(row) * 2 - 1
    moved = _grads(torch_eva_attention, p, torch.zeros_like(do), row * sign, scale, F64)
    tols = {}
    for name, m, r in zip(op.GRAD_INPUTS, moved, ref):
        size = max(r.norm().item(), floors.get(name, 0.0)) if r is not None else 0.0
        tols[name] = CONDITIONING_FACTOR * m.norm().item() / size if size else 0.0
    return tols


def _check(got, p, do, dlse, scale=None):
    """Kernel gradients against the fp64 reference; the reference in the inputs' dtype is the baseline."""
    dtype = p["q"].dtype
    ref = _grads(torch_eva_attention, p, do, dlse, scale, F64)
    base = _grads(torch_eva_attention, p, do, dlse, scale)
    floors = {**_score_path_floors(p, ref, scale), **_underflow_floors(do, dtype)}
    tol = _recompute_tol(p, scale)
    tols = _delta_rounding_tols(p, do, ref, floors, scale)
    for name, g, r, b in zip(op.GRAD_INPUTS, got, ref, base):
        if r is None:
            assert g is None, name
            continue
        want = p["summary_bias"] if name == "summary_bias" else p[name]
        assert g.shape == want.shape and g.dtype == want.dtype and g.device == want.device, name
        assert_close(f"d{name}", g, r, dtype, baseline=b, floor=floors.get(name, 0.0),
                     tol=max(tol, tols[name]))


@st.composite
def problems(draw):
    """Keyword arguments of `random_problem`: both windows, W / C in {1, 2, 8}, GQA, prefill / chunked
    prefill / decode, every summary_bias mode, odd lengths and head dims, strided layouts."""
    C = draw(st.sampled_from([1, 2, 3, 4] + ([16] if GPU else [])))
    W = C * draw(st.sampled_from([1, 2, 8] + ([32] if GPU else [])))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3] + ([4] if GPU else [])))
    Nk = draw(st.integers(1, 300 if GPU else 70))
    mode = draw(st.sampled_from(["prefill", "chunked", "decode"]))
    if mode == "prefill":
        Nq, q_offset = Nk, None
    else:
        Nq = draw(st.integers(1, Nk if mode == "chunked" else min(16, Nk)))
        q_offset = draw(st.one_of(st.none(), st.integers(0, Nk - Nq)))
    D = draw(st.sampled_from([1, 3, 16, 40] + ([64, 76, 128, 256] if GPU else [])))
    return dict(B=draw(st.integers(1, 2)), H=Hkv * G, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, C=C, W=W,
                window=draw(st.sampled_from(["block", "sliding"])),
                summary_bias=draw(st.sampled_from([None, "log_count", "tensor"])), q_offset=q_offset,
                layout=draw(st.sampled_from(["contiguous", "strided"])), dtype=draw(st.sampled_from(dtypes_here())),
                seed=draw(st.integers(0, 999)))


# ---------------------------------------------------------------- gradients vs the fp64 reference
@with_fixture
@given(case=problems(), scale=st.sampled_from([None, 0.3, 2.0]), use_lse=st.booleans())
def test_gradients_match_reference(backend, case, scale, use_lse):
    p = random_problem(device=DEVICE, **case)
    do, dlse = _upstream(p, case["seed"])
    dlse = dlse if use_lse else None
    _check(_grads(_kernel(backend), p, do, dlse, scale), p, do, dlse, scale)


@pytest.mark.parametrize("Nk,D,dtype", [(279, 256, F32), (5, 16, torch.float16)])
def test_underflowed_probabilities(backend, Nk, D, dtype):
    """Fuzz cases where the one key of a query's window gets a probability below what P can hold
    (scale 2; fp32 at D = 256 with 278 summaries: ~1e-64; fp16 at D = 16: ~1e-8, below fp16's
    subnormals): the true dv is that small, a kernel's is 0."""
    case = dict(B=1, H=1, Hkv=1, Nq=1, Nk=Nk, D=D, C=1, W=1, window="block", summary_bias=None,
                q_offset=None, layout="contiguous", dtype=dtype, seed=0)
    p = random_problem(device=DEVICE, **case)
    do, _ = _upstream(p, 0)
    ref = _grads(torch_eva_attention, p, do, None, 2.0, F64)
    assert 0 < ref[2].norm().item() < _underflow_floors(do, dtype)["v"]  # the case underflows
    _check(_grads(_kernel(backend), p, do, None, 2.0), p, do, None, 2.0)


@given(case=problems())
def test_reference_backend_gradients(case):
    """backend="reference" differentiates the torch reference (in the inputs' precision)."""
    p = random_problem(device=DEVICE, **case)
    do, dlse = _upstream(p, case["seed"])
    _check(_grads(_kernel("reference"), p, do, dlse), p, do, dlse)


TILE_PROBLEMS = [(4, 32, None), (3, 9, "log_count"), (2, 30, "tensor")]
TILE_CONFIGS = [(16, 16, 1, False), (32, 16, 3, False), (16, 16, 1, True), (32, 16, 3, True), (16, 32, 2, True)]


def _tile_kind_spread(window, C, W, bias, bm, bn, splits, split_loops):
    """Every (tiles, problem) pair once, the window kinds alternating: every pair of values of any two
    parameters occurs (15 of the 30 combinations)."""
    i, j = TILE_CONFIGS.index((bm, bn, splits, split_loops)), TILE_PROBLEMS.index((C, W, bias))
    return ["block", "sliding"].index(window) == (i + j) % 2


@gpu_spread(_tile_kind_spread)
@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("C,W,bias", TILE_PROBLEMS)
@pytest.mark.parametrize("bm,bn,splits,split_loops", TILE_CONFIGS)
def test_every_tile_kind(bwd_backend, window, C, W, bias, bm, bn, splits, split_loops):
    """Small tiles on a long problem: query tiles that see a key / summary tile fully and partly (window
    and chunk edges at every offset within a tile), summaries seen by every later query, GQA, q_offset
    not tile aligned, keys before the first query. KV_SPLIT_LOOPS: the dK/dV walk's leading, unmasked
    middle and trailing loops, each cut into the summary pieces. Each case compiles its tiles: the GPU
    runs the pairwise spread `_tile_kind_spread`, the CPU every case."""
    p = random_problem(1, 4, 2, 50, 110, 16, C, W, window=window, summary_bias=bias, q_offset=46,
                       device=DEVICE, seed=5)
    do, dlse = _upstream(p, 1)
    ins, b, rest = _split(p)
    cfg = dict(SMALL, BLOCK_M=bm, BLOCK_N=bn, BLOCK_M_DQ=bn, BLOCK_N_DQ=bm, SUM_SPLITS=splits,
               KV_SPLIT_LOOPS=split_loops)
    got = op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    assert len(got) == len(op.GRAD_INPUTS)
    _check(got, p, do, dlse)


@with_fixture
@given(C=st.integers(1, 5), m=st.integers(1, 16), window=st.sampled_from(["block", "sliding"]),
       Nk=st.integers(1, 110), data=st.data(), bm=st.sampled_from([16, 32]), bn=st.sampled_from([16, 32]),
       splits=st.sampled_from([0, 1, 2, 5]), split_loops=st.booleans())
def test_small_tiles_match_reference(bwd_backend, C, m, window, Nk, data, bm, bn, splits, split_loops):
    """16 / 32-row tiles at random query offsets and window / chunk sizes: the boundaries between fully
    and partly visible tiles fall at every offset within a tile. Summary tiles cut into 1-5 pieces
    (0: automatic), more pieces than query tiles included; the dK/dV walk in one loop or three."""
    Nq = data.draw(st.integers(1, Nk))
    q_offset = data.draw(st.integers(0, Nk - Nq))
    p = random_problem(1, 2, 1, Nq, Nk, 16, C, C * m, window=window, summary_bias="tensor", q_offset=q_offset,
                       device=DEVICE, seed=Nk)
    do, dlse = _upstream(p, Nq)
    ins, b, rest = _split(p)
    cfg = dict(SMALL, BLOCK_M=bm, BLOCK_N=bn, BLOCK_M_DQ=bn, BLOCK_N_DQ=bm, SUM_SPLITS=splits,
               KV_SPLIT_LOOPS=split_loops)
    _check(op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b), p, do, dlse)


@triton.jit
def _probe_walk_range(cases_ptr, out_ptr, n_cases, SUMMARY: tl.constexpr, SLIDING: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """`_kv_walk_range` of n_cases key tiles at once: cases rows (n0, N, Nq, C, W, q_offset), int32."""
    i = tl.arange(0, BLOCK)
    ok = i < n_cases
    n0 = tl.load(cases_ptr + i * 6, mask=ok, other=0)
    N = tl.load(cases_ptr + i * 6 + 1, mask=ok, other=1)
    Nq = tl.load(cases_ptr + i * 6 + 2, mask=ok, other=1)
    C = tl.load(cases_ptr + i * 6 + 3, mask=ok, other=1)
    W = tl.load(cases_ptr + i * 6 + 4, mask=ok, other=1)
    q_offset = tl.load(cases_ptr + i * 6 + 5, mask=ok, other=0)
    t_lo, t_hi, n_tiles, i_a, i_b = _kv_walk_range(n0, N, Nq, C, W, q_offset, SUMMARY, SLIDING, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + i * 5, t_lo, mask=ok)
    tl.store(out_ptr + i * 5 + 1, t_hi, mask=ok)
    tl.store(out_ptr + i * 5 + 2, n_tiles, mask=ok)
    tl.store(out_ptr + i * 5 + 3, i_a, mask=ok)
    tl.store(out_ptr + i * 5 + 4, i_b, mask=ok)


def _walk_range_cases(summary, rng, problems=600):
    """Key tiles (n0, N, Nq, C, W, q_offset) of random small problems: C in 1..6 (1 often: its windows
    end at every position), W / C in 1..48, prefill and later queries, summary counts other than
    ceil(Nk / C); every tile n0 < N at BLOCK_N 16 (n0 % 32 == 0 also serves BLOCK_N 32)."""
    cases = []
    for _ in range(problems):
        C = int(rng.choice([1, 1, 1, 2, 3, 4, 5, 6]))
        W = C * int(rng.integers(1, 49))
        Nk = int(rng.integers(1, 160))
        Nq = int(rng.integers(1, Nk + 1))
        q_offset = int(rng.integers(0, Nk - Nq + 1))
        N = int(rng.integers(1, -(-Nk // C) + 4)) if summary else Nk
        cases += [(n0, N, Nq, C, W, q_offset) for n0 in range(0, N, 16)]
    return np.array(cases, dtype=np.int32)


@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("summary", [False, True])
def test_kv_walk_range_is_exact(window, summary):
    """The dK/dV kernel's query walk of a key tile (`_kv_walk_range`) against SPEC.md's visibility rule,
    brute force: [t_lo, t_hi] is exactly the set of queries that see some key of the tile, and the tiles
    [i_a, i_b) (KV_SPLIT_LOOPS walks them unmasked) exactly those whose every row sees every key below N."""
    from flashswitch.reference.eva_attention import start_positions
    rng = np.random.default_rng(7 + 2 * summary + (window == "sliding"))
    all_cases = _walk_range_cases(summary, rng)
    for bm, bn in ((16, 16), (32, 16), (16, 32), (64, 32)):
        cases = all_cases[all_cases[:, 0] % bn == 0]
        out = torch.full((len(cases), 5), -99, dtype=torch.int32, device=DEVICE)
        _probe_walk_range[(1,)](torch.from_numpy(cases).to(DEVICE), out, len(cases), SUMMARY=summary,
                                SLIDING=window == "sliding", BLOCK_M=bm, BLOCK_N=bn,
                                BLOCK=triton.next_power_of_2(len(cases)))
        for (n0, N, Nq, C, W, q_offset), (t_lo, t_hi, n_tiles, i_a, i_b) in zip(cases, out.cpu().numpy()):
            keys = np.arange(n0, min(n0 + bn, N))
            t = np.arange(q_offset, q_offset + Nq + bm)[:, None]            # queries, then rows past them
            st = start_positions(t, chunk_size=int(C), window_size=int(W), window=window)
            vis = (keys < np.minimum(st // C, N)) if summary else ((keys >= st) & (keys <= t))
            vis &= t < q_offset + Nq
            seen = np.flatnonzero(vis.any(axis=1)) + q_offset
            where = f"n0={n0} N={N} Nq={Nq} C={C} W={W} q_offset={q_offset} BLOCK_M={bm} BLOCK_N={bn}"
            if len(seen) == 0:
                assert n_tiles == 0, where
                continue
            assert (t_lo, t_hi) == (seen[0], seen[-1]) and len(seen) == t_hi - t_lo + 1, where
            assert n_tiles == -(-(t_hi - t_lo + 1) // bm) and 0 <= i_a <= i_b <= n_tiles, where
            full = [i for i in range(n_tiles) if vis[t_lo - q_offset + i * bm:][:bm].all()]
            assert full == list(range(i_a, i_b)), (where, full, i_a, i_b)


@pytest.mark.parametrize("window,C,W,Nk", [("block", 1, 1, 40), ("block", 4, 4, 37), ("sliding", 4, 4, 37),
                                           ("block", 2, 64, 50), ("sliding", 3, 9, 1), ("sliding", 2, 8, 33)])
def test_window_edge_cases(backend, window, C, W, Nk):
    """C = 1, W = C, W >= N, a single token."""
    p = random_problem(1, 2, 1, None, Nk, 16, C, W, window=window, summary_bias="tensor", device=DEVICE, seed=Nk)
    do, dlse = _upstream(p, 2)
    _check(_grads(_kernel(backend), p, do, dlse), p, do, dlse)


@pytest.mark.parametrize("D", [16, 40] + ([128, 256] if GPU else []))
def test_rows_seeing_one_key(backend, D):
    """Every row's softmax sits on one key (Nk = 1, C = W = 1): dq, dk and dk_sum are exactly zero, and
    a kernel's answer is the rounding of delta against dP, judged against the gradients' uncancelled
    size (the reference's torch softmax backward gives exact zeros, so it sets no bound here)."""
    p = random_problem(1, 1, 1, 1, 1, D, 1, 1, window="block", device=DEVICE, seed=1)
    do, _ = _upstream(p, 1)
    _check(_grads(_kernel(backend), p, do, None, 0.3), p, do, None, 0.3)


@pytest.mark.parametrize("D", [1, 5, 16, 40] + ([64, 76, 128, 256] if GPU else []))
def test_head_dims(backend, D):
    p = random_problem(1, 2, 1, None, 45, D, 3, 6, window="sliding", summary_bias="log_count", device=DEVICE,
                       seed=D)
    do, _ = _upstream(p, 3)
    _check(_grads(_kernel(backend), p, do, None), p, do, None)


def _space_cases():
    """(dtype, decode, config index): on the GPU a covering spread of each space (conftest.covering_indices:
    the first, middle and last config, and configs until every value of every config key, absence
    included, occurs at least once), on the CPU the first, middle and last of the fp32 ones."""
    cases = []
    for dtype in (["fp32", "fp16", "bf16"] if GPU else ["fp32"]):
        for decode in (False, True):
            f = dict(dtype=dtype, D=64 if GPU else 16, C=4, W=16, window="block", decode=decode)
            cfgs = space.config_space(op.OP_BWD, "triton", f)
            n = len(cfgs)
            picks = covering_indices(cfgs) if GPU else sorted({0, n // 2, n - 1})
            cases += [(dtype, decode, i) for i in picks]
    return cases


@pytest.mark.parametrize("dtype,decode,index", _space_cases())
def test_explicit_configs_from_the_space(bwd_backend, dtype, decode, index):
    """Configs of the backward space (a covering spread on the GPU, the first, middle and last on the CPU;
    `_space_cases`) give right gradients. Each config is a compile, so the GPU does not run them all:
    every config of the spaces at the tuning shapes compiles for sm_90 without a
    GPU with `bench/tools/compile_check.py --ops eva_attention.bwd` (by hand: tests/test_compile_for_hopper.py runs it
    on the tuned and default configs only), and the autotuner (autotune/tune.py) checks the config it keeps
    against the fp64 reference on NaN-poisoned outputs, taking the next fastest when it is wrong; the
    configs it only times are not checked."""
    tdt = {"fp32": F32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    D = 64 if GPU else 16
    f = dict(dtype=dtype, D=D, C=4, W=16, window="block", decode=decode)
    cfg = space.config_space(op.OP_BWD, "triton", f)[index]
    Nk = 150 if GPU else 60
    p = random_problem(1, 4, 2, 5 if decode else None, Nk, D, 4, 16, summary_bias="tensor", dtype=tdt,
                       device=DEVICE, seed=index)
    do, dlse = _upstream(p, index)
    ins, b, rest = _split(p)
    _check(op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b), p, do, dlse)


@pytest.mark.parametrize("case", [
    dict(B=1, H=4, Hkv=2, Nq=None, Nk=45, D=16, C=3, W=6, window="sliding", summary_bias="tensor"),
    dict(B=2, H=2, Hkv=1, Nq=None, Nk=37, D=5, C=4, W=8, window="block", summary_bias="log_count",
         layout="strided"),
    dict(B=1, H=3, Hkv=3, Nq=7, Nk=40, D=16, C=2, W=4, window="sliding", summary_bias=None, q_offset=20),
    dict(B=1, H=2, Hkv=1, Nq=3, Nk=33, D=16, C=4, W=8, window="block", summary_bias="tensor"),
    dict(B=1, H=2, Hkv=2, Nq=None, Nk=70, D=16, C=4, W=64, window="sliding", summary_bias="log_count"),
    dict(B=1, H=2, Hkv=1, Nq=None, Nk=100, D=16, C=4, W=64, window="block", summary_bias="tensor"),
], ids=["sliding-gqa", "block-strided", "chunked", "decode", "wide-window", "block-aligned"])
@pytest.mark.parametrize("split_loops", [False, True])
def test_stored_ds_equals_recomputed(bwd_backend, case, split_loops):
    """Config DS_STORE (the dK/dV kernel stores dS, the dQ kernel reads it; outputs and the scratch start
    as NaN under FLASHSWITCH_POISON, so an entry used but never written shows): the gradients match the
    reference, and dK, dV, dk_sum, dv_sum and d bias equal the recomputing kernels' bit for bit (the
    same kernel computes them). The dQ kernel's whole-row loads (sliding windows, block windows no query
    tile straddles: "block-aligned") and its visible-entry loads (the rest) both run."""
    dt = dtypes_here()[-1]
    p = random_problem(device=DEVICE, dtype=dt, seed=case["Nk"], **case)
    do, dlse = _upstream(p, 1)
    ins, b, rest = _split(p)
    feats = op._features(op.OP_BWD, p["q"], p["k"], case["C"], case["W"], case["window"])
    cfg = {**space.default_config(op.OP_BWD, "triton", feats), "KV_SPLIT_LOOPS": split_loops}
    plain = op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    stored = op.run_backward(bwd_backend, {**cfg, "DS_STORE": True}, (do, dlse), **ins, **rest, summary_bias=b)
    _check(stored, p, do, dlse)
    for name, g, h in zip(op.GRAD_INPUTS, stored, plain):
        if name != "q" and g is not None:
            assert torch.equal(g, h), name


def test_backward_features_and_default():
    q = torch.zeros(1, 4, 33, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 100, 64, dtype=torch.bfloat16)
    f = op._features(op.OP_BWD, q, k, 16, 64, "sliding")
    assert f == dict(dtype="bf16", D=64, C=16, W=64, window="sliding", decode=False, rows=128, keys=128)
    for dtype in ("fp32", "fp16", "bf16"):
        for D in (16, 64, 128, 256):
            for decode in (False, True):
                f = dict(dtype=dtype, D=D, C=16, W=2048, window="block", decode=decode)
                cfgs = space.config_space(op.OP_BWD, "triton", f)
                assert 1 <= len(cfgs) <= 48  # each a compile when tuned
                default = space.default_config(op.OP_BWD, "triton", f)
                from flashswitch.kernels_triton.eva_attention_bwd import CONFIG_KEYS
                assert all(set(CONFIG_KEYS) <= set(c) for c in cfgs + [default])


def test_incomplete_config_is_an_error(backend):
    p = random_problem(1, 2, 1, None, 8, 16, 2, 4, device=DEVICE)
    do, _ = _upstream(p, 0)
    ins, b, rest = _split(p)
    with pytest.raises(ValueError, match="BLOCK_M_DQ"):
        op.run_backward(backend, {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}, do, **ins, **rest,
                        summary_bias=b)


# ---------------------------------------------------------------- what no query sees
@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("G,Nq,q_offset", [(1, 1, 40), (2, 3, 25), (2, 7, 0)])
@pytest.mark.parametrize("split_loops", [False, True])
def test_unseen_rows_get_zero_gradient(backend, window, G, Nq, q_offset, split_loops):
    """k/v rows past the last query and before the first query's window, and summaries past the last
    visible one (more of them than ceil(Nk / C)) hold NaN: every gradient stays finite, and theirs are 0.
    split_loops: the backward with KV_SPLIT_LOOPS (small tiles, summary pieces), whose unmasked loop
    must never take such a row."""
    if split_loops and backend != "triton":
        pytest.skip("the backward kernels are the triton backend's")
    Nk, C, W = 60, 2, 8
    p = random_problem(1, 2 * G, 2, Nq, Nk, 16, C, W, window=window, summary_bias="tensor", q_offset=q_offset,
                       device=DEVICE, seed=G)
    extra = 5  # summaries past the end of the keys
    for name in ("k_sum", "v_sum"):
        p[name] = torch.cat([p[name], torch.zeros_like(p[name][:, :, :extra])], dim=2)
    p["summary_bias"] = torch.cat([p["summary_bias"], torch.zeros_like(p["summary_bias"][:, :, :extra])], dim=2)
    t = torch.arange(Nq) + q_offset
    from flashswitch.reference.eva_attention import start_positions
    first = int(start_positions(t[:1], chunk_size=C, window_size=W, window=window)[0])
    last = int(t[-1])
    n_sum = int(start_positions(t[-1:], chunk_size=C, window_size=W, window=window)[0]) // C
    clean = {n: p[n].clone() for n in TENSORS}
    for name in ("k", "v"):
        p[name][:, :, last + 1:] = float("nan")
        p[name][:, :, :first] = float("nan")
    for name in ("k_sum", "v_sum"):
        p[name][:, :, n_sum:] = float("nan")
    do, dlse = _upstream(p, 4)
    if split_loops:
        ins, b, rest = _split(p)
        cfg = dict(SMALL, SUM_SPLITS=2, KV_SPLIT_LOOPS=True)
        got = op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    else:
        got = _grads(_kernel(backend), p, do, dlse)
    for name, g in zip(op.GRAD_INPUTS, got):
        assert torch.isfinite(g).all(), name
    for i, name in enumerate(("k", "v")):
        assert (got[1 + i][:, :, last + 1:] == 0).all() and (got[1 + i][:, :, :first] == 0).all(), name
    for i, name in enumerate(("k_sum", "v_sum")):
        assert (got[3 + i][:, :, n_sum:] == 0).all(), name
    assert (got[5][:, :, n_sum:] == 0).all()
    _check(got, {**p, **clean}, do, dlse)


# ---------------------------------------------------------------- autograd plumbing
def test_gradcheck_reference():
    p = random_problem(1, 2, 1, None, 11, 3, 2, 4, window="sliding", summary_bias="tensor", dtype=F64, seed=3)
    ins, b, rest = _split(p)
    leaves = [t.detach().requires_grad_() for t in ins.values()] + [b.detach().double().requires_grad_()]

    def f(q, k, v, k_sum, v_sum, bias):
        o, lse = torch_eva_attention(q, k, v, k_sum, v_sum, **rest, summary_bias=bias, return_lse=True)
        return o, lse

    assert torch.autograd.gradcheck(f, leaves)


def test_lse_only_loss(backend):
    """A loss of lse alone: dO is zero, d lse carries the whole gradient."""
    p = random_problem(1, 2, 1, None, 30, 16, 2, 8, summary_bias="tensor", device=DEVICE, seed=9)
    do, dlse = _upstream(p, 5)
    _check(_grads(_kernel(backend), p, torch.zeros_like(do), dlse), p, torch.zeros_like(do), dlse)


def test_bias_dtype_gradient(backend):
    p = random_problem(1, 2, 1, None, 30, 16, 2, 8, summary_bias="tensor", device=DEVICE, seed=9)
    p["summary_bias"] = p["summary_bias"].to(torch.float64)
    do, _ = _upstream(p, 6)
    got = _grads(_kernel(backend), p, do, None)
    assert got[5].dtype == torch.float64
    _check(got, p, do, None)


def test_batches_past_the_grid_limit_run_in_slices(backend, monkeypatch):
    """(batch, head) on grid axis 1: past CUDA's limit the backward runs slices of the batch, with the
    gradients of one launch over all of it (bitwise, the limit lowered here)."""
    from flashswitch.kernels_triton import eva_attention_bwd
    p = random_problem(3, 4, 2, None, 30, 16, 2, 8, summary_bias="tensor", device=DEVICE, seed=11)
    do, dlse = _upstream(p, 8)
    ins, b, rest = _split(p)
    cfg = dict(SMALL, SUM_SPLITS=2)
    whole = op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    monkeypatch.setattr(eva_attention_bwd, "MAX_GRID_Y", 9)  # two sequences of 4 heads per slice
    sliced = op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    for name, x, y in zip(op.GRAD_INPUTS, whole, sliced):
        assert torch.equal(x, y), name
    monkeypatch.setattr(eva_attention_bwd, "MAX_GRID_Y", 3)  # fewer than the heads
    with pytest.raises(ValueError, match="heads"):
        op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)


@pytest.mark.parametrize("split_loops", [False, True])
def test_deterministic(backend, split_loops):
    """Two backward calls give bitwise-equal gradients."""
    p = random_problem(1, 4, 2, None, 50, 16, 2, 16, window="sliding", summary_bias="tensor", device=DEVICE, seed=7)
    do, dlse = _upstream(p, 7)
    ins, b, rest = _split(p)
    cfg = dict(SMALL, SUM_SPLITS=3, KV_SPLIT_LOOPS=split_loops)
    a = op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    c = op.run_backward(backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    for name, x, y in zip(op.GRAD_INPUTS, a, c):
        assert torch.equal(x, y), name


def _op_args(backend, dtype=F32, requires_grad=True):
    p = random_problem(1, 2, 1, None, 20, 16, 2, 4, window="block", summary_bias="tensor", dtype=dtype,
                       device=DEVICE, seed=1)
    ins, b, _ = _split(p)
    ts = [t.detach().requires_grad_(requires_grad) for t in ins.values()]
    bias = b.detach().requires_grad_(requires_grad)
    return ts + [bias, 2, 4, "block", 0.25, 0, False, backend]


def test_opcheck_forward_with_grad(backend):
    """The forward op with inputs that require grad: schema, fake tensor, autograd registration, aot dispatch."""
    torch.library.opcheck(op.OPDEF.op, _op_args(backend))


def test_opcheck_backward(backend):
    args = _op_args(backend, requires_grad=False)
    q, k, v, k_sum, v_sum, bias = args[:6]
    o, lse = op.OPDEF.op(*args)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    scalars, backend = args[6:-1], args[-1]
    torch.library.opcheck(op.OPDEF.backward_op, [do, dlse, q, k, v, k_sum, v_sum, bias, *scalars, o, lse, backend])
    torch.library.opcheck(op.OPDEF.backward_op, [do, None, q, k, v, k_sum, v_sum, None, *scalars, o, lse, backend])


def test_compile_gradients_equal_eager(backend):
    """torch.compile(fullgraph=True) traces both custom ops (also under the interpreter on the CPU)."""
    if GPU:
        p = random_problem(1, 4, 2, None, 300, 64, 16, 64, window="sliding", summary_bias="tensor",
                           dtype=torch.bfloat16, device=DEVICE, seed=11)
    else:
        p = random_problem(1, 2, 1, None, 20, 16, 2, 4, window="sliding", summary_bias="tensor", seed=11)
    do, dlse = _upstream(p, 11)
    eager = _grads(_kernel(backend), p, do, dlse)
    compiled_fn = torch.compile(_kernel(backend), fullgraph=True)
    compiled = _grads(compiled_fn, p, do, dlse)
    for name, a, b in zip(op.GRAD_INPUTS, eager, compiled):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_cuda_graph_forward_backward(backend):
    """A whole fwd + bwd step captured in a CUDA graph and replayed on new inputs."""
    p = random_problem(1, 4, 2, None, 257, 64, 16, 64, window="block", summary_bias="tensor",
                       dtype=torch.bfloat16, device=DEVICE, seed=12)
    do, dlse = _upstream(p, 12)
    ins, b, rest = _split(p)
    leaves = [t.detach().clone().requires_grad_() for t in ins.values()] + [b.detach().clone().requires_grad_()]

    def step():
        o, lse = eva_attention(*leaves[:5], **rest, summary_bias=leaves[5], return_lse=True, backend=backend)
        return torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), leaves)

    graph, out = cuda_graph_capture(step)
    p2 = random_problem(1, 4, 2, None, 257, 64, 16, 64, window="block", summary_bias="tensor",
                        dtype=torch.bfloat16, device=DEVICE, seed=13)
    ins2, b2, _ = _split(p2)
    with torch.no_grad():
        for leaf, new in zip(leaves, list(ins2.values()) + [b2]):
            leaf.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    _check(tuple(g.clone() for g in out), p2, do, dlse)


LARGE_SHAPES = [(64, "block", 16, 256), (128, "block", 16, 512), (128, "sliding", 32, 256), (76, "sliding", 8, 72),
                (256, "block", 16, 128)]
LARGE_DTYPES = [torch.float16, torch.bfloat16]


def _large_spread(backend, dtype, D, window, C, W):
    """Every (shape, backend) pair once, the dtypes alternating: every pair of values of any two
    parameters occurs (15 of the 30 combinations; the backends differ in the forward only)."""
    i = LARGE_SHAPES.index((D, window, C, W))
    return LARGE_DTYPES.index(dtype) == (i + KERNELS.index(backend)) % 2


@pytest.mark.gpu
@gpu_spread(_large_spread)
@pytest.mark.parametrize("dtype", LARGE_DTYPES)
@pytest.mark.parametrize("D,window,C,W", LARGE_SHAPES)
def test_large_16bit(backend, dtype, D, window, C, W):
    """Tensor-core tiles of the default config at sizes where every loop runs many blocks. Each case
    compiles the default tiles of its shape and dtype: the GPU runs the pairwise spread `_large_spread`."""
    p = random_problem(1, 4, 2, None, 1100, D, C, W, window=window, summary_bias="log_count", dtype=dtype,
                       device=DEVICE, seed=D)
    do, dlse = _upstream(p, D)
    got = _grads(_kernel(backend), p, do, dlse)
    _check(got, p, do, dlse)
    again = _grads(_kernel(backend), p, do, dlse)
    for name, a, b in zip(op.GRAD_INPUTS, got, again):
        assert a is None or torch.equal(a, b), name


SPLIT_LOOP_SHAPES = [(64, "block", 16, 256, 0), (128, "block", 16, 512, 3), (128, "sliding", 32, 256, 0),
                     (76, "sliding", 8, 72, 2), (256, "block", 16, 128, 0)]


def _split_loops_spread(dtype, D, window, C, W, splits):
    """Each shape once, fp16 and bf16 alternating over the shapes (5 of the 10 combinations)."""
    return LARGE_DTYPES.index(dtype) == SPLIT_LOOP_SHAPES.index((D, window, C, W, splits)) % 2


@pytest.mark.gpu
@gpu_spread(_split_loops_spread)
@pytest.mark.parametrize("dtype", LARGE_DTYPES)
@pytest.mark.parametrize("D,window,C,W,splits", SPLIT_LOOP_SHAPES)
def test_large_16bit_split_loops(bwd_backend, dtype, D, window, C, W, splits):
    """KV_SPLIT_LOOPS on the default tiles, 16-bit tensor cores, long unmasked middle loops, summary
    pieces (the Triton 3.6 pipeliner once miscompiled a dK/dV loop in 16-bit only); deterministic.
    Each case compiles: the GPU runs each shape in one of the two 16-bit dtypes (`_split_loops_spread`)."""
    p = random_problem(1, 4, 2, None, 1100, D, C, W, window=window, summary_bias="tensor", dtype=dtype,
                       device=DEVICE, seed=D)
    do, dlse = _upstream(p, D)
    ins, b, rest = _split(p)
    f = op._features(op.OP_BWD, p["q"], p["k"], C, W, window)
    cfg = dict(space.default_config(op.OP_BWD, "triton", f), SUM_SPLITS=splits, KV_SPLIT_LOOPS=True)
    got = op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    _check(got, p, do, dlse)
    again = op.run_backward(bwd_backend, cfg, (do, dlse), **ins, **rest, summary_bias=b)
    for name, x, y in zip(op.GRAD_INPUTS, got, again):
        assert torch.equal(x, y), name


def _graph_ms(step, reps=5):
    """GPU time of `step` replayed from a CUDA graph: the least of `reps` replays (the host's time per
    call, which other test processes inflate, is not part of it)."""
    graph, _ = cuda_graph_capture(step)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


@pytest.mark.gpu
def test_backward_faster_than_dense_reference(backend):
    """fwd + bwd at N = 4096 beats autograd of the dense masked reference (O(N^2) memory and work) by 3x,
    in GPU time."""
    p = random_problem(1, 8, 8, None, 4096, 64, 16, 512, window="block", dtype=torch.bfloat16, device=DEVICE,
                       seed=0)
    do, dlse = _upstream(p, 0)
    ins, bias, rest = _split(p)
    leaves = [t.detach().clone().requires_grad_() for t in ins.values()]

    def step(fn):
        o, lse = fn(**dict(zip(ins, leaves)), **rest, summary_bias=bias, return_lse=True)
        return torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), leaves)

    ours = _graph_ms(lambda: step(_kernel(backend)))
    dense = _graph_ms(lambda: step(torch_eva_attention))
    assert ours * 3 < dense, (ours, dense)


@pytest.mark.parametrize("shape", [dict(B=1, Nq=0, Nk=10, q_offset=3), dict(B=0, Nq=None, Nk=10),
                                   dict(B=1, Nq=0, Nk=0)])
def test_empty_problems(backend, shape):
    """No queries (every gradient but dq is zeros), no batch, no keys."""
    p = random_problem(H=2, Hkv=1, D=16, C=2, W=4, summary_bias="tensor", device=DEVICE, **shape)
    do, _ = _upstream(p, 0)
    ins, b, rest = _split(p)
    got = op.run_backward(backend, None, do, **ins, **rest, summary_bias=b)
    for name, g in zip(op.GRAD_INPUTS, got):
        want = b if name == "summary_bias" else p[name]
        assert g.shape == want.shape and (g == 0).all(), name
