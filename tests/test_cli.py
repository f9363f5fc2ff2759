"""`flashswitch info | check | demo | autotune | bench` on CPU (small problems)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashswitch import cli, registry

ROOT = Path(__file__).resolve().parent.parent
HAS_TRITON_OP1 = importlib.util.find_spec("flashswitch.kernels_triton.chunk_summaries") is not None
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def _run_module(*args, env_extra=None, drop=()):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flashswitch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "reference", "cuda", "cupy", "config folder", "chunk_summaries"):
        assert word in out


@needs_cpu
def test_info_explains_missing_backends(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "TRITON_INTERPRET=1" in out
    ok, why = cli.backend_status("cuda", torch.device("cpu"))
    assert not ok and ("not built" in why or "no GPU" in why)


def test_check_references(capsys):
    assert cli.main(["check", "--backends", "reference", "--dtypes", "fp32", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "pass" in out and "0 failed" in out


@pytest.mark.skipif(not HAS_TRITON_OP1, reason="the op-1 Triton kernel is not there yet")
def test_check_with_triton_interpreter(capsys):
    # tests/conftest.py sets TRITON_INTERPRET=1 on CPU, so triton runs here on CPU tensors
    assert cli.main(["check", "--ops", "chunk_summaries", "--dtypes", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "triton" in out and "0 failed" in out


def test_check_reports_a_wrong_kernel(capsys, monkeypatch):
    spec = registry.get("chunk_summaries")

    def wrong(self, backend, config, problem):
        outs = self.torch_outputs(problem)
        return (outs[0] + 1,) + outs[1:]

    monkeypatch.setattr(registry.OpSpec, "kernel_outputs", wrong)
    monkeypatch.setattr(cli, "usable_kernel_backends", lambda device: ["triton"])
    assert cli.main(["check", "--ops", spec.name, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "k_sum" in out


def test_check_rejects_unknown_op(capsys):
    assert cli.main(["check", "--ops", "nope"]) == 2


def test_demo_without_kernels():
    r = _run_module("demo", drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "chunk_summaries" in r.stdout and "reference" in r.stdout


def test_default_command_is_demo(capsys, monkeypatch):
    if not HAS_TRITON_OP1:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "backend='auto' picks" in out and "chunk_summaries" in out


@needs_cpu
def test_autotune_refuses_without_gpu(capsys):
    assert cli.main(["autotune", "--budget", "1"]) == 2
    assert "GPU" in capsys.readouterr().out


@needs_cpu
def test_bench_quick_refuses_without_gpu(capsys):
    assert cli.main(["bench", "--quick"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_bench_without_gpu_writes_nothing(tmp_path):
    out = tmp_path / "results"
    assert cli.main(["bench", "--ops", "chunk_summaries", "--out", str(out)]) == 2
    assert not out.exists()


def _fake_tuner(monkeypatch) -> dict:
    """A visible GPU and a tuner that only records the keywords `autotune` hands it (returned)."""
    from flashswitch.autotune import tune as tune_mod
    seen = {}

    def fake_tune(**kw):
        seen.update(kw)
        return {"buckets": 1, "planned": 1, "path": "x.json", "stopped": None}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    return seen


def test_autotune_first_n_shapes(monkeypatch):
    """`autotune --first N` hands the tuner the first N shapes of each op (issue shapes first), and
    `--shape I ...` the chosen ones."""
    from flashswitch.autotune import space
    seen = _fake_tuner(monkeypatch)
    assert cli.main(["autotune", "--ops", "expert_matmul", "--first", "1", "--no-progress"]) == 0
    assert seen["shapes"]["expert_matmul"] == space.TUNE_SHAPES["expert_matmul"][:1]
    assert seen["ops"] == ["expert_matmul"]
    assert cli.main(["autotune", "--no-progress"]) == 0 and seen["shapes"] is None
    assert cli.main(["autotune", "--ops", "eva_attention", "--shape", "1", "3", "--no-progress"]) == 0
    assert seen["shapes"]["eva_attention"] == [space.TUNE_SHAPES["eva_attention"][i] for i in (1, 3)]


COMMANDS = ("demo", "info", "check", "bench", "autotune", "generate", "test")


def _fs(*args):
    return subprocess.run(["bash", str(ROOT / "fs"), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLASHSWITCH_PYTHON": sys.executable})


def test_fs_help_is_one_usage_listing_every_command():
    r = _fs("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("usage:") == 1, r.stdout
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("    ") and line.strip()}
    assert set(COMMANDS) <= listed, r.stdout


def test_fs_unknown_command_lists_the_choices():
    r = _fs("bogus")
    assert r.returncode == 2 and "invalid choice: 'bogus'" in r.stderr, r.stderr
    choices = r.stderr.split("choose from", 1)[1]
    assert all(f"'{c}'" in choices for c in COMMANDS), r.stderr


def test_printed_commands_name_fs_when_run_through_it(monkeypatch, capsys):
    """The usage line and the demo's hints name the command as it was run: `./fs` (`flashswitch` is not
    on PATH after ./fs's setup), else the console script."""
    assert _fs("--help").stdout.startswith(f"usage: {ROOT / 'fs'} [-h] <command>")
    monkeypatch.setenv("FLASHSWITCH_PROG", "./fs")
    assert cli.main(["demo", "--ops", "chunk_summaries"]) == 0
    assert "more: ./fs info | check | bench | autotune | generate   (./fs <command> --help)" in capsys.readouterr().out
    monkeypatch.delenv("FLASHSWITCH_PROG")
    assert cli.build_parser().prog == "flashswitch"


