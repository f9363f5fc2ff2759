"""Accuracy rules shared by the tests, `flashswitch check` and the tuner (SPEC.md, "Tolerances")."""
from __future__ import annotations

import numpy as np
import torch

# ||out - ref|| / ||ref|| bounds per dtype where no baseline is run (fp32 assumes tf32 off / ieee dots)
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
# fp32 roundings a kernel makes along one term's way to an output besides the baseline's (dot and online-softmax
# partial sums, rescales, an approximate hardware exp2 of up to ~2 ulp): part of the rounding floor, so that a
# kernel is not held to the order of one baseline's fp32 sums. 16 of them (~1e-6) stay 10x below the 1e-5 that
# an fp32 check must reject, and next to a half-precision rounding they are nothing.
FP32_ROUNDINGS = 16
# conditioning_tol = CONDITIONING_FACTOR x rounding_sensitivity, which moves every rounded input by a whole
# rounding (u, random signs). A real rounding moves it by a uniform fraction of u (rms u / sqrt(3)), so a
# kernel's error from rounding its inputs is about 0.6 of the sensitivity, with the output's own rounding on
# top: for the fused output projection with fp32 master weights in bf16 (weights and gates rounded: 1.43 u)
# the baseline is 0.72 u off. 1.5 (2.1 u there) leaves 3x that and stays below the baseline rule (2 x 0.72 u + u)
# where no term cancels, so that it widens the bound only where terms do.
CONDITIONING_FACTOR = 1.5


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


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an eps: the largest relative error of one rounding to `dtype`."""
    return float(torch.finfo(dtype).eps) / 2


def rounding_floor(dtype: torch.dtype) -> float:
    """What the baseline rule adds to factor x the baseline's error: one rounding of the output to `dtype`
    (all a kernel that computes exactly can do; a baseline that happens to be exact has error 0) and
    FP32_ROUNDINGS of the kernel's fp32 arithmetic. fp64 (the references' own checks): 1e-14."""
    if dtype == torch.float64:
        return 1e-14
    return unit_roundoff(dtype) + FP32_ROUNDINGS * unit_roundoff(torch.float32)


def input_roundoff(t: torch.Tensor, dtype: torch.dtype) -> float:
    """The relative size of the first rounding input `t` gets in a kernel of precision `dtype`: one to dtype
    where t is not representable there (fp32 master weights or gates of a bf16 problem), else (a bf16 input
    is not rounded again) that of the fp32 products it enters."""
    if dtype == torch.float64:
        return unit_roundoff(dtype)
    if t.dtype == dtype or torch.equal(t.to(dtype).to(t.dtype), t):
        return unit_roundoff(torch.float32)
    return unit_roundoff(dtype)


def rounding_sensitivity(fn, inputs: dict, dtype: torch.dtype, *, samples: int = 2, seed: int = 0) -> dict:
    """How far each fp64 output of `fn(inputs)` (a dict of tensors) moves, relative to its norm, when every
    input moves by one rounding (each element scaled by 1 +- input_roundoff, random signs); the largest move
    over `samples` draws, per output. This is the problem's conditioning in units of one rounding: near u
    where an output's terms do not cancel, far above it where they do (a gate gradient that sums dy * y over
    a few columns), and there any evaluation order has an error near it, whatever the baseline's own luck."""
    ref = {n: t.detach().to(torch.float64) for n, t in fn(inputs).items()}
    gen = torch.Generator().manual_seed(seed)
    u = {n: input_roundoff(t, dtype) for n, t in inputs.items()}
    worst = dict.fromkeys(ref, 0.0)
    for _ in range(samples):
        moved = {}
        for n, t in inputs.items():
            sign = torch.randint(0, 2, t.shape, generator=gen).to(t.device, torch.float64) * 2 - 1
            moved[n] = t.detach().to(torch.float64) * (1 + u[n] * sign)
        for n, t in fn(moved).items():
            worst[n] = max(worst[n], rel_error(t, ref[n]))
    return worst


def conditioning_tol(fn, inputs: dict, dtype: torch.dtype, **kw) -> dict:
    """Per output, the bound its conditioning calls for: CONDITIONING_FACTOR x rounding_sensitivity. Below
    the baseline rule where the output's terms do not cancel, so that it widens only where they do."""
    return {n: CONDITIONING_FACTOR * s for n, s in rounding_sensitivity(fn, inputs, dtype, **kw).items()}


def assert_close(name: str, out, ref, dtype: torch.dtype, *, baseline=None, factor: float = 2.0,
                 floor: float = 0.0, tol: float = 0.0) -> float:
    """The SPEC rule: pass when rel_error(out) <= factor x the error of `baseline` (the PyTorch reference in
    the same precision) plus the dtype's rounding_floor, or, without a (finite) baseline, <= the dtype's
    REL_TOL. `tol` widens the bound where the problem's conditioning calls for more (conditioning_tol).
    `floor`: as in rel_error, for both errors. Returns the error."""
    err = rel_error(out, ref, floor=floor)
    bound = REL_TOL[dtype]
    if baseline is not None:
        base_err = rel_error(baseline, ref, floor=floor)
        if np.isfinite(base_err):  # a baseline that is itself NaN/inf is none: REL_TOL judges
            bound = factor * base_err + rounding_floor(dtype)
    bound = max(bound, tol)
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3g} > {bound:.3g} ({dtype})")
    return err
