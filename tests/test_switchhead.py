"""SwitchHead attention, sigma-MoE and the decoder LMs against plain PyTorch versions of the same math.

The plain versions gather each (token, slot)'s expert weights densely (`weight[expert_idx]`, einsum),
write attention as an explicit masked softmax and RoPE as a complex rotation, and run in fp64 (the
oracle) and fp32 (the baseline of the SPEC tolerance rule). Routing is recomputed from the same fp32
router logits (a tied top-k takes the lower expert ids on both sides), gates from
the plain logits. Every backend that can run here is checked forward; backward on the backends whose
expert_matmul has a gradient (`grad_backends`: the reference everywhere, kernels once their backward
exists). Kernel outputs start as NaN (conftest), so an unwritten row fails.
"""
import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import given, strategies as st

from conftest import DEVICE, kernel_backends
from flashswitch.nn import SigmaMoE, SwitchHeadAttention
from flashswitch.nn import models
from flashswitch.nn._routing import sigmoid_top_k
from flashswitch.nn.sigma_moe import router_entropy_loss
from flashswitch.nn.switchhead import apply_rotary, attention_macs_per_token
from flashswitch.ops.expert_matmul import expert_matmul, route
from flashswitch.reference.chunk_summaries import torch_chunk_summaries
from flashswitch.reference.eva_attention import torch_eva_attention
from flashswitch.testing import assert_close, conditioning_tol

F64 = torch.float64
EVA = dict(eva_chunk_size=2, eva_window_size=4)


def forward_backends():
    return ["reference"] + kernel_backends()


@functools.lru_cache(maxsize=None)
def grad_backends():
    """Backends whose expert_matmul differentiates (one tiny backward each). Only the missing-autograd
    error drops a backend; any other failure surfaces in the tests."""
    found = []
    for backend in forward_backends():
        x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
        w = torch.randn(2, 4, 5, device=DEVICE, requires_grad=True)
        y = expert_matmul(x, route(torch.tensor([[0, 1]] * 3, device=DEVICE), 2), w, backend=backend)
        try:
            y.sum().backward()
        except RuntimeError as e:
            if "autograd" in str(e):
                continue
            raise
        found.append(backend)
    return tuple(found)


# ---------------------------------------------------------------- plain versions of the math
def _top_k(logits32, k):
    """The k largest scores, ties to the lower expert id (the layers' rule for few experts)."""
    return torch.sigmoid(logits32).sort(dim=-1, descending=True, stable=True).indices[..., :k]


def plain_rope(t, n_rot, base=10000.0):
    """RoPE as a complex rotation of (t[i], t[i + n_rot/2]) pairs by angle pos * base^(-2i/n_rot)."""
    if n_rot == 0:
        return t
    half, N = n_rot // 2, t.shape[-2]
    theta = torch.arange(N, dtype=F64, device=t.device)[:, None] * base ** (
        -2 * torch.arange(half, dtype=F64, device=t.device) / n_rot)
    z = torch.complex(t[..., :half].to(F64), t[..., half:n_rot].to(F64)) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real.to(t.dtype), z.imag.to(t.dtype), t[..., n_rot:]], -1)


def plain_causal(q, k, v):
    N, D = q.shape[-2], q.shape[-1]
    logits = (q @ k.transpose(-1, -2)) * D ** -0.5
    mask = torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), -1) @ v


def _router_logits(layer, x2, sel_dtype):
    """The router logits the layer chooses from (fp32 math, or the autocast dtype's)."""
    return F.linear(x2.to(sel_dtype), layer.router.to(sel_dtype)).float()


