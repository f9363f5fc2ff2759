"""The benchmark baselines (bench/baselines.py) compute what the ops compute, the registry entries of
ops 2 and 3 count the right work, bench/tools/plot.py turns results of ops 2 and 3 into tables and plots,
and every results file records the commit and date of its run (bench/common.py's provenance).

On CPU: FlexAttention runs eagerly (its dense reference path), SDPA and torch._grouped_mm run on CPU
tensors; the compiled FlexAttention and the CUDA grouped GEMM are checked on a GPU (`gpu` marker).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashswitch import registry
from flashswitch.reference import eva_attention as R2
from flashswitch.reference import expert_matmul as R3
from flashswitch.testing import assert_close, rel_error

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "tools")]  # baselines, common; plot
import baselines as BL  # noqa: E402

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex_attention warns on every call

EVA_CASES = [
    dict(B=1, H=4, Hkv=2, Nk=70, D=16, C=4, W=16),
    dict(B=2, H=2, Hkv=2, Nk=53, D=16, C=2, W=8, window="sliding", summary_bias="log_count"),
    dict(B=1, H=4, Hkv=1, Nk=45, D=8, C=3, W=9, summary_bias="tensor"),
    dict(B=1, H=2, Hkv=2, Nq=7, Nk=40, D=16, C=4, W=8, window="sliding"),
    dict(B=2, H=4, Hkv=2, Nq=1, Nk=50, D=16, C=4, W=8, summary_bias="tensor"),
    dict(B=1, H=2, Hkv=1, Nk=33, D=16, C=1, W=4, layout="strided"),
]
DECODE_CASES = [
    dict(B=2, H=4, Hkv=2, Nq=1, Nk=50, D=16, C=4, W=8),
    dict(B=1, H=2, Hkv=2, Nq=1, Nk=61, D=16, C=4, W=12, window="sliding", summary_bias="log_count"),
    dict(B=2, H=4, Hkv=1, Nq=1, Nk=37, D=8, C=2, W=8, summary_bias="tensor", q_offset=20),
    dict(B=1, H=2, Hkv=2, Nq=1, Nk=5, D=8, C=2, W=8),  # no summary visible yet
]


def _ref(p):
    return R2.torch_eva_attention(**p)


def _dense_causal(q, k, v, q_offset=None):
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    off = Nk - Nq if q_offset is None else q_offset
    k = k.to(F64).repeat_interleave(H // Hkv, 1)
    v = v.to(F64).repeat_interleave(H // Hkv, 1)
    logits = D ** -0.5 * q.to(F64) @ k.transpose(-1, -2)
    t = torch.arange(Nq)[:, None] + off
    logits = logits.masked_fill(torch.arange(Nk)[None, :] > t, float("-inf"))
    return torch.softmax(logits, -1) @ v


# ---------------------------------------------------------------- op 2 baselines on CPU
@pytest.mark.parametrize("case", EVA_CASES, ids=registry.describe)
def test_flex_eager_matches_reference(case):
    p = R2.random_problem(**case, seed=1)
    o = BL.flex_attention_eva(**p, compiled=False)
    assert o.shape == p["q"].shape
    assert rel_error(o, _ref(p)) < 1e-5


def test_flex_cat_and_nocat_agree_and_mask_matters():
    p = R2.random_problem(B=1, H=2, Hkv=2, Nk=70, D=16, C=4, W=16, seed=2)
    flex = BL.FlexEva(p["q"], p["k"], p["k_sum"], chunk_size=4, window_size=16, compiled=False)
    keys, values = flex.concat(p["k"], p["v"], p["k_sum"], p["v_sum"])
    assert keys.shape[2] == 70 + p["k_sum"].shape[2]
    o1, o2 = flex(p["q"], p["k"], p["v"], p["k_sum"], p["v_sum"]), flex.attend(p["q"], keys, values)
    assert torch.equal(o1, o2)
    other = _ref(dict(p, window_size=32))  # another window: another answer
    assert rel_error(o1, other) > 1e-2


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_mask_mod_is_the_reference_visibility(window):
    Nq, Nk, C, W, off = 9, 40, 4, 12, 31
    Nc = -(-Nk // C)
    exact, summ = R2.visible_masks(Nq, Nk, Nc, chunk_size=C, window_size=W, window=window, q_offset=off)
    mm = BL.eva_mask_mod(Nk, chunk_size=C, window_size=W, window=window, q_offset=off)
    qi = torch.arange(Nq)[:, None].expand(Nq, Nk + Nc)
    kj = torch.arange(Nk + Nc)[None, :].expand(Nq, Nk + Nc)
    got = mm(torch.tensor(0), torch.tensor(0), qi, kj)
    assert torch.equal(got, torch.cat([exact, summ], 1))
    with pytest.raises(ValueError, match="window"):
        BL.eva_mask_mod(Nk, chunk_size=C, window_size=W, window="ring")


@pytest.mark.parametrize("Nq,Nk,q_offset", [(33, 33, None), (1, 40, None), (1, 40, 17), (6, 30, 10), (5, 5, 0)])
@pytest.mark.parametrize("Hkv", [1, 2])
def test_sdpa_causal(Nq, Nk, q_offset, Hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Nq, 16, generator=g)
    k, v = torch.randn(2, Hkv, Nk, 16, generator=g), torch.randn(2, Hkv, Nk, 16, generator=g)
    o = BL.sdpa_causal(q, k, v, q_offset=q_offset)
    assert rel_error(o, _dense_causal(q, k, v, q_offset)) < 1e-5
    with pytest.raises(ValueError, match="q_offset"):
        BL.sdpa_causal(q, k, v, q_offset=Nk)


@pytest.mark.parametrize("case", DECODE_CASES, ids=registry.describe)
def test_cat_sdpa_decode_matches_reference(case):
    p = R2.random_problem(**case, seed=3)
    o = BL.cat_sdpa_decode(**p)
    assert o.shape == p["q"].shape
    assert rel_error(o, _ref(p)) < 1e-5


def test_cat_sdpa_decode_takes_one_query():
    p = R2.random_problem(B=1, H=2, Hkv=2, Nq=2, Nk=20, D=8, C=2, W=4)
    with pytest.raises(ValueError, match="one query"):
        BL.cat_sdpa_decode(**p)


# ---------------------------------------------------------------- op 3 baselines on CPU
def _grouped_mm_runs_on(device) -> bool:
    try:
        a = torch.randn(4, 8, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(a, torch.randn(2, 8, 8, dtype=torch.bfloat16, device=device),
                          offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


EM_CASES = [
    dict(T=20, S=4, E=6, d_in=24, d_out=16, G_out=2),
    dict(T=13, S=6, E=10, d_in=16, d_out=8, G_in=2, G_out=1),
    dict(T=9, S=2, E=3, d_in=16, d_out=8, gated=False, routing="duplicates"),
    dict(T=11, S=3, E=5, d_in=8, d_out=24, G_in=3, routing="sparse"),
    dict(T=7, S=4, E=4, d_in=16, d_out=16, G_out=1, routing="one_hot"),
    dict(T=12, S=4, E=4, d_in=16, d_out=8, weight_dtype=torch.float32),
]


def _em_check(y, p):
    args = dict(gates=p["gates"], out_groups=p["out_groups"])
    ref = R3.numpy_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)
    base = R3.torch_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)
    assert tuple(y.shape) == ref.shape and y.dtype == p["x"].dtype
    assert_close("y", y, ref, p["x"].dtype, baseline=base)


@pytest.mark.parametrize("case", EM_CASES, ids=registry.describe)
def test_grouped_mm_pipeline_cpu(case):
    if not _grouped_mm_runs_on("cpu"):
        pytest.skip(f"torch {torch.__version__} runs torch._grouped_mm on GPUs only")
    p = R3.random_problem(**case, dtype=torch.bfloat16, seed=4)
    _em_check(BL.grouped_mm_pipeline(p["x"], p["expert_idx"], p["weight"], p["gates"], p["out_groups"]), p)


@pytest.mark.parametrize("name", ["switchhead47m_v", "switchhead47m_o"])
def test_grouped_mm_pipeline_rejects_unaligned_rows(name):
    p = R3.random_problem(**R3.paper_shapes(4)[name], dtype=torch.bfloat16)
    why = BL.grouped_mm_unsupported(p["x"], p["weight"])
    assert why is not None and "16-byte" in why
    with pytest.raises(BL.Unsupported, match="16-byte"):
        BL.grouped_mm_pipeline(p["x"], p["expert_idx"], p["weight"], p["gates"], p["out_groups"])


def test_grouped_mm_pipeline_rejects_fp32():
    p = R3.random_problem(T=4, S=2, E=2, d_in=16, d_out=16)
    with pytest.raises(BL.Unsupported, match="bf16"):
        BL.grouped_mm_pipeline(p["x"], p["expert_idx"], p["weight"], p["gates"], p["out_groups"])


@pytest.mark.parametrize("name", list(R3.paper_shapes(8)))
def test_grouped_mm_support_of_paper_shapes(name):
    p = R3.random_problem(**R3.paper_shapes(8)[name], dtype=torch.bfloat16)
    assert (BL.grouped_mm_unsupported(p["x"], p["weight"]) is None) == ("47m" not in name)


def test_dense_equal_macs():
    p = R3.random_problem(T=10, S=4, E=3, d_in=24, d_out=8, dtype=torch.float32)
    a, b = BL.dense_equal_macs_operands(p["x"], p["expert_idx"], p["weight"])
    assert a.shape == (40, 24) and b.shape == (24, 8) and a.dtype == b.dtype == torch.float32
    assert 2 * a.shape[0] * a.shape[1] * b.shape[1] == registry.get("expert_matmul").cost(p)["flops"]
    assert torch.allclose(BL.dense_equal_macs(a, b), a.double().mm(b.double()).float(), atol=1e-5)


# ---------------------------------------------------------------- GPU: compiled flex, CUDA grouped GEMM
GPU_EVA = [
    dict(B=1, H=4, Hkv=4, Nk=1024, D=64, C=16, W=256),
    dict(B=2, H=4, Hkv=2, Nk=777, D=64, C=16, W=128, window="sliding", summary_bias="log_count"),
    dict(B=1, H=4, Hkv=4, Nk=512, D=128, C=32, W=64, summary_bias="tensor"),
    dict(B=4, H=4, Hkv=4, Nq=1, Nk=1024, D=128, C=32, W=256),
    dict(B=2, H=8, Hkv=2, Nq=100, Nk=600, D=64, C=8, W=64, window="sliding"),
]


def _gpu_check(out, p):
    ref = R2.torch_eva_attention(**registry.upcast(p, F64))
    base = R2.torch_eva_attention(**p)
    assert_close("o", out, ref, p["q"].dtype, baseline=base)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_EVA, ids=registry.describe)
def test_flex_compiled_gpu(case):
    p = R2.random_problem(**case, dtype=torch.bfloat16, device="cuda", seed=5)
    flex = BL.FlexEva(p["q"], p["k"], p["k_sum"], chunk_size=p["chunk_size"], window_size=p["window_size"],
                      window=p["window"], summary_bias=p["summary_bias"], q_offset=p["q_offset"])
    try:  # a shape torch's flex kernels cannot compile is reported as unsupported, as the bench does
        out = BL.flex_or_unsupported(lambda: flex(p["q"], p["k"], p["v"], p["k_sum"], p["v_sum"]))
    except BL.Unsupported as err:
        pytest.skip(str(err))
    _gpu_check(out, p)
    keys, values = flex.concat(p["k"], p["v"], p["k_sum"], p["v_sum"])
    _gpu_check(flex.attend(p["q"], keys, values), p)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_EVA if c.get("Nq") == 1], ids=registry.describe)
def test_sdpa_baselines_gpu(case):
    p = R2.random_problem(**case, dtype=torch.bfloat16, device="cuda", seed=6)
    _gpu_check(BL.cat_sdpa_decode(**p), p)
    full = BL.sdpa_causal(p["q"], p["k"], p["v"])
    assert rel_error(full, _dense_causal(*(t.cpu() for t in (p["q"], p["k"], p["v"])))) < 1.6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", EM_CASES[:5] + [dict(R3.paper_shapes(256)["switchhead262m_v"]),
                                                 dict(R3.paper_shapes(256)["sigma_moe_down"])],
                         ids=registry.describe)
def test_grouped_mm_pipeline_gpu(case):
    p = R3.random_problem(**case, dtype=torch.bfloat16, device="cuda", seed=7)
    _em_check(BL.grouped_mm_pipeline(p["x"], p["expert_idx"], p["weight"], p["gates"], p["out_groups"]), p)


# ---------------------------------------------------------------- registry entries of ops 2 and 3
def test_registry_has_all_ops():
    assert list(registry.OPS) == ["chunk_summaries", "eva_attention", "expert_matmul", "switchhead_output",
                                  "chunk_summaries.bwd", "eva_attention.bwd", "expert_matmul.bwd",
                                  "switchhead_output.bwd"]
    for spec in registry.OPS.values():
        assert spec.check_cases and spec.demo_case and spec.bench_shapes
        for shape in spec.bench_shapes:
            assert spec.bench_x in shape


def test_eva_cost_prefill_and_decode():
    spec = registry.get("eva_attention")
    p = spec.random_problem(B=2, H=4, Hkv=2, Nk=40, D=8, C=4, W=8, dtype="fp16")
    pairs = R2.visible_pairs(40, 40, 10, chunk_size=4, window_size=8)
    c = spec.cost(p)
    assert c["flops"] == 4 * 8 * pairs * 2 * 4
    # q + k, v read once + summaries of chunks before the last window (32 / 4 = 8) + o + lse
    assert c["bytes"] == 2 * 4 * 40 * 8 * 2 + 2 * 2 * (40 + 8) * 8 * 2 * 2 + 2 * 4 * 40 * 8 * 2 + 2 * 4 * 40 * 4
    d = spec.random_problem(B=3, H=2, Hkv=2, Nq=1, Nk=64, D=16, C=4, W=16, dtype="bf16")
    c = spec.cost(d)  # t = 63: exact keys 48..63 (16), summaries 0..11 (12)
    assert c["flops"] == 4 * 16 * (16 + 12) * 3 * 2
    assert c["bytes"] == 3 * 2 * 16 * 2 + 3 * 2 * (16 + 12) * 16 * 2 * 2 + 3 * 2 * 16 * 2 + 3 * 2 * 4
    assert spec.throughput(d, 1.0)["TFLOP/s"] == pytest.approx(c["flops"] / 1e9)
    assert spec.unit == "TFLOP/s" and spec.output_names(2) == ["o", "lse"]


def test_expert_matmul_cost_and_reference_args():
    spec = registry.get("expert_matmul")
    p = spec.random_problem(T=10, S=4, E=3, d_in=24, d_out=8, G_out=2, dtype="bf16")
    c = spec.cost(p)
    assert c["flops"] == 2 * 40 * 24 * 8
    assert c["bytes"] == 10 * 24 * 2 + 3 * 24 * 8 * 2 + 10 * 2 * 8 * 2
    assert "num_experts" not in spec._ref_args(p)
    (y,) = spec.torch_outputs(p)
    assert y.shape == (10, 2, 8)


def test_eva_blocked_reference_equals_dense(monkeypatch):
    monkeypatch.setattr(registry, "EVA_REFERENCE_BLOCK", 2 * 2 * 64)  # a few queries per block
    for case in (dict(B=1, H=2, Hkv=1, Nk=70, D=8, C=4, W=16, window="sliding", summary_bias="log_count"),
                 dict(B=2, H=2, Hkv=2, Nq=23, Nk=50, D=8, C=2, W=8, summary_bias="tensor")):
        p = R2.random_problem(**case, seed=8)
        o, lse = registry.eva_reference_blocked(**p, return_lse=True)
        ro, rl = R2.torch_eva_attention(**p, return_lse=True)
        assert torch.allclose(o, ro, atol=1e-6) and torch.allclose(lse, rl, atol=1e-6)
        assert torch.allclose(registry.eva_reference_blocked(**p), ro, atol=1e-6)


def test_check_covers_ops_2_and_3(capsys):
    """`flashswitch check` on the new entries: the references, and the Triton kernels where they run
    (the interpreter on CPU, which tests/conftest.py enables)."""
    from flashswitch import cli
    assert cli.main(["check", "--ops", "eva_attention", "expert_matmul", "--dtypes", "fp32", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "eva_attention" in out and "expert_matmul" in out and "0 failed" in out


def test_bench_files_collect():
    """The benchmark files import and parametrize without a GPU (every case is then skipped)."""
    import subprocess
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(BENCH / "ops" / "bench_eva_attention.py"), str(BENCH / "ops" / "bench_expert_matmul.py"),
                        str(BENCH / "ops" / "bench_switchhead_output.py"),
                        str(BENCH / "ops" / "bench_switchhead_output_bwd.py")],
                       cwd=BENCH.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Nk65536" in r.stdout and "cat_sdpa_decode" in r.stdout and "flex_nocat" in r.stdout
    assert "switchhead47m_o-grouped_mm_pipeline" in r.stdout and "sigma_moe_up-dense_equal_macs" in r.stdout
    assert "test_switchhead_output[switchhead262m-triton]" in r.stdout
    assert "test_switchhead_output_bwd[switchhead47m-reference]" in r.stdout


# ---------------------------------------------------------------- tables and plots of the results
def _fake_json(path, op, rows):
    benches = [{"extra_info": {"op": op, "device": "cpu", "torch": torch.__version__, **r},
                "stats": {"median": (r.get("ms") or 0) * 1e-3}} for r in rows]
    path.write_text(json.dumps({"benchmarks": benches, "datetime": "now", "commit": "abc1234", "date": "today"}))
    return path


def test_provenance_names_the_commit_and_marks_a_dirty_tree(tmp_path, monkeypatch):
    common = pytest.importorskip("common")
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setattr(common, "ROOT", repo)
    assert common.source_commit() is None  # a copy outside git (not a repository of its own)

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "--short=12", "HEAD")
    assert common.source_commit() == head
    (repo / "new.txt").write_text("untracked files leave the tree clean")
    assert common.source_commit() == head
    (repo / "f.txt").write_text("b")
    assert common.provenance()["commit"] == head + "-dirty"
    monkeypatch.setenv(common.COMMIT_ENV, "0123abc")  # a tree sent without its history names its commit
    assert common.provenance()["commit"] == "0123abc"
    assert common.provenance_line({"commit": "c", "date": "d"}) == "commit c, d"
    assert common.provenance_line({"created": "x"}) == "commit unknown, x"  # files written before "date"


def test_plot_op2_speedup_and_tables(tmp_path):
    plot = pytest.importorskip("plot")
    rows = []
    for n in (4096, 8192, 16384):
        shape = dict(B=1, H=16, Hkv=16, Nk=n, D=128, C=16, W=2048, window="block")
        for b, ms in (("sdpa_causal", n / 1000), ("flex", n / 3000), ("triton", n / 8000)):
            rows.append(dict(backend=b, dtype="bf16", shape=shape, x="Nk", unit="TFLOP/s", ms=ms,
                             **{"TFLOP/s": 100.0 / ms, "GB/s": 50.0 / ms}))
    rows.append(dict(backend="cat_sdpa_decode", dtype="bf16", shape=dict(B=32, Nq=1, Nk=32768), x="Nk",
                     unit="TFLOP/s", ms=0.05, label="decode", **{"TFLOP/s": 1.0, "GB/s": 3000.0},
                     ms_rotating=0.06, ms_graph=0.04, ms_read_flush=0.045,
                     **{"GB/s rotating": 2500.0, "GB/s graph": 3750.0, "GB/s read flush": 3333.3}))
    written = plot.process(_fake_json(tmp_path / "eva_attention.json", "eva_attention", rows))
    names = {w.name for w in written}
    assert names == {"eva_attention.md", "eva_attention.png", "eva_attention_throughput.png"}
    md = (tmp_path / "eva_attention.md").read_text()
    assert "speedup vs flex" in md and "speedup vs sdpa_causal" in md and "GB/s" in md
    assert "| 3.00x |" in md  # flex over sdpa_causal
    assert "decode: B=32 Nq=1 Nk=32768" in md
    assert "rotating ms" in md and "graph ms" in md and "read-flush ms" in md and "GB/s read flush" in md
    assert "| 0.0450 |" in md and "| 3333.3 |" in md
    assert "; commit abc1234, today." in md


def test_plot_op3_bars_roof_and_unsupported(tmp_path):
    plot = pytest.importorskip("plot")
    rows = []
    for name, ok in (("switchhead262m_v", True), ("switchhead47m_v", False)):
        shape = dict(R3.paper_shapes(16384)[name])
        for b, ms in (("dense_equal_macs", 1.0), ("grouped_mm_pipeline", 2.0), ("triton", 1.25)):
            if b == "grouped_mm_pipeline" and not ok:
                rows.append(dict(backend=b, dtype="bf16", shape=shape, x="T", unit="TFLOP/s", label=name,
                                 ms=None, unsupported="torch._grouped_mm needs 16-byte aligned rows"))
                continue
            rows.append(dict(backend=b, dtype="bf16", shape=shape, x="T", unit="TFLOP/s", label=name, ms=ms,
                             **{"TFLOP/s": 500.0 / ms, "GB/s": 10.0 / ms}))
    written = plot.process(_fake_json(tmp_path / "expert_matmul.json", "expert_matmul", rows))
    assert {w.name for w in written} == {"expert_matmul.md", "expert_matmul.png"}
    md = (tmp_path / "expert_matmul.md").read_text()
    assert "speedup vs grouped_mm_pipeline" in md and "% of roof (dense_equal_macs)" in md
    assert "unsupported" in md and "80.0%" in md and "1.60x" in md
    assert md.index("TFLOP/s") < md.index("GB/s")  # the op's own unit first


def test_plot_from_the_case_log_of_a_cut_run(tmp_path, monkeypatch):
    """A run stopped by its time limit leaves <op>.cases.jsonl (bench/common.py appends each finished
    case); plot.py makes the op's usual table and plot from it, with the unsupported rows."""
    plot = pytest.importorskip("plot")
    common = pytest.importorskip("common")
    log = tmp_path / "expert_matmul.cases.jsonl"
    monkeypatch.setenv(common.CASES_ENV, str(log))
    shape = dict(R3.paper_shapes(16384)["switchhead262m_v"])
    base = dict(op="expert_matmul", device="cpu", dtype="bf16", shape=shape, x="T", unit="TFLOP/s",
                label="switchhead262m_v")

    class _Bench:  # what log_case reads of pytest-benchmark's fixture after benchmark.pedantic
        class stats:
            class stats:
                median = 2e-3

    base["commit"] = "abc1234"  # as time_case records it
    common.log_case({**base, "backend": "grouped_mm_pipeline", "ms": 2.0, "TFLOP/s": 250.0}, _Bench)
    common.log_case({**base, "backend": "triton", "ms": 0.5, "TFLOP/s": 1000.0}, _Bench)
    common.log_case({**base, "backend": "cuda", "ms": None, "unsupported": "not built"})
    assert len(log.read_text().splitlines()) == 3
    written = plot.process(log)
    assert {w.name for w in written} == {"expert_matmul.md", "expert_matmul.png"}
    md = (tmp_path / "expert_matmul.md").read_text()
    assert "| 4.00x |" in md and "not built" in md and "2.0000" in md  # pedantic ms from the log
    assert "; commit abc1234, " in md  # the logged cases' commit


def test_flex_compile_failure_is_unsupported_and_other_errors_are_not():
    failures = BL.compile_failures()
    assert failures, "torch exposes the compile-failure exception types"
    err = failures[-1].__new__(failures[-1])
    Exception.__init__(err, "flex decoding\nNoValidChoicesError: no choices")

    def fails_to_compile():
        raise err
    with pytest.raises(BL.Unsupported, match="no choices"):
        BL.flex_or_unsupported(fails_to_compile)
    with pytest.raises(ZeroDivisionError):
        BL.flex_or_unsupported(lambda: 1 / 0)
