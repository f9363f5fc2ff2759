"""SwitchHead's fused output projection (switchhead_output) throughput, bf16, T = 16384 tokens: the output
projections of the papers' SwitchHead 262M and 47M models (registry.SWITCHHEAD_OUTPUT_SHAPES).

TFLOP/s counts 2·D·d per routed (token, slot) pair, op 3's count for the same projection (the kernels
multiply all E experts of a head: E / k times as many). Backends, same inputs:
  - triton: the gate table and the one dense GEMM over every expert;
  - reference: the PyTorch version (dense gate table, one matmul), eager.
bench/tools/switchhead_output.py compares it with op 3 and the dense roof.
"""
import pytest

from common import bench_op
from flashswitch.registry import SWITCHHEAD_OUTPUT_SHAPES

OP = "switchhead_output"
BACKENDS = ("triton", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SWITCHHEAD_OUTPUT_SHAPES), ids=list(SWITCHHEAD_OUTPUT_SHAPES))
def test_switchhead_output(benchmark, name, backend):
    bench_op(benchmark, OP, SWITCHHEAD_OUTPUT_SHAPES[name], backend, dtype="bf16", label=name)
