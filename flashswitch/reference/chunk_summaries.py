"""Op 1 references: `numpy_chunk_summaries` (fp64 oracle, plain loops) and `torch_chunk_summaries`
(vectorized, differentiable, any device), plus `random_problem` used by tests, check, bench and tune."""
from __future__ import annotations

import math

import numpy as np
import torch

from flashswitch.testing import to_numpy64


def numpy_chunk_summaries(k, v, chunk_size, *, omega=None, key_weight=None, valid=None, scale=None,
                          return_lse=False):
    """fp64 oracle. Accepts torch tensors or arrays; returns numpy float64 arrays."""
    k, v, omega, key_weight, valid = (to_numpy64(x) for x in (k, v, omega, key_weight, valid))
    B, H, N, D = k.shape
    C = chunk_size
    Nc = -(-N // C)
    s = (D ** -0.5 if D else 1.0) if scale is None else scale
    k_sum = np.zeros((B, H, Nc, D))
    v_sum = np.zeros((B, H, Nc, D))
    lse = np.full((B, H, Nc), -np.inf)
    for b in range(B):
        for h in range(H):
            for c in range(Nc):
                idx = [j for j in range(c * C, min(N, (c + 1) * C)) if valid is None or valid[b, j]]
                if not idx:
                    continue
                kc, vc = k[b, h, idx], v[b, h, idx]
                if omega is None:
                    w = np.zeros(D)
                elif np.ndim(omega) == 2:
                    w = omega[h]
                else:
                    w = omega[b, h, c]
                logits = s * (kc @ w - 0.5 * (kc * kc).sum(-1))
                m = logits.max()
                p = np.exp(logits - m)
                lse[b, h, c] = m + math.log(p.sum())
                v_sum[b, h, c] = (p / p.sum()) @ vc
                if key_weight is None:
                    k_sum[b, h, c] = kc.mean(0)
                else:
                    a = kc @ key_weight[h]
                    q = np.exp(a - a.max())
                    k_sum[b, h, c] = (q / q.sum()) @ kc
    return (k_sum, v_sum, lse) if return_lse else (k_sum, v_sum)


def torch_chunk_summaries(k, v, chunk_size, *, omega=None, key_weight=None, valid=None, scale=None,
                          return_lse=False):
    """Vectorized reference: fp32 math (fp64 for fp64 inputs), outputs in the input dtype."""
    B, H, N, D = k.shape
    Nc = -(-N // chunk_size)
    C = min(chunk_size, max(N, 1))  # a chunk longer than N holds tokens [0, N): pad to that, not to C
    s = (D ** -0.5 if D else 1.0) if scale is None else scale
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    pad = Nc * C - N
    kc = torch.nn.functional.pad(k.to(acc), (0, 0, 0, pad)).view(B, H, Nc, C, D)
    vc = torch.nn.functional.pad(v.to(acc), (0, 0, 0, pad)).view(B, H, Nc, C, D)
    mask = torch.ones(B, N, dtype=torch.bool, device=k.device) if valid is None else valid
    mask = torch.nn.functional.pad(mask, (0, pad), value=False).view(B, 1, Nc, C)
    count = mask.sum(-1, keepdim=True)  # [B, 1, Nc, 1]
    nonempty = count > 0
    if omega is None:
        dot = torch.zeros(B, H, Nc, C, dtype=acc, device=k.device)
    elif omega.dim() == 2:
        dot = torch.einsum("bhncd,hd->bhnc", kc, omega.to(acc))
    else:
        dot = torch.einsum("bhncd,bhnd->bhnc", kc, omega.to(acc))
    logits = s * (dot - 0.5 * (kc * kc).sum(-1))
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1)  # -inf for empty chunks
    p = torch.exp(logits - torch.where(nonempty, lse[..., None], torch.zeros_like(lse[..., None])))
    p = torch.where(nonempty, p, torch.zeros_like(p))
    v_sum = torch.einsum("bhnc,bhncd->bhnd", p, vc)
    if key_weight is None:
        k_sum = (kc * mask[..., None]).sum(-2) / count.clamp_min(1)
    else:
        a = torch.einsum("bhncd,hd->bhnc", kc, key_weight.to(acc)).masked_fill(~mask, float("-inf"))
        q = torch.softmax(a, -1)
        q = torch.where(nonempty, q, torch.zeros_like(q))  # softmax of all -inf is NaN
        k_sum = torch.einsum("bhnc,bhncd->bhnd", q, kc)
    out = (k_sum.to(k.dtype), v_sum.to(v.dtype))
    return out + (lse.float() if acc == torch.float32 else lse,) if return_lse else out


def random_problem(B=2, H=3, N=50, D=32, C=8, *, dtype=torch.float32, device="cpu", omega="none",
                   key_weight=False, valid=False, seed=0, layout="contiguous"):
    """Fresh random inputs for op 1 (never zeros). `omega`: "none", "head" or "chunk"; `layout`:
    "contiguous" or "strided" ([B, N, H, D] storage viewed as [B, H, N, D])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    Nc = -(-N // C)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype=dtype, device=device)

    if layout == "strided":
        k = rnd(B, N, H, D).transpose(1, 2)
        v = rnd(B, N, H, D).transpose(1, 2)
    else:
        k, v = rnd(B, H, N, D), rnd(B, H, N, D)
    kw = {}
    if omega == "head":
        kw["omega"] = rnd(H, D)
    elif omega == "chunk":
        kw["omega"] = rnd(B, H, Nc, D)
    if key_weight:
        kw["key_weight"] = rnd(H, D, s=0.5)
    if valid:
        m = torch.rand(B, N, generator=g) > 0.3
        if N > C:  # one fully padded chunk and right padding, the cases that need care
            m[0, :C] = False
            m[-1, N - N // 3:] = False
        kw["valid"] = m.to(device)
    return dict(k=k, v=v, chunk_size=C, **kw)