def test_test_command_hands_every_argument_to_pytest(monkeypatch):
    """`flashswitch test ...` (./fs test runs pytest itself) is pytest on the checkout's tests/, options included."""
    calls = []
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd: calls.append((cmd, cwd)) or 5)
    assert cli.main(["test", "-k", "help", "-x", "--help"]) == 5
    assert calls == [([sys.executable, "-m", "pytest", str(ROOT / "tests"), "-k", "help", "-x", "--help"], str(ROOT))]


def test_cli_backends_and_dtypes_are_the_library_ones():
    """The CLI's backends and their reasons are the table's (flashswitch/backends.py)."""
    from flashswitch import _common as C, backends
    cpu = torch.device("cpu")
    assert all(cli.backend_status(b, cpu) == backends.status(b, cpu) for b in backends.NAMES)
    assert cli.backend_status("nope", cpu) == (False, "unknown backend")
    assert set(cli.usable_kernel_backends(cpu)) <= set(backends.KERNELS)
    assert registry.DTYPES is C.DTYPES and C.DTYPE_NAMES == {v: k for k, v in C.DTYPES.items()}


def test_autotune_model_shapes(monkeypatch, capsys):
    """`autotune --model NAME` hands the tuner the buckets that model's EVA attention hits, derived from
    its config: op 1 over the kv heads, op 2 over the query heads, the backward at training shapes
    only, one shape per bucket; an unknown name is refused."""
    from flashswitch.autotune.model_shapes import _features
    from flashswitch.autotune.store import bucket_key
    seen = _fake_tuner(monkeypatch)
    assert cli.main(["autotune", "--model", "smollm2-135m", "--seq-lens", "4096", "--train-shapes", "8x2048",
                     "--windows", "sliding", "--no-progress"]) == 0
    shapes = seen["shapes"]
    assert seen["ops"] == ["chunk_summaries", "chunk_summaries.bwd", "eva_attention", "eva_attention.bwd"]
    assert shapes["chunk_summaries.bwd"] == [dict(B=8, H=3, N=2048, D=64, C=32)]
    assert shapes["eva_attention.bwd"] == [dict(B=8, H=9, Hkv=3, Nk=2048, D=64, C=32, W=256, window="sliding")]
    assert {(s["B"], s["Nk"]) for s in shapes["eva_attention"]} == {(1, 4096), (8, 2048)}
    for op, lst in shapes.items():  # one shape per bucket
        assert len({bucket_key(_features(op, s, "bf16")) for s in lst}) == len(lst)
    assert cli.main(["autotune", "--model", "gpt-5"]) == 2
    assert "smollm2-135m" in capsys.readouterr().out
