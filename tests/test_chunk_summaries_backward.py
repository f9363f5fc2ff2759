"""Op 1 gradients: every kernel backend's backward (the Triton backward kernels) against autograd of
the torch reference run in fp64.

Each gradient must be within 2x the error of the torch reference's own gradients in its dtype plus the
rounding floor (the SPEC rule, flashswitch.testing), measured against the size a gradient has where its
softmax centring does not cancel (_logit_path_floors) when it is smaller. Gradient
outputs come from new_output, which the tests poison with NaN, so an element a kernel forgets to
write fails. Loss = <g_k, k_sum> + <g_v, v_sum> + <g_lse, lse> with random g (lse in the loss).
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, cuda_graph_capture, dtypes_here, kernel_backends
import flashswitch
from flashswitch.autotune import space
from flashswitch.ops import chunk_summaries as op
from flashswitch.reference.chunk_summaries import random_problem, torch_chunk_summaries
from flashswitch.testing import REL_TOL, assert_close

GPU = DEVICE == "cuda"
DIFF = op.GRAD_INPUTS  # ("k", "v", "omega", "key_weight")
needs_triton = pytest.mark.skipif("triton" not in kernel_backends(), reason="triton cannot run here")
with_fixture = settings(suppress_health_check=list(settings().suppress_health_check)
                        + [HealthCheck.function_scoped_fixture])


def _leaves(p, dtype=None):
    """Fresh leaf copies (requires_grad) of the differentiable inputs present in problem p."""
    return {n: (p[n].detach().to(dtype) if dtype else p[n].detach().clone()).requires_grad_(True)
            for n in DIFF if p.get(n) is not None}


def _grad_outputs(p, seed=0, with_lse=True):
    B, H, N, D = p["k"].shape
    Nc = -(-N // p["chunk_size"])
    g = torch.Generator().manual_seed(seed)
    gk, gv = (torch.randn(B, H, Nc, D, generator=g).to(p["k"].dtype).to(DEVICE) for _ in range(2))
    glse = torch.randn(B, H, Nc, generator=g).to(DEVICE) if with_lse else None
    return gk, gv, glse


def _grads(backend, p, g, scale=None):
    """Gradients (dict by input name) of the loss through flashswitch.chunk_summaries on `backend`."""
    leaves = _leaves(p)
    out = flashswitch.chunk_summaries(**{**p, **leaves}, scale=scale, return_lse=True, backend=backend)
    pairs = [(o, gi) for o, gi in zip(out, g) if gi is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [gi for _, gi in pairs])
    return dict(zip(leaves, grads))


def _ref_grads(p, g, scale=None, dtype=torch.float64):
    """The torch reference's gradients by autograd, on copies of the inputs in `dtype`."""
    leaves = _leaves(p, dtype)
    out = torch_chunk_summaries(**{**p, **leaves}, scale=scale, return_lse=True)
    pairs = [(o, gi.to(o.dtype)) for o, gi in zip(out, g) if gi is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [gi for _, gi in pairs])
    return dict(zip(leaves, grads))


def _rms(t):
    return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0


