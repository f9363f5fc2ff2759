"""Op 2: causal EVA attention (softmax over exact local keys + summaries of the chunks before the window).

validate -> normalize -> pick backend -> torch.library op, declared once as an OpDef (ops/_opdef.py).
The only module that knows every backend of this op. SPEC.md, "Op 2", defines the math.

Summaries: `k_sum, v_sum` may hold any number Nc >= 0 of chunks (usually ceil(Nk / C), from op 1).
A query at position t sees summaries c in [0, start(t) / C) ∩ [0, Nc): chunks past the last stored
summary are simply absent (a shorter list is not padded). A longer one is the documented cache form
(SPEC.md, "Op 2"): rows past the last summary any query sees are unused capacity, never read (they
may hold NaN; their gradients are 0), so a preallocated summary buffer can be passed whole.
Non-finite inputs reach only the queries that see them (SPEC.md, "Op 2").
"""
from __future__ import annotations

from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.autotune import space
from flashswitch.ops import call_plan
from flashswitch.ops._opdef import OpDef

OP = "eva_attention"
OP_BWD = OP + ".bwd"
GRAD_INPUTS = ("q", "k", "v", "k_sum", "v_sum", "summary_bias")  # what `run_backward` returns, in order
WINDOWS = ("block", "sliding")
BIAS_DTYPES = C.FLOAT_DTYPES + (torch.float64,)


def _features(table: str, q: torch.Tensor, k: torch.Tensor, chunk_size: int, window_size: int, window: str) -> dict:
    """The autotune bucket of `table` (OP or OP_BWD)."""
    B, H, Nq, D = q.shape
    return space.features(table, dtype=C.DTYPE_NAMES[q.dtype], D=D, C=chunk_size, W=window_size, window=window,
                          decode=Nq <= 16, rows=B * H * Nq, keys=k.shape[2])


def check_window(chunk_size, window_size, window) -> None:
    """chunk_size and window_size positive ints, window_size >= chunk_size and a multiple of it (SPEC.md,
    "Op 2"); window a known kind."""
    C.check_positive_int("chunk_size", chunk_size)
    C.check_positive_int("window_size", window_size)
    if window_size < chunk_size:
        raise ValueError(f"window_size must be >= chunk_size (and a multiple of it), got "
                         f"window_size={window_size}, chunk_size={chunk_size}")
    if window_size % chunk_size:
        raise ValueError(f"window_size must be a multiple of chunk_size, got window_size={window_size}, "
                         f"chunk_size={chunk_size}")
    if not isinstance(window, str) or window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")


def _validate(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset):
    """Check every argument; returns (scale, q_offset, bias tensor or None, log_count)."""
    C.check_tensor("q", q, ndim=4)
    for name, t in (("k", k), ("v", v), ("k_sum", k_sum), ("v_sum", v_sum)):
        C.check_tensor(name, t, ndim=4, device=q.device)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    for name, t, ref_name, ref in (("k", k, "q", q), ("v", v, "k", k), ("k_sum", k_sum, "k", k),
                                   ("v_sum", v_sum, "k_sum", k_sum)):
        C.check_head_dim(name, t, ref_name, ref)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    C.check_shape("k", k, (B, Hkv, Nk, D))
    C.check_shape("v", v, k.shape)
    if Hkv == 0 and H != 0 or Hkv != 0 and H % Hkv:
        raise ValueError(f"q has {H} heads and k has {Hkv}: the query heads must be a multiple of the kv heads "
                         f"(H % Hkv == 0)")
    Nc = k_sum.shape[2]
    C.check_shape("k_sum", k_sum, (B, Hkv, Nc, D))
    C.check_shape("v_sum", v_sum, k_sum.shape)
    check_window(chunk_size, window_size, window)
    if q_offset is None:
        q_offset = Nk - Nq
        if q_offset < 0:
            raise ValueError(f"q has {Nq} queries but there are only {Nk} keys; pass q_offset or more keys "
                             f"(query i sits at position q_offset + i and must see key q_offset + i)")
    elif isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise TypeError(f"q_offset must be an int or None, got {type(q_offset).__name__}")
    elif q_offset < 0 or q_offset + Nq > Nk:
        raise ValueError(f"q_offset must satisfy 0 <= q_offset and q_offset + Nq <= Nk (every query sees "
                         f"its own key), got q_offset={q_offset}, Nq={Nq}, Nk={Nk}")
    bias, log_count = None, False
    if isinstance(summary_bias, str):
        if summary_bias != "log_count":
            raise ValueError(f"summary_bias must be None, 'log_count' or a [B, Hkv, Nc] tensor, "
                             f"got {summary_bias!r}")
        log_count = True
    elif isinstance(summary_bias, torch.Tensor):
        C.check_tensor("summary_bias", summary_bias, ndim=3, dtypes=BIAS_DTYPES, device=q.device,
                       last_contiguous=False)
        C.check_shape("summary_bias", summary_bias, (B, Hkv, Nc))
        bias = summary_bias
    elif summary_bias is not None:
        raise TypeError(f"summary_bias must be None, 'log_count' or a tensor, got {type(summary_bias).__name__}")
    return C.check_scale(scale, D), q_offset, bias, log_count


