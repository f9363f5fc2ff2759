"""Op 2 references: `numpy_eva_attention` (fp64 oracle, one query at a time) and `torch_eva_attention`
(vectorized dense masked softmax over [k; k_sum], differentiable), the visibility rule shared with
benchmarks (`start_positions`, `visible_masks`, `visible_pairs`), and `random_problem`."""
from __future__ import annotations

import math

import numpy as np
import torch

from flashswitch.reference.chunk_summaries import torch_chunk_summaries
from flashswitch.testing import to_numpy64

WINDOWS = ("block", "sliding")


# ---------------------------------------------------------------- visibility rule (SPEC "Op 2")
def _check_window(chunk_size: int, window_size: int, window: str) -> None:
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if window_size < chunk_size or window_size % chunk_size:
        raise ValueError(f"window_size must be >= chunk_size and a multiple of it, got "
                         f"window_size={window_size}, chunk_size={chunk_size}")


def start_position(t: int, *, chunk_size: int, window_size: int, window: str = "block") -> int:
    """First exact key of the query at absolute position t (plain ints)."""
    C, W = chunk_size, window_size
    if window == "block":
        return W * (t // W)
    if window == "sliding":
        return 0 if t < W else C * ((t - W + 1) // C)
    raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")


def start_positions(t, *, chunk_size: int, window_size: int, window: str = "block"):
    """`start_position` applied elementwise to a torch or numpy integer array of positions."""
    C, W = chunk_size, window_size
    if window == "block":
        return W * (t // W)
    if window == "sliding":
        s = C * ((t - W + 1) // C)
        return s * (t >= W)
    raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")


def default_q_offset(Nq: int, Nk: int, q_offset=None) -> int:
    return Nk - Nq if q_offset is None else int(q_offset)


def visible_masks(Nq: int, Nk: int, Nc: int, *, chunk_size: int, window_size: int, window: str = "block",
                  q_offset=None, device=None):
    """(exact [Nq, Nk] bool, summary [Nq, Nc] bool): which keys / chunk summaries each query sees."""
    _check_window(chunk_size, window_size, window)
    off = default_q_offset(Nq, Nk, q_offset)
    t = torch.arange(Nq, device=device, dtype=torch.int64) + off
    start = start_positions(t, chunk_size=chunk_size, window_size=window_size, window=window)
    j = torch.arange(Nk, device=device, dtype=torch.int64)
    c = torch.arange(Nc, device=device, dtype=torch.int64)
    exact = (j[None, :] >= start[:, None]) & (j[None, :] <= t[:, None])
    summary = c[None, :] < (start // chunk_size)[:, None]
    return exact, summary


def visible_pairs(Nq: int, Nk: int, Nc: int, *, chunk_size: int, window_size: int, window: str = "block",
                  q_offset=None) -> int:
    """Number of visible (query, key or summary) pairs per (batch, head); O(Nq) memory."""
    _check_window(chunk_size, window_size, window)
    off = default_q_offset(Nq, Nk, q_offset)
    t = np.arange(Nq, dtype=np.int64) + off
    start = start_positions(t, chunk_size=chunk_size, window_size=window_size, window=window)
    n_exact = np.clip(np.minimum(t, Nk - 1) - np.maximum(start, 0) + 1, 0, None)
    n_sum = np.clip(np.minimum(start // chunk_size, Nc), 0, None)
    return int(n_exact.sum() + n_sum.sum())


def chunk_counts(Nk: int, Nc: int, chunk_size: int):
    """n_c = number of tokens of chunk c among [0, Nk) (0 for chunks past the end), as a numpy int array."""
    c = np.arange(Nc, dtype=np.int64)
    return np.clip(np.minimum(chunk_size, Nk - c * chunk_size), 0, None)


# ---------------------------------------------------------------- fp64 oracle
def numpy_eva_attention(q, k, v, k_sum, v_sum, *, chunk_size, window_size, window="block", scale=None,
                        summary_bias=None, q_offset=None, return_lse=False):
    """fp64 oracle written for clarity. Accepts torch tensors or arrays; returns numpy float64
    `o` [B, H, Nq, Dv] (and `lse` [B, H, Nq] when asked)."""
    _check_window(chunk_size, window_size, window)
    q, k, v, k_sum, v_sum = (to_numpy64(x) for x in (q, k, v, k_sum, v_sum))
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc, Dv = k.shape[1], k.shape[2], k_sum.shape[2], v.shape[3]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    group = H // Hkv
    C = chunk_size
    s = (D ** -0.5 if D > 0 else 1.0) if scale is None else float(scale)
    off = default_q_offset(Nq, Nk, q_offset)
    counts = chunk_counts(Nk, Nc, C)
    if summary_bias is None:
        bias = np.zeros((B, Hkv, Nc))
    elif isinstance(summary_bias, str):
        if summary_bias != "log_count":
            raise ValueError(f"summary_bias must be None, 'log_count' or a tensor, got {summary_bias!r}")
        with np.errstate(divide="ignore"):
            bias = np.broadcast_to(np.log(counts.astype(np.float64)), (B, Hkv, Nc))
    else:
        bias = to_numpy64(summary_bias)
    o = np.zeros((B, H, Nq, Dv))
    lse = np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):
            hk = h // group
            for i in range(Nq):
                t = off + i
                start = start_position(t, chunk_size=C, window_size=window_size, window=window)
                keys = [j for j in range(max(start, 0), t + 1) if j < Nk]
                chunks = [c for c in range(start // C) if c < Nc]
                logits = [s * float(q[b, h, i] @ k[b, hk, j]) for j in keys]
                logits += [s * float(q[b, h, i] @ k_sum[b, hk, c]) + bias[b, hk, c] for c in chunks]
                values = [v[b, hk, j] for j in keys] + [v_sum[b, hk, c] for c in chunks]
                logits = np.array(logits)
                if not np.isfinite(logits).any():  # nothing visible: only when queries lie past the keys
                    continue
                m = logits.max()
                p = np.exp(logits - m)
                lse[b, h, i] = m + math.log(p.sum())
                o[b, h, i] = (p / p.sum()) @ np.stack(values)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------- vectorized reference
def summary_bias_tensor(summary_bias, B: int, Hkv: int, Nk: int, Nc: int, chunk_size: int, *, dtype,
                        device) -> torch.Tensor:
    """The additive summary logit bias as a [B, Hkv, Nc] tensor (-inf for chunks with no token)."""
    if summary_bias is None:
        return torch.zeros(B, Hkv, Nc, dtype=dtype, device=device)
    if isinstance(summary_bias, str):
        if summary_bias != "log_count":
            raise ValueError(f"summary_bias must be None, 'log_count' or a tensor, got {summary_bias!r}")
        counts = torch.as_tensor(chunk_counts(Nk, Nc, chunk_size), dtype=dtype, device=device)
        return torch.log(counts).expand(B, Hkv, Nc)
    return summary_bias.to(dtype)


def torch_eva_attention(q, k, v, k_sum, v_sum, *, chunk_size, window_size, window="block", scale=None,
                        summary_bias=None, q_offset=None, return_lse=False):
    """Dense masked softmax over the augmented keys [k; k_sum]: fp32 math (fp64 for fp64 inputs),
    differentiable in q, k, v, k_sum, v_sum and a tensor summary_bias. Returns `o` in q's dtype and
    `lse` [B, H, Nq] in fp32 (fp64 for fp64 inputs)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc, Dv = k.shape[1], k.shape[2], k_sum.shape[2], v.shape[3]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    group = H // Hkv
    s = (D ** -0.5 if D > 0 else 1.0) if scale is None else float(scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    exact, summ = visible_masks(Nq, Nk, Nc, chunk_size=chunk_size, window_size=window_size, window=window,
                                q_offset=q_offset, device=dev)
    bias = summary_bias_tensor(summary_bias, B, Hkv, Nk, Nc, chunk_size, dtype=acc, device=dev)
    qg = q.to(acc).reshape(B, Hkv, group, Nq, D)
    keys = torch.cat([k.to(acc), k_sum.to(acc)], dim=2)  # [B, Hkv, Nk + Nc, D]
    vals = torch.cat([v.to(acc), v_sum.to(acc)], dim=2)
    # a non-finite key or value reaches only the rows that see it: the products run on finite copies
    # (0 * inf would be NaN in rows whose weight is 0) and the rows that see one are NaN
    bad_key = ~torch.isfinite(keys).all(-1)[:, :, None, None, :]  # [B, Hkv, 1, 1, Nk + Nc]
    bad_val = ~torch.isfinite(vals).all(-1)[:, :, None, None, :]
    keys = torch.where(torch.isfinite(keys), keys, 0.0)
    logits = s * torch.einsum("bhgqd,bhkd->bhgqk", qg, keys)
    zero = torch.zeros(B, Hkv, Nk, dtype=acc, device=dev)
    logits = logits + torch.cat([zero, bias], dim=2)[:, :, None, None, :]
    logits = logits.masked_fill(bad_key, float("nan"))
    mask = torch.cat([exact, summ], dim=1)  # [Nq, Nk + Nc]
    logits = logits.masked_fill(~mask, float("-inf"))
    # rows with nothing visible (only possible when q_offset puts queries past the keys): o = 0, lse = -inf
    empty = torch.isneginf(logits).all(-1, keepdim=True)
    safe = logits.masked_fill(empty, 0.0)
    p = torch.softmax(safe, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(empty[..., 0], float("-inf"))
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, torch.where(torch.isfinite(vals), vals, 0.0))
    o = o.masked_fill(((p > 0) & bad_val).any(-1, keepdim=True), float("nan"))
    o = o.reshape(B, H, Nq, Dv).to(q.dtype)
    return (o, lse.reshape(B, H, Nq)) if return_lse else o


# ---------------------------------------------------------------- test problems
def random_problem(B=2, H=4, Hkv=2, Nq=None, Nk=64, D=32, C=4, W=16, *, window="block", summary_bias=None,
                   q_offset=None, dtype=torch.float32, device="cpu", seed=0, layout="contiguous"):
    """Fresh random inputs for op 2 (never zeros), as keyword arguments of `eva_attention`.

    k_sum / v_sum are op-1 summaries of k, v (mean keys, omega = 0), computed in fp32 then cast.
    `summary_bias`: None, "log_count" or "tensor" (a random [B, Hkv, Nc] fp32 tensor). `layout`:
    "contiguous" or "strided" (tensors stored [B, N, H, D] and viewed as [B, H, N, D])."""
    Nq = Nk if Nq is None else Nq
    g = torch.Generator(device="cpu").manual_seed(seed)
    Nc = -(-Nk // C)

    def rnd(b, h, n, d):
        if layout == "strided":
            x = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
        elif layout == "contiguous":
            x = torch.randn(b, h, n, d, generator=g)
        else:
            raise ValueError(f"layout must be 'contiguous' or 'strided', got {layout!r}")
        return x

    q, k, v = rnd(B, H, Nq, D), rnd(B, Hkv, Nk, D), rnd(B, Hkv, Nk, D)
    k_sum, v_sum = torch_chunk_summaries(k, v, C)
    if layout == "strided":
        k_sum = k_sum.transpose(1, 2).contiguous().transpose(1, 2)
        v_sum = v_sum.transpose(1, 2).contiguous().transpose(1, 2)
    if summary_bias == "tensor":
        bias = (torch.randn(B, Hkv, Nc, generator=g) * 0.5).to(device)
    elif summary_bias in (None, "log_count"):
        bias = summary_bias
    else:
        raise ValueError(f"summary_bias must be None, 'log_count' or 'tensor', got {summary_bias!r}")
    cast = dict(dtype=dtype, device=device)
    return dict(q=q.to(**cast), k=k.to(**cast), v=v.to(**cast), k_sum=k_sum.to(**cast),
                v_sum=v_sum.to(**cast), chunk_size=C, window_size=W, window=window, summary_bias=bias,
                q_offset=q_offset)