def _logit_path_floors(p, ref, g, scale):
    """The size the logit-path gradients have where their softmax centring does not cancel. A chunk
    whose value softmax sits on one token has dl_j = p_j (dv_sum . v_j - delta_v + dlse) = 0 up to
    rounding of dv_sum . v_j - delta_v, which any fp32 order (the kernel's or the reference's) leaves.
    |dl_j| is then about rms(v) |dv_j| (dv_j = p_j dv_sum, from the fp64 reference), and d omega and the
    logit term of dk are s sqrt(D) rms(k) times that. The key softmax a_j (key_weight) cancels the same
    way in g_j = a_j (dk_sum . k_j - delta_k): its uncancelled terms a_j |dk_sum . k_j| k_j (d key_weight)
    and a_j |dk_sum . k_j| key_weight (dk), computed in fp64. A quarter of the value path's, an eighth of
    the key path's (its terms add up less): estimates, kept about below the gradients' norms where
    nothing cancels."""
    k = p["k"].double().cpu()
    B, H, N, D = k.shape
    s = scale if scale is not None else D ** -0.5
    size = 0.25 * s * D ** 0.5 * _rms(p["v"]) * ref["v"].double().norm().item()
    omega = p.get("omega")
    floors = {"omega": size * _rms(p["k"]), "k": size * max(_rms(p["k"]), _rms(omega) if omega is not None else 0.0)}
    kw = p.get("key_weight")
    if kw is not None:
        Nc = -(-N // p["chunk_size"])
        C = min(p["chunk_size"], max(N, 1))  # as the reference: a chunk longer than N holds N tokens
        pad = Nc * C - N
        kc = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, Nc, C, D)
        valid = torch.ones(B, N, dtype=torch.bool) if p.get("valid") is None else p["valid"].cpu()
        mask = torch.nn.functional.pad(valid, (0, pad), value=False).view(B, 1, Nc, C)
        logits = torch.einsum("bhncd,hd->bhnc", kc, kw.double().cpu()).masked_fill(~mask, float("-inf"))
        a = torch.nan_to_num(torch.softmax(logits, -1))  # an empty chunk: NaN -> 0
        t = a * torch.einsum("bhnd,bhncd->bhnc", g[0].double().cpu(), kc).abs()  # a_j |dk_sum . k_j|
        floors["key_weight"] = 0.125 * (t.pow(2) * kc.pow(2).sum(-1)).sum().sqrt().item()
        by_k = 0.125 * t.pow(2).sum().sqrt().item() * kw.double().norm().item() / H ** 0.5
        floors["k"] = max(floors["k"], by_k)
    return floors


def _check(got, p, g, scale=None):
    """Each gradient against fp64 autograd; the torch reference's gradients in the inputs' own dtype
    are the baseline."""
    ref = _ref_grads(p, g, scale)
    base = _ref_grads(p, g, scale, dtype=None)
    floors = _logit_path_floors(p, ref, g, scale)
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        o = got[name]
        assert o.shape == p[name].shape and o.dtype == p[name].dtype and o.device.type == DEVICE, name
        assert_close(f"d{name}", o, r, p[name].dtype, baseline=base[name], floor=floors.get(name, 0.0))


@st.composite
def problems(draw):
    C = draw(st.sampled_from([1, 2, 3, 5, 16, 100] + ([64, 128, 200] if GPU else [])))
    N = draw(st.one_of(st.integers(1, max(1, C - 1)), st.sampled_from([C, 2 * C + 1]), st.integers(1, 3 * C + 5)))
    D = draw(st.sampled_from([1, 5, 16, 76] + ([64, 128, 256] if GPU else [])))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), N=N, D=D, C=C,
                omega=draw(st.sampled_from(["none", "head", "chunk"])), key_weight=draw(st.booleans()),
                valid=draw(st.booleans()), layout=draw(st.sampled_from(["contiguous", "strided"])),
                dtype=draw(st.sampled_from(dtypes_here())), seed=draw(st.integers(0, 999)))


@with_fixture
@given(case=problems(), scale=st.sampled_from([None, 0.3, 2.0]), with_lse=st.booleans())
def test_gradients_match_reference(backend, case, scale, with_lse):
    p = random_problem(device=DEVICE, **case)
    g = _grad_outputs(p, case["seed"], with_lse)
    _check(_grads(backend, p, g, scale), p, g, scale)


def test_one_hot_value_softmax(backend):
    """Large logits put each chunk's softmax on one token: d omega is then rounding left by the
    cancellation in dl (the fp32 reference is off by ~20% too), checked against its no-cancellation size."""
    case = dict(B=1, H=1, N=2, D=128, C=2, omega="head", key_weight=False, valid=False, layout="contiguous",
                dtype=torch.float32, seed=2)
    p = random_problem(device=DEVICE, **case)
    g = _grad_outputs(p, case["seed"], with_lse=False)
    _check(_grads(backend, p, g, 2.0), p, g, 2.0)


