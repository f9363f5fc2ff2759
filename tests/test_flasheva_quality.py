"""bench/e2e/flasheva_quality.py: the objective, the frontier test, and the whole --smoke run on the CPU."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "e2e"))
import flasheva_quality as Q  # noqa: E402
from flashswitch.nn.llama import LlamaConfig, LlamaLM  # noqa: E402

CFG = LlamaConfig(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=40)


def test_kd_loss_ends():
    """alpha 0: the model's own cross-entropy; alpha 1 with the model as its own teacher: zero KL."""
    model = LlamaLM(CFG, seed=1).requires_grad_(False)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(Q.kd_loss(model, model, 0.0)(tokens), model.loss(tokens), rtol=1e-6)
    assert abs(float(Q.kd_loss(model, model, 1.0)(tokens))) < 1e-6
    other = LlamaLM(CFG, seed=2)
    assert float(Q.kd_loss(model, other, 1.0)(tokens)) > 1e-4


def test_below_frontier():
    rows = [dict(variant="swa", W=256, C=32, kv_bytes_8k=100, ppl_8k=30.0),
            dict(variant="swa", W=512, C=32, kv_bytes_8k=200, ppl_8k=26.0),
            dict(variant="eva", W=128, C=32, kv_bytes_8k=50, ppl_8k=40.0),    # no window is as small
            dict(variant="eva", W=256, C=32, kv_bytes_8k=150, ppl_8k=29.0),   # under the 100-byte window's 30
            dict(variant="eva", W=512, C=32, kv_bytes_8k=250, ppl_8k=27.0)]   # over the 200-byte window's 26
    assert Q.below_frontier(rows) == {(128, 32): None, (256, 32): True, (512, 32): False}


def test_smoke_run(tmp_path):
    assert Q.main(["--smoke", "--out", str(tmp_path), "--kd", "0.5", "--cache-dir", str(tmp_path), "--budgets", "64",
                   "128", "--pareto-eva", "8,4", "--pareto-swa", "8", "16"]) == 0
    d = json.loads((tmp_path / "flasheva_quality.json").read_text())
    assert d["errors"] == {} and d["skipped"] == [] and "commit" in d and d["date"]
    assert {(r["variant"], r["tokens"]) for r in d["curves"]} == {(v, b) for v in Q.VARIANTS for b in (64, 128)}
    for r in d["curves"]:
        assert {"variant", "tokens", "ppl_2k", "ppl_8k"} <= set(r) and math.isfinite(r["ppl_8k"]) and r["ppl_2k"] > 1
    (t,) = {json.dumps(r["transfer"]) for r in d["curves"] if r["variant"] == "eva-transfer"}
    assert json.loads(t)["steps"] == 2
    assert [(r["variant"], r["W"], r["C"]) for r in d["pareto"]] == [("eva", 8, 4), ("swa", 8, 4), ("swa", 16, 4)]
    for r in d["pareto"]:
        assert {"variant", "W", "C", "kv_bytes_8k", "ppl_8k", "passkey"} <= set(r) and r["from"] == "exact fine-tuned"
        assert r["kv_bytes_8k"] > 0 and 0 <= r["passkey"] <= 1 and math.isfinite(r["ppl_8k"])
    swa8 = next(r for r in d["pareto"] if r["variant"] == "swa" and r["W"] == 8)
    eva8 = next(r for r in d["pareto"] if r["variant"] == "eva" and r["W"] == 8)
    assert swa8["kv_bytes_8k"] < eva8["kv_bytes_8k"]  # a window keeps no summary slots
    md = (tmp_path / "flasheva_quality.md").read_text()
    for part in ("## Perplexity against fine-tune tokens", "## EVA against sliding windows at equal memory",
                 "Target: EVA with transfer within 5 %", "0.5 KL to the exact pretrained model"):
        assert part in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "flasheva_quality.png").stat().st_size > 0
