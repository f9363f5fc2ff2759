"""Op 3 (expert_matmul) throughput, bf16, T = 16384 tokens: the paper cases of SPEC "Op 3"
(`reference.expert_matmul.paper_shapes`): SwitchHead 262M V and O, sigma-MoE up and down, SwitchHead
47M V and O.

TFLOP/s counts 2·d_in·d_out per routed (token, slot) pair (P = T·S pairs). Backends, all timed in
this run:
  - triton, cuda, cupy: `run_kernel`, routing included (device sort, no host sync) + the kernel;
  - grouped_mm_pipeline: what a user writes with torch._grouped_mm (argsort, offsets, gather, grouped
    GEMM, scatter, gates, group sum): the baseline of the speedup column ("unsupported" for the 47M
    sizes, whose rows are not 16-byte aligned);
  - dense_equal_macs: one dense bf16 matmul [P, d_in] @ [d_in, d_out] with the same multiply-adds:
    the roof (the "% of roof" column);
  - reference: the PyTorch reference (a Python loop of per-expert matmuls, fp32 math), eager.
"""
import pytest

from baselines import dense_equal_macs, dense_equal_macs_operands, grouped_mm_pipeline
from common import bench_op
from flashswitch.reference.expert_matmul import paper_shapes

OP = "expert_matmul"
T = 16384
CASES = paper_shapes(T)  # name -> random_problem keyword arguments
BACKENDS = ("triton", "cuda", "cupy", "grouped_mm_pipeline", "dense_equal_macs", "reference")


def _grouped_mm(problem):
    args = (problem["x"], problem["expert_idx"], problem["weight"], problem["gates"], problem["out_groups"])
    grouped_mm_pipeline(*args)  # raises Unsupported before anything is timed
    return lambda: grouped_mm_pipeline(*args)


def _dense(problem):
    a, b = dense_equal_macs_operands(problem["x"], problem["expert_idx"], problem["weight"])
    return lambda: dense_equal_macs(a, b)


BUILDERS = {"grouped_mm_pipeline": _grouped_mm, "dense_equal_macs": _dense}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_expert_matmul(benchmark, name, backend):
    shape = CASES[name]
    bench_op(benchmark, OP, shape, backend, dtype="bf16", builders=BUILDERS, label=name)