def plain_switchhead(layer, P, x, sel_dtype=torch.float32):
    """SwitchHead in P's dtype: P holds the layer's parameters by name; x [B, N, d]."""
    B, N, d = x.shape
    T, H, E, k, D = B * N, layer.num_heads, layer.num_experts, layer.experts_per_head, layer.head_dim
    x2 = x.reshape(T, d)
    with torch.no_grad():
        idx = _top_k(_router_logits(layer, x2, sel_dtype).view(T, 2, H, E), k)  # [T, 2, H, k]
    gates = torch.sigmoid((x2 @ P["router"].T).view(T, 2, H, E)).gather(-1, idx)
    gid = idx + torch.arange(H, device=x.device)[:, None] * E
    v = torch.einsum("td,thkde,thk->the", x2, P["v_experts"][gid[:, 0]], gates[:, 0])
    q, kk = (x2 @ P["qk"].T).view(B, N, 2, H, D).permute(2, 0, 3, 1, 4)
    q, kk = plain_rope(q, layer.n_rot), plain_rope(kk, layer.n_rot)
    v = v.view(B, N, H, D).transpose(1, 2)
    if layer.attention == "sdpa":
        a = plain_causal(q, kk, v)
    else:
        C, W = layer.eva_chunk_size, layer.eva_window_size
        k_sum, v_sum = torch_chunk_summaries(kk, v, C)
        a = torch_eva_attention(q, kk, v, k_sum, v_sum, chunk_size=C, window_size=W, window=layer.eva_window)
    a = a.transpose(1, 2).reshape(T, H, D)
    y = torch.einsum("the,thkef,thk->tf", a, P["o_experts"][gid[:, 1]], gates[:, 1])
    return y.view(B, N, d)


def plain_sigma_moe(layer, P, x, sel_dtype=torch.float32):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    with torch.no_grad():
        idx = _top_k(_router_logits(layer, x2, sel_dtype), layer.experts_per_token)  # [T, k]
    gates = torch.sigmoid(x2 @ P["router"].T).gather(-1, idx)
    h = torch.relu(torch.einsum("td,tkdg->tkg", x2, P["up"][idx]))
    return torch.einsum("tkg,tkgf,tk->tf", h, P["down"][idx], gates).view(x.shape)


# ---------------------------------------------------------------- comparison
def _run_plain(plain, layer, x, dy, dtype, params=None):
    """The plain version in `dtype` on the layer's parameters (or `params`, by name): y and the gradients of
    x and every parameter for the cotangent dy."""
    params = dict(layer.named_parameters()) if params is None else params
    P = {n: p.detach().to(dtype).requires_grad_() for n, p in params.items()}
    xp = x.detach().to(dtype).requires_grad_()
    y = plain(layer, P, xp)
    (y * dy.to(dtype)).sum().backward()
    return y.detach(), {"x": xp.grad, **{n: p.grad for n, p in P.items()}}


def _conditioning_tols(plain, layer, x, dy):
    """Per output, the tolerance its conditioning calls for (testing.conditioning_tol over the parameters
    and dy; x stays, so the routing does)."""
    def fp64(inputs):
        inputs = dict(inputs)
        y, grads = _run_plain(plain, layer, x, inputs.pop("dy"), F64, inputs)
        return {"y": y, **{f"d{n}": g for n, g in grads.items()}}
    inputs = {n: p.detach() for n, p in layer.named_parameters()} | {"dy": dy}
    return conditioning_tol(fp64, inputs, torch.float32)


def check_against_plain(layer, plain, x, *, backward: bool, causal_qk: bool = False):
    """The layer (fp32) within the SPEC rule of the fp64 plain version, with the fp32 plain version as
    baseline, widened where an output's terms cancel (`_conditioning_tols`): its output and, with
    `backward`, the gradients of x and every parameter. `causal_qk`: causal attention's first row sees one
    key, so its part of the q/k projection's gradient is exactly zero and a kernel's answer there is the
    rounding of its softmax backward (with N = 1, all of it; on a GPU, SDPA's fp32 backward at N = 2 was
    1.2e-5 off), which no perturbation of the inputs shows (the zero is exact for all of them). dqk's
    errors are measured against a quarter of the value projection's gradient where dqk is smaller, the size
    it has when nothing cancels (as the op tests' rows seeing one key): the baseline rule then allows the
    rounding floor of that size, not the relative bound of it."""
    x = x.detach().requires_grad_(backward)
    y = layer(x)
    dy = torch.randn_like(y)
    ref, ref_grads = _run_plain(plain, layer, x, dy, F64)
    base, base_grads = _run_plain(plain, layer, x, dy, torch.float32)
    tols = _conditioning_tols(plain, layer, x, dy)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close("y", y, ref, torch.float32, baseline=base, tol=tols["y"])
    if not backward:
        return
    layer.zero_grad(set_to_none=True)
    (y * dy).sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    floors = {"qk": 0.25 * ref_grads["v_experts"].norm().item()} if causal_qk else {}
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        assert_close(f"d{name}", g, ref_grads[name], torch.float32, baseline=base_grads[name],
                     floor=floors.get(name, 0.0), tol=tols[f"d{name}"])
    return grads