def _kernel_bias(bias):
    """Kernels read a tensor bias as fp32 (any strides)."""
    return None if bias is None else bias.to(torch.float32)


# ---------------------------------------------------------------- the op's own parts of its OpDef
# the call's arguments (also the custom op's): q, k, v, k_sum, v_sum, bias (fp32 tensor or None), chunk_size,
# window_size, window, scale, q_offset, log_count; the plan's: eva_attention's, summary_bias as given
def _normalize(q, k, v, k_sum, v_sum, chunk_size, window_size, window="block", scale=None, summary_bias=None,
               q_offset=None, return_lse=False):
    scale, q_offset, bias, log_count = _validate(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale,
                                                 summary_bias, q_offset)
    return q, k, v, k_sum, v_sum, _kernel_bias(bias), chunk_size, window_size, window, scale, q_offset, log_count


def _key(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend):
    T, S = call_plan.tensor_key, call_plan.scalar_key
    bias = T(summary_bias) if isinstance(summary_bias, torch.Tensor) else S(summary_bias)
    return (T(q), T(k), T(v), T(k_sum), T(v_sum), S(chunk_size), S(window_size), S(window), S(scale), bias,
            S(q_offset), S(backend))


def _replan(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count, backend):
    summary_bias = bias if bias is not None else "log_count" if log_count else None
    return q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend


def _reference(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count):
    from flashswitch.reference.eva_attention import torch_eva_attention
    summary_bias = bias if bias is not None else "log_count" if log_count else None
    return torch_eva_attention(q, k, v, k_sum, v_sum, chunk_size=chunk_size, window_size=window_size, window=window,
                               scale=scale, summary_bias=summary_bias, q_offset=q_offset, return_lse=True)


def _grad_call(args, outs, ups, needs):
    """(dq, dk, dv, dk_sum, dv_sum, dbias) by the Triton backward kernels, whichever the forward backend
    was; dbias is fp32 [B, Hkv, Nc] for a tensor bias, None otherwise; dlse may be None. Prepared per
    layout of the upstream gradients."""
    q, k, v, k_sum, v_sum, bias = args[:6]
    (o, lse), (do, dlse) = outs, ups
    grads = C.new_outputs([None if t is None else (t.shape, t.dtype) for t in args[:6]], q.device)  # bias: fp32
    if k.shape[0] * k.shape[1] * k.shape[3] == 0:  # B * Hkv * D
        return [None if t is None else t.zero_() for t in grads], None, None
    do = do if do.stride(-1) == 1 else do.contiguous()  # e.g. an expanded gradient
    dlse = dlse if dlse is None or dlse.stride(-1) == 1 else dlse.contiguous()
    key = (do.stride(), None if dlse is None else (dlse.dtype, dlse.stride()))
    return grads, key, (q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, *grads)


