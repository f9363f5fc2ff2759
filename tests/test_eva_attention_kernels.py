"""Op 2 kernels (every kernel backend that can run here) against the fp64 NumPy oracle.

`o` must be within 2x the error of the PyTorch reference in the same precision plus the dtype's
rounding floor (the SPEC rule); `lse` is held to fp32 accuracy. Kernel outputs
start as NaN (FLASHSWITCH_POISON), so an element a kernel forgets to write fails. Also: SPEC
properties 1, 3, 5, 6, 7 on the kernels, the decode (split key range) path, explicit configs from
the autotune space, inputs that must never be read, and the op's argument checks.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, covering_indices, dense_causal, dtypes_here, gpu_spread
from flashswitch import backends
from flashswitch.autotune import space
from flashswitch.ops import eva_attention as op
from flashswitch.ops.eva_attention import eva_attention
from flashswitch.reference.chunk_summaries import torch_chunk_summaries
from flashswitch.reference.eva_attention import (numpy_eva_attention, random_problem, start_position,
                                                 torch_eva_attention)
from flashswitch.testing import assert_close, rel_error

GPU = DEVICE == "cuda"
F32, F64 = torch.float32, torch.float64
WINDOW = st.sampled_from(["block", "sliding"])
BIAS = st.sampled_from([None, "log_count", "tensor"])
# hypothesis with the function-scoped `backend` fixture: the fixture does not change between examples
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # many tiles on tiny problems


def _run(backend, p, scale=None, config=None):
    if config is None:
        return eva_attention(**p, scale=scale, return_lse=True, backend=backend)
    return op.run_kernel(backend, config, **p, scale=scale)


def _check(out, p, scale=None):
    """Compare (o, lse) with the oracle; the torch reference in the same dtype is the baseline."""
    dtype = p["q"].dtype
    ref_o, ref_l = numpy_eva_attention(**p, scale=scale, return_lse=True)
    base_o, base_l = torch_eva_attention(**p, scale=scale, return_lse=True)
    o, lse = out
    assert tuple(o.shape) == ref_o.shape and tuple(lse.shape) == ref_l.shape
    assert o.dtype == dtype and lse.dtype == F32
    assert o.device.type == DEVICE and lse.device.type == DEVICE
    assert_close("o", o, ref_o, dtype, baseline=base_o)
    assert_close("lse", lse, ref_l, F32, baseline=base_l)


@st.composite
def problems(draw, mode=None):
    """Keyword arguments of `random_problem`: window kinds, W / C in {1, 2, 8}, GQA, prefill /
    chunked prefill / decode, every summary_bias mode, odd lengths and head dims, strided layouts."""
    C = draw(st.sampled_from([1, 2, 3, 4] + ([16, 32] if GPU else [])))
    W = C * draw(st.sampled_from([1, 2, 8] + ([32] if GPU else [])))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3] + ([4, 8] if GPU else [])))
    Nk = draw(st.integers(1, 300 if GPU else 80))  # the oracle loops over queries in Python
    mode = mode or draw(st.sampled_from(["prefill", "chunked", "decode"]))
    if mode == "prefill":
        Nq, q_offset = Nk, None
    else:
        Nq = draw(st.integers(1, Nk if mode == "chunked" else min(16, Nk)))
        q_offset = draw(st.one_of(st.none(), st.integers(0, Nk - Nq)))
    D = draw(st.sampled_from([3, 16, 40] + ([32, 64, 76, 128, 256] if GPU else [])))
    return dict(B=draw(st.integers(1, 2)), H=Hkv * G, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, C=C, W=W,
                window=draw(WINDOW), summary_bias=draw(BIAS), q_offset=q_offset,
                layout=draw(st.sampled_from(["contiguous", "strided"])), dtype=draw(st.sampled_from(dtypes_here())),
                seed=draw(st.integers(0, 999)))


# ---------------------------------------------------------------- kernels vs the oracle
@with_fixture
@given(case=problems(), scale=st.sampled_from([None, 0.3, 2.0]))
def test_kernel_matches_reference(backend, case, scale):
    p = random_problem(device=DEVICE, **case)
    _check(_run(backend, p, scale), p, scale)


@with_fixture
@given(case=problems(mode="decode"), config=st.fixed_dictionaries(
    {"NUM_SPLITS": st.sampled_from([0, 1, 2, 3, 7]), "PACK_GQA": st.booleans(), "FUSE": st.booleans()}))
def test_decode_matches_reference(backend, case, config):
    p = random_problem(device=DEVICE, **case)
    _check(_run(backend, p, config=dict(SMALL, **config)), p)


@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("bias", [None, "log_count", "tensor"])
@pytest.mark.parametrize("fuse", [False, True])
def test_every_tile_kind(backend, window, pack, bias, fuse):
    """16 x 16 tiles on a long problem: summary blocks with and without masks, exact blocks below
    start(t_max), fully visible ones and the causal diagonal all occur; q_offset is not tile aligned.
    FUSE (triton) walks the same blocks in one loop."""
    p = random_problem(1, 4, 2, 90, 203, 16, 4, 32, window=window, summary_bias=bias, q_offset=101,
                       device=DEVICE, seed=5)
    _check(_run(backend, p, config=dict(SMALL, PACK_GQA=pack, FUSE=fuse)), p)


@pytest.mark.parametrize("Nq", [1, 5, 16])
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_decode_splits(backend, Nq, splits, pack, fuse):
    """The split key range (flash-decoding) with the combine pass, forced through explicit configs."""
    p = random_problem(2, 6, 2, Nq, 150, 32, 4, 16, window="sliding", summary_bias="tensor", device=DEVICE,
                       seed=Nq)
    _check(_run(backend, p, config=dict(SMALL, NUM_SPLITS=splits, PACK_GQA=pack, FUSE=fuse)), p)


@pytest.mark.parametrize("scale", [0.3, 2.0])
@pytest.mark.parametrize("fuse,tma", [(False, False), (True, False), (True, True)])
def test_q_in_registers(backend, scale, fuse, tma):
    """Config QREG (q multiplied by a run-time +-1 so that q.k takes it from registers) gives the same
    answer in both walks and with TMA tiles."""
    if backend != "triton":
        pytest.skip("QREG is a triton config")
    dtype = torch.bfloat16 if GPU else torch.float16
    p = random_problem(1, 4, 2, 90, 203, 64 if GPU else 16, 4, 32, window="sliding", summary_bias="log_count",
                       q_offset=101, dtype=dtype, device=DEVICE, seed=3)
    cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3) if GPU else dict(SMALL)
    _check(_run(backend, p, scale, config=dict(cfg, QREG=True, FUSE=fuse, TMA=tma)), p, scale)


def test_register_cap_config(backend):
    """Config maxnreg (a register cap per thread, a Triton launch option) gives the same answer; a
    cap Triton cannot take is a ValueError naming the key."""
    if backend != "triton":
        pytest.skip("maxnreg is a triton launch option")
    p = random_problem(1, 4, 2, None, 150, 64, 4, 32, summary_bias="log_count", dtype=torch.float16, device=DEVICE,
                       seed=3)
    _check(_run(backend, p, config=dict(SMALL, maxnreg=168)), p)
    with pytest.raises(ValueError, match="maxnreg"):
        _run(backend, p, config=dict(SMALL, maxnreg=100))


@pytest.mark.parametrize("splits", [2, 5])
def test_splits_agree_with_one_pass(backend, splits):
    """A split key range merged by lse equals the single pass (SPEC property 6, inside the kernel)."""
    p = random_problem(1, 4, 4, 37, 120, 16, 2, 8, summary_bias="log_count", device=DEVICE, seed=1)
    o1, l1 = _run(backend, p, config=dict(SMALL, NUM_SPLITS=1))
    o2, l2 = _run(backend, p, config=dict(SMALL, NUM_SPLITS=splits))
    assert rel_error(o2, o1) < 1e-6 and rel_error(l2, l1) < 1e-6


@pytest.mark.parametrize("D", [1, 3, 16, 40] + ([64, 76, 128, 256] if GPU else []))
def test_head_dims(backend, D):
    p = random_problem(1, 2, 1, None, 45, D, 3, 6, window="sliding", summary_bias="log_count", device=DEVICE)
    _check(_run(backend, p), p)


@pytest.mark.parametrize("dtype", dtypes_here())
def test_dtypes(backend, dtype):
    p = random_problem(2, 4, 2, None, 70, 32, 4, 16, summary_bias="tensor", dtype=dtype, device=DEVICE, seed=2)
    _check(_run(backend, p), p)


def test_strided_everything(backend):
    """Non-contiguous q, k, v, summaries and bias (only the last dim is unit-stride)."""
    p = random_problem(2, 4, 2, 20, 50, 16, 2, 8, window="sliding", layout="strided", device=DEVICE, seed=3)
    g = torch.Generator().manual_seed(0)
    p["q"] = torch.randn(2, 20, 4, 48, generator=g)[..., 8:24].transpose(1, 2).to(DEVICE)  # padded rows
    p["summary_bias"] = torch.randn(25, 2, 2, generator=g).permute(2, 1, 0).to(DEVICE)
    assert not p["q"].is_contiguous() and not p["summary_bias"].is_contiguous()
    _check(_run(backend, p), p)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, F64])
def test_bias_dtypes(backend, bias_dtype):
    p = random_problem(1, 2, 1, None, 40, 16, 2, 4, summary_bias="tensor", device=DEVICE)
    p["summary_bias"] = p["summary_bias"].to(bias_dtype)
    _check(_run(backend, p), p)


@pytest.mark.parametrize("Nc_delta", [-100, -3, 4])
def test_summary_count_differs_from_ceil(backend, Nc_delta):
    """Nc below ceil(Nk / C): later summaries are absent; above it: the extra ones are never seen."""
    p = random_problem(1, 2, 2, None, 60, 16, 2, 4, summary_bias="tensor", device=DEVICE)
    Nc = max(0, p["k_sum"].shape[2] + Nc_delta)
    g = torch.Generator().manual_seed(1)
    for name in ("k_sum", "v_sum"):
        x = torch.randn(1, 2, Nc, 16, generator=g).to(DEVICE)
        n = min(Nc, p[name].shape[2])
        x[:, :, :n] = p[name][:, :, :n]
        p[name] = x
    p["summary_bias"] = torch.randn(1, 2, Nc, generator=g).to(DEVICE)
    _check(_run(backend, p), p)


def _poison_unused(p, *, first, Nk, n_sum, names_sum=("k_sum", "v_sum")):
    """NaN where a cache holds no data yet: exact keys before `first` and from Nk on, summaries from
    n_sum on (and whatever else `names_sum` lists, e.g. the bias)."""
    for name in ("k", "v"):
        p[name] = p[name].clone()
        p[name][:, :, :first] = float("nan")
        p[name][:, :, Nk:] = float("nan")
    for name in names_sum:
        p[name] = p[name].clone()
        p[name][:, :, n_sum:] = float("nan")


@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("G,Nq", [(1, 1), (4, 1), (2, 3)])
@pytest.mark.parametrize("fuse", [False, True])
def test_never_reads_outside_the_visible_range(backend, window, G, Nq, fuse):
    """Decode from cache-like buffers: exact keys before start(first query) and after the last query,
    and summaries past the last visible one, hold NaN (unused capacity); the output stays exact."""
    C, W, Nk, cap = 4, 16, 77, 90
    p = random_problem(1, 2 * G, 2, Nq, cap, 16, C, W, window=window, summary_bias="tensor", q_offset=Nk - Nq,
                       device=DEVICE, seed=G)
    first = start_position(Nk - Nq, chunk_size=C, window_size=W, window=window)
    n_sum = start_position(Nk - 1, chunk_size=C, window_size=W, window=window) // C
    _poison_unused(p, first=first, Nk=Nk, n_sum=n_sum, names_sum=("k_sum", "v_sum", "summary_bias"))
    out = _run(backend, p, config=dict(SMALL, NUM_SPLITS=3, FUSE=fuse))
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert_close("o", out[0], ref_o, F32)
    assert_close("lse", out[1], ref_l, F32)


@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("pack,Nq", [(False, None), (True, None), (False, 3)])
@pytest.mark.parametrize("bias", [None, "tensor"])
@pytest.mark.parametrize("fuse", [False, True])
def test_tma_descriptors(backend, window, pack, Nq, bias, fuse, monkeypatch):
    """Config TMA (k, v and summaries through descriptors: of their [B*Hkv*N, D] views, or with FUSE
    of [B, Hkv, N, D] cut at the last visible row): every tile kind, GQA packing, decode splits; the
    rows a masked block reads past its limit belong to the next head or hold NaN (unused cache
    capacity, summaries no query sees) and must not reach the output. A k stored [B, N, Hkv, D]
    makes the five-loop walk fall back to pointers; the one-loop walk reads it by TMA."""
    if backend != "triton":
        pytest.skip("TMA is a triton config")
    from flashswitch.kernels_triton import eva_attention as kt
    used = []
    real = kt._tma_operands
    monkeypatch.setattr(kt, "_tma_operands", lambda *a: used.append(real(*a)) or used[-1])
    dtype = torch.float16 if not GPU else torch.bfloat16
    C, W, Nk, cap = 4, 32, 203, 224
    q_offset = Nk - (Nq or 90)
    p = random_problem(2, 4, 2, Nq or 90, cap, 16, C, W, window=window, summary_bias=bias, q_offset=q_offset,
                       dtype=dtype, device=DEVICE, seed=11)
    n_sum = start_position(Nk - 1, chunk_size=C, window_size=W, window=window) // C
    _poison_unused(p, first=0, Nk=Nk, n_sum=n_sum)
    cfg = dict(SMALL, TMA=True, FUSE=fuse, PACK_GQA=pack, NUM_SPLITS=3 if Nq else 1)
    out = _run(backend, p, config=cfg)
    assert used and used[-1] is not None
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    base_o, base_l = torch_eva_attention(**p, return_lse=True)
    assert_close("o", out[0], ref_o, dtype, baseline=base_o)
    assert_close("lse", out[1], ref_l, F32, baseline=base_l)
    p["k"] = p["k"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, stored [B, N, Hkv, D]
    out = _run(backend, p, config=cfg)
    assert (used[-1] is not None) == fuse
    assert_close("o", out[0], ref_o, dtype, baseline=base_o)


TMA_TUNED = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
             dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
             dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
             dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, QREG=True),
             dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, QREG=True)]
TMA_TUNED_HEADS = [(128, 4), (64, 2)]
TMA_TUNED_WALKS = [("block", False), ("block", True), ("sliding", True)]


def _tma_tuned_spread(cfg, D, Hkv, window, fuse):
    """Every (tile, walk) pair, the head dims alternating: each tile meets both head dims and each walk
    both head dims (15 of the 30 combinations)."""
    i, j = TMA_TUNED.index(cfg), TMA_TUNED_WALKS.index((window, fuse))
    return TMA_TUNED_HEADS.index((D, Hkv)) == (i + j) % 2


@pytest.mark.gpu
@gpu_spread(_tma_tuned_spread)
@pytest.mark.parametrize("cfg", TMA_TUNED)
@pytest.mark.parametrize("D,Hkv", TMA_TUNED_HEADS)
@pytest.mark.parametrize("window,fuse", TMA_TUNED_WALKS)
def test_tma_tuned_tiles(cfg, D, Hkv, window, fuse):
    """The TMA tiles the H200 tuner picks (five-loop walk for block windows, one-loop walk for both),
    on a problem with ragged tiles (Nq and q_offset not tile multiples, packed GQA) and NaN in the
    unused cache capacity past Nk and in the summaries no query sees. Each tile compiles per head dim
    and walk; the GPU runs the pairwise spread `_tma_tuned_spread` (every tile with every walk and with
    both head dims), not all 30 combinations."""
    C, W, Nk, cap = 16, 256, 1000, 1100
    p = random_problem(2, 8, Hkv, 700, cap, D, C, W, window=window, summary_bias="log_count", q_offset=Nk - 700,
                       dtype=torch.bfloat16, device=DEVICE, seed=D)
    n_sum = start_position(Nk - 1, chunk_size=C, window_size=W, window=window) // C
    _poison_unused(p, first=0, Nk=Nk, n_sum=n_sum)
    out = _run("triton", p, config=dict(cfg, TMA=True, FUSE=fuse))
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert_close("o", out[0], ref_o, torch.bfloat16)
    assert_close("lse", out[1], ref_l, torch.bfloat16)


def _gluon_tiles():
    """(D, G, cfg): the Gluon tiles of the space at each D (128 x 128 with 2 stages exceeds shared
    memory at D = 128; test_autotune checks the estimate)."""
    out = []
    for D, G in ((64, 1), (128, 2), (32, 1), (16, 1)):
        for bn, s in ((64, 2), (64, 3), (64, 4), (128, 2)):
            if space._eva_gluon_fits({"D": D, "dtype": "bf16"}, bn, s):
                out.append((D, G, dict(BLOCK_N=bn, num_stages=s)))
    return out


GLUON_WINDOWS = [("block", 16, 256), ("sliding", 8, 72), ("block", 4, 4)]
GLUON_INPUTS = [(None, torch.bfloat16, False), ("log_count", torch.bfloat16, False), (None, torch.float16, True)]


def _gluon_spread(cfg, D, G, window, C, W, bias, dtype, prefill):
    """Every (tile, window) pair once, the input kind (bias / dtype / prefill) chosen so that every
    (tile, input kind) and every (window, input kind) pair occurs too: a third of the combinations."""
    i = [(d, g, c) for d, g, c in _gluon_tiles()].index((D, G, cfg))
    j = GLUON_WINDOWS.index((window, C, W))
    return GLUON_INPUTS.index((bias, dtype, prefill)) == (i + j) % 3


@pytest.mark.gpu
@gpu_spread(_gluon_spread)
@pytest.mark.parametrize("D,G,cfg", _gluon_tiles())
@pytest.mark.parametrize("window,C,W", GLUON_WINDOWS)
@pytest.mark.parametrize("bias,dtype,prefill", GLUON_INPUTS)
def test_gluon_kernel(cfg, D, G, window, C, W, bias, dtype, prefill, monkeypatch):
    """Config GLUON (the warp-specialized Hopper kernel) against the oracle on ragged tiles: chunked
    prefill (Nq and q_offset not tile multiples) with NaN in the cache capacity past Nk and in the
    summaries no query sees, and a whole prefill in fp16; the kernel must have run (not the Triton
    fallback). Every case compiles its own kernel: the GPU runs the spread `_gluon_spread` (each tile
    with each window kind, each tile and each window kind with each input kind), not the product."""
    Nk, cap, Nq = (700, 700, 700) if prefill else (700, 800, 300)
    p = random_problem(2, 2 * G, 2, Nq, cap, D, C, W, window=window, summary_bias=bias, q_offset=Nk - Nq,
                       dtype=dtype, device=DEVICE, seed=D + C)
    _check_gluon(p, cfg, Nk, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("window,C,W", [("block", 16, 256), ("sliding", 8, 72)])
@pytest.mark.parametrize("bias", [None, "log_count"])
def test_gluon_peaked_logits(window, C, W, bias, monkeypatch):
    """Peaked logits (scale 6 / sqrt(D)): a row's max often jumps from one key block to the next, so
    the output is rescaled by factors far from 1 (and underflows to 0 for some rows)."""
    D, Nk = 128, 700
    p = random_problem(2, 4, 2, 300, 800, D, C, W, window=window, summary_bias=bias, q_offset=Nk - 300,
                       dtype=torch.bfloat16, device=DEVICE, seed=C)
    _check_gluon(p, dict(BLOCK_N=64, num_stages=3), Nk, monkeypatch, scale=6 / D ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("Nq,Nk,runs_gluon", [(128, 128, False), (1024, 1024, True)])
def test_gluon_config_on_tiny_problems_runs_the_triton_kernel(Nq, Nk, runs_gluon, monkeypatch):
    """Config GLUON (what the nearest tuned bucket gives a small prefill) on a problem below
    eva_attention_gluon.MIN_MACS runs the Triton kernel, whose launch costs less host time than the
    Gluon one; a larger problem runs the Gluon kernel. Both match the oracle."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90")
    from flashswitch.kernels_triton import eva_attention_gluon as glu
    ran = []
    real = glu.launch
    monkeypatch.setattr(glu, "launch", lambda *a, **kw: (ran.append(1), real(*a, **kw)))
    p = random_problem(1, 2, 2, Nq, Nk, 64, 16, 64, window="block", dtype=torch.bfloat16, device=DEVICE, seed=3)
    out = _run("triton", p, config=dict(GLUON=True, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4))
    assert bool(ran) == runs_gluon
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert_close("o", out[0], ref_o, torch.bfloat16)
    assert_close("lse", out[1], ref_l, torch.bfloat16)