@st.composite
def switchhead_cases(draw):
    E = draw(st.integers(1, 4))
    return dict(B=draw(st.integers(1, 2)), N=draw(st.integers(1, 9)), d=draw(st.sampled_from([8, 12])),
                H=draw(st.integers(1, 3)), D=draw(st.sampled_from([4, 6, 8])), E=E, k=draw(st.integers(1, E)),
                attention=draw(st.sampled_from(["sdpa", "eva"])), rope=draw(st.sampled_from([0.0, 0.5, 1.0])),
                seed=draw(st.integers(0, 999)))


def _switchhead(c, backend):
    torch.manual_seed(c["seed"])
    layer = SwitchHeadAttention(c["d"], c["H"], c["D"], c["E"], c["k"], attention=c["attention"],
                                rope_fraction=c["rope"], backend=backend, device=DEVICE, **EVA).eval()
    return layer, torch.randn(c["B"], c["N"], c["d"], device=DEVICE)


@pytest.mark.parametrize("backend", forward_backends())
@given(case=switchhead_cases())
def test_switchhead_matches_plain(backend, case):
    layer, x = _switchhead(case, backend)
    check_against_plain(layer, plain_switchhead, x, backward=backend in grad_backends(),
                        causal_qk=True)


@st.composite
def sigma_moe_cases(draw):
    E = draw(st.integers(1, 8))
    return dict(shape=draw(st.sampled_from([(1, 8), (13, 8), (2, 5, 12)])), E=E, G=draw(st.sampled_from([3, 8])),
                k=draw(st.integers(1, min(E, 4))), seed=draw(st.integers(0, 999)))


@pytest.mark.parametrize("backend", forward_backends())
@given(case=sigma_moe_cases())
def test_sigma_moe_matches_plain(backend, case):
    torch.manual_seed(case["seed"])
    d = case["shape"][-1]
    layer = SigmaMoE(d, case["E"], case["G"], case["k"], backend=backend, device=DEVICE).eval()
    check_against_plain(layer, plain_sigma_moe, torch.randn(*case["shape"], device=DEVICE),
                        backward=backend in grad_backends())


# ---------------------------------------------------------------- ties, empty experts
@pytest.mark.parametrize("backend", forward_backends())
def test_switchhead_ties_and_empty_experts(backend):
    """A zero router ties every score: all tokens take the same k experts of each head (the rest stay
    empty, and their weights get exactly zero gradient), each with gate 1/2."""
    torch.manual_seed(0)
    layer = SwitchHeadAttention(8, 2, 6, 4, 2, backend=backend, device=DEVICE).eval()
    with torch.no_grad():
        layer.router.zero_()
    x = torch.randn(2, 5, 8, device=DEVICE)
    ids, gates = layer.select(x.reshape(-1, 8))
    assert torch.all(gates == 0.5)
    assert torch.all(ids == ids[:, :1])  # one choice for all tokens
    grads = check_against_plain(layer, plain_switchhead, x, backward=backend in grad_backends())
    if grads is not None:
        used = torch.zeros(8, dtype=torch.bool, device=DEVICE)
        used[ids[0, 0]] = True
        assert torch.all(grads["v_experts"][~used] == 0) and grads["v_experts"][used].abs().sum() > 0
        used = torch.zeros(8, dtype=torch.bool, device=DEVICE)
        used[ids[1, 0]] = True
        assert torch.all(grads["o_experts"][~used] == 0) and grads["o_experts"][used].abs().sum() > 0


@pytest.mark.parametrize("backend", forward_backends())
def test_sigma_moe_ties_and_empty_experts(backend):
    torch.manual_seed(1)
    layer = SigmaMoE(8, 6, 4, 3, backend=backend, device=DEVICE).eval()
    with torch.no_grad():
        layer.router.zero_()
    grads = check_against_plain(layer, plain_sigma_moe, torch.randn(7, 8, device=DEVICE),
                                backward=backend in grad_backends())
    if grads is not None:
        empty = grads["up"].flatten(1).abs().sum(1) == 0
        assert int(empty.sum()) == 3 and torch.all(grads["down"][empty] == 0)


