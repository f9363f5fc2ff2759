"""bench/tools/regress.py end to end on the CPU: --smoke against HEAD (Triton interpreter, tiny shapes), in a
worktree under tmp_path that is removed afterwards. Checks the JSON and markdown it writes, that head
against itself gives ratios near 1, and that the exit status follows the threshold: a head made a million
times slower by the test hook fails the gate.
The driver runs in this process (its main(), as the script calls it: one interpreter start less per
run); its two workers are processes of their own, as always. One run at a time (`exclusive`): a run's
workers share one pinned core, where another run's would skew its ratios, and two runs' `git worktree`
calls (add, prune) on the one repository must not interleave."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import exclusive

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "tools" / "regress.py"
sys.path.insert(0, str(SCRIPT.parent))
import regress  # noqa: E402

# op 3 forward at SwitchHead-262M V, op 1 forward + backward (also its host row), the route's host row
CASES = ["expert_matmul fwd switchhead262m_v", "chunk_summaries fwd+bwd", "host route"]
# the same code on both sides: a ratio is timing noise only. Smoke timings are a few calls each on a busy
# CPU, so the band is wide; a ratio outside it means the two sides are not timed alike
SAME_CODE_BAND = (0.5, 2.0)


@pytest.fixture(scope="module")
def worktrees(tmp_path_factory):
    folder = tmp_path_factory.mktemp("regress_worktrees")
    yield folder
    with exclusive("regress"):
        for wt in folder.iterdir():  # leave no worktree registered in the repository
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


def run_regress(monkeypatch, *args) -> int:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    return regress.main()


def smoke(monkeypatch, out: Path, worktrees: Path, *args) -> int:
    with exclusive("regress"):
        return run_regress(monkeypatch, "--against", "HEAD", "--smoke", "--rounds", "2", "--ops", "chunk_summaries",
                           "expert_matmul", "--out-dir", str(out), "--worktree-dir", str(worktrees), *args)


def test_regress_smoke_writes_report_and_passes(tmp_path, worktrees, monkeypatch):
    """HEAD against itself: the gate passes and every gated ratio lies within SAME_CODE_BAND of 1."""
    rc = smoke(monkeypatch, tmp_path, worktrees, "--cases", *CASES, "--threshold", str(SAME_CODE_BAND[1]),
               "--out-name", "regress_head")
    data = json.loads((tmp_path / "regress_head.json").read_text())
    ratios = {c["name"]: c["ratio"] for c in data["cases"] if c["gated"]}
    assert all(SAME_CODE_BAND[0] <= r <= SAME_CODE_BAND[1] for r in ratios.values()), ratios
    assert rc == 0
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert data["rev"]["commit"] == data["head"]["commit"] == sha
    assert isinstance(data["head"]["dirty"], bool) and data["rev"]["ref"] == "HEAD"
    assert "--against HEAD" in data["command"] and data["torch"] == torch.__version__ and data["triton"]
    assert data["device"] and data["date"] and data["smoke"] and data["failed"] == []
    assert data["route"] == "torch"  # REV's extension is not built: route() takes torch ops on both sides
    names = [c["name"] for c in data["cases"]]
    assert names == ["expert_matmul fwd switchhead262m_v", "chunk_summaries fwd+bwd", "host bare triton launch",
                     "host route tiny", "host chunk_summaries fwd+bwd tiny"]
    bare = next(c for c in data["cases"] if c["name"] == "host bare triton launch")
    for c in data["cases"]:
        assert c["unit"] == ("us" if c["name"].startswith("host") else "ms")
        assert len(c["rev_rounds"]) == len(c["head_rounds"]) == 2
        raw = c["head"] / c["rev"]
        if c["name"].startswith("host") and c["gated"]:  # over the bare launch's ratio of the run
            assert c["raw_ratio"] == pytest.approx(raw) and c["ratio"] == pytest.approx(raw / bare["ratio"])
        else:
            assert c["rev"] > 0 and c["head"] > 0 and c["ratio"] == pytest.approx(raw)
        assert c["status"] == ("ok" if c["gated"] else "reference, not gated")
    assert [c["gated"] for c in data["cases"]].count(False) == 1
    assert data["cases"][0]["head_throughput"].keys() == {"TFLOP/s"}
    assert data["cases"][1]["head_throughput"].keys() == {"GB/s"}
    worst = max((c for c in data["cases"] if c["gated"]), key=lambda c: c["ratio"])
    assert data["worst"] == {"name": worst["name"], "ratio": worst["ratio"]}

    md = (tmp_path / "regress_head.md").read_text().strip().splitlines()
    assert sum(ln.startswith("| ") for ln in md) == 1 + len(names)  # header + one row per case
    m = re.fullmatch(r"worst ratio: (\d+\.\d\d) \((.+)\)", md[-1])
    assert m and m.group(2) == worst["name"] and float(m.group(1)) == pytest.approx(worst["ratio"], abs=0.006)


def test_regress_gate_fails_on_a_slower_head(tmp_path, worktrees, monkeypatch):
    monkeypatch.setenv(regress.SLOWDOWN_ENV, "1e6")
    assert smoke(monkeypatch, tmp_path, worktrees, "--cases", "host route", "--threshold", "1000") == 1
    data = json.loads((tmp_path / "regress.json").read_text())
    assert data["failed"] == ["host route tiny"] and data["worst"]["ratio"] > 1000
    bare = next(c for c in data["cases"] if c["name"] == "host bare triton launch")
    assert bare["status"] == "reference, not gated" and bare["ratio"] < 1000  # the reference: not slowed
    assert (tmp_path / "regress.md").read_text().strip().splitlines()[-1].startswith("worst ratio: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_regress_needs_a_gpu_without_smoke(tmp_path, monkeypatch, capsys):
    assert run_regress(monkeypatch, "--against", "HEAD", "--out-dir", str(tmp_path)) == 2
    assert "GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_regress_smoke_shapes_cover_the_headline_ones():
    """Every headline case has its tiny --smoke stand-in (the shapes themselves come from the registry)."""
    assert set(regress.OP2) == set(regress.OP2_SMOKE) and set(regress.OP3) == set(regress.OP3_SMOKE)


def test_regress_worktrees_are_ignored():
    proc = subprocess.run(["git", "check-ignore", "-q", ".regress/x"], cwd=ROOT)
    assert proc.returncode == 0  # the default worktree folder stays out of `git status`
