"""Op 2: causal EVA attention (softmax over exact local keys + summaries of the chunks before the window).

validate -> normalize -> pick backend -> torch.library op. The only module that knows every backend
of this op. SPEC.md, "Op 2", defines the math.

Summaries: `k_sum, v_sum` may hold any number Nc >= 0 of chunks (usually ceil(Nk / C), from op 1).
A query at position t sees summaries c in [0, start(t) / C) ∩ [0, Nc): chunks past the last stored
summary are simply absent (a shorter list is not padded). A longer one is the documented cache form
(SPEC.md, "Op 2"): rows past the last summary any query sees are unused capacity, never read (they
may hold NaN; their gradients are 0), so a preallocated summary buffer can be passed whole.
Non-finite inputs reach only the queries that see them (SPEC.md, "Op 2").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.autotune import space
from flashswitch.ops import call_plan

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


def _run_backend(backend: str, q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset,
                 log_count, config=None, enqueue=None):
    """(o, lse) from `backend`'s launcher, or from `enqueue` (a call plan's prepared launch); config:
    complete (call_plan), None: looked up."""
    B, H, Nq, D = q.shape
    o = C.new_output((B, H, Nq, D), q.dtype, q.device)
    lse = C.new_output((B, H, Nq), torch.float32, q.device)
    if B * H * Nq == 0:
        return o, lse
    if enqueue is None:
        if config is None:
            config = call_plan.config(OP, backend, _features(OP, q, k, chunk_size, window_size, window))
        enqueue = call_plan.forward_launch(OP, backend, config, _scalars(chunk_size, window_size, window, scale,
                                                                         q_offset, log_count))
    enqueue(q, k, v, k_sum, v_sum, bias, o, lse)
    return o, lse


def _scalars(chunk_size, window_size, window, scale, q_offset, log_count) -> dict:
    """The launchers' keyword arguments (forward and backward)."""
    return dict(chunk_size=chunk_size, window_size=window_size, sliding=window == "sliding", scale=scale,
                q_offset=q_offset, log_count=log_count)


@torch.library.custom_op("flashswitch::eva_attention", mutates_args=())
def _eva_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_sum: torch.Tensor,
                      v_sum: torch.Tensor, bias: Optional[torch.Tensor], chunk_size: int, window_size: int,
                      window: str, scale: float, q_offset: int, log_count: bool,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    # a traced caller's call runs the eager calls' plan: the prepared launch, no per-call config lookup
    plan = _op_plan(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count, backend)
    return _run_backend(plan.backend, q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset,
                        log_count, config=plan.config, enqueue=plan.enqueue)


@_eva_attention_op.register_fake
def _(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count, backend):
    B, H, Nq, D = q.shape
    return q.new_empty((B, H, Nq, D)), q.new_empty((B, H, Nq), dtype=torch.float32)