@pytest.mark.parametrize("omega", ["none", "head", "chunk"])
@pytest.mark.parametrize("key_weight", [False, True])
@pytest.mark.parametrize("valid", [False, True])
def test_every_mode(backend, omega, key_weight, valid):
    """Each combination of omega form, key mode and padding, N not a multiple of C, odd D."""
    p = random_problem(2, 2, 23, 5, 4, device=DEVICE, omega=omega, key_weight=key_weight, valid=valid)
    g = _grad_outputs(p)
    _check(_grads(backend, p, g), p, g)


@pytest.mark.parametrize("N,C,D", [(9, 1, 3), (5, 16, 76), (1, 1, 4), (17, 16, 8), (150, 100, 5),
                                   (130, 65, 3), (40, 8, 33)])
def test_lengths(backend, N, C, D):
    """C = 1, C > N, a ragged last chunk and chunks longer than one 64-token piece (two passes)."""
    p = random_problem(1, 2, N, D, C, device=DEVICE, omega="chunk", key_weight=True, valid=N > C)
    g = _grad_outputs(p)
    _check(_grads(backend, p, g), p, g)


def test_chunk_longer_than_the_sequence(backend):
    """A chunk_size far above N is one chunk of all N tokens: the backward loops over the tokens, not
    over chunk_size."""
    import time
    p = random_problem(2, 3, 37, 16, 4, device=DEVICE, omega="chunk", key_weight=True, valid=True, seed=1)
    p["chunk_size"] = 2 ** 40
    p["omega"] = p["omega"][:, :, :1]
    g = _grad_outputs(p)
    t0 = time.perf_counter()
    grads = _grads(backend, p, g)
    assert time.perf_counter() - t0 < 60
    _check(grads, p, g)


def test_lse_only_loss(backend):
    """A loss of lse alone: the gradients flow through lse (k_sum, v_sum get zero gradients)."""
    p = random_problem(2, 2, 30, 6, 4, device=DEVICE, omega="head", key_weight=True, valid=True)
    leaves = _leaves(p)
    lse = flashswitch.chunk_summaries(**{**p, **leaves}, return_lse=True, backend=backend)[2]
    torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    ref_leaves = _leaves(p, torch.float64)
    ref = torch_chunk_summaries(**{**p, **ref_leaves}, return_lse=True)[2]
    torch.where(torch.isfinite(ref), ref, 0.0).sum().backward()
    for name in ("k", "omega"):  # v and key_weight do not reach lse: the reference leaves them None
        assert_close(f"d{name}", leaves[name].grad, ref_leaves[name].grad, torch.float32)
    assert leaves["k"].grad.abs().sum() > 0 and leaves["omega"].grad.abs().sum() > 0
    assert torch.all(leaves["v"].grad == 0) and torch.all(leaves["key_weight"].grad == 0)


def test_padding_gets_zero_gradients(backend):
    """Padding tokens get exact zeros even when they hold inf / NaN; empty chunks contribute nothing."""
    p = random_problem(2, 3, 40, 8, 8, device=DEVICE, omega="chunk", key_weight=True, valid=True, seed=4)
    valid = p["valid"].clone()
    valid[1, :] = False  # a sequence of padding only
    valid[0, 8] = True
    valid[0, 9:16] = False  # a chunk with one valid token
    p["valid"] = valid
    g = _grad_outputs(p)
    clean = _grads(backend, p, g)
    bad = (~valid)[:, None, :, None].expand_as(p["k"])
    dirty = _grads(backend, dict(p, k=p["k"].masked_fill(bad, float("nan")),
                                 v=p["v"].masked_fill(bad, float("inf"))), g)
    _check(clean, p, g)
    for name in DIFF:
        assert torch.equal(clean[name], dirty[name]), name
    for name in ("k", "v"):
        assert torch.all(clean[name].masked_select(bad) == 0), name
    assert torch.all(clean["omega"][1] == 0) and torch.all(clean["omega"][0, :, 0] == 0)


