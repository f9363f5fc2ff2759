"""Benchmark-suite setup: collect bench_*.py files, skip the whole suite without a GPU or without
pytest-benchmark. Run it through `flashswitch bench` (writes bench/results/<device>/<op>.json), or
`python -m pytest bench/ops/bench_<op>.py --benchmark-json=bench/results/<device>/<op>.json`."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common, baselines`


def pytest_collect_file(file_path, parent):
    # bench_*.py named on the command line are collected by pytest itself; this adds them when a folder is given
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-benchmark, which may be missing
def pytest_benchmark_update_json(config, benchmarks, output_json):
    from common import provenance
    output_json.update(provenance())


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "the benchmarks need a CUDA GPU"
    elif importlib.util.find_spec("pytest_benchmark") is None:
        reason = "pytest-benchmark is not installed (pip install pytest-benchmark)"
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            item.add_marker(skip)
