"""EvaCache: one attention layer's compressed key/value cache for decoding (SPEC.md, "Decode with a
compressed cache").

Design. Every buffer is allocated once, in one tensor per k and v of shape [B, Hkv, S + R + 1, D]:
  rows [0, S)          summaries, slot c = chunk c (S = ceil(max_seq_len / C)), append-only;
  rows [S, S + R)      exact-token ring: position p lives in row S + p % R (R = W, or W + C - 1 sliding);
  row  S + R           the token being decoded.
A step runs op 2 on this buffer as if it were a list of S + R "summaries" plus one exact key: with
chunk_size 1, window_size S + R and q_offset S + R, the query sees the last row exactly and every
other row as a summary; a per-sequence fp32 bias (0 or -1e30) switches each summary slot and ring
row on or off from the positions, which live on the device. So one step has fixed shapes and
launch arguments whatever the positions: no host sync, no torch.cat, no allocation of cache memory,
and it can be captured in a CUDA graph and replayed for every token. A chunk is summarised with op 1
when it completes (its C tokens are still in the ring), written to its slot, and becomes visible
when the window start passes it; the masked bias reproduces op 2's rule for every query exactly.

With FUSED_STEP on and op 1 able to run in Triton (backend "auto" or "triton"), a one-token step is
one launch plus op 2's own: kernels_triton/eva_cache.py's step (op 1 over the chunk ending at t - 1
straight from the ring where it completed, the token rows, the summary slot, the bias row,
lengths += 1), then op 2. Otherwise op 1 runs on its own: gather_chunk (the chunk's ring rows), op 1
on them, append (the rest), op 2.
CPU tensors outside the Triton backend take the same stages as torch ops (about 40 small kernels).

Limits. Multi-token steps run one token at a time (n single-token steps: n launches of op 1 and
op 2). Ragged prompts are right-padded: `prefill(..., lengths=)` gives each sequence's prompt length
(outputs at padded positions are meaningless) and every sequence then advances by the same n per
step. `omega` is one centre per kv head ([Hkv, D]); a tensor `summary_bias` is [B, Hkv, S].
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from flashswitch import _common as C
from flashswitch.ops import layers
from flashswitch.ops.chunk_summaries import chunk_summaries
from flashswitch.ops.eva_attention import check_window, eva_attention

MASKED = -1e30  # bias of a switched-off slot: finite, so any online softmax drops it without NaN


def window_start(t: torch.Tensor, chunk_size: int, window_size: int, window: str) -> torch.Tensor:
    """start(t) of SPEC op 2, elementwise on an int64 tensor of positions."""
    if window == "block":
        return window_size * torch.div(t, window_size, rounding_mode="floor")
    s = chunk_size * torch.div(t - window_size + 1, chunk_size, rounding_mode="floor")
    return torch.where(t >= window_size, s, torch.zeros_like(s))


# The one-launch step (kernels_triton/eva_cache.step) for caches whose op 1 may run in Triton; off, such
# a step runs gather_chunk, op 1 and append (the tests run both paths).
FUSED_STEP = True


class EvaCache:
    """Compressed cache of one EVA attention layer: exact ring of the last W (block) or W + C - 1
    (sliding) tokens plus one summary per chunk that left it. See the module docstring for the design.

    `prefill(q, k, v, lengths=None)` attends over a prompt (op 1 + op 2, full sequence) and fills the
    cache; `step(q, k, v)` appends n >= 1 tokens per sequence and attends from them. q: [B, H, n, D],
    k, v: [B, Hkv, n, D] (GQA: H % Hkv == 0). `lengths` ([B] ints, on the device) holds every
    sequence's length; `reorder(beam_idx)` permutes the sequences (beam search); `reset()` empties it.
    `key_weight`, `omega` ([Hkv, D]) go to op 1, `summary_bias` (None, "log_count" or [B, Hkv, S]) and
    `scale` to op 2, `backend` to both.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *, chunk_size: int, window_size: int,
                 window: str = "block", max_seq_len: int, dtype: Optional[torch.dtype] = None, device=None,
                 key_weight: Optional[torch.Tensor] = None, omega: Optional[torch.Tensor] = None,
                 summary_bias=None, scale: Optional[float] = None, backend: str = "auto"):
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_seq_len", max_seq_len)):
            C.check_positive_int(name, value)
        check_window(chunk_size, window_size, window)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in C.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {C.FLOAT_DTYPES}, got {dtype}")
        # "cuda" -> "cuda:0": inputs are compared with the cache's device, which must carry the index
        device = torch.empty(0, device="cpu" if device is None else device).device
        B, Hkv, D = batch_size, num_kv_heads, head_dim
        self.batch_size, self.num_kv_heads, self.head_dim = B, Hkv, D
        self.chunk_size, self.window_size, self.window = chunk_size, window_size, window
        self.max_seq_len, self.dtype, self.device = max_seq_len, dtype, device
        self.scale = C.check_scale(scale, D)
        self.backend = backend
        self.num_summaries = S = -(-max_seq_len // chunk_size)
        self.ring_size = R = window_size + (chunk_size - 1 if window == "sliding" else 0)
        for name, t in (("key_weight", key_weight), ("omega", omega)):
            if t is not None:
                C.check_tensor(name, t, ndim=2, device=device)
                C.check_shape(name, t, (Hkv, D))
        # a cache holds no autograd state: it reads the current values of (learnable) centres
        self.key_weight = None if key_weight is None else key_weight.detach()
        self.omega = None if omega is None else omega.detach()
        self.log_count = False
        self.user_bias = None
        if isinstance(summary_bias, str):
            if summary_bias != "log_count":
                raise ValueError(f"summary_bias must be None, 'log_count' or a [B, Hkv, S] tensor, "
                                 f"got {summary_bias!r}")
            self.log_count = True
        elif isinstance(summary_bias, torch.Tensor):
            C.check_tensor("summary_bias", summary_bias, ndim=3, dtypes=C.FLOAT_DTYPES + (torch.float64,),
                           device=device, last_contiguous=False)
            C.check_shape("summary_bias", summary_bias, (B, Hkv, S))
            self.user_bias = summary_bias
        elif summary_bias is not None:
            raise TypeError(f"summary_bias must be None, 'log_count' or a tensor, got {type(summary_bias).__name__}")
        # zeros, not empty: a switched-off row still meets a zero softmax weight, and 0 * NaN is NaN
        self.k = torch.zeros(B, Hkv, S + R + 1, D, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.bias = torch.zeros(B, Hkv, S + R, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=device)
        self._slots = torch.arange(S, device=device)
        self._rows = torch.arange(R, device=device)
        self._chunk = torch.arange(chunk_size, device=device)
        self._max_len = 0  # host-side bound on every length (known without a sync)
        # a step's bookkeeping: Triton launches on the GPU whatever the ops' backend (and under the
        # interpreter for the Triton backend), else torch ops. With FUSED_STEP, where op 1 may run in
        # Triton ("auto", "triton"), the chunk's summary joins them: one launch (eva_cache.step), else two
        # around op 1
        self._kernels = layers.cache_kernels(device, backend)
        self._fused = FUSED_STEP and self._kernels is not None and backend in ("auto", "triton")
        self._done_programs = torch.zeros(B, dtype=torch.int32, device=device)  # eva_cache.step's counter

    # ------------------------------------------------------------ state
    @property
    def nbytes(self) -> int:
        """Bytes of the cache's allocation: (S + R + 1) * 2 * D elements per (sequence, kv head), plus
        the [B, Hkv, S + R] fp32 bias and the lengths."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.bias, self.lengths))

    @property
    def empty(self) -> bool:
        """Whether nothing was added since construction or reset() (a host-side count: no sync)."""
        return self._max_len == 0

    @property
    def summaries(self):
        """(k_sum, v_sum) views [B, Hkv, S, D]: slot c holds chunk c once it has completed."""
        S = self.num_summaries
        return self.k[:, :, :S], self.v[:, :, :S]

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.lengths.zero_()
        self._max_len = 0

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Sequence b takes the state of sequence beam_idx[b] (a [B] int tensor on the cache's device)."""
        C.check_tensor("beam_idx", beam_idx, ndim=1, dtypes=(torch.int32, torch.int64), device=self.device,
                       last_contiguous=False)
        C.check_shape("beam_idx", beam_idx, (self.batch_size,))
        for t in (self.k, self.v, self.lengths):
            t.copy_(t.index_select(0, beam_idx))

    # ------------------------------------------------------------ checks
    def _check_qkv(self, q, k, v):
        C.check_tensor("q", q, ndim=4, dtypes=(self.dtype,), device=self.device)
        for name, t in (("k", k), ("v", v)):
            C.check_tensor(name, t, ndim=4, dtypes=(self.dtype,), device=self.device)
        B, H, n, D = q.shape
        if B != self.batch_size or D != self.head_dim:
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [{self.batch_size}, H, n, {self.head_dim}]")
        C.check_shape("k", k, (self.batch_size, self.num_kv_heads, n, self.head_dim))
        C.check_shape("v", v, k.shape)
        if H % self.num_kv_heads:
            raise ValueError(f"q has {H} heads, not a multiple of the cache's {self.num_kv_heads} kv heads")
        return n

    def _grow(self, n: int) -> None:
        if self._max_len + n > self.max_seq_len:
            raise ValueError(f"the cache holds max_seq_len={self.max_seq_len} positions; {self._max_len} are "
                             f"(at most) used and {n} more were given")
        self._max_len += n

    # ------------------------------------------------------------ prefill
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of a prompt (op 2 over op 1's summaries, as a full-sequence call) into an empty
        cache, which then holds it. q: [B, H, P, D]; k, v: [B, Hkv, P, D]. `lengths`: optional [B]
        int tensor, each sequence's prompt length <= P; prompts are right-padded (outputs past a
        sequence's length are meaningless and its padding never enters the cache)."""
        P = self._check_qkv(q, k, v)
        if self._max_len:
            raise ValueError("prefill needs an empty cache (call reset() first); use step() to extend it")
        B, Cs = self.batch_size, self.chunk_size
        valid = None
        if lengths is not None:
            C.check_tensor("lengths", lengths, ndim=1, dtypes=(torch.int32, torch.int64), device=self.device)
            C.check_shape("lengths", lengths, (B,))
            valid = torch.arange(P, device=self.device)[None, :] < lengths[:, None]
        self._grow(P)
        k_sum, v_sum = chunk_summaries(k, v, Cs, omega=self.omega, key_weight=self.key_weight, valid=valid,
                                       scale=self.scale, backend=self.backend)
        Nc = k_sum.shape[2]
        bias = "log_count" if self.log_count else self.user_bias
        if isinstance(bias, torch.Tensor):
            bias = bias[:, :, :Nc]
        o = eva_attention(q, k, v, k_sum, v_sum, chunk_size=Cs, window_size=self.window_size, window=self.window,
                          scale=self.scale, summary_bias=bias, backend=self.backend)
        # chunks a sequence has not completed hold partial summaries; they stay switched off until a
        # step completes the chunk and overwrites its slot
        if self._kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1:  # one launch
            self._kernels.prefill(self.k, self.v, self.lengths, k, v, k_sum, v_sum, lengths,
                                  num_summaries=self.num_summaries, ring_size=self.ring_size)
            return o
        self.k[:, :, :Nc] = k_sum
        self.v[:, :, :Nc] = v_sum
        L = torch.full((B,), P, dtype=torch.int64, device=self.device) if lengths is None else lengths.to(torch.int64)
        if P:
            # ring row r gets the latest prompt position p <= L - 1 with p = r (mod R), if any
            R, S = self.ring_size, self.num_summaries
            pos = (L - 1)[:, None] - torch.remainder((L - 1)[:, None] - self._rows[None, :], R)   # [B, R]
            idx = pos.clamp(min=0)[:, None, :, None].expand(B, self.num_kv_heads, R, self.head_dim)
            self.k[:, :, S:S + R] = torch.gather(k, 2, idx)
            self.v[:, :, S:S + R] = torch.gather(v, 2, idx)
        self.lengths.copy_(L)
        return o

    # ------------------------------------------------------------ decode
    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append n >= 1 tokens to every sequence and return their attention o [B, H, n, D]. Fixed
        shapes and launch arguments, positions on the device: CUDA-graph capturable."""
        n = self._check_qkv(q, k, v)
        if n == 0:
            raise ValueError("step needs at least one new token (q has 0 positions)")
        self._grow(n)
        if n == 1:
            return self._step_one(q, k, v)
        o = torch.empty_like(q)
        for i in range(n):  # token i must see tokens < i of this step: one decode step each
            o[:, :, i:i + 1] = self._step_one(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1])
        return o

    def _step_one(self, q, k, v):
        self._append_token(k, v)
        # op 2 over the buffer: the decode row exactly, every other row as a "summary" under the bias
        S, R = self.num_summaries, self.ring_size
        return eva_attention(q, self.k, self.v, self.k[:, :, :S + R], self.v[:, :, :S + R], chunk_size=1,
                             window_size=S + R, window="block", scale=self.scale, summary_bias=self.bias,
                             q_offset=S + R, backend=self.backend)

    def _append_token(self, k, v) -> None:
        """The cache state of a one-token step (all but its attention)."""
        Cs, R, S = self.chunk_size, self.ring_size, self.num_summaries
        if self._fused:  # stages 1 and 2 in one launch
            self._kernels.step(self.k, self.v, self.bias, self.lengths, self._done_programs, k, v, self.omega,
                               self.key_weight, self.user_bias, chunk_size=Cs, window_size=self.window_size,
                               window=self.window, num_summaries=S, ring_size=R, on_bias=self._on_bias(),
                               scale=self.scale)
            return
        # 1. the chunk ending at t - 1 (t = lengths) has just completed when t % C == 0: summarise it
        #    from the ring (computed every step, stored only where it completed: fixed shapes)
        if self._kernels is not None:
            chunk_k, chunk_v, t = self._kernels.gather_chunk(self.k, self.v, self.lengths, chunk_size=Cs,
                                                             num_summaries=S, ring_size=R)
        else:
            chunk_k, chunk_v = self._gather_chunk_torch()
        ks, vs = chunk_summaries(chunk_k, chunk_v, Cs, omega=self.omega, key_weight=self.key_weight,
                                 scale=self.scale, backend=self.backend)
        # 2. the summary into its slot, the new token into its ring row and the exact row, the bias row of
        #    the query at t, lengths += 1
        if self._kernels is not None:
            self._kernels.append(self.k, self.v, self.bias, self.lengths, t, k, v, ks, vs, self.user_bias,
                                 chunk_size=Cs, window_size=self.window_size, window=self.window,
                                 num_summaries=S, ring_size=R, on_bias=self._on_bias())
        else:
            self._append_torch(k, v, ks, vs)

    def _on_bias(self) -> float:
        return math.log(self.chunk_size) if self.log_count else 0.0  # every visible chunk is full

    # the same two stages in torch ops (CPU tensors outside the Triton backend)
    def _gather_chunk_torch(self):
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        Cs, R, S = self.chunk_size, self.ring_size, self.num_summaries
        c_done = torch.div(self.lengths, Cs, rounding_mode="floor") - 1
        rows = S + torch.remainder(c_done[:, None] * Cs + self._chunk[None, :], R)                # [B, C]
        idx = rows[:, None, :, None].expand(B, Hkv, Cs, D)
        return torch.gather(self.k, 2, idx), torch.gather(self.v, 2, idx)

    def _append_torch(self, k, v, ks, vs):
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        Cs, W, R, S = self.chunk_size, self.window_size, self.ring_size, self.num_summaries
        t = self.lengths  # position of the new token, per sequence
        done = (torch.remainder(t, Cs) == 0) & (t >= Cs)
        c_done = torch.div(t, Cs, rounding_mode="floor") - 1
        # row writes are gather/scatter along the row dim (per-sequence rows, capturable)
        slot = c_done.clamp(min=0)[:, None, None, None].expand(B, Hkv, 1, D)
        keep = ~done[:, None, None, None]
        self.k.scatter_(2, slot, torch.where(keep, torch.gather(self.k, 2, slot), ks))
        self.v.scatter_(2, slot, torch.where(keep, torch.gather(self.v, 2, slot), vs))
        ring_row = (S + torch.remainder(t, R))[:, None, None, None].expand(B, Hkv, 1, D)
        self.k.scatter_(2, ring_row, k)
        self.v.scatter_(2, ring_row, v)
        self.k[:, :, S + R:] = k
        self.v[:, :, S + R:] = v
        # which slots the query at t sees (SPEC op 2): summaries c < start(t) / C, ring positions
        # [start(t), t) (t itself is the exact row)
        start = window_start(t, Cs, W, self.window)
        sum_on = self._slots[None, :] < torch.div(start, Cs, rounding_mode="floor")[:, None]        # [B, S]
        pos = t[:, None] - torch.remainder(t[:, None] - self._rows[None, :], R)                     # [B, R]
        ring_on = (pos >= start[:, None]) & (pos < t[:, None])
        on_bias = self.user_bias.to(torch.float32) if self.user_bias is not None else self._on_bias()
        self.bias[:, :, :S] = torch.where(sum_on[:, None, :], on_bias, MASKED)
        self.bias[:, :, S:] = torch.where(ring_on[:, None, :], 0.0, MASKED)
        self.lengths += 1


__all__ = ["EvaCache", "window_start"]