@pytest.mark.parametrize("shape", [(0, 5, 8), (2, 0, 8)])
def test_empty_inputs(shape):
    """No tokens: empty outputs and zero gradients, every attention path."""
    for layer in (SwitchHeadAttention(8, 2, 4, 3, 2, **EVA), SwitchHeadAttention(8, 2, 4, 3, 2, attention="eva", **EVA),
                  SigmaMoE(8, 4, 3, 2)):
        x = torch.randn(*shape, requires_grad=True)
        y = layer(x)
        assert y.shape == shape
        y.sum().backward()
        assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


# ---------------------------------------------------------------- router, rotary, MACs
def test_sigmoid_top_k_picks_largest_and_drops_experts():
    torch.manual_seed(0)
    logits = torch.randn(50, 3, 7)
    idx, gates = sigmoid_top_k(logits, 3)
    top = torch.sigmoid(logits).sort(-1, descending=True).values[..., :3]
    assert torch.equal(gates.sort(-1, descending=True).values, top)
    assert torch.equal(torch.sigmoid(logits).gather(-1, idx), gates)
    # expert dropout: only in training; a dropped expert is chosen only when fewer than k survive, gate 0
    idx_eval, _ = sigmoid_top_k(logits, 3, expert_dropout=0.99, training=False)
    assert torch.equal(idx_eval, idx)
    _, gates_drop = sigmoid_top_k(logits, 3, expert_dropout=0.99, training=True)
    assert (gates_drop == 0).float().mean() > 0.5


def test_rotary_matches_complex_rotation_and_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 10, 12, dtype=F64), torch.randn(2, 3, 10, 12, dtype=F64)
    for n_rot in (0, 6, 12):
        rq, rk = apply_rotary(q, k, n_rot)
        assert torch.allclose(rq, plain_rope(q, n_rot)) and torch.allclose(rk, plain_rope(k, n_rot))
        assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1))
    # the logit of (i, j) depends on i - j only: same vectors at every position
    same = torch.randn(1, 1, 1, 12, dtype=F64).expand(1, 1, 10, 12)
    rq, rk = apply_rotary(same, same, 12)
    logits = (rq @ rk.transpose(-1, -2))[0, 0]
    assert torch.allclose(logits.diagonal(2), logits[2, 0].expand(8))


def test_macs_per_token():
    """All experts used (k = E) costs what the dense layers cost, plus the routers; EVA with a window
    covering the sequence counts exact attention's pairs plus its summaries."""
    d, H, D, N = 16, 3, 8, 40
    sh = SwitchHeadAttention(d, H, D, 1, 1)
    dense = models.DenseAttention(d, H, D)
    assert sh.macs_per_token(N) == dense.macs_per_token(N) + 2 * H * d
    assert dense.macs_per_token(N) == 4 * d * H * D + H * D * (N + 1)
    moe = SigmaMoE(d, 4, 5, 4)
    assert moe.macs_per_token() == models.DenseMLP(d, 20).macs_per_token() + 4 * d
    eva = attention_macs_per_token(H, D, N, attention="eva", eva_chunk_size=4, eva_window_size=40)
    assert eva == attention_macs_per_token(H, D, N) + 3 * H * D
    m = models.build_model("47M", "switchall", device="meta")
    assert m.macs_per_token(256) == sum(b.macs_per_token(256) for b in m.blocks) + 8000 * 412
    macs = models.paper_macs("262M", 512)
    assert macs["dense"] > macs["switchhead"] > macs["switchall"]


