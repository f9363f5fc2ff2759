"""The fused inference kernels around attention (kernels_triton/layer_ops.py) against the torch
versions the layers use with gradients: rotary embedding of q and k at per-sequence positions, the
residual add with the RMSNorm after it, SwiGLU's activation; and the one-GEMM q/k/v projection. On the
CPU the kernels run under the Triton interpreter in fp32; bf16 / fp16 on the GPU. Their outputs start
as NaN (FLASHSWITCH_POISON, set by conftest), so an element a kernel does not write fails."""
import pytest
import torch

from conftest import DEVICE, dtypes_here
from flashswitch.kernels_triton import layer_ops
from flashswitch.nn import _projections
from flashswitch.ops import layers
from flashswitch.nn.llama import RMSNorm, SdpaAttention, SwiGLU
from flashswitch.nn.rotary import Rotary, apply_rotary

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("B,H,Hkv,n,D,per_seq", [(2, 4, 2, 5, 16, True), (1, 9, 3, 1, 64, True),
                                                 (3, 2, 2, 7, 12, False), (2, 32, 8, 1, 128, True)])
def test_rotary_qk_matches_torch(dtype, B, H, Hkv, n, D, per_seq):
    """q, k as the layers make them (views of [B, n, heads, D] projections), positions per sequence
    (decode after ragged prompts) or shared (a prefill)."""
    g = torch.Generator().manual_seed(D + n)
    q = torch.randn(B, n, H, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, n, Hkv, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    rot = Rotary(D, 500000.0, device=DEVICE)
    steps = torch.arange(n, device=DEVICE)
    offsets = torch.tensor([3, 900, 40000][:B], device=DEVICE) if per_seq else None
    qo, ko = layer_ops.rotary_qk(q, k, rot.inv_freq, offsets)
    cos, sin = rot.cos_sin(steps if offsets is None else offsets[:, None] + steps)
    for got, x in ((qo, q), (ko, k)):
        want = apply_rotary(x, cos, sin)
        assert got.stride() == x.stride()
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("shape", [(2, 3, 576), (1, 1, 2048), (4, 5, 40), (0, 3, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], eps=1e-5, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(DEVICE, dtype))
    x = (3 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    r = torch.randn(*shape, generator=g).to(DEVICE, dtype) if with_residual else None
    s, y = layer_ops.add_rms_norm(x, r, norm.weight, norm.eps)
    with torch.enable_grad():
        want_s, want_y = norm.add(x.requires_grad_(), r)  # a gradient wanted: the torch version
    assert torch.equal(s, want_s.detach())  # the sum rounds once, like torch's add
    torch.testing.assert_close(y.float(), want_y.detach().float(), rtol=TOL[dtype], atol=TOL[dtype])
    if shape[0]:
        assert torch.equal(layer_ops.rms_norm(x, norm.weight, norm.eps), layer_ops.add_rms_norm(x, None, norm.weight,
                                                                                               norm.eps)[1])


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("shape", [(2, 3, 1536), (1, 1, 5000), (3, 40), (0, 16)])
def test_silu_mul_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    gate = (4 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    up = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    got = layer_ops.silu_mul(gate, up)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_projection_one_gemm_equals_three(monkeypatch, bias):
    """The stacked weight gives the three projections' outputs, and is rebuilt when a weight changes
    in place (an optimizer step) or is replaced."""
    monkeypatch.setattr(layers, "_on_kernels", lambda tensors: True)  # any device
    torch.manual_seed(0)
    attn = SdpaAttention(48, 6, num_kv_heads=2, head_dim=8, device=DEVICE)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        if bias:
            m.bias = torch.nn.Parameter(torch.randn(m.out_features, device=DEVICE))
    x = torch.randn(2, 5, 48, device=DEVICE)

    def three():
        with torch.enable_grad():
            return [t.detach() for t in _projections.qkv_projection(attn, x.requires_grad_())]

    with torch.no_grad():
        for step in range(3):
            got = _projections.qkv_projection(attn, x)
            assert "_qkv_fused" in attn.__dict__
            for a, b in zip(got, three()):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            if step == 0:
                attn.k_proj.weight.mul_(-2.0)  # in place: a new version
            else:
                attn.v_proj.weight = torch.nn.Parameter(torch.randn_like(attn.v_proj.weight))


@pytest.mark.parametrize("dtype", dtypes_here())
def test_swiglu_fused_equals_torch(monkeypatch, dtype):
    monkeypatch.setattr(layers, "_on_kernels", lambda tensors: True)
    torch.manual_seed(1)
    mlp = SwiGLU(32, 80, device=DEVICE, dtype=dtype)
    x = torch.randn(3, 4, 32, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        got = mlp(x)
    want = mlp(x.requires_grad_()).detach()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
def test_layers_take_the_fused_kernels_only_without_gradients(monkeypatch):
    """Under no_grad the model's RMSNorm and rotary run the fused kernels; with gradients the torch
    versions (the kernels have no backward)."""
    calls = []
    for name in ("add_rms_norm", "rotary_qk"):
        real = getattr(layer_ops, name)
        monkeypatch.setattr(layer_ops, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    norm = RMSNorm(64, device=DEVICE, dtype=torch.bfloat16)
    rot = Rotary(16, device=DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 3, 16, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm(x), rot.rotate_qk(q, q)
    assert calls == ["add_rms_norm", "rotary_qk"]
    calls.clear()
    norm(x.requires_grad_()), rot.rotate_qk(q.requires_grad_(), q)
    assert calls == []


@pytest.mark.parametrize("attention", ["sdpa", "eva"])
def test_model_inference_path_matches_the_torch_path(monkeypatch, attention):
    """A whole decoder's prefill and decode steps in inference (fused kernels, one q/k/v GEMM) against
    the same model with gradients on (the torch versions); bf16 on the GPU, fp32 on the CPU."""
    from flashswitch.nn.llama import LlamaConfig, LlamaLM
    monkeypatch.setattr(layers, "_on_kernels", lambda tensors: True)  # any device
    calls = []
    for name in ("add_rms_norm", "rotary_qk", "silu_mul"):
        real = getattr(layer_ops, name)
        monkeypatch.setattr(layer_ops, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256)
    kw = dict(chunk_size=8, window_size=16) if attention == "eva" else {}
    model = LlamaLM(cfg, attention=attention, device=DEVICE, dtype=dtype, **kw)
    tokens = torch.randint(0, 64, (2, 40), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    logits = {}
    for mode in ("fused", "torch"):
        calls.clear()
        with torch.set_grad_enabled(mode == "torch"):
            cache = model.new_cache(2, 64)
            out = [model(tokens[:, :30], cache)]
            out += [model(tokens[:, i:i + 1], cache) for i in range(30, 40)]
            logits[mode] = torch.cat(out, 1).detach().float()
        assert set(calls) == ({"add_rms_norm", "rotary_qk", "silu_mul"} if mode == "fused" else set())
    assert len(calls) == 0 and torch.isfinite(logits["fused"]).all()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(logits["fused"], logits["torch"], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("B,N,P,H,D,n_rot,sliced", [(2, 7, 2, 3, 16, 8, False), (1, 5, 2, 4, 112, 56, False),
                                                    (2, 6, 2, 2, 12, 12, True), (1, 3, 2, 1, 10, 4, True)])
def test_rotary_packed_forward_and_backward_match_torch(dtype, B, N, P, H, D, n_rot, sliced):
    """The packed projection rotated as the training layers do (q and k parts of one [B, N, P, H, D]
    tensor, or a slice of a q/k/v one), its gradient rotated back; against the torch version's
    forward and autograd."""
    from flashswitch.nn.switchhead import _inv_freq, rotary_tables, rotate
    g = torch.Generator().manual_seed(D + N)
    full = torch.randn(B, N, P + sliced, H, D, generator=g).to(DEVICE, dtype)
    t = full[:, :, :P] if sliced else full
    up = torch.randn(B, N, P, H, D, generator=g).to(DEVICE, dtype)
    got_t = t.detach().clone().requires_grad_() if not sliced else t.detach().requires_grad_()
    got = layer_ops.rotary_packed(got_t, _inv_freq(n_rot, 10000.0, t.device), n_rot)
    got.backward(up)
    want_t = t.detach().clone().requires_grad_()
    cos, sin = rotary_tables(N, n_rot, 10000.0, t.device, torch.float32)
    want = rotate(want_t, cos[:, None, None], sin[:, None, None], n_rot)
    want.backward(up)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.detach().float(), want.detach().float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(got_t.grad.float(), want_t.grad.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_switchhead_layer_with_the_rotary_kernel_equals_torch(monkeypatch):
    """The SwitchHead layer's output and every gradient, with the packed rotary kernel (any device
    here) and with the torch rotation."""
    from flashswitch.nn.switchhead import SwitchHeadAttention
    torch.manual_seed(0)
    layer = SwitchHeadAttention(32, 2, 12, 3, 2, backend="reference", device=DEVICE)
    x = torch.randn(2, 9, 32, device=DEVICE)
    runs = {}
    for mode in ("kernel", "torch"):
        if mode == "kernel":
            monkeypatch.setattr(layers, "packed_rotary", lambda t: True)
        else:
            monkeypatch.undo()
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        runs[mode] = [y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(runs["kernel"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,P,H,E,k", [(257, 1, 1, 4, 2), (64, 2, 3, 5, 3), (9, 1, 2, 1, 1), (130, 2, 4, 16, 4),
                                         (33, 1, 1, 32, 4), (7, 1, 1, 64, 64), (0, 2, 2, 4, 2)])
@pytest.mark.parametrize("offset", [False, True])
def test_top_k_gates_equals_a_stable_sort(T, P, H, E, k, offset):
    """The routers' top-k kernel picks what a stable descending sort picks, in the same order (scores on a
    coarse grid: many ties, lower column first; exact zeros as after expert dropout), lays them out as
    [P, T, H k] (ids h E + e with offset) with their scores as gates, and its backward puts each gate's
    gradient (an expanded one too) at its pick, as torch.gather's does."""
    g = torch.Generator().manual_seed(T + E)
    scores = (torch.randint(0, 5, (T, P, H, E), generator=g) / 4.0).to(DEVICE).requires_grad_()
    idx, gates = layer_ops.top_k_gates(scores, k, offset)
    want = scores.detach().sort(dim=-1, descending=True, stable=True).indices[..., :k]    # [T, P, H, k]
    want_gates = torch.gather(scores, -1, want)
    if offset:
        want = want + torch.arange(H, device=DEVICE)[:, None] * E
    assert idx.dtype == torch.int64 and idx.shape == (P, T, H * k)
    assert torch.equal(idx, want.permute(1, 0, 2, 3).reshape(P, T, H * k))
    assert torch.equal(gates, want_gates.detach().permute(1, 0, 2, 3).reshape(P, T, H * k))
    up = torch.randn(P, T, H * k, generator=g).to(DEVICE)
    for u in (up, torch.ones(()).to(DEVICE).expand(P, T, H * k)):
        got, = torch.autograd.grad(gates, scores, u, retain_graph=True)
        ref, = torch.autograd.grad(want_gates, scores, u.reshape(P, T, H, k).permute(1, 0, 2, 3), retain_graph=True)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("offset_layout", [False, True])
def test_routers_take_the_top_k_kernel(monkeypatch, offset_layout):
    """sigmoid_top_k's and head_top_k's choice and gates come from the kernel where it serves (CUDA, eager),
    from the sort otherwise: the same ids, gates and logits' gradient either way."""
    from flashswitch.nn._routing import head_top_k, sigmoid_top_k
    calls = []
    real = layer_ops.top_k_gates
    monkeypatch.setattr(layer_ops, "top_k_gates", lambda s, k, o=False: calls.append(k) or real(s, k, o))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2, 3, 8, generator=g).to(DEVICE).requires_grad_()
    route = (lambda x: head_top_k(x, 2)) if offset_layout else (lambda x: sigmoid_top_k(x, 2))
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(layers, "_on_kernels", lambda tensors, kernel=kernel: kernel)
        idx, gates = route(logits)
        up = torch.linspace(-1, 1, gates.numel(), device=DEVICE).view(gates.shape)
        runs.append((idx, gates.detach(), torch.autograd.grad(gates, logits, up)[0]))
    assert calls == [2]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert torch.count_nonzero(runs[0][2]).item() == 6 * 2 * 3 * 2


def test_launches_are_kept_per_metadata():
    """kernel_call.launch keeps one prepared launch per (kernel, device, dtypes, grid, arguments): a
    second call with new values and the same metadata reuses it and computes on its own inputs; another
    shape or dtype gets its own."""
    from flashswitch.kernels_triton import kernel_call
    kernel_call._LAUNCHES.clear()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, generator=g).to(DEVICE)
    norm = RMSNorm(40, 1e-5, device=DEVICE)
    norm.weight.data.copy_(w)
    outs = []
    for shape in ((3, 40), (3, 40), (5, 40)):
        x, r = (torch.randn(*shape, generator=g).to(DEVICE) for _ in range(2))
        s, y = layer_ops.add_rms_norm(x, r, w, 1e-5)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0)
        torch.testing.assert_close(y, norm(x + r), rtol=1e-5, atol=1e-5)
        outs.append(len(kernel_call._LAUNCHES))
    assert outs == [1, 1, 2]


@pytest.mark.gpu
def test_layer_kernels_launch_directly(monkeypatch):
    """On the GPU the layers' kernels launch without JITFunction.run from the second call of a shape on,
    bitwise as Triton's own launch (FLASHSWITCH_FAST_LAUNCH=0)."""
    from triton.runtime import jit
    from flashswitch.kernels_triton import kernel_call
    g = torch.Generator().manual_seed(6)
    x, r = (torch.randn(7, 576, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    gate, up = (torch.randn(7, 1536, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 7, 9, 64, generator=g).to(DEVICE, torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 7, 3, 64, generator=g).to(DEVICE, torch.bfloat16).transpose(1, 2)
    w = torch.randn(576, generator=g).to(DEVICE, torch.bfloat16)
    inv_freq = Rotary(64, 100000.0, device=DEVICE).inv_freq

    def calls():
        return (*layer_ops.add_rms_norm(x, r, w, 1e-5), layer_ops.silu_mul(gate, up),
                *layer_ops.rotary_qk(q, k, inv_freq))

    monkeypatch.setenv(kernel_call.FAST_LAUNCH_ENV, "0")
    kernel_call._LAUNCHES.clear()
    want = calls()
    monkeypatch.delenv(kernel_call.FAST_LAUNCH_ENV)
    kernel_call._LAUNCHES.clear()
    calls()
    runs, real = [], jit.JITFunction.run
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **kw: runs.append(self) or real(self, *a, **kw))
    got = calls()
    assert not runs, [getattr(f, "__name__", f) for f in runs]
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
