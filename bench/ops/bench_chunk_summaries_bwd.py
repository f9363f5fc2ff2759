"""Op 1 (chunk_summaries) forward + backward, bf16: one training step of the op. GB/s counts the
essential traffic of both passes (forward: k, v read, summaries and lse written; backward: k, v, d k_sum,
d v_sum read, d k and d v written), against the measured copy ceiling. Backends: triton (forward +
backward kernels) and reference (autograd of the PyTorch reference, eager)."""
import pytest

from common import bench_op, shape_id

OP = "chunk_summaries.bwd"
SHAPES = [
    dict(B=1, H=16, N=32768, D=128, C=16),
    dict(B=2, H=16, N=8192, D=128, C=16),
    dict(B=1, H=16, N=32768, D=64, C=16),
    dict(B=1, H=16, N=32768, D=128, C=16, omega="chunk", key_weight=True),
]
BACKENDS = ("triton", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_chunk_summaries_bwd(benchmark, shape, backend):
    bench_op(benchmark, OP, shape, backend, dtype="bf16")
