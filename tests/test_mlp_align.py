"""MLP widths aligned for Hopper's GEMMs (flashswitch.nn.models: d_ff_multiple_of rounds the width,
d_ff_pad_multiple stores the paper's width padded with zero units) and the script that measures the
GEMMs (bench/tools/gemm_align.py).

The padded model is the unpadded one: same loss and gradients (fp32, reference backend), the padding's
gradients exactly zero and its weights still zero after AdamW steps with weight decay, checkpoints in
the logical shapes either way. The rounded model has the rounded width and its MACs. The script's
--smoke run (tiny shapes on the CPU) writes its JSON and table, and its padded layout multiplies the
same numbers as the contiguous one.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE
from flashswitch.nn import models

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
import gemm_align  # noqa: E402

# d_ff 37: rows of 148 fp32 / 74 bf16 bytes, padded to 40
TINY = dict(vocab_size=40, d_model=24, n_layers=2, context=8, dropout=0.0, d_ff=37, backend="reference")
VARIANTS = {"dense": dict(n_heads=3, head_dim=8), "switchhead": dict(n_heads=2, head_dim=12, att_experts=3, att_k=2)}
TIGHT = dict(rtol=1e-6, atol=1e-7)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # toy shapes: intra-op threads only spin
    yield
    torch.set_num_threads(n)


def build(variant: str, seed: int = 0, **overrides) -> models.DecoderLM:
    torch.manual_seed(seed)
    return models.DecoderLM(models.ModelConfig(**TINY, **VARIANTS[variant], **overrides), device=DEVICE)


def mlps(model):
    return [b.mlp for b in model.blocks]


def logical_grads(model) -> dict:
    """Each parameter's gradient in the logical shape (a padded MLP weight's real units only)."""
    out = {n: p.grad for n, p in model.named_parameters()}
    for i, m in enumerate(mlps(model)):
        out[f"blocks.{i}.mlp.up"] = m.up.grad[: m.d_ff]
        out[f"blocks.{i}.mlp.down"] = m.down.grad[:, : m.d_ff]
    return out


def padding(m: models.DenseMLP, of_grad: bool = False):
    up, down = (m.up.grad, m.down.grad) if of_grad else (m.up.detach(), m.down.detach())
    return torch.cat([up[m.d_ff:].flatten(), down[:, m.d_ff:].flatten()])


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_mlp_gives_the_same_loss_and_gradients(variant):
    plain, padded = build(variant), build(variant, d_ff_pad_multiple=8)
    assert [m.up.shape[0] for m in mlps(padded)] == [40, 40] and padded.config.mlp_width == 37
    assert plain.state_dict().keys() == padded.state_dict().keys()
    for (name, a), b in zip(plain.state_dict().items(), padded.state_dict().values()):
        assert torch.equal(a, b), name  # a seed draws the same weights, padded or not
    tokens = torch.randint(0, 40, (2, 9), device=DEVICE)
    losses = [m.loss(tokens) for m in (plain, padded)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], **TIGHT)
    want, got = logical_grads(plain), logical_grads(padded)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TIGHT, msg=name)
    for m in mlps(padded):
        assert torch.equal(padding(m, of_grad=True), torch.zeros_like(padding(m, of_grad=True)))


def test_padding_stays_zero_under_adamw():
    plain, padded = build("dense"), build("dense", d_ff_pad_multiple=8)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, padded)]
    tokens = torch.randint(0, 40, (2, 9), device=DEVICE)
    for _ in range(3):
        losses = []
        for m, opt in zip((plain, padded), opts):
            loss = m.loss(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for m in mlps(padded):
        assert not padding(m).any()
    for (name, a), b in zip(plain.state_dict().items(), padded.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoints_move_between_padded_and_unpadded():
    plain, padded = build("dense", seed=1), build("dense", d_ff_pad_multiple=16)
    state = plain.state_dict()
    assert {k: v.shape for k, v in padded.state_dict().items()} == {k: v.shape for k, v in state.items()}
    padded.load_state_dict(state)  # strict: the logical shapes match
    assert all(torch.equal(a, b) for a, b in zip(state.values(), padded.state_dict().values()))
    assert [m.up.shape[0] for m in mlps(padded)] == [48, 48] and not any(padding(m).any() for m in mlps(padded))
    back = build("dense", seed=2)
    back.load_state_dict(padded.state_dict())
    tokens = torch.randint(0, 40, (2, 9), device=DEVICE)
    torch.testing.assert_close(padded.loss(tokens), back.loss(tokens), **TIGHT)
    # a tensor in the stored shape loads too; padding it carries is dropped
    m = mlps(padded)[0]
    stored = {"up": torch.randn(48, 24, device=DEVICE), "down": torch.randn(24, 48, device=DEVICE)}
    m.load_state_dict(stored)
    assert torch.equal(m.up[:37], stored["up"][:37]) and not padding(m).any()


def test_rounded_widths_and_macs():
    for size, variant, paper, rounded in (("262M", "dense", 4110, 4112), ("262M", "switchhead", 4188, 4192),
                                          ("47M", "dense", 2053, 2056), ("47M", "switchhead", 2080, 2080)):
        assert models.paper_config(size, variant).mlp_width == paper  # the paper's widths by default
        cfg = models.paper_config(size, variant, **models.mlp_align("round"))
        assert (cfg.d_ff, cfg.mlp_width) == (paper, rounded)
        built = {mode: models.build_model(size, variant, device="meta", **models.mlp_align(mode))
                 for mode in models.MLP_ALIGN}
        extra = 2 * cfg.d_model * (rounded - paper) * cfg.n_layers
        assert built["round"].macs_per_token() - built["none"].macs_per_token() == extra
        assert built["pad"].macs_per_token() == built["none"].macs_per_token()
        assert built["round"].num_parameters() - built["none"].num_parameters() == extra
        assert built["pad"].num_parameters() == built["none"].num_parameters()
        stored = built["pad"].blocks[0].mlp.up.shape[0]
        assert stored == rounded and stored % models.ALIGN_ELEMENTS == 0
    assert models.build_model("262M", "switchall", device="meta", **models.mlp_align("round")).macs_per_token() == \
        models.build_model("262M", "switchall", device="meta").macs_per_token()  # no dense MLP to round


def test_mlp_align_options():
    assert models.mlp_align("none") == {"d_ff_pad_multiple": 1}
    assert models.mlp_align("pad") == {"d_ff_pad_multiple": 8}
    assert models.mlp_align("round", 64) == {"d_ff_multiple_of": 64, "d_ff_pad_multiple": 1}
    # the paper's configs store their MLP padded: the paper's widths on aligned GEMMs
    cfg = models.paper_config("262M", "dense")
    assert (cfg.d_ff, cfg.d_ff_pad_multiple) == (4110, 8)
    assert models.paper_config("262M", "dense", **models.mlp_align("none")).d_ff_pad_multiple == 1


@pytest.mark.parametrize("make, name", [
    (lambda: models.mlp_align("align"), "mode"),
    (lambda: models.mlp_align("pad", 0), "multiple"),
    (lambda: models.paper_config("262M", "dense", d_ff_pad_multiple=0), "d_ff_pad_multiple"),
    (lambda: models.paper_config("262M", "dense", d_ff_multiple_of=8.0), "d_ff_multiple_of"),
    (lambda: models.DenseMLP(8, 5, pad_multiple=-1), "pad_multiple"),
    (lambda: models.DenseMLP(8, 0), "d_ff"),
])
def test_bad_arguments_name_the_argument(make, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make()


# ---------------------------------------------------------------- bench/tools/gemm_align.py
def test_gemm_align_widths_and_kernel_classes():
    assert gemm_align.default_widths("262M") == [4096, 4110, 4112, 4188, 4192]
    assert gemm_align.default_widths("47M") == [2048, 2053, 2056, 2080]
    for name, cls in (("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "hopper"),
                      ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "hopper"),
                      ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align2", "ampere"),
                      ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "ampere"),
                      ("void at::native::vectorized_elementwise_kernel<4>", "other")):
        assert gemm_align.kernel_class(name) == cls, name
    t = torch.arange(12.0).view(3, 4)
    v = gemm_align.place(t, 8)
    assert torch.equal(v, t) and v.stride() == (8, 1)


def test_gemm_align_smoke(tmp_path):
    assert gemm_align.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gemm_align.json").read_text())
    assert data["smoke"] and data["device"] == "cpu" and data["commit"] is not None and data["date"]
    layouts = [(s["d_ff"], s["layout"], s["ld"]) for s in data["widths"]]
    assert layouts == [(32, "contiguous", 32), (37, "contiguous", 37), (37, "padded", 40), (40, "contiguous", 40)]
    assert len(data["rows"]) == 6 * len(layouts)
    for r in data["rows"]:
        assert r["ms"] > 0 and r["flops"] == 2 * 40 * 24 * r["d_ff"] and r["kernels"] == ["aten::mm"], r
        if r["layout"] == "padded":
            assert r["rel_diff_vs_contiguous"] <= gemm_align.MAX_REL_DIFF, r
    assert [m["d_ff_round"] for m in data["macs"]] == [4112, 4192]
    md = (tmp_path / "gemm_align.md").read_text()
    assert "| 37 | padded | 80 |" in md and "smoke run" in md and "| 262M | dense | 4110 | 4112 |" in md


@pytest.mark.gpu
def test_gemm_align_on_gpu(tmp_path):
    """A short GPU run: every GEMM timed, its CUDA kernels named and classed, the padded layout's
    outputs those of the contiguous one."""
    assert gemm_align.main(["--tokens", "512", "--d-ff", "64", "68", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gemm_align.json").read_text())
    assert data["device"] != "cpu" and data["roof"]["TFLOPs"] > 0 and len(data["rows"]) == 18
    for r in data["rows"]:
        assert r["ms"] > 0 and r["kernels"] and r["kernel_class"] in ("hopper", "ampere", "other"), r
