"""The Triton kernels compile for sm_90 (the H200) with the installed Triton, with the configs the H200
config file gives each tuning shape and the defaults: `bench/tools/compile_check.py` in a process without
the interpreter (which replaces the kernels), no GPU needed. A config the compiler rejects fails here,
not on the device."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "flashswitch" / "autotune" / "configs" / "NVIDIA_H200.json"

pytest.importorskip("triton")


def _compile_check(tmp_path, *args):
    """bench/tools/compile_check.py's process and rows. It runs without TRITON_INTERPRET (the interpreter replaces
    the kernels) and without this tree on PYTHONPATH: the script must find its own tree's package, not an
    installed one (possibly another checkout's) nor none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools" / "compile_check.py"), *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert f"flashswitch from {ROOT / 'flashswitch'}," in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, (json.loads(out.read_text()) if out.exists() else [])


def test_tuned_and_default_configs_compile_for_sm90(tmp_path):
    proc, rows = _compile_check(tmp_path, "--ops", "chunk_summaries", "eva_attention", "expert_matmul",
                                "--tuned", str(H200))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["op"] for r in rows} == {"chunk_summaries", "eva_attention", "expert_matmul"}
    assert rows and all(r["ok"] and r["kernels"] for r in rows)
    # every kernel fits the multiprocessor, with no local arrays; register spills (the stack frame) are
    # reported, not gated here: the Triton forward's in-kernel isolating walk spills (docs/PERFORMANCE.md)
    for r in rows:
        for k in r["kernels"]:
            assert k["regs"] <= 255 and k["local"] == 0 and k["shared"] <= 227 * 1024, (r["config"], k)
            assert k["stack"] >= 0, (r["config"], k)


def _module():
    from importlib import util
    spec = util.spec_from_file_location("compile_check", ROOT / "bench" / "tools" / "compile_check.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_rejected_config_is_reported():
    """A config the launcher refuses (BLOCK_M not a power of two) is a failed row, not a crash: the
    check can fail."""
    mod = _module()
    problem = mod.shape_problem("eva_attention", 1, "bf16")
    rows = mod.check_configs("eva_attention", 1, [{"BLOCK_M": 48, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}],
                             90, problem)
    assert len(rows) == 1 and not rows[0]["ok"] and "BLOCK_M" in rows[0]["error"]


def test_sass_comparison_tells_a_code_change_apart(tmp_path):
    """--compare: the same kernels compiled again have the same SASS digests (exit 0); a digest that
    differs, or a config the earlier file lacks, is reported and fails the check (exit 1)."""
    args = ("--ops", "chunk_summaries", "--shape", "0", "--first", "2")
    proc, first = _compile_check(tmp_path, *args)
    assert proc.returncode == 0 and len(first) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(len(k["sass"]) == 64 for r in first for k in r["kernels"])
    before = tmp_path / "before.json"
    before.write_text(json.dumps(first))
    proc, _ = _compile_check(tmp_path, *args, "--compare", str(before))
    assert proc.returncode == 0 and "0 of 2 configs changed" in proc.stdout, proc.stdout[-3000:]
    first[0]["kernels"] = first[1]["kernels"]  # as if config 0 now compiled to config 1's code
    before.write_text(json.dumps(first[:1]))  # and config 1 were new
    proc, _ = _compile_check(tmp_path, *args, "--compare", str(before))
    assert proc.returncode == 1 and "2 of 2 configs changed" in proc.stdout, proc.stdout[-3000:]


def test_eva_cache_step_kernels_compile_for_sm90(tmp_path):
    """The launches of an EvaCache: its prefill (a one-token prompt among them) and a decode step's (the two
    around op 1, and the one-launch step), each window, with and without a bias tensor."""
    proc, rows = _compile_check(tmp_path, "--ops", "eva_cache")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows) == 4 and all(r["ok"] for r in rows)
    for r in rows:
        assert {k["name"] for k in r["kernels"]} == {"_gather_chunk_kernel", "_append_kernel", "_step_kernel",
                                                     "_prefill_kernel"}
        assert all(k["regs"] <= 128 and k["local"] == 0 for k in r["kernels"]), r
