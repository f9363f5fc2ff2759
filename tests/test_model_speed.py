"""LlamaLM.compile_regions (the fast path of full-sequence calls) and bench/e2e/model_speed.py.

On the CPU (reference backend): the compiled loss and every gradient equal eager, for exact and EVA
attention, with two graphs whatever the depth (one block graph serves every layer); the bench's
--smoke run writes its JSON, table and plot with the fields the results README names.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE
from flashswitch.nn.llama import LlamaConfig, LlamaLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "e2e"))
import e2e_common as E  # noqa: E402
import model_speed  # noqa: E402

CFG = LlamaConfig(vocab_size=61, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                  intermediate_size=40)
ATTENTION = {"sdpa": {}, "eva": dict(chunk_size=4, window_size=8, window="sliding", summary_bias="log_count")}


@pytest.mark.parametrize("attention", list(ATTENTION))
def test_compiled_regions_equal_eager(attention):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    model = LlamaLM(CFG, attention=attention, seed=3, device=DEVICE, **ATTENTION[attention])
    tokens = torch.randint(0, CFG.vocab_size, (2, 29), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    results = []
    for compiled in (False, True):
        model.compile_regions(compiled)
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l1, l0, rtol=1e-5, atol=0), (float(l1), float(l0))
    for name, grad in g0.items():
        err = float((g1[name] - grad).norm() / grad.norm())
        assert err < 1e-5, (name, err)
    assert counters["stats"]["unique_graphs"] == 2  # the block (every layer) and the loss head
    with torch.no_grad():  # a full-sequence forward takes the compiled blocks too
        model.compile_regions()
        out = model(tokens[:, :-1])
        ref = model.compile_regions(False)(tokens[:, :-1])
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_smoke_run(tmp_path):
    assert model_speed.main(["--smoke", "--impls", "eager", "--no-graph", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "model_speed.json").read_text())
    assert data["commit"] is not None or data["date"]
    modes = {(r["mode"], r["attention"]) for r in data["rows"]}
    assert modes == {(m, a) for m in model_speed.MODES for a in model_speed.ATTENTIONS}  # flex: CUDA only
    for r in data["rows"]:
        assert {"model", "mode", "batch", "seq_len", "attention", "ms", "ideal_speedup"} <= set(r), r
        assert r["ms"] > 0 and r["ideal_speedup"] > 0 and "error" not in r
    eva = [r for r in data["rows"] if r["attention"] != "sdpa"]
    assert all(r["ideal_speedup"] > 1 for r in eva if r["seq_len"] >= 96)  # past the window: fewer MACs
    md = (tmp_path / "model_speed.md").read_text()
    assert "| smollm2-135m | train | 2 x 48 | eva-sliding | eager |" in md
    assert E.kernel_family("_eva_bwd_dq") == "op2_bwd" and E.kernel_family("nvjet_tst_128x") == "gemm"
    assert E.kernel_family("_dw_kernel") == "op3" and E.kernel_family("_eva_bwd_sum_splits") == "op2_bwd"


@pytest.mark.gpu
def test_smoke_run_on_the_gpu(tmp_path):
    """Every train impl on CUDA, the graphed step (compiled regions replayed from one CUDA graph) included."""
    assert model_speed.main(["--smoke", "--device", "cuda", "--modes", "train", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "model_speed.json").read_text())["rows"]
    assert {(r["attention"], r["impl"]) for r in rows} == {(a, i) for a in model_speed.ATTENTIONS
                                                           for i in model_speed.IMPLS}
    assert all(r["ms"] > 0 and "error" not in r for r in rows)


@pytest.mark.gpu
def test_attention_rows_with_flex_on_the_gpu(tmp_path):
    """The attention op alone on CUDA: EVA's kernels, SDPA and the same EVA attention through FlexAttention
    (the same MACs as the EVA row it mirrors)."""
    assert model_speed.main(["--smoke", "--device", "cuda", "--modes", "attention", "--out", str(tmp_path)]) == 0
    rows = {r["attention"]: r for r in json.loads((tmp_path / "model_speed.json").read_text())["rows"]}
    assert set(rows) == {*model_speed.ATTENTIONS, *model_speed.FLEX}
    assert all(r["ms"] > 0 and r["graph_ms"] and "error" not in r for r in rows.values())
    for flex, eva in model_speed.FLEX.items():
        assert rows[flex]["ideal_speedup"] == rows[eva]["ideal_speedup"]