def test_expert_dropout_only_in_training():
    """Training with expert_dropout 0 is eval; with dropout the output changes but stays finite."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    for layer in (SwitchHeadAttention(8, 2, 4, 4, 2, expert_dropout=0.5), SigmaMoE(8, 6, 4, 2, expert_dropout=0.5)):
        y_eval = layer.eval()(x)
        layer.expert_dropout = 0.0
        torch.testing.assert_close(layer.train()(x), y_eval, rtol=0, atol=0)
        layer.expert_dropout = 0.5
        y_drop = layer.train()(x)
        assert torch.isfinite(y_drop).all() and not torch.equal(y_drop, y_eval)


def test_paper_configs():
    for size, d, layers in (("47M", 412, 16), ("262M", 1024, 18)):
        cfgs = {v: models.paper_config(size, v) for v in models.VARIANTS}
        assert {(c.d_model, c.n_layers, c.vocab_size) for c in cfgs.values()} == {(d, layers, 8000)}
        assert cfgs["dense"].att_experts == 0 and cfgs["switchhead"].moe_experts == 0
        assert cfgs["switchall"].att_experts and cfgs["switchall"].moe_experts
        params = {v: models.DecoderLM(c, device="meta").num_parameters() for v, c in cfgs.items()}
        assert max(params.values()) / min(params.values()) < 1.06  # parameter-matched variants
    sh = models.paper_config("262M", "switchhead")
    assert (sh.n_heads, sh.att_experts, sh.att_k, sh.head_dim) == (4, 4, 2, 112)
    sh = models.paper_config("47M", "switchhead")
    assert (sh.n_heads, sh.att_experts, sh.att_k, sh.head_dim) == (2, 5, 3, 76)


# ---------------------------------------------------------------- compile, models
@pytest.mark.parametrize("backend", forward_backends())
def test_compiled_matches_eager(backend):
    """torch.compile(fullgraph=True) of both layers, routing included (route(check=False) inside the
    step), gives eager's output and, where expert_matmul differentiates, the gradients of the input and
    of every parameter: no graph break, so no host sync or data-dependent Python in the step (the
    reference's per-expert split runs inside one custom op)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    backward = backend in grad_backends()
    for layer in (SwitchHeadAttention(8, 2, 6, 3, 2, backend=backend, device=DEVICE).eval(),
                  SigmaMoE(8, 5, 4, 2, backend=backend, device=DEVICE).eval()):
        x = torch.randn(2, 5, 8, device=DEVICE, requires_grad=backward)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        with torch.set_grad_enabled(backward):  # AOTAutograd traces a backward for grad-requiring params
            y, yc = layer(x), compiled(x)
        torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-6)
        if backward:
            wrt = [x, *layer.parameters()]
            for a, b in zip(torch.autograd.grad(yc.sum(), wrt), torch.autograd.grad(y.sum(), wrt)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


TINY = dict(d_model=24, n_layers=2, vocab_size=40, n_heads=2, head_dim=12, d_ff=32, moe_experts=6, moe_expert_dim=8,
            context=8)


@pytest.mark.parametrize("variant, attention", [(v, "sdpa") for v in models.VARIANTS] + [("switchall", "eva")])
def test_model_training_step(variant, attention):
    """forward + loss + backward + AdamW step for each variant: finite loss, a gradient for every
    parameter, every parameter that got a nonzero gradient moves, the loss goes down."""
    backend = grad_backends()[-1]
    torch.manual_seed(0)
    overrides = {k: v for k, v in TINY.items() if variant == "switchall" or not k.startswith("moe")}
    if variant == "dense":
        overrides["n_heads"] = 3
    m = models.build_model("47M", variant, backend=backend, device=DEVICE, dropout=0.0, attention=attention,
                           eva_chunk_size=2, eva_window_size=4, **overrides)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    tokens = torch.randint(0, 40, (2, 9), device=DEVICE)
    losses = []
    for _ in range(2):
        loss = m.loss(tokens)
        assert torch.isfinite(loss) and loss.shape == ()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        for n, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        opt.step()
        for n, p in m.named_parameters():
            if p.grad.abs().sum() > 0:
                assert not torch.equal(before[n], p.detach()), n
        losses.append(float(loss.detach()))
    assert losses[1] < losses[0]
    assert m(tokens).shape == (2, 9, 40)


def test_sigma_moe_entropy_regulariser():
    torch.manual_seed(0)
    layer = SigmaMoE(8, 4, 3, 2, entropy_reg=0.5)
    x = torch.randn(6, 8)
    _, aux = layer(x, return_aux_loss=True)
    logits = x @ layer.router.T
    p = torch.softmax(logits, -1).mean(0)
    assert torch.allclose(aux, 0.5 * (p * p.log()).sum())
    assert torch.allclose(router_entropy_loss(torch.zeros(5, 4)), torch.tensor(-math.log(4)))
    _, aux_eval = layer.eval()(x, return_aux_loss=True)
    assert aux_eval == 0


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("make, name", [
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 3), "experts_per_head"),
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 1, attention="flash"), "attention"),
    (lambda: SwitchHeadAttention(8, 0, 4, 2, 1), "num_heads"),
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 1, attention="eva", eva_chunk_size=3, eva_window_size=4),
     "eva_window_size"),
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 1, expert_dropout=1.0), "expert_dropout"),
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 1, eva_window="global"), "eva_window"),
    (lambda: SwitchHeadAttention(8, 2, 4, 2, 1)(torch.randn(3, 8)), "x"),
    (lambda: SigmaMoE(8, 4, 3, 5), "experts_per_token"),
    (lambda: SigmaMoE(8, 4, 3, 2)(torch.randn(3, 7)), "x"),
    (lambda: SigmaMoE(8, 4, 3, 2, entropy_reg=-1.0), "entropy_reg"),
    (lambda: models.paper_config("1B", "dense"), "size"),
    (lambda: models.paper_config("47M", "moe"), "variant"),
    (lambda: models.build_model("47M", "dense", device="meta", d_model=0), "d_model"),
    (lambda: models.build_model("47M", "dense", device="meta", n_layer=2), "n_layer"),
])
def test_bad_arguments_name_the_argument(make, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make()


# ---------------------------------------------------------------- GPU: half precision, CUDA graphs
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "eva"])
def test_half_precision_layers_on_gpu(dtype, attention):
    """bf16/fp16 layers (fp32 master weights, autocast) within the dtype's bound of the fp64 plain version."""
    torch.manual_seed(0)
    layer = SwitchHeadAttention(64, 2, 76, 5, 3, attention=attention, eva_chunk_size=16, eva_window_size=64,
                                device="cuda").eval()
    moe = SigmaMoE(64, 16, 32, 4, device="cuda").eval()
    x = torch.randn(2, 200, 64, device="cuda")
    for mod, plain in ((layer, plain_switchhead), (moe, plain_sigma_moe)):
        # sdpa: the padded head dim (76 -> 80) must take SDPA's flash kernel (an error otherwise)
        flash = attention == "sdpa" and mod is layer
        with torch.autocast("cuda", dtype=dtype), (
                sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext()):
            y = mod(x)
        assert y.dtype == dtype
        with torch.no_grad():
            ref, base = (plain(mod, {n: p.detach().to(t) for n, p in mod.named_parameters()}, x.to(dtype).to(t),
                               sel_dtype=dtype) for t in (F64, dtype))
        assert_close("y", y, ref, dtype, baseline=base)


