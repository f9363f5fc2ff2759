"""Op 1 (chunk_summaries) throughput, bf16: the two issue shapes and a sequence-length sweep.

Bytes counted per call: k and v read once, k_sum and v_sum written once, lse (fp32) written once.
"""
import pytest

from common import BACKENDS, bench_op, shape_id, unique
from flashswitch import registry

OP = "chunk_summaries"
HEADLINE = list(registry.CHUNK_SUMMARIES_SHAPES.values())
SWEEP = [dict(B=1, H=16, N=n, D=128, C=16) for n in (2048, 4096, 8192, 16384, 32768, 65536)]
SHAPES = unique(HEADLINE + SWEEP)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_chunk_summaries(benchmark, shape, backend):
    if backend == "compiled" and shape not in HEADLINE:
        pytest.skip("torch.compile'd reference: issue shapes only (one compile per shape)")
    bench_op(benchmark, OP, shape, backend, dtype="bf16")
