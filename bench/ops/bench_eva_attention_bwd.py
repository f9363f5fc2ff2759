"""Op 2 (eva_attention) forward + backward, bf16, deterministic: one training step of the op on the
issue shapes and a sweep over the sequence length (4096..65536 at B=1, H=16, D=128, W=2048, C=16, block).

TFLOP/s counts 14·D flops per visible (query, key or summary) pair: 4·D forward (q·k, p·v) and 10·D
backward (q·k recomputed, dO·vᵀ, dV, dK, dQ), times B·H, for every backend. Backends, same inputs:
  - triton: the Triton forward + backward kernels (tuned or default configs), gradients of q, k, v,
    k_sum and v_sum;
  - flex: FlexAttention (torch.compile) forward + backward over [k; k_sum] with the EVA mask (block
    mask built once), concatenation in the step, so the gradients reach k_sum and v_sum too;
  - sdpa_causal: exact causal SDPA (flash) forward + backward over the whole sequence;
  - reference: autograd of the dense PyTorch reference, only up to N = 4096.
"""
import pytest

from baselines import flex_fwd_bwd, sdpa_causal_fwd_bwd
from bench_eva_attention import _compiled_or_unsupported, _flex_for
from common import bench_op, shape_id, unique
from flashswitch import registry

OP = "eva_attention.bwd"
REFERENCE_MAX_N = 4096
HEADLINE = {n: s for n, s in registry.EVA_ATTENTION_SHAPES.items() if n != "decode"}
SWEEP = [dict(B=1, H=16, Hkv=16, Nk=n, D=128, C=16, W=2048, window="block") for n in (4096, 8192, 16384, 65536)]
SHAPES = unique(list(HEADLINE.values()) + SWEEP)
LABELS = {shape_id(s): name for name, s in HEADLINE.items()}
BACKENDS = ("triton", "flex", "sdpa_causal", "reference")


def _flex(problem):
    flex = _flex_for(problem)
    args = [problem[n] for n in ("q", "k", "v", "k_sum", "v_sum")]
    return _compiled_or_unsupported(flex_fwd_bwd(flex, *args, problem["grad_outputs"][0]))


def _sdpa(problem):
    return sdpa_causal_fwd_bwd(problem["q"], problem["k"], problem["v"], problem["grad_outputs"][0],
                               q_offset=problem["q_offset"])


BUILDERS = {"flex": _flex, "sdpa_causal": _sdpa}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_eva_attention_bwd(benchmark, shape, backend):
    if backend == "reference" and shape["Nk"] > REFERENCE_MAX_N:
        pytest.skip(f"the dense reference runs only up to N = {REFERENCE_MAX_N}")
    bench_op(benchmark, OP, shape, backend, dtype="bf16", builders=BUILDERS, label=LABELS.get(shape_id(shape)))
