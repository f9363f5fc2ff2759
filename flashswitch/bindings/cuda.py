"""AOT backend: the compiled extension `flashswitch._C` (ops under `torch.ops.flashswitch_C`).

Launchers take torch tensors (outputs preallocated by the op module) and write into the outputs;
their Python signatures match the Triton and CuPy launchers of the same op.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# Defaults of the op-1 kernel's knobs (autotune/space.py declares the searched values).
CS_DEFAULTS = {"threads": 128, "unroll": 4, "split": 0}


@functools.lru_cache(maxsize=None)
def _load_error() -> Optional[str]:
    try:
        import flashswitch._C  # noqa: F401  (importing runs the op registrations)
    except Exception as err:  # not built, or built against another torch/CUDA
        return f"{type(err).__name__}: {err}"
    if not hasattr(torch.ops.flashswitch_C, "chunk_summaries_fwd"):
        return "flashswitch._C imported but registered no chunk_summaries_fwd op"
    return None


def available() -> bool:
    """Whether the extension imported and registered its ops (cached; never raises)."""
    try:
        return _load_error() is None
    except Exception:
        return False


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True)."""
    try:
        return _load_error()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def chunk_summaries_config(config: Optional[dict]) -> tuple[int, int, int]:
    """(threads, unroll, split) of an op-1 config dict; missing keys take CS_DEFAULTS. The launchers
    round them to supported values (threads: power of two in [32, 256]; unroll: 1, 2 or 4; split: 0
    = automatic, else a power of two)."""
    cfg = dict(CS_DEFAULTS)
    cfg.update(config or {})
    return int(cfg["threads"]), int(cfg["unroll"]), int(cfg["split"])


def chunk_summaries(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config=None):
    """Op 1 (SPEC.md): write k_sum, v_sum [B, H, Nc, D] and lse [B, H, Nc] for k, v [B, H, N, D].

    omega: None or a [B, H, Nc, D] view (stride 0 where shared); key_weight: None or [H, D];
    valid: None or bool [B, N]. Last dims contiguous, other strides free."""
    threads, unroll, split = chunk_summaries_config(config)
    C = min(int(chunk_size), max(k.shape[2], 1))  # a chunk longer than N holds tokens [0, N)
    torch.ops.flashswitch_C.chunk_summaries_fwd(k, v, omega, key_weight, valid, k_sum, v_sum, lse,
                                                C, float(scale), threads, unroll, split)


__all__ = ["available", "unavailable_reason", "chunk_summaries", "chunk_summaries_config", "CS_DEFAULTS"]


# ---------------------------------------------------------------- op 3: expert_matmul
def expert_matmul_config(config: Optional[dict]) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_N) of an op-3 config dict; a missing key is 0, the launcher's default
    (BLOCK_M 64, BLOCK_N from d_out, all column tiles per sweep). The launchers round tiles to 32, 64
    or 128 with BLOCK_M * BLOCK_N <= 8192; other keys (Triton's BLOCK_K, num_warps, ...) are ignored."""
    cfg = config or {}
    return int(cfg.get("BLOCK_M") or 0), int(cfg.get("BLOCK_N") or 0), int(cfg.get("GROUP_N") or 0)


def expert_matmul_ordered(config: Optional[dict], deterministic: bool) -> bool:
    """Whether the slot reduction runs as per-pair fp32 rows + an ordered sum: when asked for
    (`deterministic`) or chosen by the config (`REDUCE: "ordered"`, as the tuner may pick it)."""
    reduce = (config or {}).get("REDUCE", "atomic")
    if reduce not in ("atomic", "ordered"):
        raise ValueError(f"config REDUCE must be 'atomic' or 'ordered', got {reduce!r}")
    return bool(deterministic) or reduce == "ordered"


def expert_matmul_variant(config: Optional[dict]) -> int:
    """The config's CUDA kernel variant: 1 (default) or 2 (cp.async pipeline + ldmatrix, only where its
    alignment preconditions hold: the launchers fall back to 1 otherwise)."""
    v = int((config or {}).get("variant") or 1)
    if v not in (1, 2):
        raise ValueError(f"config variant must be 1 or 2, got {v}")
    return v


def expert_matmul(x3, weight, gates, route, y, *, G_in, G_out, deterministic, config=None):
    """Op 3 (SPEC.md): fill y [T, G_out, d_out] (x's dtype) over the expert-sorted pairs of `route`.

    x3: [T, G_in, d_in], last dim contiguous; weight: [E, d_in, d_out], any strides, x's dtype or fp32
    with fp16/bf16 x; gates: None or [T, S]. Same signature as the Triton and CuPy launchers."""
    err = _load_error()
    if err is not None:
        raise RuntimeError(f"flashswitch._C is not usable: {err}")
    if not hasattr(torch.ops.flashswitch_C, "expert_matmul_fwd"):
        raise RuntimeError("flashswitch._C was built without expert_matmul_fwd; rebuild the extension")
    if x3.dim() != 3 or x3.shape[1] != G_in:
        raise ValueError(f"expert_matmul: x3 must be [T, G_in={G_in}, d_in], got shape {tuple(x3.shape)}")
    block_m, block_n, group_n = expert_matmul_config(config)
    torch.ops.flashswitch_C.expert_matmul_fwd(x3, weight, gates, route.token, route.slot, route.offsets, y,
                                              int(route.S), int(G_out), expert_matmul_ordered(config, deterministic),
                                              block_m, block_n, group_n, expert_matmul_variant(config))


__all__ += ["expert_matmul", "expert_matmul_config", "expert_matmul_ordered", "expert_matmul_variant"]


# ---------------------------------------------------------------- op 2: eva_attention
def eva_attention(q, k, v, k_sum, v_sum, bias, o, lse, *, chunk_size, window_size, sliding, scale, q_offset,
                  log_count, config=None):
    """Op 2 (SPEC.md): fill o [B, H, Nq, D] (q's dtype) and lse fp32 [B, H, Nq] (natural log).

    q: [B, H, Nq, D]; k, v: [B, Hkv, Nk, D]; k_sum, v_sum: [B, Hkv, Nc, D]; last dims contiguous, other
    strides free. bias: None or an fp32 [B, Hkv, Nc] tensor (any strides); log_count: log n_c as the
    summary bias. config: {"decode": 1} runs the decode kernel (one block per query row, its keys
    split across 8 warps) for fp16/bf16 with Nq <= 16; else the tensor-core kernel. Same signature as
    the Triton and CuPy launchers."""
    err = _load_error()
    if err is not None:
        raise RuntimeError(f"flashswitch._C is not usable: {err}")
    if not hasattr(torch.ops.flashswitch_C, "eva_attention_fwd"):
        raise RuntimeError("flashswitch._C was built without eva_attention_fwd; rebuild the extension")
    torch.ops.flashswitch_C.eva_attention_fwd(q, k, v, k_sum, v_sum, bias, o, lse, int(chunk_size),
                                              int(window_size), bool(sliding), float(scale), int(q_offset),
                                              bool(log_count), int((config or {}).get("decode", 0)))


__all__ += ["eva_attention"]
