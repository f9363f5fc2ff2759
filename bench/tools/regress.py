"""Performance regression gate: the headline cases of every op, timed on this working tree (head) and on
a git revision (REV), side by side on one GPU.

    python bench/tools/regress.py --against REV [--ops ...] [--cases SUBSTR ...] [--rounds 5] [--threshold 1.05]
                            [--backend triton] [--build] [--smoke] [--out-dir DIR] [--out-name regress]

REV is checked out in a git worktree under `.regress/<sha>` (ignored by git; reused while it is clean,
stale ones pruned). For a copy of the repository without its git history (a remote GPU machine),
`--export` writes REV's files there beforehand (carry `.regress` along) and FLASHSWITCH_COMMIT names
head's commit. Each side runs in its own persistent process (bench/tools/regress_worker.py, driven over
stdin/stdout) with PYTHONPATH set to its checkout and FLASHSWITCH_CONFIG_DIR unset, so each imports its
own flashswitch and reads its own tuned configs. The worker calls only the public API, with inputs from
fixed seeds. A case a side cannot run (no backward pass, a missing argument) is reported unsupported
there and gets no ratio; head failing a case that REV runs fails the gate.

Cases (CASES, below): forward at the headline shapes, forward + backward at each op's first one (op 2:
all three), op 2 forward and forward + backward at SmolLM2-135M's fine-tuning shapes, op 2's decode step,
and host time per call at tiny shapes next to a bare Triton launch (a
reference for the host's speed: not gated). For every case, rounds alternate the sides (REV then head,
head then REV on odd rounds); a round is do_bench's median of CUDA-event timings with the L2 flushed
(ms per call) or, for host rows, the CPU time per call over back-to-back calls (us). Each side's value
is the median over rounds, ratio = head / REV (> 1: head is slower). Exit status 1 when a gated case's
ratio exceeds --threshold, 2 when nothing could be measured (no GPU without --smoke, a worker failure),
else 0.

Writes bench/results/<device>/<out-name>.{json,md} (--out-dir to change; a CPU run only with
--out-dir). --backend cuda times the CUDA extension: head's must be built, REV's is built with --build
(`setup.py build_ext --inplace` in its worktree, MAX_JOBS jobs). --smoke: tiny shapes and few
repetitions, so that the plumbing runs on the CPU under TRITON_INTERPRET=1 (tests/test_regress.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
BENCH = TOOLS.parent
ROOT = BENCH.parent
WORKER = TOOLS / "regress_worker.py"
sys.path[:0] = [str(BENCH), str(TOOLS)]  # `import common`, `import regress_worker`

import torch  # noqa: E402

from common import COMMIT_ENV, device_name, env_info, now, results_dir  # noqa: E402
from flashswitch import registry  # noqa: E402
from flashswitch.ops.expert_matmul import ROUTE_ENV  # noqa: E402  (REV reads the same variable)
from regress_worker import make_inputs  # noqa: E402

# test hook: head's timings (but the bare launch's, the host reference) multiplied by this factor, so a test
# can see the gate fail
SLOWDOWN_ENV = "FLASHSWITCH_REGRESS_TEST_SLOWDOWN"


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # a public call ("route" included) or "bare_triton"
    pass_: str  # "fwd" or "fwd+bwd"
    timer: str  # "device": ms per call; "host": us of CPU time per call
    shape: dict = field(default_factory=dict)
    smoke: dict = field(default_factory=dict)  # the shape under --smoke
    gated: bool = True

    @property
    def family(self) -> str:
        """The op that --ops selects it by."""
        return {"route": "expert_matmul"}.get(self.op, self.op)


# the headline shapes (registry), and tiny ones of the same kinds for --smoke
OP1 = registry.CHUNK_SUMMARIES_SHAPES["n32768"]
OP1_SMOKE = dict(B=1, H=2, N=64, D=32, C=16)
OP2 = {n: s for n, s in registry.EVA_ATTENTION_SHAPES.items() if n != "decode"}  # q_offset, bias: defaults
# and SmolLM2-135M's attention at its fine-tuning shapes (9 query / 3 kv heads, D 64, sliding W 256 C 32)
OP2.update(smollm2_8x2048=dict(B=8, H=9, Hkv=3, Nk=2048, D=64, C=32, W=256, window="sliding"),
           smollm2_2x8192=dict(B=2, H=9, Hkv=3, Nk=8192, D=64, C=32, W=256, window="sliding"))
OP2_SMOKE = {
    "block_d128": dict(B=1, H=2, Hkv=2, Nk=64, D=32, C=8, W=32, window="block"),
    "block_d64_b2": dict(B=2, H=2, Hkv=1, Nk=48, D=16, C=8, W=16, window="block"),
    "sliding_w256": dict(B=1, H=2, Hkv=2, Nk=64, D=32, C=8, W=16, window="sliding"),
    "smollm2_8x2048": dict(B=2, H=3, Hkv=1, Nk=64, D=16, C=8, W=16, window="sliding"),
    "smollm2_2x8192": dict(B=1, H=3, Hkv=1, Nk=96, D=16, C=8, W=16, window="sliding"),
}
DECODE = registry.EVA_ATTENTION_SHAPES["decode"]
DECODE_SMOKE = dict(B=2, H=2, Hkv=2, Nq=1, Nk=64, D=32, C=8, W=32, window="block")
OP3 = registry.EXPERT_MATMUL_SHAPES
OP3_SMOKE = {
    "switchhead262m_v": dict(T=8, S=4, E=4, d_in=32, d_out=16, G_out=2, gated=True),
    "switchhead262m_o": dict(T=8, S=4, E=4, d_in=16, d_out=32, G_in=2, G_out=1, gated=True),
    "sigma_moe_up": dict(T=8, S=4, E=8, d_in=32, d_out=16, G_out=4, gated=False),
    "sigma_moe_down": dict(T=8, S=4, E=8, d_in=16, d_out=32, G_in=4, G_out=1, gated=True),
}
# host time: bench/tools/host_time.py's tiny shapes
HOST_OP1 = dict(B=1, H=2, N=64, D=64, C=16)
HOST_DECODE = dict(B=1, H=8, Hkv=8, Nq=1, Nk=256, D=64, C=16, W=64, window="block")
HOST_PREFILL = dict(B=1, H=2, Hkv=2, Nk=128, D=64, C=16, W=64, window="block")
HOST_OP3 = dict(T=16, S=2, E=4, d_in=64, d_out=64)
HOST_OP3_SMOKE = dict(T=8, S=2, E=4, d_in=16, d_out=16)

CASES = [
    Case("chunk_summaries fwd", "chunk_summaries", "fwd", "device", OP1, OP1_SMOKE),
    *[Case(f"eva_attention fwd {n}", "eva_attention", "fwd", "device", s, OP2_SMOKE[n]) for n, s in OP2.items()],
    Case("eva_attention decode", "eva_attention", "fwd", "device", DECODE, DECODE_SMOKE),
    *[Case(f"expert_matmul fwd {n}", "expert_matmul", "fwd", "device", s, OP3_SMOKE[n]) for n, s in OP3.items()],
    Case("chunk_summaries fwd+bwd", "chunk_summaries", "fwd+bwd", "device", OP1, OP1_SMOKE),
    *[Case(f"eva_attention fwd+bwd {n}", "eva_attention", "fwd+bwd", "device", s, OP2_SMOKE[n])
      for n, s in OP2.items()],
    Case("expert_matmul fwd+bwd switchhead262m_v", "expert_matmul", "fwd+bwd", "device",
         OP3["switchhead262m_v"], OP3_SMOKE["switchhead262m_v"]),
    Case("host bare triton launch", "bare_triton", "fwd", "host", gated=False),
    Case("host chunk_summaries fwd tiny", "chunk_summaries", "fwd", "host", HOST_OP1, OP1_SMOKE),
    Case("host eva_attention decode tiny", "eva_attention", "fwd", "host", HOST_DECODE, DECODE_SMOKE),
    Case("host eva_attention fwd tiny prefill", "eva_attention", "fwd", "host", HOST_PREFILL,
         OP2_SMOKE["block_d128"]),
    Case("host route tiny", "route", "fwd", "host", HOST_OP3, HOST_OP3_SMOKE),
    Case("host expert_matmul fwd tiny", "expert_matmul", "fwd", "host", HOST_OP3, HOST_OP3_SMOKE),
    Case("host chunk_summaries fwd+bwd tiny", "chunk_summaries", "fwd+bwd", "host", HOST_OP1, OP1_SMOKE),
    Case("host eva_attention fwd+bwd tiny prefill", "eva_attention", "fwd+bwd", "host", HOST_PREFILL,
         OP2_SMOKE["block_d128"]),
    Case("host expert_matmul fwd+bwd tiny", "expert_matmul", "fwd+bwd", "host", HOST_OP3, HOST_OP3_SMOKE),
]
OPS = ("chunk_summaries", "eva_attention", "expert_matmul")
# per round: do_bench's warmup / rep (ms; reps: synchronous calls on the CPU), host batches of back-to-back
# calls; --smoke: a few calls (host: a warm-up and 3 batches of 5, so that a side against itself stays within
# 0.5-2 of 1 on a busy CPU; one batch of 2 with no warm-up gave 0.43 to 1.4 for the route's host row)
TIMING = {"device": dict(warmup=25, rep=100), "host": dict(warmup=10, calls=300, batches=5)}
SMOKE_TIMING = {"device": dict(warmup=1, rep=5, reps=2), "host": dict(warmup=1, calls=5, batches=3)}


class NeedsAttention(Exception):
    """Nothing to compare: the message says why (exit status 2)."""


# ---------------------------------------------------------------- git
def git(*args, cwd: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise NeedsAttention(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


COMMIT_FILE = "REGRESS_COMMIT"  # in an exported tree: its full sha


def export(rev: str, folder: Path) -> Path:
    """REV's files (git archive, no history) under folder/<sha12> with its sha in COMMIT_FILE: a tree to
    carry to a machine whose copy of the repository has no git history."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = folder / sha[:12]
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    (path / COMMIT_FILE).write_text(sha + "\n")
    return path