def test_strided_inputs_and_gradients(backend):
    """Views of k, v, omega, key_weight, valid with any strides, and gradient outputs that are
    expanded views (loss = sum of the outputs)."""
    B, H, N, D, C = 2, 3, 37, 10, 6
    Nc = -(-N // C)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(B, N, H, D + 2, generator=g)[..., 1:D + 1].transpose(1, 2).to(DEVICE)
    v = torch.randn(H, B, N, D, generator=g).transpose(0, 1).to(DEVICE)
    omega = torch.randn(B, Nc, H, D, generator=g).transpose(1, 2).to(DEVICE)
    key_weight = torch.randn(2 * H, D, generator=g)[::2].to(DEVICE)
    valid = (torch.rand(B, 3 * N, generator=g) > 0.3)[:, ::3].to(DEVICE)
    p = dict(k=k, v=v, chunk_size=C, omega=omega, key_weight=key_weight, valid=valid)
    assert not k.is_contiguous() and not v.is_contiguous() and not omega.is_contiguous()
    grads = _grads(backend, p, _grad_outputs(p))
    _check(grads, p, _grad_outputs(p))
    ones = (torch.ones(B, H, Nc, D, device=DEVICE), torch.ones(B, H, Nc, D, device=DEVICE), None)
    leaves = _leaves(p)
    k_sum, v_sum = flashswitch.chunk_summaries(**{**p, **leaves}, backend=backend)
    (k_sum.sum() + v_sum.sum()).backward()  # gradient outputs with stride 0 everywhere
    _check({n: t.grad for n, t in leaves.items()}, p, ones)


@pytest.mark.parametrize("omega", ["head", "chunk"])
def test_deterministic(backend, omega):
    """Two backward calls give bitwise-equal gradients (no atomics; partials summed in a fixed order)."""
    shape = (2, 4, 4096 + 7, 64, 16) if GPU else (2, 2, 70, 8, 4)
    p = random_problem(*shape, device=DEVICE, omega=omega, key_weight=True, valid=True)
    g = _grad_outputs(p)
    first, second = _grads(backend, p, g), _grads(backend, p, g)
    for name in DIFF:
        assert torch.equal(first[name], second[name]), name


def test_empty_problems(backend):
    """N = 0 and D = 0: gradients of the right shapes, all zero."""
    for N, D in ((0, 4), (13, 0)):
        p = random_problem(2, 2, N, D, 4, device=DEVICE, omega="head", key_weight=True, valid=True)
        grads = _grads(backend, p, _grad_outputs(p))
        for name, t in grads.items():
            assert t.shape == p[name].shape and torch.all(t == 0), name


def test_explicit_configs(backend):
    """Every backward tuning candidate computes the same gradients (run_backward with that config)."""
    for shape in (dict(B=1, H=2, N=45, D=76, C=5), dict(B=1, H=1, N=150, D=16, C=100)):
        p = random_problem(device=DEVICE, omega="head", key_weight=True, valid=True, **shape)
        feats = op._features(op.OP_BWD, p["k"], p["chunk_size"])
        configs = space.config_space(op.OP_BWD, "triton", feats)
        assert configs and space.default_config(op.OP_BWD, "triton", feats) in configs
        if not GPU:  # the interpreter ignores warps and stages
            configs = list({(c["BLOCK_CHUNKS"], c.get("BLOCK_J")): c for c in configs}.values())
        g = _grad_outputs(p)
        for config in configs:
            got = op.run_backward(backend, config, g, **p)
            try:
                _check(dict(zip(DIFF, got)), p, g)
            except AssertionError as err:
                raise AssertionError(f"config {config}: {err}") from err


def test_run_backward(backend):
    """run_backward: GRAD_INPUTS order, None for absent inputs, equal to autograd through the op; the
    reference backend gives the reference's gradients."""
    p = random_problem(1, 2, 20, 8, 4, device=DEVICE, omega="chunk", valid=True)
    g = _grad_outputs(p)
    got = op.run_backward(backend, None, g, **p)
    assert len(got) == len(DIFF) and got[DIFF.index("key_weight")] is None
    auto = _grads(backend, p, g)
    for name, t in zip(DIFF, got):
        if name in auto:
            assert torch.equal(t, auto[name]), name
    ref = op.run_backward("reference", None, g, **p)
    _check({n: t for n, t in zip(DIFF, ref) if t is not None}, p, g)


@needs_triton
def test_config_from_another_shape():
    """A config tuned for a neighbouring bucket must still run: tiles shrink to fit; bad ones raise."""
    p = random_problem(1, 2, 130, 76, 65, device=DEVICE, omega="head", key_weight=True, valid=True)
    g = _grad_outputs(p)
    for config in ({"BLOCK_CHUNKS": 32, "num_warps": 1}, {"BLOCK_CHUNKS": 2, "BLOCK_J": 128, "num_warps": 2},
                   {"BLOCK_CHUNKS": 1, "BLOCK_J": 4, "num_warps": 2, "num_stages": 3}):
        _check(dict(zip(DIFF, op.run_backward("triton", config, g, **p))), p, g)
    with pytest.raises(ValueError, match="BLOCK_CHUNKS"):
        op.run_backward("triton", {"BLOCK_CHUNKS": 3, "num_warps": 1}, g, **p)
    with pytest.raises(ValueError, match="num_warps"):
        op.run_backward("triton", {"BLOCK_CHUNKS": 2}, g, **p)


@needs_triton
def test_64bit_offsets_path(monkeypatch):
    from flashswitch.kernels_triton import chunk_summaries_bwd as kernel
    monkeypatch.setattr(kernel, "FORCE_OFFS_64", True)
    for C, omega in ((5, "head"), (70, "chunk")):
        p = random_problem(2, 2, 150, 12, C, device=DEVICE, omega=omega, key_weight=True, valid=True,
                           layout="strided")
        g = _grad_outputs(p)
        _check(_grads("triton", p, g), p, g)


def test_reference_gradcheck():
    """The torch reference's gradients (the oracle above) against finite differences in fp64."""
    for omega, key_weight, valid in (("head", True, True), ("chunk", False, True), ("none", True, False)):
        p = random_problem(1, 2, 11, 3, 4, dtype=torch.float64, omega=omega, key_weight=key_weight, valid=valid)
        names = [n for n in DIFF if n in p]

        def f(*xs):
            out = torch_chunk_summaries(**{**p, **dict(zip(names, xs))}, return_lse=True)
            return out[0], out[1], torch.where(torch.isfinite(out[2]), out[2], 0.0)

        assert torch.autograd.gradcheck(f, [p[n].clone().requires_grad_(True) for n in names])


def test_opcheck(backend):
    """Both custom ops: schema, fake implementations, autograd registration and AOT dispatch (inputs
    that require grad run the backward op through the AOT tests)."""
    p = random_problem(1, 2, 10, 8, 4, device=DEVICE, omega="head", key_weight=True, valid=True)
    leaves = _leaves(p)
    args = (leaves["k"], leaves["v"], 4, leaves["omega"], leaves["key_weight"], p["valid"], 0.3, backend)
    torch.library.opcheck(torch.ops.flashswitch.chunk_summaries.default, args)
    omega4 = torch.randn(1, 2, 3, 8, device=DEVICE, requires_grad=True)
    args = (leaves["k"], leaves["v"], 4, omega4, None, None, 0.3, backend)
    torch.library.opcheck(torch.ops.flashswitch.chunk_summaries.default, args)
    gk, gv, glse = _grad_outputs(p)
    for omega, kw, dlse in ((p["omega"], p["key_weight"], glse), (None, None, None)):
        args = (gk, gv, dlse, p["k"], p["v"], 4, omega, kw, p["valid"], 0.3, backend)
        torch.library.opcheck(torch.ops.flashswitch.chunk_summaries_backward.default, args)


def test_torch_compile_gradients(backend):
    """torch.compile(fullgraph=True) of the forward and loss: AOTAutograd traces the backward op into
    the compiled backward graph; its gradients equal the eager ones."""
    p = random_problem(1, 2, 10, 8, 4, device=DEVICE, omega="head", key_weight=True, valid=True)
    g = _grad_outputs(p)

    def f(k, v, omega, key_weight, valid):
        k_sum, v_sum, lse = flashswitch.chunk_summaries(k, v, 4, omega=omega, key_weight=key_weight, valid=valid,
                                                        return_lse=True, backend=backend)
        return (k_sum * g[0]).sum() + (v_sum * g[1]).sum() + (torch.where(torch.isfinite(lse), lse, 0) * g[2]).sum()

    def grads(fn):
        leaves = _leaves(p)
        fn(leaves["k"], leaves["v"], leaves["omega"], leaves["key_weight"], p["valid"]).backward()
        return {n: t.grad for n, t in leaves.items()}

    torch._dynamo.reset()
    try:
        compiled = grads(torch.compile(f, fullgraph=True, backend="inductor" if GPU else "aot_eager"))
    finally:
        torch._dynamo.reset()
    eager = grads(f)
    for name in DIFF:
        torch.testing.assert_close(compiled[name], eager[name], rtol=REL_TOL[torch.float32], atol=1e-6, msg=name)


def test_reference_backend_is_differentiable():
    p = random_problem(1, 2, 21, 6, 4, device=DEVICE, omega="chunk", key_weight=True, valid=True)
    g = _grad_outputs(p)
    _check(_grads("reference", p, g), p, g)


# ---------------------------------------------------------------- GPU-only
@pytest.mark.gpu
@pytest.mark.parametrize("D,C", [(128, 16), (64, 16), (128, 64), (256, 100), (76, 16)])
def test_large(backend, D, C):
    """fp32/fp16/bf16 at sizes the CPU cannot run; the oracle is the torch reference in fp64."""
    for dtype in dtypes_here():
        p = random_problem(2, 4, 4096 + 3, D, C, dtype=dtype, device=DEVICE, omega="chunk", key_weight=True,
                           valid=True, layout="strided")
        g = _grad_outputs(p)
        _check(_grads(backend, p, g), p, g)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_head_omega(backend, dtype):
    """d omega [Hkv, D] summed over many chunks from fp32 partials, in a 16-bit dtype."""
    p = random_problem(2, 4, 8192, 128, 16, dtype=dtype, device=DEVICE, omega="head", key_weight=True)
    g = _grad_outputs(p)
    _check(_grads(backend, p, g), p, g)


@pytest.mark.gpu
def test_cuda_graph_fwd_bwd(backend):
    """A whole forward + backward step captured in a CUDA graph and replayed on new inputs."""
    p = random_problem(2, 4, 1000, 64, 16, dtype=torch.bfloat16, device=DEVICE, omega="head", key_weight=True,
                       valid=True)
    g = _grad_outputs(p)
    leaves = _leaves(p)

    def step():
        k_sum, v_sum, lse = flashswitch.chunk_summaries(**{**p, **leaves}, return_lse=True, backend=backend)
        loss = ((k_sum * g[0]).float().sum() + (v_sum * g[1]).float().sum()
                + (torch.where(torch.isfinite(lse), lse, 0) * g[2]).sum())
        return torch.autograd.grad(loss, list(leaves.values()))

    graph, static = cuda_graph_capture(step)
    new = random_problem(2, 4, 1000, 64, 16, dtype=torch.bfloat16, device=DEVICE, omega="head", key_weight=True,
                         seed=9)
    with torch.no_grad():
        for name, leaf in leaves.items():
            leaf.copy_(new[name])
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, s, e in zip(leaves, static, eager):
        assert torch.equal(s, e), name
