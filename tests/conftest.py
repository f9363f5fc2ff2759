"""Test setup: hypothesis profiles, NaN-poisoned kernel outputs, device/backend parametrization.

Profiles (HYPOTHESIS_PROFILE): "ci" (the CPU default: Triton interpreter, few small examples) and "gpu"
(the default when a GPU is visible) are deterministic: derandomized, no example database, so a clean
clone gives the same result on every run. "explore" draws new examples each run (the default count of
the device; `--hypothesis-seed N` repeats one), "fuzz" draws 2000 per test for long GPU runs; both
print a failing example's reproduction blob. Without a GPU the Triton kernels run under
TRITON_INTERPRET=1 on CPU tensors; CUDA/CuPy tests skip. A test whose asset (a model file, the corpus, a
plotting package) is missing skips, or fails under FLASHSWITCH_REQUIRE_ASSETS=1 (CI): `missing_asset`.
`./fs test` runs the suite over pytest-xdist workers, one per core: each worker's torch (and the processes
its tests start) takes its share of the cores, and a test may run next to any other one, so a test keeps
its files under tmp_path and holds `exclusive(name)` around what two processes must not share.
"""
import importlib
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel module is imported
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of N pytest-xdist workers (./fs test): its share of the cores
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _share = max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))  # the processes a test starts take the same share
os.environ["FLASHSWITCH_POISON"] = "1"  # every kernel output starts as NaN: unwritten elements fail

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from flashswitch.backends import KERNELS  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True, database=None)
_DEFAULT = "gpu" if torch.cuda.is_available() else "ci"
settings.register_profile("ci", max_examples=12, derandomize=True, **_common)
# "gpu" runs a third of what "explore" draws on the device: every strategy stays the same (each branch
# reachable), the long draws are explore's / fuzz's job and the whole suite fits one GPU visit
settings.register_profile("gpu", max_examples=20, derandomize=True, **_common)
settings.register_profile("explore", max_examples=60 if _DEFAULT == "gpu" else 12, **_common)
settings.register_profile("fuzz", max_examples=2000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _DEFAULT))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_backends():
    """Kernel backends that can run in this process (triton runs on the CPU under the interpreter)."""
    from flashswitch import backends
    return backends.usable(torch.device(DEVICE), KERNELS)


TIMES_ENV = "FLASHSWITCH_TEST_TIMES"  # a file: one "seconds<TAB>outcome<TAB>test id" line per finished test
FAILURES_ENV = "FLASHSWITCH_TEST_FAILURES"  # a file: each failure's report, as it happens


