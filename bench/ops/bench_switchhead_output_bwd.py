"""SwitchHead's fused output projection forward + backward, bf16, T = 16384 tokens: one training step of the
op on the output projections of the papers' SwitchHead 262M and 47M models.

TFLOP/s counts 6·D·d per routed pair (forward y, backward da and dW). Backends, same inputs:
  - triton: the fused forward and the backward kernels (gradients of a, gates and weight);
  - reference: autograd of the PyTorch version.
"""
import pytest

from common import bench_op
from flashswitch.registry import SWITCHHEAD_OUTPUT_SHAPES

OP = "switchhead_output.bwd"
BACKENDS = ("triton", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SWITCHHEAD_OUTPUT_SHAPES), ids=list(SWITCHHEAD_OUTPUT_SHAPES))
def test_switchhead_output_bwd(benchmark, name, backend):
    bench_op(benchmark, OP, SWITCHHEAD_OUTPUT_SHAPES[name], backend, dtype="bf16", label=name)