@pytest.mark.gpu
def test_cuda_graph_capture_of_layers():
    """Forward (and backward where the kernels differentiate) captured in one CUDA graph and replayed
    on new inputs equals eager: no host sync anywhere in the step."""
    torch.manual_seed(0)
    backend = next((b for b in grad_backends() if b != "reference"), kernel_backends()[0])
    backward = backend in grad_backends()
    layer = SwitchHeadAttention(64, 4, 112, 4, 2, backend=backend, device="cuda").eval()
    moe = SigmaMoE(64, 16, 32, 4, backend=backend, device="cuda").eval()
    static_x = torch.randn(2, 128, 64, device="cuda", requires_grad=backward)

    def step():
        y = moe(layer(static_x))
        if backward:
            return (y, *torch.autograd.grad(y.square().sum(), [static_x, layer.router, moe.up]))
        return (y,)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()  # warm-up: JIT compiles and autotune lookups outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = step()
    new_x = torch.randn_like(static_x)
    with torch.no_grad():
        static_x.copy_(new_x)
    g.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(static_out, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", models.VARIANTS)
def test_model_bf16_autocast_step_on_gpu(variant):
    """A small model of each variant under bf16 autocast on the kernels: a training step where the
    kernels differentiate (finite loss that goes down), else a finite forward."""
    backend = next((b for b in grad_backends() if b != "reference"), kernel_backends()[0])
    torch.manual_seed(0)
    m = models.build_model("47M", variant, backend=backend, device="cuda", n_layers=2, vocab_size=512, dropout=0.0)
    tokens = torch.randint(0, 512, (4, 129), device="cuda")
    if backend not in grad_backends():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.isfinite(m(tokens)).all()
        return
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m.loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