def pytest_runtest_logreport(report):
    """Append each test's call time to $FLASHSWITCH_TEST_TIMES and each failure's report to
    $FLASHSWITCH_TEST_FAILURES as they finish, so that a run cut by its time limit still tells which
    tests took the time and why those that failed did (pytest prints both only at the end)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller gets every worker's reports
        return
    path = os.environ.get(TIMES_ENV)
    if path and (report.when == "call" or report.failed):
        with open(path, "a") as fh:
            fh.write(f"{report.duration:.2f}\t{report.when}:{report.outcome}\t{report.nodeid}\n")
    path = os.environ.get(FAILURES_ENV)
    if path and report.failed:
        with open(path, "a") as fh:
            fh.write(f"==== {report.when} {report.nodeid}\n{report.longreprtext[-6000:]}\n\n")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    if torch.cuda.is_available():  # gpu_spread: on the GPU only the chosen cases of a parametrization
        kept, dropped = [], []
        for item in items:
            mark = item.get_closest_marker("gpu_spread")
            keep = mark is None or not hasattr(item, "callspec") or mark.kwargs["keep"](**item.callspec.params)
            (kept if keep else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def gpu_spread(keep):
    """Mark: on the GPU, run only the parametrized cases for which keep(**params) is true (the others are
    deselected); on the CPU every case is collected as before. For GPU sweeps whose every combination
    costs compiles: `keep` picks a deterministic spread that still has every value of every parameter,
    and every pair of values where the docstring says so."""
    return pytest.mark.gpu_spread(keep=keep)


_ABSENT = "<absent>"


def covering_indices(configs: list) -> list:
    """Sorted indices of a deterministic spread of `configs` (dicts): the first, middle and last, then,
    greedily, the config that adds the most (key, value) pairs not yet present (lowest index on a tie)
    until every (key, value) pair of the list is present at least once (a key a config lacks counts as
    the value "absent")."""
    if not configs:
        return []
    keys = sorted({k for c in configs for k in c})
    pairs = [{(k, repr(c.get(k, _ABSENT))) for k in keys} for c in configs]
    picked = sorted({0, len(configs) // 2, len(configs) - 1})
    seen = set().union(*(pairs[i] for i in picked))
    want = set().union(*pairs)
    while seen != want:
        i = max(range(len(configs)), key=lambda j: (len(pairs[j] - seen), -j))
        picked.append(i)
        seen |= pairs[i]
    return sorted(picked)


@pytest.fixture(params=KERNELS)
def backend(request):
    """Each kernel backend; skipped where it cannot run here."""
    if request.param not in kernel_backends():
        pytest.skip(f"backend {request.param} is not available on {DEVICE}")
    return request.param


@pytest.fixture
def device():
    return DEVICE


def dtypes_here():
    """bf16 arithmetic is missing/wrong in the Triton interpreter: test it on the GPU only."""
    if DEVICE == "cuda":
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16]


REQUIRE_ASSETS_ENV = "FLASHSWITCH_REQUIRE_ASSETS"  # CI sets it: ./fs installs every asset, so none may be missing


def missing_asset(what: str, install: str):
    """Skip the test (or module) that needs `what`; under FLASHSWITCH_REQUIRE_ASSETS=1 fail it instead, so
    that a failed install cannot turn a CI run's tests into skips."""
    why = f"{what} is missing: {install}"
    if os.environ.get(REQUIRE_ASSETS_ENV) == "1":
        pytest.fail(f"{why} ({REQUIRE_ASSETS_ENV}=1: test assets are required)", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def exclusive(name: str, timeout: float = 1800):
    """A lock held by one process at a time (a file in the temp folder, one per user), as a context manager:
    around what two tests running at once (pytest-xdist workers, or another run of the suite) must not
    share."""
    from filelock import FileLock  # a dependency of torch
    user = os.getuid() if hasattr(os, "getuid") else 0
    return FileLock(os.path.join(tempfile.gettempdir(), f"flashswitch-tests-{user}-{name}.lock"), timeout=timeout)


def import_asset(module: str, install: str):
    """The module, or `missing_asset` when it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing_asset(f"the {module!r} package", install)


def pytest_report_header(config):
    prof = settings()
    name = getattr(settings, "_current_profile", None) or os.environ.get("HYPOTHESIS_PROFILE", "?")
    return [f"flashswitch: device {DEVICE}, kernel backends {kernel_backends()}, "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
            f"hypothesis profile {name!r}: max_examples={prof.max_examples}"]


def dense_causal(q, k, v, q_offset=None, scale=None):
    """Exact causal softmax attention in fp64, (o, lse): query i at position q_offset + i (default
    Nk - Nq + i) sees keys j <= it; k, v [B, Hkv, Nk, D] shared by H // Hkv query heads each."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    off = Nk - Nq if q_offset is None else q_offset
    k = k.to(torch.float64).repeat_interleave(H // Hkv, 1)
    v = v.to(torch.float64).repeat_interleave(H // Hkv, 1)
    s = D ** -0.5 if scale is None else scale
    logits = s * q.to(torch.float64) @ k.transpose(-1, -2)
    t = torch.arange(Nq, device=q.device)[:, None] + off
    logits = logits.masked_fill(torch.arange(Nk, device=q.device)[None, :] > t, float("-inf"))
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


def cuda_graph_capture(step):
    """(graph, outputs): `step` warmed up on a side stream (compiles, autotunes, allocates), then captured
    once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
