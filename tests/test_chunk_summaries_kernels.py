"""Op 1 kernels (every kernel backend that can run here) against the fp64 NumPy oracle.

Each output must be within 2x the error of the PyTorch reference in the same precision plus the
dtype's rounding floor (the SPEC rule); lse is held to fp32 accuracy, widened where its logits cancel. Kernel
outputs start as NaN (FLASHSWITCH_POISON), so an element a kernel forgets to write fails.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, dtypes_here, kernel_backends
import flashswitch
from flashswitch.autotune import space
from flashswitch.ops import chunk_summaries as op
from flashswitch.reference.chunk_summaries import numpy_chunk_summaries, random_problem, torch_chunk_summaries
from flashswitch.testing import assert_close, conditioning_tol

NAMES = ("k_sum", "v_sum", "lse")
GPU = DEVICE == "cuda"
needs_triton = pytest.mark.skipif("triton" not in kernel_backends(), reason="triton cannot run here")
# hypothesis with the function-scoped `backend` fixture: the fixture does not change between examples
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])


def _run(backend, problem, scale=None):
    return flashswitch.chunk_summaries(**problem, scale=scale, return_lse=True, backend=backend)


def _lse_tol(problem, scale=None) -> float:
    """lse's bound where its logits cancel (lse near zero while s (omega.k - |k|^2 / 2) is not):
    testing.conditioning_tol of the fp64 oracle over the floating-point inputs."""
    names = [n for n in ("k", "v", "omega", "key_weight") if problem.get(n) is not None]
    rest = {n: x for n, x in problem.items() if n not in names}

    def lse(inputs):
        return {"lse": torch.from_numpy(numpy_chunk_summaries(**rest, **inputs, scale=scale, return_lse=True)[2])}
    return conditioning_tol(lse, {n: problem[n] for n in names}, problem["k"].dtype)["lse"]


def _check(out, problem, scale=None):
    """Compare (k_sum, v_sum, lse) with the oracle; the torch reference in the same dtype is the baseline.
    lse is held to fp32's rule, widened where its logits cancel (_lse_tol)."""
    dtype = problem["k"].dtype
    ref = numpy_chunk_summaries(**problem, scale=scale, return_lse=True)
    base = torch_chunk_summaries(**problem, scale=scale, return_lse=True)
    for name, o, r, b in zip(NAMES, out, ref, base):
        assert tuple(o.shape) == r.shape, name
        assert o.device.type == DEVICE, name
        assert o.dtype == (torch.float32 if name == "lse" else dtype), name
        assert_close(name, o, r, torch.float32 if name == "lse" else dtype, baseline=b,
                     tol=_lse_tol(problem, scale) if name == "lse" else 0.0)


@st.composite
def problems(draw):
    C = draw(st.sampled_from([1, 2, 3, 5, 16, 64, 100] + ([128, 200] if GPU else [])))
    N = draw(st.one_of(st.just(1), st.integers(1, max(1, C - 1)), st.sampled_from([C, 2 * C + 1]),
                       st.integers(1, 3 * C + 5)))
    D = draw(st.sampled_from([1, 2, 16, 33, 76] + ([64, 128, 256] if GPU else [])))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), N=N, D=D, C=C,
                omega=draw(st.sampled_from(["none", "head", "chunk"])), key_weight=draw(st.booleans()),
                valid=draw(st.booleans()), layout=draw(st.sampled_from(["contiguous", "strided"])),
                dtype=draw(st.sampled_from(dtypes_here())), seed=draw(st.integers(0, 999)))


@with_fixture
@given(case=problems(), scale=st.sampled_from([None, 0.3, 2.0]))
def test_kernel_matches_reference(backend, case, scale):
    p = random_problem(device=DEVICE, **case)
    _check(_run(backend, p, scale), p, scale)


@pytest.mark.parametrize("N,C", [(0, 4), (1, 1), (1, 16), (3, 5), (15, 16), (17, 16), (64, 64), (65, 64),
                                 (129, 100), (300, 130)])