# ---------------------------------------------------------------- backward
def _run_backward(backend, q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, chunk_size, window_size, window, scale,
                  q_offset, log_count, config=None, plan: Optional["_Plan"] = None):
    """(dq, dk, dv, dk_sum, dv_sum, dbias) by the Triton backward kernels, whichever the forward backend
    was; dbias is fp32 [B, Hkv, Nc] for a tensor bias, an empty tensor otherwise. dlse may be None.
    config: complete (call_plan), None: looked up; plan: the call plan whose prepared launches to use."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    dq = C.new_output((B, H, Nq, D), q.dtype, q.device)
    dk = C.new_output((B, Hkv, Nk, D), k.dtype, q.device)
    dv = C.new_output((B, Hkv, Nk, D), v.dtype, q.device)
    dk_sum = C.new_output((B, Hkv, Nc, D), k_sum.dtype, q.device)
    dv_sum = C.new_output((B, Hkv, Nc, D), v_sum.dtype, q.device)
    dbias = C.new_output((B, Hkv, Nc), torch.float32, q.device) if bias is not None else call_plan.absent(q)
    if B * Hkv * D == 0:
        for t in (dq, dk, dv, dk_sum, dv_sum, dbias):
            t.zero_()
        return dq, dk, dv, dk_sum, dv_sum, dbias
    if do.stride(-1) != 1:  # e.g. an expanded gradient
        do = do.contiguous()
    if dlse is not None and dlse.stride(-1) != 1:
        dlse = dlse.contiguous()
    tensors = (q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum,
               dbias if bias is not None else None)
    # the prepared launch per layout of the upstream gradients
    key = (do.stride(), None if dlse is None else (dlse.dtype, dlse.stride()))
    enqueue = None if plan is None else plan.backward.get(key)
    if enqueue is None:
        enqueue = call_plan.backward_launch(OP, backend, plan, key, config, (_features, q, k, chunk_size, window_size,
                                                                            window), *tensors,
                                            **_scalars(chunk_size, window_size, window, scale, q_offset, log_count))
    enqueue(*tensors)
    return dq, dk, dv, dk_sum, dv_sum, dbias


@torch.library.custom_op("flashswitch::eva_attention_backward", mutates_args=())
def _eva_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_sum: torch.Tensor,
                               v_sum: torch.Tensor, bias: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor,
                               do: torch.Tensor, dlse: Optional[torch.Tensor], chunk_size: int, window_size: int,
                               window: str, scale: float, q_offset: int, log_count: bool, backend: str
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
    plan = _op_plan(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count, backend)
    return _run_backward(plan.backend, q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, chunk_size, window_size, window,
                         scale, q_offset, log_count, plan=plan)


@_eva_attention_backward_op.register_fake
def _(q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, chunk_size, window_size, window, scale, q_offset, log_count,
      backend):
    dbias = q.new_empty(bias.shape, dtype=torch.float32) if bias is not None else call_plan.absent(q)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(k_sum, memory_format=torch.contiguous_format),
            torch.empty_like(v_sum, memory_format=torch.contiguous_format), dbias)


def _setup_context(ctx, inputs, output):
    q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, k_sum, v_sum, bias, o, lse)
    ctx.args = (chunk_size, window_size, window, scale, q_offset, log_count, backend)


def _backward(ctx, do, dlse):
    q, k, v, k_sum, v_sum, bias, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dk_sum, dv_sum, dbias = _eva_attention_backward_op(q, k, v, k_sum, v_sum, bias, o, lse, do, dlse,
                                                                   *ctx.args)
    return (dq, dk, dv, dk_sum, dv_sum, dbias if bias is not None else None) + (None,) * 7


_eva_attention_op.register_autograd(_backward, setup_context=_setup_context)


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
    else:
        if isinstance(q_offset, bool) or not isinstance(q_offset, int):
            raise TypeError(f"q_offset must be an int or None, got {type(q_offset).__name__}")
        if q_offset < 0 or q_offset + Nq > Nk:
            raise ValueError(f"q_offset must satisfy 0 <= q_offset and q_offset + Nq <= Nk (every query sees "
                             f"its own key), got q_offset={q_offset}, Nq={Nq}, Nk={Nk}")
    bias, log_count = None, False
    if summary_bias is None:
        pass
    elif isinstance(summary_bias, str):
        if summary_bias != "log_count":
            raise ValueError(f"summary_bias must be None, 'log_count' or a [B, Hkv, Nc] tensor, "
                             f"got {summary_bias!r}")
        log_count = True
    elif isinstance(summary_bias, torch.Tensor):
        C.check_tensor("summary_bias", summary_bias, ndim=3, dtypes=BIAS_DTYPES, device=q.device,
                       last_contiguous=False)
        C.check_shape("summary_bias", summary_bias, (B, Hkv, Nc))
        bias = summary_bias
    else:
        raise TypeError(f"summary_bias must be None, 'log_count' or a tensor, got {type(summary_bias).__name__}")
    return C.check_scale(scale, D), q_offset, bias, log_count


def _kernel_bias(bias):
    """Kernels read a tensor bias as fp32 (any strides)."""
    return None if bias is None else bias.to(torch.float32)


def problem_features(q, k, v, k_sum, v_sum, chunk_size, window_size, window="block", scale=None,
                     summary_bias=None, q_offset=None, return_lse=False) -> dict:
    """The autotune bucket of a problem (keyword arguments as `eva_attention` takes them)."""
    return _features(OP, q, k, chunk_size, window_size, window)


def problem_features_bwd(q, k, v, k_sum, v_sum, chunk_size, window_size, window="block", scale=None,
                         summary_bias=None, q_offset=None, return_lse=False) -> dict:
    """The backward pass's autotune bucket of a problem (keyword arguments as `eva_attention` takes them)."""
    return _features(OP_BWD, q, k, chunk_size, window_size, window)


def run_kernel(backend: str, config: dict, q, k, v, k_sum, v_sum, chunk_size, window_size, window="block",
               scale=None, summary_bias=None, q_offset=None, return_lse=False):
    """One kernel call with an explicit config, for the tuner and the benchmarks: (o, lse)."""
    scale, q_offset, bias, log_count = _validate(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale,
                                                 summary_bias, q_offset)
    if config is not None:
        config = call_plan.complete_config(OP, backend, _features(OP, q, k, chunk_size, window_size, window), config)
    return _run_backend(backend, q, k, v, k_sum, v_sum, _kernel_bias(bias), chunk_size, window_size, window,
                        scale, q_offset, log_count, config)


