"""Shared pieces of the benchmark suite, the plot script and the ceilings script.

Every benchmark case is (op, shape, backend, dtype). Backends: the kernel backends ("triton",
"cuda", "cupy", each with its tuned or default config), "reference" (the PyTorch reference, eager)
and "compiled" (the PyTorch reference under torch.compile). Each case is timed twice:
  - `benchmark.pedantic` on a callable that runs the op and then torch.cuda.synchronize()
    (wall clock per call, launch overhead included): pytest-benchmark's own statistics;
  - `triton.testing.do_bench` (median of CUDA-event timings, L2 flushed between runs): stored in
    `benchmark.extra_info["ms"]` with the throughput, and used by the tables and plots.
Results go to bench/results/<device>/<op>.json (pytest-benchmark --benchmark-json).
"""
from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
if str(ROOT) not in sys.path:  # a checkout used without installing the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flashswitch import registry  # noqa: E402
from flashswitch.autotune import store  # noqa: E402
from flashswitch.autotune.tune import bench_ms, versions  # noqa: E402

BACKENDS = ("triton", "cuda", "cupy", "reference", "compiled")
KERNEL_BACKENDS = ("triton", "cuda", "cupy")
BACKEND_ORDER = {b: i for i, b in enumerate(("reference", "compiled") + KERNEL_BACKENDS)}
RESULTS = BENCH_DIR / "results"
# fallbacks when bench/results/<device>/ceilings.json is missing: H200 copy bandwidth (bytes read + written)
DEFAULT_COPY_GBPS = 4300.0
DEFAULT_MATMUL_TFLOPS = None
PEDANTIC_ROUNDS = 20
PEDANTIC_WARMUP = 3


def gpu() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if gpu() else "cpu"


def device_slug(name: str | None = None) -> str:
    return store.device_slug(name or device_name())


def results_dir(name: str | None = None) -> Path:
    return RESULTS / device_slug(name)


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
    from flashswitch import _common as C
    if backend not in KERNEL_BACKENDS:
        return True
    try:
        return C.backend_available(backend, torch.device("cuda"))
    except Exception:
        return False


# ---------------------------------------------------------------- one benchmark case
def time_case(benchmark, fn, *, spec: registry.OpSpec, problem: dict, backend: str, shape: dict,
              dtype: str) -> dict:
    """Time `fn` with do_bench (median, CUDA events) and with benchmark.pedantic (synchronizing
    callable); record everything in benchmark.extra_info and return it."""
    ms = bench_ms(fn, warmup=25, rep=100)  # also compiles / warms up

    def synced():
        fn()
        torch.cuda.synchronize()

    benchmark.group = f"{spec.name} {registry.describe(shape)} {dtype}"
    benchmark.pedantic(synced, rounds=PEDANTIC_ROUNDS, warmup_rounds=PEDANTIC_WARMUP, iterations=1)
    cost = spec.cost(problem)
    info = {"op": spec.name, "backend": backend, "dtype": dtype, "shape": dict(shape), "x": spec.bench_x,
            "ms": ms, "bytes": cost.get("bytes"), "flops": cost.get("flops"), **spec.throughput(problem, ms),
            **env_info()}
    benchmark.extra_info.update(info)
    return info


def bench_op(benchmark, op: str, shape: dict, backend: str, dtype: str = "bf16", seed: int = 0) -> dict:
    """One case of the suite: skip an unusable backend, build the problem on the GPU, time it."""
    import pytest
    if not backend_usable(backend):
        pytest.skip(f"backend {backend} is not usable here (see `flashswitch info`)")
    spec = registry.get(op)
    problem = spec.random_problem(**shape, dtype=dtype, device="cuda", seed=seed)
    fn = make_callable(spec, backend, problem)
    return time_case(benchmark, fn, spec=spec, problem=problem, backend=backend, shape=shape, dtype=dtype)


# ---------------------------------------------------------------- ceilings
def load_ceilings(folder: Path) -> dict:
    """Measured ceilings (bench/ceilings.py) or the defaults, with "source" saying which."""
    path = Path(folder) / "ceilings.json"
    try:
        data = json.loads(path.read_text())
        return {"copy_GBps": float(data["copy_GBps"]),
                "matmul_TFLOPs": data.get("bf16_matmul_TFLOPs"),
                "source": f"measured ({path.name}, {data.get('created', '?')})"}
    except (OSError, ValueError, KeyError, TypeError):
        return {"copy_GBps": DEFAULT_COPY_GBPS, "matmul_TFLOPs": DEFAULT_MATMUL_TFLOPS,
                "source": f"nominal {DEFAULT_COPY_GBPS / 1000:.1f} TB/s copy bandwidth"}


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
