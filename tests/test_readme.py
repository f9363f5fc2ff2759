"""The README's Quickstart and "On a CPU" commands run as written. Each line of those sections' fenced
bash blocks runs through bash in the checkout's root, as after the two quickstart commands: `./fs` with
FLASHSWITCH_PYTHON set to this interpreter (as tests/test_cli.py's `_fs`), `.venv/bin/python` standing
for this interpreter (the one `./fs test` runs the tests with), and TRITON_INTERPRET as a user's shell
has it (unset: conftest sets it on the CPU). A command that stops existing (a renamed script, subcommand
or flag) fails. The slow ones run a cheap equivalent (CHEAP says which and why); a line whose comment
says "GPU only" skips without a GPU, and the "On a CPU" ones skip with one (they are for a machine
without: e.g. the Triton interpreter's demo)."""
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CPU_SECTION = "On a CPU"
SECTIONS = ("Quickstart", CPU_SECTION)
AS_WRITTEN = {".venv/bin/python": sys.executable}
TIMEOUT_S = 120

# a command's first words -> the arguments appended to it, and why. The command is kept whole: argparse
# takes a repeated flag's last value, so every flag as written is still parsed and checked.
CHEAP = {
    ("./fs", "test"): (["--collect-only", "-q"], "the suite cannot run inside itself: that every test collects"),
    (".venv/bin/python", "bench/e2e/e2e_training.py"): (
        ["--sizes", "tiny", "--seq-lens", "16", "--tokens", "32", "--steps", "1", "--warmup", "0"],
        "47M steps take seconds on an idle CPU, minutes on shared cores: the same run of the tiny model"),
}


def section_commands(title: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    blocks = re.findall(r"^```bash\n(.*?)^```", m.group(1), re.M | re.S) if m else []
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


COMMANDS = [pytest.param(title, line, id=f"{title}: {shlex.join(shlex.split(line, comments=True)[:3])}")
            for title in SECTIONS for line in section_commands(title)]


@pytest.mark.parametrize("title", SECTIONS)
def test_the_section_has_commands(title):
    assert section_commands(title), f'README.md has no "## {title}" section with a fenced bash block'


@pytest.mark.parametrize("title, line", COMMANDS)
def test_command_runs_as_written(title, line):
    if re.search(r"#.*\bGPU only\b", line) and not torch.cuda.is_available():
        pytest.skip("GPU only")
    if title == CPU_SECTION and torch.cuda.is_available():
        pytest.skip("for a machine without a GPU")
    words = [AS_WRITTEN.get(w, w) for w in shlex.split(line, comments=True)]
    command = list(itertools.dropwhile(lambda w: re.fullmatch(r"[A-Za-z_]\w*=.*", w), words))  # past VAR=value
    for head, (extra, why) in CHEAP.items():
        if tuple(command[:len(head)]) == tuple(AS_WRITTEN.get(w, w) for w in head):
            print(f"cheap equivalent, {why}: + {shlex.join(extra)}")
            words += extra
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHSWITCH_PYTHON"] = sys.executable
    try:
        r = subprocess.run(["bash", "-c", shlex.join(words)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{line!r} ran past {TIMEOUT_S} s: give it a cheap equivalent in CHEAP")
    assert r.returncode == 0, f"{line!r} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