def exported(rev: str, folder: Path) -> tuple[str, Path] | None:
    """(sha, tree) of an exported tree of `rev` (a sha or its prefix) under `folder`, if there is one."""
    for path in sorted(folder.glob("*/" + COMMIT_FILE)):
        sha = path.read_text().strip()
        if len(rev) >= 7 and sha.startswith(rev.lower()):
            return sha, path.parent
    return None


def checkout(rev: str, folder: Path) -> tuple[str, Path]:
    """(full sha, worktree) of `rev`: an exported tree of it under `folder` (`--export`), an existing
    clean worktree, else a new one."""
    found = exported(rev, folder)
    if found:
        return found
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = folder / sha[:12]
    git("worktree", "prune")  # forget worktrees whose folders were deleted
    if path.exists():
        try:
            if git("rev-parse", "HEAD", cwd=path) == sha and not git("status", "--porcelain", cwd=path) \
                    and Path(git("rev-parse", "--show-toplevel", cwd=path)).resolve() == path.resolve():
                return sha, path
        except NeedsAttention:
            pass
        print(f"regress: replacing the stale worktree {path}", file=sys.stderr)
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)
        shutil.rmtree(path, ignore_errors=True)
        git("worktree", "prune")
    folder.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "--detach", str(path), sha)
    return sha, path


