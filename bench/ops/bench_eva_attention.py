"""Op 2 (eva_attention) throughput, bf16: the issue shapes, one decode step, and a sweep over the
sequence length N (4096..65536 at B=1, H=16, D=128, W=2048, C=16, block windows) for the plot of the
speedup over full causal attention (SDPA) vs N.

TFLOP/s counts 4·D flops per visible (query, key or summary) pair (q·k and p·v), times B·H: the work
EVA attention does, for every backend (full causal SDPA does more work in the same time; its row
shows what that costs). GB/s counts q read, the exact keys/values visible to some query and the
visible summaries read once, o and lse written: in decode (one query at position 32767 of a 32768-key
cache) only the exact buffer and the summaries, which the kernels read in place from the full k / v.

Backends, all timed in this run on the same inputs:
  - triton, cuda, cupy: the kernels (tuned or default config);
  - flex: FlexAttention (torch.compile) over [k; k_sum] with the EVA mask (block mask built once,
    outside the timed region), concatenation included in each call (what a user runs each step);
  - flex_nocat: the same attention on keys/values concatenated beforehand;
  - sdpa_causal: exact causal SDPA over the whole sequence (what EVA saves);
  - cat_sdpa_decode (decode only): torch.cat of the exact buffer and the summaries, SDPA, no mask;
  - reference: the dense PyTorch reference, eager, only up to N = 8192.
"""
import pytest

from baselines import FlexEva, Unsupported, cat_sdpa_decode, sdpa_causal
from common import bench_op, shape_id, unique
from flashswitch import registry

OP = "eva_attention"
REFERENCE_MAX_N = 8192  # the reference materialises [Nq, Nk + Nc] logits

HEADLINE = registry.EVA_ATTENTION_SHAPES
SWEEP = [dict(B=1, H=16, Hkv=16, Nk=n, D=128, C=16, W=2048, window="block")
         for n in (4096, 8192, 16384, 32768, 65536)]
SHAPES = unique(list(HEADLINE.values()) + SWEEP)
LABELS = {shape_id(s): name for name, s in HEADLINE.items()}
BACKENDS = ("triton", "cuda", "cupy", "flex", "flex_nocat", "sdpa_causal", "cat_sdpa_decode", "reference")

_FLEX: dict = {"key": None, "flex": None}


def _flex_key(problem) -> tuple:
    """What the block mask and score_mod depend on (the FlexEva holds no input tensor but a bias)."""
    bias = problem["summary_bias"]
    return (tuple(problem["q"].shape), tuple(problem["k"].shape), tuple(problem["k_sum"].shape),
            problem["chunk_size"], problem["window_size"], problem["window"], problem["q_offset"],
            bias.data_ptr() if hasattr(bias, "data_ptr") else bias, str(problem["q"].device))


def _flex_for(problem) -> FlexEva:
    """One FlexEva (block mask, score_mod) per problem shape, shared by the flex and flex_nocat rows."""
    key = _flex_key(problem)
    if _FLEX["key"] != key:
        _FLEX.update(key=None, flex=None)
        flex = FlexEva(problem["q"], problem["k"], problem["k_sum"], chunk_size=problem["chunk_size"],
                       window_size=problem["window_size"], window=problem["window"],
                       summary_bias=problem["summary_bias"], q_offset=problem["q_offset"])
        _FLEX.update(key=key, flex=flex)
    return _FLEX["flex"]


def _compiled_or_unsupported(fn):
    """Run `fn` once (it compiles there); a shape FlexAttention cannot compile becomes an "unsupported"
    row with the compiler's message (e.g. torch 2.11's Inductor rejects the one-query decode shape)."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - any compile failure is reported, not hidden
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        raise Unsupported(f"FlexAttention did not compile: {type(err).__name__}: {lines[-1] if lines else ''}"[:300])
    return fn


def _flex(problem):
    flex = _flex_for(problem)
    args = [problem[n] for n in ("q", "k", "v", "k_sum", "v_sum")]
    return _compiled_or_unsupported(lambda: flex(*args))


def _flex_nocat(problem):
    flex = _flex_for(problem)
    q = problem["q"]
    keys, values = FlexEva.concat(problem["k"], problem["v"], problem["k_sum"], problem["v_sum"])
    return _compiled_or_unsupported(lambda: flex.attend(q, keys, values))


def _sdpa(problem):
    q, k, v, off = problem["q"], problem["k"], problem["v"], problem["q_offset"]
    return lambda: sdpa_causal(q, k, v, q_offset=off)


def _cat_sdpa(problem):
    return lambda: cat_sdpa_decode(**problem)


BUILDERS = {"flex": _flex, "flex_nocat": _flex_nocat, "sdpa_causal": _sdpa, "cat_sdpa_decode": _cat_sdpa}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_eva_attention(benchmark, shape, backend):
    if backend == "cat_sdpa_decode" and shape.get("Nq") != 1:
        pytest.skip("cat_sdpa_decode is a decode baseline (one query)")
    if backend == "reference" and shape["Nk"] > REFERENCE_MAX_N:
        pytest.skip(f"the dense reference runs only up to N = {REFERENCE_MAX_N}")
    bench_op(benchmark, OP, shape, backend, dtype="bf16", builders=BUILDERS, label=LABELS.get(shape_id(shape)))
