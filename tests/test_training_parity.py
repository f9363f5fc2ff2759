"""Training parity: a tiny 2-layer model that uses all three ops (EVA attention fed by op-1 summaries,
SwitchHead-style value and output projections through `expert_matmul` with sigmoid-gated top-k routing)
trained with AdamW on the kernel backend and on the reference backend from one initialisation: the
per-step losses must agree. fp32: within 1e-3 relative at every step. bf16 (GPU): the kernel run's
distance from the fp32 reference run stays within twice the bf16 reference run's distance from it
(plus a floor), i.e. within the spread that bf16 rounding alone causes. Activations are cast to the
run's dtype before each op; weights stay fp32 (master weights, cast in the kernels)."""
import math

import pytest
import torch

import flashswitch as fs
from conftest import DEVICE, kernel_backends


class TinyEvaSwitchLM(torch.nn.Module):
    def __init__(self, vocab=64, d=64, heads=4, head_dim=16, experts=4, k=2, layers=2, chunk=4, window=16,
                 dtype=torch.float32):
        super().__init__()
        self.dtype = dtype
        self.h, self.hd, self.e, self.k, self.c, self.w = heads, head_dim, experts, k, chunk, window
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.norm = torch.nn.LayerNorm(d)
            layer.qk = torch.nn.Linear(d, 2 * heads * head_dim, bias=False)
            layer.router = torch.nn.Linear(d, heads * experts, bias=False)
            layer.w_v = torch.nn.Parameter(torch.randn(heads * experts, d, head_dim) * d ** -0.5)
            layer.w_o = torch.nn.Parameter(torch.randn(heads * experts, head_dim, d) * (heads * head_dim) ** -0.5)
            self.layers.append(layer)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def attention(self, layer, x, backend):
        B, N, d = x.shape
        H, hd, E = self.h, self.hd, self.e
        flat = x.reshape(B * N, d).to(self.dtype)  # 16-bit activations, fp32 master weights
        scores = torch.sigmoid(layer.router(flat.float())).view(B * N, H, E)
        gate, idx = scores.topk(self.k, dim=-1)                                  # [T, H, k]
        idx = (idx + torch.arange(H, device=x.device)[None, :, None] * E).reshape(B * N, H * self.k)
        rt = fs.route(idx, H * E, check=False)
        gates = gate.reshape(B * N, H * self.k).to(self.dtype)
        v = fs.expert_matmul(flat, rt, layer.w_v, gates=gates, out_groups=H, backend=backend)  # [T, H, hd]
        q, k = torch.nn.functional.linear(flat, layer.qk.weight.to(self.dtype)).view(B, N, 2, H, hd).permute(2, 0, 3, 1, 4)
        v = v.view(B, N, H, hd).transpose(1, 2)
        k_sum, v_sum = fs.chunk_summaries(k, v, self.c, backend=backend)
        o = fs.eva_attention(q, k, v, k_sum, v_sum, chunk_size=self.c, window_size=self.w, backend=backend)
        o = o.transpose(1, 2).reshape(B * N, H, hd)
        return fs.expert_matmul(o, rt, layer.w_o, gates=gates, out_groups=1, backend=backend).view(B, N, d).float()

    def forward(self, tokens, backend):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + self.attention(layer, layer.norm(x), backend)
        return self.head(self.norm(x))


def train_losses(backend, steps, dtype, device, seed=0):
    torch.manual_seed(seed)
    model = TinyEvaSwitchLM(dtype=dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 48), generator=g).to(device)
        logits = model(tokens[:, :-1], backend)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_training_parity_fp32():
    kernels = kernel_backends()
    if "triton" not in kernels:
        pytest.skip("no Triton backend here")
    steps = 50 if DEVICE == "cuda" else 4
    ref = train_losses("reference", steps, torch.float32, DEVICE)
    ker = train_losses("triton", steps, torch.float32, DEVICE)
    assert all(math.isfinite(x) for x in ker)
    for i, (a, b) in enumerate(zip(ker, ref)):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {i}: kernel loss {a} vs reference {b}"


@pytest.mark.gpu
def test_training_parity_bf16():
    steps = 50
    ref32 = train_losses("reference", steps, torch.float32, DEVICE)
    ref16 = train_losses("reference", steps, torch.bfloat16, DEVICE)
    ker16 = train_losses("triton", steps, torch.bfloat16, DEVICE)
    spread = max(abs(a - b) for a, b in zip(ref16, ref32))
    for i, (a, b) in enumerate(zip(ker16, ref32)):
        assert abs(a - b) <= 2 * spread + 2e-2 * abs(b), f"step {i}: bf16 kernel loss {a} vs fp32 reference {b}"
