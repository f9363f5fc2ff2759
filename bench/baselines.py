"""What a user would run instead of flashswitch, timed in the same benchmark runs as the kernels.

Op 2 (eva_attention, SPEC "Op 2"):
  - `FlexEva` / `flex_attention_eva`: FlexAttention (`torch.nn.attention.flex_attention`, under
    torch.compile) over the concatenated keys [k; k_sum] and values [v; v_sum], with the EVA
    visibility as a `mask_mod` (exact key j: start(t) <= j <= t; summary c: c < start(t) / C), the
    summary bias as a `score_mod`, GQA through `enable_gqa`. The block mask is built once per problem
    shape (`eva_block_mask`); the concatenation runs on every call (`FlexEva.__call__`: the bench row
    "flex") or is done beforehand (`FlexEva.attend`: "flex_nocat").
  - `sdpa_causal`: full causal SDPA over the same sequence: the cost EVA avoids.
  - `cat_sdpa_decode`: one decode step the plain way: torch.cat of the exact buffer (keys
    start(t)..t) and the summaries, then SDPA of the one query with no mask.
Op 3 (expert_matmul, SPEC "Op 3"):
  - `grouped_mm_pipeline`: argsort of the expert ids, per-expert offsets (bincount + cumsum, on the
    device), gather of the input rows, `torch._grouped_mm`, scatter back, gate multiply, slot-group sum.
    `torch._grouped_mm` needs bf16/fp16 and 16-byte aligned rows: other problems raise `Unsupported`.
  - `dense_equal_macs`: one dense matmul [P, d_in] @ [d_in, d_out] with the same multiply-adds as the
    P = T·S routed pairs: the roof a grouped matmul can reach.

Each baseline returns what the op returns in the op's layout (o [B, H, Nq, D]; y [T, G_out, d_out]) so
tests can compare it with the PyTorch reference. The module runs on torch 2.11 and later.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from flashswitch.reference.eva_attention import (default_q_offset, start_position, summary_bias_tensor)


class Unsupported(RuntimeError):
    """The baseline cannot run this problem (a limit of the library it calls, not a bug)."""


# ================================================================ op 2: eva_attention
RECOMPILE_LIMIT = 64  # one compiled flex_attention serves every shape of a benchmark session


def compiled_flex_attention():
    """`flex_attention` under torch.compile (dynamic=False), made once per process.

    Every new shape or mask recompiles; the recompile limit is raised so a benchmark sweep never falls
    back to the eager (dense, memory-hungry) flex_attention."""
    fn = _COMPILED.get("flex")
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
                setattr(cfg, name, RECOMPILE_LIMIT)
        fn = _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return fn


_COMPILED: dict = {}


def eva_mask_mod(num_exact: int, *, chunk_size: int, window_size: int, window: str = "block", q_offset: int = 0):
    """The EVA visibility over the concatenated keys [k (num_exact of them); k_sum] as a FlexAttention
    mask_mod: query index i sits at t = q_offset + i; kv index j < num_exact is exact key j (visible
    when start(t) <= j <= t), j >= num_exact is summary c = j - num_exact (visible when c < start(t) / C)."""
    C, W, Nk, off = int(chunk_size), int(window_size), int(num_exact), int(q_offset)
    if window == "block":
        def start_of(t):
            return (t // W) * W
    elif window == "sliding":
        def start_of(t):
            return torch.where(t < W, 0, ((t - W + 1) // C) * C)
    else:
        raise ValueError(f"window must be 'block' or 'sliding', got {window!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        t = q_idx + off
        start = start_of(t)
        exact = (kv_idx < Nk) & (kv_idx >= start) & (kv_idx <= t)
        summary = (kv_idx >= Nk) & (kv_idx - Nk < start // C)
        return exact | summary

    return mask_mod


def eva_score_mod(bias: torch.Tensor, num_exact: int, group: int):
    """score_mod adding bias[b, kv head, c] to the logit of summary c (kv index num_exact + c).
    `bias`: [B, Hkv, Nc] fp32; `group` = H // Hkv (the score_mod sees query heads)."""
    Nk, G = int(num_exact), int(group)
    bias = bias.to(torch.float32).contiguous()

    def score_mod(score, b, h, q_idx, kv_idx):
        c = torch.clamp(kv_idx - Nk, min=0)
        return torch.where(kv_idx >= Nk, score + bias[b, h // G, c], score)

    return score_mod


def eva_block_mask(Nq: int, Nk: int, Nc: int, *, chunk_size: int, window_size: int, window: str = "block",
                   q_offset: Optional[int] = None, device=None):
    """The FlexAttention BlockMask of the EVA visibility for Nq queries over [k; k_sum] (Nk + Nc keys).
    Built once per shape, outside any timed region (compiled on a GPU: no dense [Nq, Nk + Nc] mask)."""
    from torch.nn.attention.flex_attention import create_block_mask
    off = default_q_offset(Nq, Nk, q_offset)
    mask_mod = eva_mask_mod(Nk, chunk_size=chunk_size, window_size=window_size, window=window, q_offset=off)
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        try:
            return create_block_mask(mask_mod, None, None, Nq, Nk + Nc, device=device, _compile=True)
        except Exception:  # an inductor that cannot compile it: the dense construction
            pass
    return create_block_mask(mask_mod, None, None, Nq, Nk + Nc, device=device)


class FlexEva:
    """FlexAttention set up for one EVA problem (shapes, window, bias): block mask and score_mod are
    built here, once; calls only concatenate (`__call__`) and attend.

    `compiled=False` runs the eager flex_attention (a dense reference implementation: small problems
    only, e.g. tests on CPU)."""

    def __init__(self, q, k, k_sum, *, chunk_size, window_size, window="block", scale=None, summary_bias=None,
                 q_offset=None, compiled=True, block_mask=None):
        B, H, Nq, D = q.shape
        Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
        if Hkv == 0 or H % Hkv:
            raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
        self.num_exact = Nk
        self.scale = (D ** -0.5 if D > 0 else 1.0) if scale is None else float(scale)
        self.enable_gqa = H != Hkv
        self.block_mask = block_mask if block_mask is not None else eva_block_mask(
            Nq, Nk, Nc, chunk_size=chunk_size, window_size=window_size, window=window, q_offset=q_offset,
            device=q.device)
        self.score_mod = None
        if summary_bias is not None:
            bias = summary_bias_tensor(summary_bias, B, Hkv, Nk, Nc, chunk_size, dtype=torch.float32,
                                       device=q.device)
            self.score_mod = eva_score_mod(bias, Nk, H // Hkv)
        if compiled:
            self._flex = compiled_flex_attention()
        else:
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = flex_attention

    @staticmethod
    def concat(k, v, k_sum, v_sum):
        """The augmented keys and values [k; k_sum], [v; v_sum] along the sequence dim."""
        return torch.cat([k, k_sum], dim=2), torch.cat([v, v_sum], dim=2)

    def attend(self, q, keys, values):
        """Attention over already concatenated keys / values (the "flex_nocat" row): o [B, H, Nq, D]."""
        kw = {"enable_gqa": True} if self.enable_gqa else {}
        return self._flex(q, keys, values, score_mod=self.score_mod, block_mask=self.block_mask, scale=self.scale,
                          **kw)

    def __call__(self, q, k, v, k_sum, v_sum):
        """What a user runs each step (the "flex" row): concatenate, then attend."""
        keys, values = self.concat(k, v, k_sum, v_sum)
        return self.attend(q, keys, values)


def flex_attention_eva(q, k, v, k_sum, v_sum, *, chunk_size, window_size, window="block", scale=None,
                       summary_bias=None, q_offset=None, compiled=True, block_mask=None):
    """EVA attention through FlexAttention, one shot (builds the block mask unless given): o [B, H, Nq, D]."""
    flex = FlexEva(q, k, k_sum, chunk_size=chunk_size, window_size=window_size, window=window, scale=scale,
                   summary_bias=summary_bias, q_offset=q_offset, compiled=compiled, block_mask=block_mask)
    return flex(q, k, v, k_sum, v_sum)


def compile_failures() -> tuple:
    """The exception types of torch.compile failing to build a kernel (not of a wrong answer)."""
    out = []
    try:
        from torch._dynamo.exc import BackendCompilerFailed
        out.append(BackendCompilerFailed)
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch._inductor.exc import InductorError
        out.append(InductorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(out)


def flex_or_unsupported(fn):
    """`fn()` (a FlexAttention call, compiled on first use); a shape torch cannot compile becomes
    `Unsupported` with the compiler's last message line (e.g. Inductor's flex decoding kernel rejects some
    GQA decode shapes), so benchmarks and tests report it instead of failing."""
    try:
        return fn()
    except compile_failures() as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        raise Unsupported(f"FlexAttention did not compile: {type(err).__name__}: {lines[-1] if lines else ''}"[:300])


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)


def sdpa_causal(q, k, v, *, scale=None, q_offset=None):
    """Exact causal softmax attention over all keys (SDPA; flash kernels on a GPU): o [B, H, Nq, D].
    Query i sits at q_offset + i (default Nk - Nq) and sees keys 0..q_offset + i."""
    Nq, Nk = q.shape[2], k.shape[2]
    off = default_q_offset(Nq, Nk, q_offset)
    if off < 0 or off + Nq > Nk:
        raise ValueError(f"q_offset must satisfy 0 <= q_offset and q_offset + Nq <= Nk, got {off}, {Nq}, {Nk}")
    if off == 0:
        return _sdpa(q, k[:, :, :Nq], v[:, :, :Nq], is_causal=True, scale=scale)
    if Nq == 1:
        return _sdpa(q, k[:, :, :off + 1], v[:, :, :off + 1], scale=scale)
    t = torch.arange(Nq, device=q.device)[:, None] + off
    mask = torch.arange(off + Nq, device=q.device)[None, :] <= t
    return _sdpa(q, k[:, :, :off + Nq], v[:, :, :off + Nq], attn_mask=mask, scale=scale)


def cat_sdpa_decode(q, k, v, k_sum, v_sum, *, chunk_size, window_size, window="block", scale=None,
                    summary_bias=None, q_offset=None):
    """One EVA decode step the plain way: the query at t = q_offset (one query, Nq = 1) attends with SDPA,
    no mask, to torch.cat([exact buffer = keys start(t)..t, summaries 0..start(t)/C - 1]). A summary
    bias goes in as an additive float mask. o [B, H, 1, D]."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    if Nq != 1:
        raise ValueError(f"cat_sdpa_decode takes one query per (batch, head), got Nq = {Nq}")
    t = default_q_offset(Nq, Nk, q_offset)
    start = start_position(t, chunk_size=chunk_size, window_size=window_size, window=window)
    n_sum = max(0, min(Nc, start // chunk_size))
    keys = torch.cat([k[:, :, start:t + 1], k_sum[:, :, :n_sum]], dim=2)
    values = torch.cat([v[:, :, start:t + 1], v_sum[:, :, :n_sum]], dim=2)
    mask = None
    if summary_bias is not None:
        bias = summary_bias_tensor(summary_bias, B, Hkv, Nk, Nc, chunk_size, dtype=torch.float32,
                                   device=q.device)[:, :, :n_sum]
        bias = torch.cat([bias.new_zeros(B, Hkv, t + 1 - start), bias], dim=2)
        mask = bias.repeat_interleave(H // Hkv, dim=1)[:, :, None, :].to(q.dtype)
    return _sdpa(q, keys, values, attn_mask=mask, scale=scale)


# ================================================================ op 3: expert_matmul
GROUPED_MM_DTYPES = (torch.bfloat16,)


def grouped_mm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why `torch._grouped_mm` cannot take this problem (None when it can): it needs bf16 operands
    (fp16 only with cuBLASLt grouped GEMM on CUDA 13.3+, left out here) and rows that are multiples of
    16 bytes (d_in and d_out multiples of 8 in bf16)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.dtype not in GROUPED_MM_DTYPES:
        return f"torch._grouped_mm takes bf16 operands, x is {x.dtype}"
    d_in, d_out = weight.shape[1], weight.shape[2]
    align = 16 // x.element_size()
    bad = [f"{name} = {n}" for name, n in (("d_in", d_in), ("d_out", d_out)) if n % align]
    if bad:
        return f"torch._grouped_mm needs 16-byte aligned rows ({align} bf16 values): {', '.join(bad)}"
    return None


def grouped_mm_pipeline(x, expert_idx, weight, gates=None, out_groups=None):
    """Op 3 as a user writes it with `torch._grouped_mm` (no host sync): y [T, G_out, d_out] in x's dtype.

    x: [T, d_in] or [T, G_in, d_in]; expert_idx: [T, S] ids in [0, E); weight: [E, d_in, d_out] (cast to
    x's dtype when it is not: fp32 master weights); gates: [T, S] or None; out_groups: G_out dividing S.
    Raises `Unsupported` where `torch._grouped_mm` cannot run the problem."""
    why = grouped_mm_unsupported(x, weight)
    if why:
        raise Unsupported(why)
    T, S = expert_idx.shape
    E, d_in, d_out = weight.shape
    G_in = 1 if x.dim() == 2 else x.shape[1]
    G_out = S if out_groups is None else int(out_groups)
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair p = t * S + s, sorted by expert
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)  # end of each expert's rows
    if G_in == 1:
        rows = x.reshape(T, d_in)[order // S]
    else:
        rows = x.reshape(T * G_in, d_in)[(order // S) * G_in + (order % S) // (S // G_in)]
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    out_sorted = torch._grouped_mm(rows, w, offs=offs)  # [P, d_out]
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted).view(T, S, d_out)
    if gates is not None:
        out = out * gates.to(out.dtype)[:, :, None]
    if G_out == S:
        return out
    return out.view(T, G_out, S // G_out, d_out).sum(2)


def dense_equal_macs_operands(x, expert_idx, weight, *, seed: int = 0):
    """(a [P, d_in], b [d_in, d_out]) in x's dtype on x's device, P = T·S: a dense matmul with the
    multiply-adds of the routed problem."""
    T, S = expert_idx.shape
    d_in, d_out = weight.shape[1], weight.shape[2]
    g = torch.Generator(device=x.device).manual_seed(seed)
    a = torch.randn(T * S, d_in, generator=g, device=x.device, dtype=torch.float32).to(x.dtype)
    b = (torch.randn(d_in, d_out, generator=g, device=x.device, dtype=torch.float32) * d_in ** -0.5).to(x.dtype)
    return a, b


def dense_equal_macs(a, b):
    """The roof: one dense matmul a @ b ([P, d_in] @ [d_in, d_out])."""
    return a @ b


__all__ = ["Unsupported", "flex_or_unsupported", "FlexEva", "flex_attention_eva", "eva_block_mask", "eva_mask_mod", "eva_score_mod",
           "compiled_flex_attention", "sdpa_causal", "cat_sdpa_decode", "grouped_mm_unsupported",
           "grouped_mm_pipeline", "dense_equal_macs_operands", "dense_equal_macs"]


# ================================================================ forward + backward (training) baselines
def fwd_bwd(forward, leaves: list, cotangent: torch.Tensor):
    """A callable running `forward(*leaves)` and the gradients of <out, cotangent> w.r.t. `leaves`
    (torch.autograd.grad: nothing accumulates into .grad between calls): one training step of the op."""
    leaves = [t.detach().requires_grad_(True) for t in leaves]

    def step():
        out = forward(*leaves)
        return torch.autograd.grad(out, leaves, cotangent)
    return step


def flex_fwd_bwd(flex: "FlexEva", q, k, v, k_sum, v_sum, do):
    """FlexAttention forward + backward over [k; k_sum] (concatenation in the step, so the gradients reach
    k_sum and v_sum as EVA's do)."""
    return fwd_bwd(lambda *t: flex(*t), [q, k, v, k_sum, v_sum], do)


def sdpa_causal_fwd_bwd(q, k, v, do, *, q_offset=None):
    """Full causal SDPA (flash) forward + backward over the whole sequence."""
    return fwd_bwd(lambda a, b, c: sdpa_causal(a, b, c, q_offset=q_offset), [q, k, v], do)


def grouped_mm_pipeline_fwd_bwd(x, expert_idx, weight, dy, gates=None, out_groups=None):
    """The torch grouped_mm pipeline forward + backward (gradients of x, weight and gates)."""
    why = grouped_mm_unsupported(x, weight)
    if why:
        raise Unsupported(why)
    leaves = [x, weight] + ([gates] if gates is not None else [])

    def forward(x_, w_, g_=None):
        return grouped_mm_pipeline(x_, expert_idx, w_, gates=g_, out_groups=out_groups)
    return fwd_bwd(forward, leaves, dy)


def dense_equal_macs_fwd_bwd(a, b):
    """The roof of a routed fwd + bwd: one dense matmul and its two gradient matmuls."""
    return fwd_bwd(lambda a_, b_: a_ @ b_, [a, b], torch.ones(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device))


__all__ += ["fwd_bwd", "flex_fwd_bwd", "sdpa_causal_fwd_bwd", "grouped_mm_pipeline_fwd_bwd", "dense_equal_macs_fwd_bwd"]