@pytest.mark.parametrize("dtype", dtypes_here())
def test_lengths(backend, N, C, dtype):
    p = random_problem(1, 2, N, 12, C, dtype=dtype, device=DEVICE, omega="head", key_weight=True)
    out = _run(backend, p)
    assert out[0].shape == (1, 2, -(-N // C), 12)
    _check(out, p)


def test_zero_head_dim(backend):
    """D = 0: empty summaries, lse = log(number of valid tokens) (every logit is 0)."""
    p = random_problem(2, 2, 13, 0, 4, device=DEVICE, valid=True)
    out = _run(backend, p)
    assert out[0].shape == (2, 2, 4, 0)
    _check(out, p)


@pytest.mark.parametrize("D", [1, 3, 76] + ([128, 256] if GPU else []))
def test_head_dims(backend, D):
    p = random_problem(2, 2, 40, D, 8, device=DEVICE, omega="chunk", valid=True)
    _check(_run(backend, p), p)


def test_empty_chunks(backend):
    """A chunk with no valid token: k_sum = v_sum = 0 exactly, lse = -inf, no NaN anywhere."""
    N, C = 40, 8
    for key_weight in (False, True):
        p = random_problem(2, 3, N, 6, C, device=DEVICE, omega="head", key_weight=key_weight, seed=3)
        valid = torch.rand(2, N, generator=torch.Generator().manual_seed(0)) > 0.4
        valid[0, :C] = False          # first chunk
        valid[0, 3 * C:] = False      # the last chunk (and right padding)
        valid[1, :] = False           # a whole sequence of padding
        valid[0, C:2 * C] = False
        valid[0, C + 3] = True        # a chunk with a single valid token
        p["valid"] = valid.to(DEVICE)
        k_sum, v_sum, lse = out = _run(backend, p)
        _check(out, p)
        for b, c in [(0, 0), (0, 3), (0, 4)] + [(1, c) for c in range(N // C)]:
            assert torch.all(k_sum[b, :, c] == 0) and torch.all(v_sum[b, :, c] == 0)
            assert torch.all(torch.isneginf(lse[b, :, c]))
        assert torch.isfinite(lse[0, :, 1:3]).all()
        # a single valid token: its own key and value, lse = its logit
        assert torch.allclose(k_sum[0, :, 1].float(), p["k"][0, :, C + 3].float(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(v_sum[0, :, 1].float(), p["v"][0, :, C + 3].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("C,first_valid,last_valid", [(100, 70, 100), (100, 0, 30), (130, 64, 65),
                                                       (200, 150, 200), (70, 64, 70)])
def test_online_softmax_pieces(backend, C, first_valid, last_valid):
    """Chunks longer than one 64-token piece, valid tokens only in a later (or the first) piece."""
    N = 2 * C + 7
    p = random_problem(1, 2, N, 5, C, device=DEVICE, omega="chunk", key_weight=True, seed=C)
    valid = torch.zeros(1, N, dtype=torch.bool)
    for c0 in range(0, N, C):
        valid[0, c0 + first_valid:c0 + last_valid] = True
    p["valid"] = valid.to(DEVICE)
    _check(_run(backend, p), p)


def test_large_logits(backend):
    """Keys with large norms: logits around -1e4, only a max-subtracted softmax stays finite."""
    p = random_problem(2, 2, 70, 16, 5, device=DEVICE, omega="chunk", key_weight=True, valid=True, seed=5)
    p["k"] = p["k"] * 40
    p["omega"] = p["omega"] * 40
    p["key_weight"] = p["key_weight"] * 10
    _check(_run(backend, p), p)


def test_padding_garbage_is_ignored(backend):
    """inf / NaN in padded positions must not reach any output (the oracle never reads them)."""
    p = random_problem(2, 2, 30, 8, 4, device=DEVICE, omega="head", key_weight=True, valid=True, seed=1)
    bad = (~p["valid"])[:, None, :, None].expand_as(p["k"])
    p = dict(p, k=p["k"].masked_fill(bad, float("nan")), v=p["v"].masked_fill(bad, float("inf")))
    out = _run(backend, p)
    ref = numpy_chunk_summaries(**p, return_lse=True)
    for name, o, r in zip(NAMES, out, ref):
        assert_close(name, o, r, torch.float32)


@pytest.mark.parametrize("view", ["token_step", "padded_rows", "offset", "batch_major"])
def test_strided_inputs(backend, view):
    """Views with any strides but a unit last one, an odd storage offset, a strided valid mask and a
    transposed per-chunk omega in another dtype."""
    B, H, N, D, C = 2, 3, 37, 10, 6
    Nc = -(-N // C)
    g = torch.Generator().manual_seed(7)
    dtype = dtypes_here()[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)

    if view == "token_step":
        k, v = rnd(B, H, 2 * N, D)[:, :, ::2], rnd(B, H, 2 * N, D)[:, :, 1::2]
    elif view == "padded_rows":  # row stride D + 3: no alignment beyond one element
        k, v = rnd(B, H, N, D + 3)[..., :D], rnd(B, H, N, D + 3)[..., 3:]
    elif view == "offset":
        k, v = rnd(B * H * N * D + 1)[1:].view(B, H, N, D), rnd(B, N, H, D + 1)[..., 1:].transpose(1, 2)
    else:
        k, v = rnd(H, B, N, D).transpose(0, 1), rnd(N, B, H, D).permute(1, 2, 0, 3)
    valid = (torch.rand(B, 3 * N, generator=g) > 0.3)[:, ::3].to(DEVICE)
    omega = torch.randn(B, Nc, H, D, generator=g, dtype=torch.float32).to(DEVICE).transpose(1, 2)
    key_weight = rnd(2 * H, D)[::2]
    p = dict(k=k, v=v, chunk_size=C, omega=omega, key_weight=key_weight, valid=valid)
    assert not k.is_contiguous() or view == "offset"
    _check(_run(backend, p), p)


def test_explicit_configs(backend):
    """Every tuning candidate computes the same thing: a badly tuned config may be slow, never wrong."""
    for shape in (dict(B=2, H=2, N=45, D=76, C=5), dict(B=1, H=2, N=150, D=16, C=100),
                  dict(B=1, H=1, N=9, D=1, C=1)):
        p = random_problem(device=DEVICE, omega="chunk", key_weight=True, valid=True, **shape)
        feats = op.problem_features(**p)
        configs = space.config_space(op.OP, backend, feats)
        assert configs and space.default_config(op.OP, backend, feats) in configs
        if not GPU and backend == "triton":  # the interpreter ignores warps and stages
            configs = list({(c["BLOCK_CHUNKS"], c.get("BLOCK_J")): c for c in configs}.values())
        for config in configs:
            try:
                _check(op.run_kernel(backend, config, **p), p)
            except AssertionError as err:
                raise AssertionError(f"config {config}: {err}") from err


@needs_triton
def test_config_from_another_shape():
    """A tuned config looked up for a neighbouring bucket (another C or D) must still run correctly."""
    p = random_problem(1, 2, 230, 76, 100, device=DEVICE, omega="head", key_weight=True, valid=True)
    for config in ({"BLOCK_CHUNKS": 64, "num_warps": 1, "num_stages": 3}, {"BLOCK_CHUNKS": 2, "BLOCK_J": 128},
                   {"BLOCK_CHUNKS": 1, "BLOCK_J": 4, "num_warps": 2}, {}):
        _check(op.run_kernel("triton", config, **p), p)
    with pytest.raises(ValueError, match="BLOCK_CHUNKS"):
        op.run_kernel("triton", {"BLOCK_CHUNKS": 3}, **p)


@needs_triton
def test_64bit_offsets_path(monkeypatch):
    """The 64-bit offset code (taken for heads past 2^31 elements) on a small problem."""
    from flashswitch.kernels_triton import chunk_summaries as kernel
    monkeypatch.setattr(kernel, "FORCE_OFFS_64", True)
    for C in (5, 100):
        p = random_problem(2, 2, 210, 12, C, device=DEVICE, omega="chunk", key_weight=True, valid=True,
                           layout="strided")
        _check(_run("triton", p), p)


def test_outputs_are_fresh_and_typed(backend):
    p = random_problem(1, 2, 20, 8, 4, dtype=dtypes_here()[-1], device=DEVICE)
    k_sum, v_sum, lse = _run(backend, p)
    assert k_sum.is_contiguous() and v_sum.is_contiguous() and lse.is_contiguous()
    assert k_sum.dtype == p["k"].dtype and lse.dtype == torch.float32
    assert k_sum.data_ptr() != v_sum.data_ptr()
    two = flashswitch.chunk_summaries(**p, backend=backend)
    assert len(two) == 2 and torch.equal(two[0], k_sum) and torch.equal(two[1], v_sum)


def test_opcheck(backend):
    """The registered op's schema, fake (meta) implementation, autograd registration and AOT dispatch."""
    p = random_problem(1, 2, 10, 8, 4, device=DEVICE, omega="head", key_weight=True, valid=True)
    omega = op._kernel_inputs(p["k"], p["v"], 4, p["omega"], None, None, None)[2]
    args = (p["k"], p["v"], 4, omega, p["key_weight"], p["valid"], 0.3, backend)
    torch.library.opcheck(torch.ops.flashswitch.chunk_summaries.default, args)
    args = (p["k"], p["v"], 3, None, None, None, 0.3, backend)
    torch.library.opcheck(torch.ops.flashswitch.chunk_summaries.default, args)


def test_torch_compile_fullgraph(backend):
    p = random_problem(1, 2, 10, 8, 4, device=DEVICE, omega="head", key_weight=True, valid=True)

    def f(k, v, omega, key_weight, valid):
        k_sum, v_sum, lse = flashswitch.chunk_summaries(k, v, 4, omega=omega, key_weight=key_weight, valid=valid,
                                                        return_lse=True, backend=backend)
        return k_sum * 2, v_sum, lse

    torch._dynamo.reset()
    args = (p["k"], p["v"], p["omega"], p["key_weight"], p["valid"])
    try:
        out = torch.compile(f, fullgraph=True, backend="inductor" if GPU else "aot_eager")(*args)
    finally:
        torch._dynamo.reset()
    for o, r in zip(out, f(*args)):
        assert torch.equal(o, r)


# ---------------------------------------------------------------- GPU-only sizes
@pytest.mark.gpu
@pytest.mark.parametrize("D,C", [(128, 16), (64, 16), (128, 64), (256, 100), (76, 16)])
def test_large(backend, D, C):
    for dtype in dtypes_here():
        p = random_problem(2, 8, 8192 + 3, D, C, dtype=dtype, device=DEVICE, omega="chunk", key_weight=True,
                           valid=True, layout="strided")
        out = _run(backend, p)
        base = torch_chunk_summaries(**p, return_lse=True)
        ref = torch_chunk_summaries(**{**p, **{n: p[n].double() for n in ("k", "v", "omega", "key_weight")}},
                                    return_lse=True)
        for name, o, r, b in zip(NAMES, out, ref, base):
            assert_close(name, o, r, torch.float32 if name == "lse" else dtype, baseline=b)


@pytest.mark.gpu
def test_offsets_past_int32(backend):
    """One head holding more than 2^31 elements: offsets must be computed in 64 bits."""
    C, D = 16, 128
    N = (1 << 31) // D + 4 * C + 5
    k = torch.randn(1, 1, N, D, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn(1, 1, N, D, dtype=torch.bfloat16, device=DEVICE)
    assert k.numel() > 2 ** 31
    k_sum, v_sum, lse = flashswitch.chunk_summaries(k, v, C, return_lse=True, backend=backend)
    tail = 40  # last chunks, past element 2^31
    start = (-(-N // C) - tail) * C
    ref = torch_chunk_summaries(k[:, :, start:].double(), v[:, :, start:].double(), C, scale=D ** -0.5,
                                return_lse=True)
    for name, o, r in zip(NAMES, (k_sum[:, :, -tail:], v_sum[:, :, -tail:], lse[:, :, -tail:]), ref):
        assert_close(name, o, r, torch.float32 if name == "lse" else torch.bfloat16)
    del k, v


def test_eager_fast_path_matches_custom_op(backend):
    """Eager calls without autograd skip the custom op's dispatcher; a call on a tensor that requires
    grad goes through it. Both give bitwise the same outputs."""
    from flashswitch import _common
    p = random_problem(1, 2, 20, 8, 4, device=DEVICE, omega="head", valid=True)
    fast = flashswitch.chunk_summaries(**p, return_lse=True, backend=backend)
    k = p["k"].clone().requires_grad_(True)
    assert _common.eager_fast_path(p["k"]) and not _common.eager_fast_path(k)
    slow = flashswitch.chunk_summaries(**dict(p, k=k), return_lse=True, backend=backend)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0, equal_nan=False)


def test_chunk_longer_than_the_sequence_returns_at_once(backend):
    """A chunk_size far above N is one chunk of all N tokens; the kernel loops over the tokens, not
    over chunk_size."""
    import time
    p = random_problem(2, 3, 37, 16, 4, dtype=torch.float32, device=DEVICE, seed=1)
    p["chunk_size"] = 2 ** 40
    t0 = time.perf_counter()
    out = _run(backend, p)
    assert time.perf_counter() - t0 < 60
    _check(out, p)
