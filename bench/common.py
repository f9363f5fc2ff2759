"""Shared pieces of bench/ops (the benchmark suite), bench/e2e and bench/tools (plot, ceilings, ...).

Every benchmark case is (op, shape, backend, dtype). Backends: the kernel backends ("triton",
"cuda", "cupy", each with its tuned or default config), "reference" (the PyTorch reference, eager),
"compiled" (the PyTorch reference under torch.compile) and the baselines of bench/baselines.py that a
bench file passes as `builders` (flex, sdpa_causal, grouped_mm_pipeline, ...: what a user would run
instead). A baseline that cannot run a problem (baselines.Unsupported) is recorded as an
"unsupported" row and the case is skipped. Each case is timed twice:
  - `benchmark.pedantic` on a callable that runs the op and then torch.cuda.synchronize()
    (wall clock per call, launch overhead included): pytest-benchmark's own statistics;
  - `triton.testing.do_bench` (median of CUDA-event timings, L2 flushed between runs): stored in
    `benchmark.extra_info["ms"]` with the throughput, and used by the tables and plots.
Results go to bench/results/<device>/<op>.json (pytest-benchmark --benchmark-json).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
if str(ROOT) not in sys.path:  # a checkout used without installing the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flashswitch import backends, registry  # noqa: E402
from flashswitch.autotune import store  # noqa: E402
from flashswitch.autotune.tune import bench_ms, versions  # noqa: E402

KERNEL_BACKENDS = backends.KERNELS
BACKENDS = KERNEL_BACKENDS + ("reference", "compiled")
BASELINES = ("sdpa_causal", "cat_sdpa_decode", "flex", "flex_nocat", "dense_equal_macs", "grouped_mm_pipeline")
BACKEND_ORDER = {b: i for i, b in enumerate(("reference", "compiled") + BASELINES + KERNEL_BACKENDS)}
RESULTS = BENCH_DIR / "results"
# fallbacks when bench/results/<device>/ceilings.json is missing: H200 copy bandwidth (bytes read + written)
DEFAULT_COPY_GBPS = 4300.0
DEFAULT_MATMUL_TFLOPS = None
PEDANTIC_ROUNDS = 20
PEDANTIC_WARMUP = 3
# each finished case is also appended to this file (one pytest-benchmark-shaped entry per line), so a
# run cut short by a time limit keeps its cases: `flashswitch bench` sets it to <op>.cases.jsonl
CASES_ENV = "FLASHSWITCH_BENCH_CASES"
# the commit of a tree without its git history (a copy sent to a GPU machine), set by whoever sends it
COMMIT_ENV = "FLASHSWITCH_COMMIT"


def gpu() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if gpu() else "cpu"


def device_slug(name: str | None = None) -> str:
    return store.device_slug(name or device_name())


def results_dir(name: str | None = None) -> Path:
    return RESULTS / device_slug(name)


def log_case(info: dict, benchmark=None) -> None:
    """Append one finished case (extra_info and the pedantic median in seconds) to $FLASHSWITCH_BENCH_CASES."""
    path = os.environ.get(CASES_ENV)
    if not path:
        return
    median = None
    try:
        median = float(benchmark.stats.stats.median)
    except AttributeError:  # no statistics (an unsupported row)
        pass
    with open(path, "a") as f:
        f.write(json.dumps({"extra_info": info, "stats": {"median": median}}) + "\n")


def env_info() -> dict:
    info = {"device": device_name(), **versions()}
    if gpu():
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def shape_id(shape: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in shape.items())


def unique(shapes) -> list[dict]:
    out = []
    for s in shapes:
        if s not in out:
            out.append(dict(s))
    return out


# ---------------------------------------------------------------- callables
def make_callable(spec: registry.OpSpec, backend: str, problem: dict):
    """The call to time for `backend` (kernels: config=None, i.e. the tuned or default config)."""
    if backend in KERNEL_BACKENDS:
        return spec.kernel_callable(backend, None, problem)
    if backend == "reference":
        return spec.torch_callable(problem)
    if backend == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across the sweep
        fn = torch.compile(spec.torch_fn(), dynamic=False)
        args = spec._ref_args(problem)
        return lambda: fn(**args)
    raise ValueError(f"unknown bench backend {backend!r}; expected one of {BACKENDS}")


def backend_usable(backend: str) -> bool:
    if backend not in KERNEL_BACKENDS:
        return True
    try:
        return backends.available(backend, torch.device("cuda"))
    except Exception:
        return False


# ---------------------------------------------------------------- one benchmark case
def _case_info(spec: registry.OpSpec, backend: str, shape: dict, dtype: str, label) -> dict:
    info = {"op": spec.name, "backend": backend, "dtype": dtype, "shape": dict(shape), "x": spec.bench_x,
            "unit": spec.unit}
    if label:
        info["label"] = label
    return info


def time_ms(fn, gpu: bool) -> float:
    """do_bench's median on a GPU; on the CPU (smoke runs) the median wall clock of a few calls, a number
    that means nothing but shows the code path ran."""
    if gpu:
        return bench_ms(fn, warmup=25, rep=100)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rotating_ms(fns, reps: int = 200) -> float:
    """Median CUDA-event time of one call, cycling through `fns` (the same op on distinct input sets
    that together exceed the L2 several times) with no cache flush in between.

    do_bench flushes the L2 by zeroing 256 MB before every call, which leaves up to one L2 of dirty
    lines that the timed kernel then writes back: ~12 us of extra HBM traffic on the H200, a large share
    of a memory-bound call of 30-100 us. Rotating inputs keeps every read cold without that write-back.
    """
    for f in fns * 3:
        f()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2]


def read_flush_ms(fn, reps: int = 100) -> float:
    """Median CUDA-event time of one call after flushing the L2 by *reading* 512 MB (a sum into one
    value) instead of do_bench's zeroing: every input is as cold as under do_bench, but the L2 then
    holds only clean lines, so the timed call does not write back the flush's own data. The sum's
    ~125 us of GPU time hides up to that much host work per call (do_bench's flush: ~60 us, less
    than the 144 us a decode call costs this device's host, measured on the H200), so that the events time
    the kernels, not a GPU waiting for the host."""
    buf = torch.ones(128 << 20, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.sum(buf, dim=0, out=sink)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2]


def graph_ms(fns) -> float | None:
    """Kernel-only time: median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`) of a call
    that cycles through `fns`, so neither the host's per-call work nor an L2 flush is in it. None
    when the call cannot be captured."""
    from triton.testing import do_bench_cudagraph
    turn = [0]

    def cycle():
        fns[turn[0] % len(fns)]()
        turn[0] += 1

    try:
        return float(do_bench_cudagraph(cycle, rep=50, return_mode="median"))
    except Exception:  # a backend that cannot be captured: report no number rather than fail the case
        torch.cuda.synchronize()
        return None


def rotation_sets(nbytes: int) -> int:
    """How many input sets make a cold rotation: at least 4x the L2, at most 8 sets or 8 GB."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if gpu() else 0
    want = -(-4 * l2 // max(nbytes, 1))
    return int(max(2, min(8, want, (8 << 30) // max(nbytes, 1))))


def time_case(benchmark, fn, *, spec: registry.OpSpec, problem: dict, backend: str, shape: dict,
              dtype: str, label: str | None = None, rotate=None) -> dict:
    """Time `fn` with do_bench (median, CUDA events) and with benchmark.pedantic (synchronizing
    callable); `rotate` (a list of the same call on other input sets) adds the rotating-inputs median
    (`ms_rotating`), the CUDA-graph replay (`ms_graph`) and the read-flush median (`ms_read_flush`).
    Record everything in benchmark.extra_info and return it."""
    ms = bench_ms(fn, warmup=25, rep=100)  # also compiles / warms up
    rot = {}
    if rotate:
        rms = rotating_ms([fn] + list(rotate))
        gms = graph_ms([fn] + list(rotate))
        fms = read_flush_ms(fn)
        rot = {"ms_rotating": rms, "rotating_sets": 1 + len(rotate), "ms_graph": gms, "ms_read_flush": fms,
               **{f"{k} read flush": v for k, v in spec.throughput(problem, fms).items()},
               **{f"{k} rotating": v for k, v in spec.throughput(problem, rms).items()},
               **{f"{k} graph": v for k, v in (spec.throughput(problem, gms) if gms else {}).items()}}

    def synced():
        fn()
        torch.cuda.synchronize()

    benchmark.group = f"{spec.name} {registry.describe(shape)} {dtype}"
    benchmark.pedantic(synced, rounds=PEDANTIC_ROUNDS, warmup_rounds=PEDANTIC_WARMUP, iterations=1)
    cost = spec.cost(problem)
    info = {**_case_info(spec, backend, shape, dtype, label),
            "ms": ms, "bytes": cost.get("bytes"), "flops": cost.get("flops"), **spec.throughput(problem, ms),
            **rot, **env_info(), **provenance()}
    benchmark.extra_info.update(info)
    log_case(info, benchmark)
    return info


def record_unsupported(benchmark, *, spec: registry.OpSpec, backend: str, shape: dict, dtype: str, reason: str,
                       label: str | None = None) -> dict:
    """A row saying `backend` cannot run this case (kept in the JSON so the tables show it); the
    pytest-benchmark statistics of such a row are those of an empty call and mean nothing."""
    benchmark.group = f"{spec.name} {registry.describe(shape)} {dtype}"
    benchmark.pedantic(lambda: None, rounds=1, warmup_rounds=0, iterations=1)
    info = {**_case_info(spec, backend, shape, dtype, label), "ms": None, "unsupported": reason, **env_info(),
            **provenance()}
    benchmark.extra_info.update(info)
    log_case(info)
    return info


# one shape's problems at a time are kept: the cases of one shape (all backends) share them
_PROBLEM: dict = {"key": None, "problems": []}


def get_problems(spec: registry.OpSpec, shape: dict, dtype: str, seed: int = 0, count: int = 1) -> list[dict]:
    """`count` random problems of a case on the GPU (seeds seed, seed + 1, ...): the first is the timed
    one, the others the rotation sets; reused by consecutive cases of the same shape (building a
    decode problem of several GB per backend would cost more than timing it)."""
    key = (spec.name, json.dumps(shape, sort_keys=True), dtype, seed)
    if _PROBLEM["key"] != key:
        _PROBLEM.update(key=None, problems=[])
        if gpu():
            torch.cuda.empty_cache()
        _PROBLEM["key"] = key
    probs = _PROBLEM["problems"]
    while len(probs) < count:
        probs.append(spec.random_problem(**shape, dtype=dtype, device="cuda", seed=seed + len(probs)))
    return probs[:count]


def get_problem(spec: registry.OpSpec, shape: dict, dtype: str, seed: int = 0) -> dict:
    """The random problem of a case on the GPU, reused by consecutive cases of the same shape."""
    return get_problems(spec, shape, dtype, seed)[0]


def bench_op(benchmark, op: str, shape: dict, backend: str, dtype: str = "bf16", seed: int = 0, *,
             builders: dict | None = None, label: str | None = None) -> dict:
    """One case of the suite: skip an unusable backend, build the problem on the GPU, time it.

    `builders` maps extra backend names (baselines) to `build(problem) -> callable`; a builder raising
    `baselines.Unsupported` gives an "unsupported" row and a skipped case. `label` names the shape in
    the tables and plots."""
    import pytest
    from baselines import Unsupported
    if not backend_usable(backend):
        pytest.skip(f"backend {backend} is not usable here (see `flashswitch info`)")
    spec = registry.get(op)
    problem = get_problem(spec, shape, dtype, seed)
    try:
        if builders and backend in builders:
            fn = builders[backend](problem)
        else:
            fn = make_callable(spec, backend, problem)
    except Unsupported as err:
        record_unsupported(benchmark, spec=spec, backend=backend, shape=shape, dtype=dtype, reason=str(err),
                           label=label)
        pytest.skip(f"{backend} unsupported: {err}")
    rotate = None
    wants_rotate = spec.bench_rotate(shape) if callable(spec.bench_rotate) else spec.bench_rotate
    if wants_rotate and backend != "compiled":  # (compiled: one compile per problem is too slow)
        build = builders[backend] if builders and backend in builders else (
            lambda prob: make_callable(spec, backend, prob))
        n = rotation_sets(spec.cost(problem).get("bytes") or 0)
        rotate = [build(p) for p in get_problems(spec, shape, dtype, seed, n)[1:]]
    return time_case(benchmark, fn, spec=spec, problem=problem, backend=backend, shape=shape, dtype=dtype,
                     label=label, rotate=rotate)


# ---------------------------------------------------------------- ceilings
def load_ceilings(folder: Path) -> dict:
    """Measured ceilings (bench/tools/ceilings.py) or the defaults, with "source" saying which."""
    path = Path(folder) / "ceilings.json"
    try:
        data = json.loads(path.read_text())
        return {"copy_GBps": float(data["copy_GBps"]),
                "matmul_TFLOPs": data.get("bf16_matmul_TFLOPs"),
                "source": f"measured ({path.name}, {provenance_line(data)})"}
    except (OSError, ValueError, KeyError, TypeError):
        return {"copy_GBps": DEFAULT_COPY_GBPS, "matmul_TFLOPs": DEFAULT_MATMUL_TFLOPS,
                "source": f"nominal {DEFAULT_COPY_GBPS / 1000:.1f} TB/s copy bandwidth"}


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def source_commit() -> str | None:
    """The commit of the code that runs: $FLASHSWITCH_COMMIT where set, else this checkout's HEAD with
    "-dirty" when a tracked file differs from it; None when neither is known (a copy outside git)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or Path(top.stdout.strip()).resolve() != ROOT.resolve():  # not a repo of its own
            return None
        head = git("rev-parse", "--short=12", "HEAD").stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + "-dirty" if dirty else head) or None


def provenance() -> dict:
    """What every results file records of its run: {"commit", "date"} (UTC, ISO 8601)."""
    return {"commit": source_commit(), "date": now()}


def provenance_line(data: dict) -> str:
    """A table header's statement of where its numbers come from ("created": files written before
    "date" was recorded)."""
    return f"commit {data.get('commit') or 'unknown'}, {data.get('date') or data.get('created') or 'date unknown'}"