OPDEF = OpDef(
    name=OP, outputs=("o", "lse"), optional_grads=("lse",), save_outputs=True, key=_key, normalize=_normalize,
    replan=_replan, reference=_reference, grad_call=_grad_call, grads=("q", "k", "v", "k_sum", "v_sum", "bias"),
    grad_inputs=GRAD_INPUTS, keep=("scale", "q_offset", "log_count"),
    schema="Tensor q, Tensor k, Tensor v, Tensor k_sum, Tensor v_sum, Tensor? bias, SymInt chunk_size, "
           "SymInt window_size, str window, float scale, SymInt q_offset, bool log_count",
    shapes=lambda q, *args: [(tuple(q.shape), q.dtype), (tuple(q.shape[:3]), torch.float32)],
    features=lambda table, q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, *args: _features(
        table, q, k, chunk_size, window_size, window),
    scalars=lambda q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count: dict(
        chunk_size=chunk_size, window_size=window_size, sliding=window == "sliding", scale=scale, q_offset=q_offset,
        log_count=log_count),  # the launchers' keyword arguments, forward and backward
).register()
# the tooling: run_backward's grad_outputs are dO, or (dO,) / (dO, dlse); None for summary_bias unless a tensor
problem_features, problem_features_bwd, run_kernel, run_backward = OPDEF.tooling()


def eva_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_sum: torch.Tensor, v_sum: torch.Tensor,
                  *, chunk_size: int, window_size: int, window: str = "block", scale: Optional[float] = None,
                  summary_bias=None, q_offset: Optional[int] = None, return_lse: bool = False,
                  backend: str = "auto"):
    """Causal EVA attention (SPEC.md, op 2): softmax attention of each query over the exact keys of its
    window and the summaries (k_sum, v_sum) of the chunks before it.

    q: [B, H, Nq, D]; k, v: [B, Hkv, Nk, D] with H % Hkv == 0 (query head h reads kv head
    h // (H // Hkv)); k_sum, v_sum: [B, Hkv, Nc, D] (any Nc; summaries past Nc are absent, rows past the
    last one any query sees are never read: unused capacity of a summary buffer may hold anything).
    window: "block" (start(t) = W floor(t / W)) or "sliding" (start(t) = C floor((t - W + 1) / C),
    0 while t < W); window_size W must be a multiple of chunk_size C. q_offset: position of q[:, :, 0]
    (default Nk - Nq), with q_offset + Nq <= Nk. summary_bias: None, "log_count" (log of each chunk's
    token count) or a [B, Hkv, Nc] tensor added to the summary logits. Returns o [B, H, Nq, D] in q's
    dtype, plus the fp32 natural-log normaliser lse [B, H, Nq] when `return_lse`. `backend` is
    "auto", "reference", "triton", "cuda" or "cupy".

    Differentiable in q, k, v, k_sum, v_sum, a tensor summary_bias and through lse. The kernel
    backends ("triton", "cuda", "cupy") all run the Triton backward kernels (recomputing the
    softmax from the saved lse; deterministic); "reference" differentiates the torch reference.
    """
    plan = OPDEF.plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend)
    bias = summary_bias if isinstance(summary_bias, torch.Tensor) else None
    out = OPDEF.run(plan, backend, (q, k, v, k_sum, v_sum, None if bias is None else bias.to(torch.float32),
                                    chunk_size, window_size, window, plan.scale, plan.q_offset,
                                    plan.log_count)) if plan.kernels else None
    if out is None:  # the reference, on summary_bias as given
        out = _reference(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, plan.scale, plan.q_offset,
                         plan.log_count)
    return tuple(out) if return_lse else out[0]


__all__ = ["eva_attention", "run_backward", "GRAD_INPUTS"]
