"""Op 3 (expert_matmul) forward + backward, bf16, deterministic, T = 16384 tokens: one training step of
the op on the paper cases of SPEC "Op 3" (SwitchHead 262M V and O, sigma-MoE up and down, SwitchHead
47M V and O).

TFLOP/s counts 6·d_in·d_out per routed pair (forward y, backward dx and dW). Backends, same inputs:
  - triton: routing + the Triton forward and backward kernels (gradients of x, weight and gates);
  - grouped_mm_pipeline: the torch._grouped_mm pipeline of bench_expert_matmul.py under autograd
    (gradients of x, weight and gates; "unsupported" where grouped_mm cannot take the sizes);
  - dense_equal_macs: one dense matmul with the same multiply-adds and its two gradient matmuls: the roof;
  - reference: autograd of the PyTorch reference (a loop of per-expert matmuls).
"""
import pytest

from baselines import dense_equal_macs_fwd_bwd, dense_equal_macs_operands, grouped_mm_pipeline_fwd_bwd
from common import bench_op
from flashswitch.reference.expert_matmul import paper_shapes

OP = "expert_matmul.bwd"
CASES = paper_shapes(16384)
BACKENDS = ("triton", "grouped_mm_pipeline", "dense_equal_macs", "reference")


def _grouped_mm(problem):
    step = grouped_mm_pipeline_fwd_bwd(problem["x"], problem["expert_idx"], problem["weight"],
                                       problem["grad_outputs"][0], problem["gates"], problem["out_groups"])
    step()  # raises Unsupported before anything is timed
    return step


def _dense(problem):
    return dense_equal_macs_fwd_bwd(*dense_equal_macs_operands(problem["x"], problem["expert_idx"], problem["weight"]))


BUILDERS = {"grouped_mm_pipeline": _grouped_mm, "dense_equal_macs": _dense}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_expert_matmul_bwd(benchmark, name, backend):
    bench_op(benchmark, OP, CASES[name], backend, dtype="bf16", builders=BUILDERS, label=name)
