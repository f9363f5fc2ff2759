"""Accuracy rules shared by the tests, `flashswitch check` and the tuner (SPEC.md, "Tolerances")."""
from __future__ import annotations

import numpy as np
import torch

# ||out - ref|| / ||ref|| bounds per dtype (fp32 assumes tf32 off / ieee dots)
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def to_numpy64(x) -> np.ndarray | None:
    """x (a tensor, array or nested sequence) as a float64 numpy array on the host; None stays None."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def rel_error(out, ref, *, floor: float = 0.0) -> float:
    """Relative L2 error over finite reference entries; inf when `out` has NaN, or inf where ref has none.
    `floor` bounds the denominator from below: the size the result has when its terms do not cancel, for
    references that cancel to (near) zero, where rounding of the terms is all that is left."""
    o, r = to_numpy64(out), to_numpy64(ref)
    if o.shape != r.shape:
        raise AssertionError(f"shape {o.shape} != reference shape {r.shape}")
    if np.isnan(o).any():
        return float("inf")
    inf_r = ~np.isfinite(r)
    if inf_r.any():  # e.g. lse = -inf for empty chunks: must match exactly
        if not np.array_equal(o[inf_r], r[inf_r]):
            return float("inf")
        o, r = o[~inf_r], r[~inf_r]
    if not np.isfinite(o).all():
        return float("inf")
    denom = max(float(np.linalg.norm(r)), floor)
    num = np.linalg.norm(o - r)
    if denom == 0:
        return float(num)
    return float(num / denom)


def rule_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The precision whose bound judges output `name` of a problem with `dtype` inputs: that dtype (fp32
    master weights' gradients included: they come from 16-bit x and dy), but for lse, which every kernel
    computes and returns in fp32."""
    return torch.float32 if name == "lse" else dtype


def rounding_sensitivity(fn, inputs: dict, dtype: torch.dtype, *, samples: int = 2, seed: int = 0) -> dict:
    """How far each fp64 output of `fn(inputs)` (a dict of tensors) moves, relative to its norm, when every
    input moves by one rounding of `dtype` (each element scaled by 1 +- eps, random signs); the largest
    move over `samples` draws, per output. This is the problem's conditioning in units of dtype's
    rounding: where the terms of a result cancel (a gate gradient that sums dy * y over a few columns),
    any evaluation order of that precision has an error near this, whatever the reference's own luck."""
    eps = float(torch.finfo(dtype).eps)
    ref = {n: t.detach().to(torch.float64) for n, t in fn(inputs).items()}
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(ref, 0.0)
    for _ in range(samples):
        moved = {}
        for n, t in inputs.items():
            sign = torch.randint(0, 2, t.shape, generator=gen).to(t.device, torch.float64) * 2 - 1
            moved[n] = t.detach().to(torch.float64) * (1 + eps * sign)
        for n, t in fn(moved).items():
            worst[n] = max(worst[n], rel_error(t, ref[n]))
    return worst


def assert_close(name: str, out, ref, dtype: torch.dtype, *, baseline=None, factor: float = 2.0,
                 floor: float = 0.0, tol: float = 0.0) -> float:
    """Pass when rel_error(out) <= the dtype bound (or `tol` where the problem's conditioning calls for
    more), or <= factor x the error of `baseline` (the PyTorch reference in the same precision) plus the
    dtype's rounding floor. `floor`: as in rel_error. Returns the error."""
    err = rel_error(out, ref, floor=floor)
    bound = max(REL_TOL[dtype], tol)
    if baseline is not None:
        floor = float(torch.finfo(dtype).eps) if dtype != torch.float64 else 1e-14
        base_err = rel_error(baseline, ref, floor=floor)
        if np.isfinite(base_err):  # a baseline that is itself NaN/inf must not open the bound
            bound = max(bound, factor * base_err + floor)
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3g} > {bound:.3g} ({dtype})")
    return err
