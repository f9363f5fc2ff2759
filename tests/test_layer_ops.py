"""The fused inference kernels around attention (kernels_triton/layer_ops.py) against the torch
versions the layers use with gradients: rotary embedding of q and k at per-sequence positions, and
RMSNorm. On the CPU they run under the Triton interpreter in fp32; bf16 / fp16 on the GPU."""
import pytest
import torch

from conftest import DEVICE, dtypes_here
from flashswitch.kernels_triton import layer_ops
from flashswitch.nn.llama import RMSNorm
from flashswitch.nn.rotary import Rotary, apply_rotary
from flashswitch.testing import assert_close

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _poisoned_like(t):
    return torch.full_like(t, float("nan"))


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
    pos = torch.tensor([3, 900, 40000][:B], device=DEVICE)[:, None] + steps if per_seq else steps
    qo, ko = layer_ops.rotary_qk(q, k, pos, rot.inv_freq)
    cos, sin = rot.cos_sin(pos)
    for got, x in ((qo, q), (ko, k)):
        want = apply_rotary(x, cos, sin)
        assert got.stride() == x.stride()
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", dtypes_here())
@pytest.mark.parametrize("shape", [(2, 3, 576), (1, 1, 2048), (4, 5, 40), (0, 3, 16)])
def test_rms_norm_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], eps=1e-5, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g).to(DEVICE, dtype))
    x = (3 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    got = layer_ops.rms_norm(x, norm.weight, norm.eps)
    with torch.enable_grad():
        want = norm(x.requires_grad_())  # a gradient wanted: the torch version
    torch.testing.assert_close(got.float(), want.detach().float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
def test_layers_take_the_fused_kernels_only_without_gradients(monkeypatch):
    """Under no_grad the model's RMSNorm and rotary run the fused kernels; with gradients the torch
    versions (the kernels have no backward)."""
    calls = []
    for name in ("rms_norm", "rotary_qk"):
        real = getattr(layer_ops, name)
        monkeypatch.setattr(layer_ops, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    norm = RMSNorm(64, device=DEVICE, dtype=torch.bfloat16)
    rot = Rotary(16, device=DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 3, 16, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm(x), rot.rotate_qk(q, q)
    assert calls == ["rms_norm", "rotary_qk"]
    calls.clear()
    norm(x.requires_grad_()), rot.rotate_qk(q.requires_grad_(), q)
    assert calls == []