def run_backward(backend: str, config, grad_outputs, q, k, v, k_sum, v_sum, chunk_size, window_size,
                 window="block", scale=None, summary_bias=None, q_offset=None, return_lse=False) -> tuple:
    """The forward (tuned or default config), then the backward kernels with an explicit `config`
    (None: the tuned one), for the tuner and the benchmarks. grad_outputs: dO, or (dO,) / (dO, dlse).
    Returns the gradients named by GRAD_INPUTS (None for summary_bias unless it is a tensor)."""
    scale, q_offset, bias, log_count = _validate(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale,
                                                 summary_bias, q_offset)
    if isinstance(grad_outputs, torch.Tensor):
        grad_outputs = (grad_outputs,)
    do, dlse = (tuple(grad_outputs) + (None,))[:2]
    kbias = _kernel_bias(bias)
    with torch.no_grad():
        o, lse = _run_backend(backend, q, k, v, k_sum, v_sum, kbias, chunk_size, window_size, window, scale,
                              q_offset, log_count)
        grads = _run_backward(backend, q, k, v, k_sum, v_sum, kbias, o, lse, do, dlse, chunk_size, window_size,
                              window, scale, q_offset, log_count, config)
    dbias = grads[5].to(bias.dtype) if bias is not None else None
    return grads[:5] + (dbias,)


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
    plan = _cached_plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend)
    if not plan.kernels or not C.kernels_serve(
            backend, q, k, v, k_sum, v_sum, summary_bias if isinstance(summary_bias, torch.Tensor) else None):
        from flashswitch.reference.eva_attention import torch_eva_attention
        out = torch_eva_attention(q, k, v, k_sum, v_sum, chunk_size=chunk_size, window_size=window_size,
                                  window=window, scale=plan.scale, summary_bias=summary_bias, q_offset=plan.q_offset,
                                  return_lse=True)
    else:
        bias = summary_bias.to(torch.float32) if plan.bias_tensor else None
        args = (q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, plan.scale, plan.q_offset,
                plan.log_count)
        if C.eager_fast_path(q, k, v, k_sum, v_sum, bias):
            out = _run_backend(plan.backend, *args, config=plan.config, enqueue=plan.enqueue)
        elif C.eager_autograd_path(q, k, v, k_sum, v_sum, bias):
            out = _EagerAutograd.apply(plan, *args)
        else:
            out = _eva_attention_op(*args, plan.backend)
    return tuple(out) if return_lse else out[0]


class _EagerAutograd(torch.autograd.Function):
    """An eager call that needs gradients (C.eager_autograd_path): the custom op's forward and backward
    with the call plan's prepared launch and backward config, without the dispatcher layers."""

    @staticmethod
    def forward(ctx, plan, q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count):
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient tensor
        o, lse = _run_backend(plan.backend, q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale,
                              q_offset, log_count, config=plan.config, enqueue=plan.enqueue)
        ctx.save_for_backward(q, k, v, k_sum, v_sum, bias, o, lse)
        ctx.plan, ctx.args = plan, (chunk_size, window_size, window, scale, q_offset, log_count)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, k_sum, v_sum, bias, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        grads = _run_backward(ctx.plan.backend, q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, *ctx.args,
                              plan=ctx.plan)
        return (None,) + grads[:5] + (grads[5] if bias is not None else None,) + (None,) * 6


# ---------------------------------------------------------------- call plans
@dataclass(frozen=True, kw_only=True)
class _Plan(call_plan.Plan):
    scale: float
    q_offset: int
    bias_tensor: bool
    log_count: bool


_PLANS = call_plan.PlanCache()


def _call_key(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend):
    T, S = call_plan.tensor_key, call_plan.scalar_key
    bias = T(summary_bias) if isinstance(summary_bias, torch.Tensor) else S(summary_bias)
    return (T(q), T(k), T(v), T(k_sum), T(v_sum), S(chunk_size), S(window_size), S(window), S(scale), bias,
            S(q_offset), S(backend))


def _cached_plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset,
                 backend) -> _Plan:
    """The plan of a call, kept for the next call with the same metadata."""
    key = call_plan.key_or_none(_call_key, q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale,
                                summary_bias, q_offset, backend)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend)
        _PLANS.put(key, plan)
    return plan


def _op_plan(q, k, v, k_sum, v_sum, bias, chunk_size, window_size, window, scale, q_offset, log_count,
             backend) -> _Plan:
    """The plan of a custom-op call (normalized arguments: an fp32 bias tensor or the log-count flag)."""
    summary_bias = bias if bias is not None else ("log_count" if log_count else None)
    return _cached_plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset,
                        backend)


def _plan(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale, summary_bias, q_offset, backend) -> _Plan:
    """Every check, the backend, the config and the forward launch: the uncached part of a call."""
    scale, q_offset, bias, log_count = _validate(q, k, v, k_sum, v_sum, chunk_size, window_size, window, scale,
                                                 summary_bias, q_offset)
    features = (_features, q, k, chunk_size, window_size, window)
    backend, bucket = call_plan.resolve(OP, backend, q.device, *features)
    B, H, Nq, D = q.shape
    outputs = (torch.empty((B, H, Nq, D), dtype=q.dtype, device="meta"),  # only shapes, strides and dtypes are read
               torch.empty((B, H, Nq), dtype=torch.float32, device="meta"))
    launch = (_scalars(chunk_size, window_size, window, scale, q_offset, log_count),
              (q, k, v, k_sum, v_sum, _kernel_bias(bias)), outputs) if B * H * Nq else None
    return call_plan.kernel_plan(_Plan, OP, backend, bucket, features, launch, scale=scale, q_offset=q_offset,
                                 bias_tensor=bias is not None, log_count=log_count)


__all__ = ["eva_attention", "run_backward", "GRAD_INPUTS"]