def head_state() -> tuple[str, bool]:
    """(HEAD's full sha, whether the working tree differs from it); FLASHSWITCH_COMMIT, where set, names
    the commit of a copy whose git metadata is absent or not its own (taken as clean)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV], False
    return git("rev-parse", "HEAD"), bool(git("status", "--porcelain"))


# ---------------------------------------------------------------- workers
def route_path(args) -> str:
    """How route() sorts on both sides: with the CUDA extension's one-call sort ("device") only when
    REV's extension is built too (--build, which --backend cuda needs), else torch ops on both: head
    with its extension against REV without one times two different paths."""
    return "device" if args.build else "torch"


def _pin_to_host_cpu() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


class Worker:
    """One checkout's timing process (bench/tools/regress_worker.py), one JSON line per request and answer."""

    def __init__(self, side: str, root: Path, smoke_cpu: bool, route: str):
        env = {**os.environ, "PYTHONPATH": str(root), ROUTE_ENV: route}
        env.pop("FLASHSWITCH_CONFIG_DIR", None)  # each side reads its own tuned configs
        env.pop("FLASHSWITCH_POISON", None)  # time what a user runs (the tests' NaN fill costs a kernel)
        if smoke_cpu:
            env["TRITON_INTERPRET"] = "1"
        self.side, self.root = side, root
        # both sides on the same CPU core: host times of two processes on different cores differed by up to
        # 1.4x for the same bare launch (they alternate, so they never share the core)
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_pin_to_host_cpu)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise NeedsAttention(f"the {self.side} worker ({self.root}) exited with status {self.proc.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise NeedsAttention(f"the {self.side} worker ({self.root}) failed:\n{answer['error']}")
        return answer

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def ready(self) -> dict:
        info = self.read()
        imported = Path(info["flashswitch"]).resolve()
        if not imported.is_relative_to(self.root.resolve()):
            raise NeedsAttention(f"the {self.side} worker imported {imported}, not the checkout {self.root}")
        return info

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- timing
def measure(case: Case, workers: dict, *, rounds: int, smoke: bool, dtype: str, backend: str) -> dict:
    """Prepare `case` on both sides, then `rounds` alternating rounds on the sides that can run it."""
    shape = case.smoke if smoke else case.shape
    timing = (SMOKE_TIMING if smoke else TIMING)[case.timer]
    spec = {"op": case.op, "pass": case.pass_, "timer": case.timer, "shape": shape, "dtype": dtype, "seed": 0,
            "timing": timing}
    request = {"cmd": "prepare", "case": spec, "backend": backend}
    unsupported = {side: w.ask(request).get("unsupported") for side, w in workers.items()}
    values = {side: [] for side in workers}
    for r in range(rounds):
        for side in (("rev", "head") if r % 2 == 0 else ("head", "rev")):
            if unsupported[side] is None:
                values[side].append(workers[side].ask({"cmd": "time"})["value"])
    return {"shape": shape, "unsupported": unsupported, "values": values}


def throughput(case: Case, shape: dict, dtype: str, ms: float | None) -> dict:
    """Head's GB/s or TFLOP/s from the registry's cost of the problem (counted on meta tensors)."""
    if ms is None or case.timer != "device" or case.op not in OPS:
        return {}
    spec = registry.get(case.op if case.pass_ == "fwd" else f"{case.op}.bwd")
    tp = spec.throughput(make_inputs(case.op, shape, dtype, "meta"), ms)
    return {spec.unit: tp[spec.unit]} if spec.unit in tp else tp


def evaluate(case: Case, m: dict, threshold: float, slowdown: float, dtype: str) -> dict:
    vals, unsup = m["values"], m["unsupported"]
    head = statistics.median(vals["head"]) * slowdown if vals["head"] else None
    rev = statistics.median(vals["rev"]) if vals["rev"] else None
    ratio = head / rev if head is not None and rev is not None else None
    if unsup["head"] and not unsup["rev"]:
        status = "fail: head cannot run it"
    elif ratio is None:
        status = "no ratio: unsupported at REV" if unsup["rev"] else "no ratio"
    elif not case.gated:
        status = "reference, not gated"
    else:
        status = "fail" if ratio > threshold else "ok"
    return {"name": case.name, "op": case.op, "pass": case.pass_, "timer": case.timer, "shape": m["shape"],
            "dtype": dtype, "unit": "ms" if case.timer == "device" else "us", "rev": rev, "head": head,
            "ratio": ratio, "gated": case.gated, "status": status,
            "rev_rounds": vals["rev"], "head_rounds": [v * slowdown for v in vals["head"]],
            "rev_unsupported": unsup["rev"], "head_unsupported": unsup["head"],
            "head_throughput": throughput(case, m["shape"], dtype, head)}


# ---------------------------------------------------------------- report
def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if v < 100 else f"{v:.1f}"


def against_bare_launch(rows: list[dict], threshold: float) -> None:
    """Host rows' ratios divided by the bare Triton launch's ratio in the same run (the raw one kept as
    raw_ratio): two processes' host speeds differ by up to 1.5x on a shared machine (the bare launch
    alone, 11.9 against 17.6 us on one H200 loan), which says nothing about the code."""
    bare = next((r for r in rows if r["op"] == "bare_triton" and r["ratio"]), None)
    if bare is None:
        return
    for r in rows:
        if r["timer"] == "host" and r["gated"] and r["ratio"] is not None:
            r["raw_ratio"], r["ratio"] = r["ratio"], r["ratio"] / bare["ratio"]
            r["status"] = "fail" if r["ratio"] > threshold else "ok"


def worst(rows: list[dict]) -> dict | None:
    rated = [r for r in rows if r["gated"] and r["ratio"] is not None]
    return max(rated, key=lambda r: r["ratio"]) if rated else None


def markdown(report: dict) -> str:
    h, r = report["head"], report["rev"]
    lines = [f"# Regression gate: head vs {r['ref']} ({report['device']}, {report['backend']} backend"
             f"{', smoke' if report['smoke'] else ''})", "",
             f"head {h['commit'][:12]}{' + uncommitted changes' if h['dirty'] else ''}, REV {r['ref']} = "
             f"{r['commit'][:12]}; torch {report['torch']}, triton {report['triton']}, {report['date']}. "
             f"`{report['command']}`", "",
             f"{report['rounds']} rounds per case, alternating the sides; a round is "
             + ("the median wall time of a few calls (ms; --smoke on the CPU)" if report["device"] == "cpu" else
                "do_bench's median (CUDA events, L2 flushed, ms per call)")
             + " or, for host rows, the CPU time per call over back-to-back calls (us); each side's value is its "
             f"median over rounds. ratio = head / REV (> 1: head slower; host rows: over the bare launch's ratio, "
             f"each process's own host speed); a gated ratio above {report['threshold']} fails; head failing a case "
             "that REV runs fails too. route(): "
             + ("the extension's device sort on both sides" if report.get("route") == "device" else
                "torch ops on both sides (REV's extension is not built)") + ".", "",
             "| case | shape | unit | REV | head | ratio | head throughput | status |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for c in report["cases"]:
        tp = " ".join(f"{v:.3g} {k}" for k, v in c["head_throughput"].items())
        status = c["status"]
        for side in ("rev", "head"):
            if c[f"{side}_unsupported"]:
                status += f"; {'REV' if side == 'rev' else 'head'}: {c[f'{side}_unsupported'][:120]}"
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        lines.append(f"| {c['name']} | {registry.describe(c['shape'])} | {c['unit']} | {fmt(c['rev'])} | "
                     f"{fmt(c['head'])} | {ratio} | {tp} | {status.replace('|', '/')} |")
    w = report["worst"]
    lines += ["", f"worst ratio: {w['ratio']:.2f} ({w['name']})" if w else "worst ratio: none (no gated case ran "
              "on both sides)"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main
def select(args) -> list[Case]:
    """The cases of --ops whose names contain one of --cases, with the bare Triton launch whenever a host
    row is in (the reference those rows are read against)."""
    chosen = [c for c in CASES if c.family in args.ops and (not args.cases or any(s in c.name for s in args.cases))]
    host = any(c.timer == "host" for c in chosen)
    return [c for c in CASES if c in chosen or (host and c.op == "bare_triton")]


def run(args) -> int:
    gpu = torch.cuda.is_available()
    if not gpu and not args.smoke:
        raise NeedsAttention("bench/tools/regress.py times kernels on a GPU and none is visible here; "
                             "--smoke runs its tiny cases on the CPU (TRITON_INTERPRET=1) to check the plumbing")
    if args.rounds is not None and args.rounds < 1:
        raise NeedsAttention("--rounds must be at least 1")
    cases = select(args)
    if not cases:
        raise NeedsAttention("no case matches --ops / --cases")
    rounds = args.rounds or (2 if args.smoke else 5)
    dtype = "bf16" if gpu else "fp32"
    slowdown = float(os.environ.get(SLOWDOWN_ENV, "1"))
    head_sha, dirty = head_state()
    rev_sha, rev_root = checkout(args.against, args.worktree_dir.resolve())
    if args.build:
        env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 4))}
        print(f"regress: building the CUDA extension in {rev_root}", file=sys.stderr)
        if subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=rev_root, env=env).returncode:
            raise NeedsAttention(f"the build in {rev_root} failed")
    route = route_path(args)
    workers = {side: Worker(side, root, not gpu, route) for side, root in (("rev", rev_root), ("head", ROOT))}
    rows = []
    try:
        for w in workers.values():  # both import in parallel
            w.ready()
        for case in cases:
            m = measure(case, workers, rounds=rounds, smoke=args.smoke, dtype=dtype, backend=args.backend)
            row = evaluate(case, m, args.threshold, 1.0 if case.op == "bare_triton" else slowdown, dtype)
            rows.append(row)
            ratio = "" if row["ratio"] is None else f"ratio {row['ratio']:.3f}"
            print(f"{case.name:42s} REV {fmt(row['rev']):>9s} head {fmt(row['head']):>9s} {row['unit']:2s} "
                  f"{ratio:12s} {row['status']}", flush=True)
    finally:
        for w in workers.values():
            w.close()
    against_bare_launch(rows, args.threshold)
    failed = [r["name"] for r in rows if r["status"].startswith("fail")]
    w = worst(rows)
    report = {
        "command": shlex.join(["python", os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "bench/tools/regress.py",
                               *sys.argv[1:]]),
        "date": now(), "device": device_name(), **{k: v for k, v in env_info().items() if k != "device"},
        "backend": args.backend, "route": route, "smoke": args.smoke, "rounds": rounds, "threshold": args.threshold,
        "head": {"commit": head_sha, "dirty": dirty, "root": str(ROOT)},
        "rev": {"ref": args.against, "commit": rev_sha, "root": str(rev_root)},
        **({"test_slowdown": slowdown} if slowdown != 1 else {}),
        "cases": rows, "worst": {"name": w["name"], "ratio": w["ratio"]} if w else None, "failed": failed,
    }
    md = markdown(report)
    print("\n" + md, end="")
    out_dir = args.out_dir or (results_dir() if gpu else None)
    if out_dir is None:
        print("no GPU: nothing written (--out-dir DIR keeps the tables)")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{args.out_name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out_dir / f"{args.out_name}.md").write_text(md)
        print(f"wrote {out_dir / args.out_name}.json and .md")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, metavar="REV", help="the git revision to compare with")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--cases", nargs="+", metavar="SUBSTR", help="only cases whose name contains one of these")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per case (default 5; --smoke 2)")
    ap.add_argument("--threshold", type=float, default=1.05, help="the largest ratio head / REV that passes")
    ap.add_argument("--backend", default="triton", choices=("triton", "cuda"))
    ap.add_argument("--build", action="store_true", help="build REV's CUDA extension in its worktree first")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few calls: runs on the CPU")
    ap.add_argument("--out-dir", type=Path, default=None, help="default bench/results/<device>/")
    ap.add_argument("--out-name", default="regress", help="file stem (e.g. regress_61b62cb)")
    ap.add_argument("--worktree-dir", type=Path, default=ROOT / ".regress", help="where REV's worktree goes")
    ap.add_argument("--export", action="store_true",
                    help="only write REV's files under --worktree-dir, for a machine without git history")
    args = ap.parse_args()
    try:
        if args.export:
            print(export(args.against, args.worktree_dir.resolve()))
            return 0
        return run(args)
    except NeedsAttention as err:
        print(f"regress: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