def _check_gluon(p, cfg, Nk, monkeypatch, scale=None):
    """Run config GLUON + cfg on p with NaN past Nk and in the summaries no query sees, check that the
    Gluon kernel ran (not the Triton fallback) and compare with the oracle."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90")
    from flashswitch.kernels_triton import eva_attention_gluon as glu
    monkeypatch.setattr(glu, "MIN_MACS", 0)  # these small problems exercise the kernel's edges
    ran = []
    real = glu.launch
    monkeypatch.setattr(glu, "launch", lambda *a, **kw: (ran.append(1), real(*a, **kw)))
    n_sum = start_position(Nk - 1, chunk_size=p["chunk_size"], window_size=p["window_size"], window=p["window"]) \
        // p["chunk_size"]
    _poison_unused(p, first=0, Nk=Nk, n_sum=n_sum)
    out = _run("triton", p, scale=scale, config=dict(cfg, GLUON=True, BLOCK_M=128, num_warps=8))
    assert ran, "the Gluon kernel did not take the problem"
    ref_o, ref_l = numpy_eva_attention(**p, scale=scale, return_lse=True)
    assert_close("o", out[0], ref_o, p["q"].dtype)
    assert_close("lse", out[1], ref_l, p["q"].dtype)


def _space_problem(window, decode, device):
    return random_problem(1, 4, 2, 9 if decode else None, 300 if decode else 160, 32, 4, 32, window=window,
                          summary_bias="log_count", dtype=torch.float16, device=device, seed=4)


def _space_configs(window, decode):
    p = _space_problem(window, decode, "cpu")
    return space.config_space("eva_attention", "triton", op.problem_features(**p))


def _space_cases():
    """(window, decode, config index): on a GPU a covering spread of each space (conftest.covering_indices:
    the first, middle and last config, and configs until every value of every config key, absence
    included, occurs at least once; one test each, so that pytest-xdist spreads the compiles), a spread
    of them on the CPU."""
    out = []
    for window in ("sliding", "block"):
        for decode in (False, True):
            cfgs = _space_configs(window, decode)
            n = len(cfgs)
            picks = covering_indices(cfgs) if GPU else range(0, n, max(1, n // 4))
            out += [pytest.param(window, decode, i, id=f"{window}-{'decode' if decode else 'prefill'}-{i}")
                    for i in picks]
    return out


@pytest.mark.parametrize("window,decode,index", _space_cases())
def test_explicit_configs_from_the_space(backend, window, decode, index):
    """Configs of the tuning space (TMA tiles in the block-window one) give correct answers: on the GPU a
    covering spread of each space (`_space_cases`), not every config, since each one is a compile. The
    rest are not run here: every config of the spaces at the tuning shapes compiles for sm_90 without a
    GPU with `bench/tools/compile_check.py --ops eva_attention` (by hand: tests/test_compile_for_hopper.py runs it
    on the tuned and default configs only), and the autotuner (autotune/tune.py) checks the config it keeps
    against the fp64 reference on NaN-poisoned outputs, taking the next fastest when it is wrong; the
    configs it only times are not checked."""
    if backend != "triton":
        pytest.skip("the space below is the triton one")
    cfgs = _space_configs(window, decode)
    assert cfgs and all("BLOCK_M" in c and "BLOCK_N" in c for c in cfgs)
    p = _space_problem(window, decode, DEVICE)
    _check(op.run_kernel(backend, cfgs[index], **p), p)


def test_default_config_and_features():
    p = random_problem(2, 4, 2, 3, 70, 64, 4, 16, window="sliding", dtype=torch.float16)
    f = op.problem_features(**p)
    assert f == dict(dtype="fp16", D=64, C=4, W=16, window="sliding", decode=True, rows=32, keys=64)
    assert op.problem_features(**random_problem(1, 2, 2, None, 40, 16, 2, 4))["decode"] is False
    for dtype in ("fp16", "bf16", "fp32"):
        for D in (16, 64, 128, 256):
            for decode in (False, True):
                f = dict(dtype=dtype, D=D, C=16, W=256, window="block", decode=decode)
                cfg = space.default_config("eva_attention", "triton", f)
                assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(cfg)
                assert ("NUM_SPLITS" in cfg) == decode
                assert space._eva_triton_fits(f, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"],
                                              cfg["num_stages"])
                assert space.config_space("eva_attention", "triton", f)


def test_auto_splits():
    if not backends.available("triton", torch.device(DEVICE)):
        pytest.skip("triton is not available")
    from flashswitch.kernels_triton.eva_attention import auto_splits
    assert auto_splits(programs=512, n_blocks=20, sms=132) == 1       # grid already fills the GPU
    assert auto_splits(programs=16, n_blocks=1, sms=132) == 1         # nothing to split
    s = auto_splits(programs=16, n_blocks=40, sms=132)
    assert 2 <= s <= 40 // 4 and 16 * s <= 2 * 132
    assert auto_splits(programs=2, n_blocks=20, sms=132) == 5         # at least MIN_SPLIT_BLOCKS blocks per split
    assert auto_splits(programs=2, n_blocks=7, sms=132) == 1          # too short a walk to split


# ---------------------------------------------------------------- edge sizes
@pytest.mark.parametrize("B,H,Nq,Nk", [(0, 2, 3, 5), (1, 2, 0, 5), (1, 2, 0, 0), (1, 0, 3, 5), (1, 2, 1, 1)])
def test_empty_and_tiny(backend, B, H, Nq, Nk):
    Hkv = 1 if H else 0
    q = torch.randn(B, H, Nq, 8, device=DEVICE)
    k = torch.randn(B, Hkv, Nk, 8, device=DEVICE)
    v = torch.randn(B, Hkv, Nk, 8, device=DEVICE)
    ks = torch.randn(B, Hkv, -(-Nk // 2), 8, device=DEVICE)
    p = dict(q=q, k=k, v=v, k_sum=ks, v_sum=ks.clone(), chunk_size=2, window_size=4)
    o, lse = _run(backend, p)
    assert o.shape == (B, H, Nq, 8) and lse.shape == (B, H, Nq)
    if o.numel():
        _check((o, lse), p)


def test_zero_head_dim(backend):
    p = random_problem(1, 2, 1, None, 9, 0, 2, 4, summary_bias="log_count", device=DEVICE)
    o, lse = _run(backend, p)
    assert o.shape == (1, 2, 9, 0)
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert_close("lse", lse, ref_l, F32)


# ---------------------------------------------------------------- SPEC properties on the kernels
@pytest.mark.parametrize("window", ["block", "sliding"])
@pytest.mark.parametrize("how", ["C=1", "W>=N"])
def test_property_1_exact_causal(backend, window, how):
    Nk = 50
    C, W = (1, 8) if how == "C=1" else (4, 52)
    for Nq in (Nk, 7):
        p = random_problem(1, 4, 2, Nq, Nk, 16, C, W, window=window, device=DEVICE, seed=Nq)
        o, lse = _run(backend, p, config=SMALL)
        ref_o, ref_l = dense_causal(p["q"], p["k"], p["v"])
        assert_close("o", o, ref_o, F32)
        assert_close("lse", lse, ref_l, F32)


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_property_3_causality(backend, window):
    Nk, C, W = 70, 2, 8
    p = random_problem(1, 2, 1, None, Nk, 16, C, W, window=window, summary_bias="log_count", device=DEVICE)
    g = torch.Generator().manual_seed(0)
    for tau in (1, 33, 64):
        q, k, v = (p[n].clone() for n in ("q", "k", "v"))
        for x in (q, k, v):
            x[:, :, tau:] = (torch.randn(x[:, :, tau:].shape, generator=g) * 10).to(DEVICE)
        k_sum, v_sum = torch_chunk_summaries(k, v, C)
        o_a, l_a = _run(backend, p, config=SMALL)
        o_b, l_b = _run(backend, dict(p, q=q, k=k, v=v, k_sum=k_sum, v_sum=v_sum), config=SMALL)
        assert rel_error(o_b[:, :, :tau], o_a[:, :, :tau]) < 1e-6
        assert rel_error(l_b[:, :, :tau], l_a[:, :, :tau]) < 1e-6


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_property_5_equal_keys_and_log_count(backend, window):
    Nk, C, W = 61, 4, 8
    p = random_problem(2, 2, 1, None, Nk, 16, C, W, window=window, summary_bias="log_count", device=DEVICE)
    k = p["k"][:, :, ::C].repeat_interleave(C, 2)[:, :, :Nk].contiguous()
    k_sum, v_sum = torch_chunk_summaries(k, p["v"], C)
    p.update(k=k, k_sum=k_sum, v_sum=v_sum)
    o, lse = _run(backend, p, config=SMALL)
    ref_o, ref_l = dense_causal(p["q"], k, p["v"])
    assert_close("o", o, ref_o, F32)
    assert_close("lse", lse, ref_l, F32)


def test_property_6_merge_by_lse(backend):
    """Exact keys + summaries S1 (A) and exact keys + the other summaries S2 (B), each switched off by
    a -inf bias, merged with the exact-only part E by lse (inclusion-exclusion) give the whole."""
    p = random_problem(1, 4, 2, None, 90, 16, 2, 16, summary_bias="tensor", device=DEVICE, seed=6)
    bias = p["summary_bias"]
    g = torch.Generator().manual_seed(6)
    in_s1 = (torch.rand(bias.shape, generator=g) < 0.5).to(DEVICE)
    off = torch.full_like(bias, float("-inf"))
    parts = [_run(backend, dict(p, summary_bias=torch.where(m, bias, off)), config=SMALL)
             for m in (in_s1, ~in_s1, torch.zeros_like(in_s1))]
    o, lse = _run(backend, p, config=SMALL)
    (oa, la), (ob, lb), (oe, le) = [(x.to(F64), y.to(F64)) for x, y in parts]
    wa, wb, we = (torch.exp(x - lse.to(F64))[..., None] for x in (la, lb, le))
    merged_l = lse.to(F64) + torch.log(wa + wb - we)[..., 0]
    merged_o = wa * oa + wb * ob - we * oe
    assert rel_error(merged_o, o) < 1e-5 and rel_error(merged_l, lse) < 1e-5
    ref_o, ref_l = numpy_eva_attention(**p, return_lse=True)
    assert_close("o", o, ref_o, F32)
    assert_close("lse", lse, ref_l, F32)


def test_property_7_scale_invariance(backend):
    p = random_problem(1, 4, 2, None, 50, 16, 2, 8, window="sliding", summary_bias="tensor", device=DEVICE)
    o, lse = _run(backend, p, scale=0.3, config=SMALL)
    for alpha in (2.0, 0.5):
        o2, l2 = _run(backend, dict(p, q=alpha * p["q"]), scale=0.3 / alpha, config=SMALL)
        assert rel_error(o2, o) < 1e-5 and rel_error(l2, lse) < 1e-5


@pytest.mark.parametrize("pack", [False, True])
def test_property_7_gqa_equals_repeated_kv(backend, pack):
    p = random_problem(2, 6, 2, 20, 50, 16, 2, 8, summary_bias="tensor", device=DEVICE)
    r = {n: p[n].repeat_interleave(3, 1) for n in ("k", "v", "k_sum", "v_sum", "summary_bias")}
    o, lse = _run(backend, p, config=dict(SMALL, PACK_GQA=pack))
    o2, l2 = _run(backend, dict(p, **r), config=SMALL)
    assert rel_error(o2, o) < 1e-6 and rel_error(l2, lse) < 1e-6


def test_property_7_permutations(backend):
    p = random_problem(3, 4, 2, None, 30, 16, 2, 4, summary_bias="tensor", device=DEVICE)
    pb, pk = torch.tensor([2, 0, 1], device=DEVICE), torch.tensor([1, 0], device=DEVICE)
    ph = torch.tensor([3, 2, 1, 0], device=DEVICE)  # kv groups {0,1} -> {1,0}, heads reversed inside
    perm = {n: p[n][pb][:, pk] for n in ("k", "v", "k_sum", "v_sum", "summary_bias")}
    perm["q"] = p["q"][pb][:, ph]
    o, lse = _run(backend, p)
    o2, l2 = _run(backend, dict(p, **perm))
    assert rel_error(o2, o[pb][:, ph]) < 1e-6 and rel_error(l2, lse[pb][:, ph]) < 1e-6


def test_queries_are_rows_of_the_prefill(backend):
    """Decode (Nq = 1) and chunked prefill give the matching rows of the full prefill."""
    full = random_problem(1, 4, 2, None, 57, 16, 4, 16, window="sliding", summary_bias="log_count", device=DEVICE)
    o_full, l_full = _run(backend, full)
    for Nq, start in [(1, 56), (1, 20), (5, 40), (16, 0), (30, 11)]:
        p = dict(full, q=full["q"][:, :, start:start + Nq], q_offset=start)
        o, lse = _run(backend, p)
        assert rel_error(o, o_full[:, :, start:start + Nq]) < 1e-6
        assert rel_error(lse, l_full[:, :, start:start + Nq]) < 1e-6


# ---------------------------------------------------------------- custom op
def test_custom_op_fake_and_schema(backend):
    p = random_problem(1, 2, 1, 4, 12, 16, 2, 4, summary_bias="tensor", device=DEVICE)
    args = (p["q"], p["k"], p["v"], p["k_sum"], p["v_sum"], p["summary_bias"], 2, 4, "block", 0.25, 8, False,
            backend)
    torch.library.opcheck(op.OPDEF.op, args, test_utils=("test_schema", "test_faketensor"))


def test_reference_backend_is_differentiable():
    p = random_problem(1, 2, 1, 3, 8, 4, 2, 4)
    q = p["q"].clone().requires_grad_()
    o = eva_attention(**dict(p, q=q), backend="reference")
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---------------------------------------------------------------- bad inputs (op 2)
def _valid(**kw):
    return random_problem(1, 4, 2, None, 12, 8, 2, 4, **kw)


BAD = [
    ("window_size", dict(window_size=6, chunk_size=4), ValueError, "multiple of chunk_size"),
    ("window below chunk", dict(window_size=2, chunk_size=4), ValueError, ">= chunk_size"),
    ("window_size zero", dict(window_size=0), ValueError, "window_size"),
    ("chunk_size zero", dict(chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size float", dict(chunk_size=2.0), TypeError, "chunk_size"),
    ("window string", dict(window="global"), ValueError, "window must be one of"),
    ("window type", dict(window=None), ValueError, "window must be one of"),
    ("q_offset negative", dict(q_offset=-1), ValueError, "q_offset"),
    ("q_offset too large", dict(q_offset=1), ValueError, "q_offset"),
    ("q_offset bool", dict(q_offset=True), TypeError, "q_offset"),
    ("q_offset float", dict(q_offset=0.0), TypeError, "q_offset"),
    ("bias string", dict(summary_bias="count"), ValueError, "summary_bias"),
    ("bias type", dict(summary_bias=1.0), TypeError, "summary_bias"),
    ("bias shape", dict(summary_bias=torch.zeros(1, 2, 5)), ValueError, "summary_bias"),
    ("bias heads", dict(summary_bias=torch.zeros(1, 4, 6)), ValueError, "summary_bias"),
    ("bias dtype", dict(summary_bias=torch.zeros(1, 2, 6, dtype=torch.int32)), TypeError, "summary_bias"),
    ("scale", dict(scale="big"), TypeError, "scale"),
]


@pytest.mark.parametrize("name,change,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(name, change, error, match):
    p = _valid()
    p.update(change)
    with pytest.raises(error, match=match):
        eva_attention(**p)


def _tensor_change(p, name, value):
    p = dict(p)
    p[name] = value
    return p


BAD_TENSORS = [
    ("heads", lambda p: _tensor_change(p, "q", torch.randn(1, 3, 12, 8)), ValueError, "multiple of the kv heads"),
    ("q ndim", lambda p: _tensor_change(p, "q", torch.randn(4, 12, 8)), ValueError, "q must have 4 dims"),
    ("k ndim", lambda p: _tensor_change(p, "k", torch.randn(2, 12, 8)), ValueError, "k must have 4 dims"),
    ("v shape", lambda p: _tensor_change(p, "v", torch.randn(1, 2, 11, 8)), ValueError, "v has shape"),
    ("k head dim", lambda p: _tensor_change(p, "k", torch.randn(1, 2, 12, 4)), ValueError, "k has head dim 4 but q"),
    ("k batch", lambda p: _tensor_change(p, "k", torch.randn(2, 2, 12, 8)), ValueError, "k has shape"),
    ("k_sum head dim", lambda p: _tensor_change(p, "k_sum", torch.randn(1, 2, 6, 4)), ValueError,
     "k_sum has head dim 4 but k"),
    ("k_sum shape", lambda p: _tensor_change(p, "k_sum", torch.randn(1, 1, 6, 8)), ValueError, "k_sum has shape"),
    ("v_sum shape", lambda p: _tensor_change(p, "v_sum", torch.randn(1, 2, 5, 8)), ValueError, "v_sum has shape"),
    ("k dtype", lambda p: _tensor_change(p, "k", p["k"].half()), TypeError, "k has dtype"),
    ("v_sum dtype", lambda p: _tensor_change(p, "v_sum", p["v_sum"].double()), TypeError, "v_sum has dtype"),
    ("q int", lambda p: _tensor_change(p, "q", p["q"].int()), TypeError, "q has dtype"),
    ("q list", lambda p: _tensor_change(p, "q", [[1.0]]), TypeError, "q must be a torch.Tensor"),
    ("q last dim", lambda p: _tensor_change(p, "q", torch.randn(1, 4, 8, 12).transpose(-1, -2)), ValueError,
     "q must be contiguous in its last dim"),
    ("more queries than keys", lambda p: _tensor_change(p, "q", torch.randn(1, 4, 13, 8)), ValueError, "queries"),
]


@pytest.mark.parametrize("name,make,error,match", BAD_TENSORS, ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensors(name, make, error, match):
    with pytest.raises(error, match=match):
        eva_attention(**make(_valid()))


def test_head_dim_too_large_for_triton():
    if not backends.available("triton", torch.device(DEVICE)):
        pytest.skip("triton is not available")
    p = random_problem(1, 1, 1, None, 4, 264, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        eva_attention(**p, backend="triton")


@pytest.mark.gpu
def test_device_mix():
    p = _valid(device="cuda")
    p["k_sum"] = p["k_sum"].cpu()
    with pytest.raises(ValueError, match="k_sum is on"):
        eva_attention(**p)


# ---------------------------------------------------------------- larger shapes (GPU only)
@pytest.mark.gpu
@pytest.mark.parametrize("window,C,W", [("block", 16, 2048), ("sliding", 32, 256), ("block", 32, 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_sequences(backend, window, C, W, dtype):
    N = 4096 + 17
    p = random_problem(1, 4, 2, None, N, 128, C, W, window=window, summary_bias="log_count", dtype=dtype,
                       device=DEVICE)
    o, lse = _run(backend, p)
    base_o, base_l = torch_eva_attention(**p, return_lse=True)
    ref_o, ref_l = torch_eva_attention(**{**p, **{n: p[n].double() for n in ("q", "k", "v", "k_sum", "v_sum")}},
                                       return_lse=True)
    assert_close("o", o, ref_o, dtype, baseline=base_o)
    assert_close("lse", lse, ref_l, F32, baseline=base_l)


@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [16, 4])
def test_long_decode(backend, Hkv):
    """One query at position 32767 of a 32k cache: 256 exact keys + 1016 summaries per head."""
    p = random_problem(2, 16, Hkv, 1, 32768, 128, 32, 256, dtype=torch.bfloat16, device=DEVICE)
    o, lse = _run(backend, p)
    base_o, base_l = torch_eva_attention(**p, return_lse=True)
    ref_o, ref_l = torch_eva_attention(**{**p, **{n: p[n].double() for n in ("q", "k", "v", "k_sum", "v_sum")}},
                                       return_lse=True)
    assert_close("o", o, ref_o, torch.bfloat16, baseline=base_o)
    assert_close("lse", lse, ref_l, F32, baseline=base_l)
    assert math.isfinite(float(lse.sum()))


@pytest.mark.parametrize("bias", [None, "tensor"])
def test_batch_heads_past_the_grid_limit(backend, bias, monkeypatch):
    """B * H above CUDA's 65535 on grid axis 1 (large decode batches): the Triton launcher runs slices of
    the batch. On the CPU the limit is lowered to exercise the slicing on a small problem."""
    if backend != "triton":
        pytest.skip("the grid limit is the Triton launcher's")
    from flashswitch.kernels_triton import eva_attention as K
    if DEVICE == "cpu":
        monkeypatch.setattr(K, "MAX_GRID_Y", 7)
        p = random_problem(5, 4, 2, 1, 40, 16, 4, 8, summary_bias=bias, device=DEVICE, seed=3)
    else:
        p = random_problem(4100, 16, 16, 1, 64, 32, 4, 16, summary_bias=bias, dtype=torch.bfloat16,
                           device=DEVICE, seed=3)
    _check(_run(backend, p), p)
