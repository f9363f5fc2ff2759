"""Each kernel's configuration space, shape buckets, heuristic defaults and tuning shapes, declared once.

A *bucket* is a small dict of features of a call: categorical strings (dtype, mode) must match
exactly; integer features are compared on a log2 scale when the store looks for the nearest bucket.
Sizes that only change the grid (token counts) are rounded to a power of two so that a new length
needs no retuning.
"""
from __future__ import annotations

import itertools


def pow2_bucket(n: int) -> int:
    """Round n >= 1 to the nearest power of two (on a log scale)."""
    n = max(int(n), 1)
    lo = 1 << (n.bit_length() - 1)
    return lo if n < lo * 1.5 else lo * 2


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def features(op: str, **kw) -> dict:
    """The bucket of one call of `op`; each op passes its own keywords (see ops/<op>.py)."""
    out = {}
    for name, value in kw.items():
        if isinstance(value, bool) or isinstance(value, str):
            out[name] = value
        elif name in _ROUNDED.get(op, ()):
            out[name] = pow2_bucket(value)
        else:
            out[name] = int(value)
    return out


# features that only change the grid: bucketed to powers of two
_ROUNDED = {
    "chunk_summaries": ("rows",),
    "eva_attention": ("rows", "keys"),
    "expert_matmul": ("tokens",),
}


# ---------------------------------------------------------------- op 1: chunk_summaries
def _cs_triton_space(f: dict) -> list[dict]:
    block_j = min(next_pow2(f["C"]), 64)
    block_d = next_pow2(f["D"])
    out = []
    for cb, w, s in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 3)):
        if cb * block_j * block_d > 32768 or cb * block_j * block_d < 32 * w:
            continue
        out.append({"BLOCK_CHUNKS": cb, "num_warps": w, "num_stages": s})
    return out


def _cs_triton_default(f: dict) -> dict:
    block_j = min(next_pow2(f["C"]), 64)
    block_d = next_pow2(f["D"])
    cb = max(1, min(8, 4096 // (block_j * block_d)))
    return {"BLOCK_CHUNKS": cb, "num_warps": 4, "num_stages": 2}


def _cs_cuda_space(f: dict) -> list[dict]:
    return [{"threads": t, "unroll": u} for t in (64, 128, 256) for u in (1, 2, 4)]


def _cs_cuda_default(f: dict) -> dict:
    return {"threads": 128, "unroll": 2}


# ---------------------------------------------------------------- registry
SPACES = {
    ("chunk_summaries", "triton"): _cs_triton_space,
    ("chunk_summaries", "cuda"): _cs_cuda_space,
    ("chunk_summaries", "cupy"): _cs_cuda_space,
}
DEFAULTS = {
    ("chunk_summaries", "triton"): _cs_triton_default,
    ("chunk_summaries", "cuda"): _cs_cuda_default,
    ("chunk_summaries", "cupy"): _cs_cuda_default,
}

# Shapes `flashswitch autotune` sweeps: keyword arguments of each op's bench/tune problem builder.
TUNE_SHAPES = {
    "chunk_summaries": [
        dict(B=1, H=16, N=32768, D=128, C=16),
        dict(B=2, H=16, N=8192, D=128, C=16),
        dict(B=1, H=16, N=32768, D=64, C=16),
        dict(B=1, H=16, N=32768, D=128, C=32),
        dict(B=4, H=8, N=4096, D=128, C=64),
    ],
}


def config_space(op: str, backend: str, feats: dict) -> list[dict]:
    fn = SPACES.get((op, backend))
    return fn(feats) if fn else [{}]


def default_config(op: str, backend: str, feats: dict) -> dict:
    fn = DEFAULTS.get((op, backend))
    return fn(feats) if fn else {}
