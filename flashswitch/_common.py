"""Helpers shared by every op: argument checks, call paths, output allocation, settings."""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad

BACKEND_ENV = "FLASHSWITCH_BACKEND"  # forces the backend that backend="auto" picks
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # config files' dtype names
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


# ---------------------------------------------------------------- argument checks
def check_tensor(name: str, t, *, ndim: Optional[int] = None, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
                 device: Optional[torch.device] = None, last_contiguous: bool = True) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a usable tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs must share one device)")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)}); call .contiguous()")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)}")


def check_head_dim(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t`'s last dim (the head dim) is `ref`'s. Checked before the whole shape, whose message would show
    an expected shape built from several tensors without saying which one set the head dim."""
    if t.shape[-1] != ref.shape[-1]:
        raise ValueError(f"{name} has head dim {t.shape[-1]} but {ref_name} has head dim {ref.shape[-1]}")


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    return float(scale)


# ---------------------------------------------------------------- call paths
def triton_interpret() -> bool:
    return (env_get("TRITON_INTERPRET") or "0") not in ("", "0")


def eager_fast_path(*tensors) -> bool:
    """Whether an op call may skip its torch.library custom op and call the backend directly: eager
    (not traced, no functorch transform, no forward-mode AD level), plain tensors, needing no autograd.
    The custom op's dispatcher layers cost tens of microseconds per call, as much as a small kernel;
    traced calls and calls on tensors that require grad keep them."""
    if torch.compiler.is_compiling() or _under_functorch() or _forward_ad._current_level >= 0:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad)):
            return False
    return True


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def eager_autograd_path(*tensors) -> bool:
    """Whether an eager call that needs gradients may run through the op's torch.autograd.Function
    instead of its custom op (the same kernels both ways): not traced, plain tensors (no subclass such
    as DTensor or a fake tensor) and no functorch transform, which only the custom op's registrations
    serve. Saves the custom op's dispatcher layers on the forward and on the backward."""
    if torch.compiler.is_compiling() or _under_functorch() or _forward_ad._current_level >= 0:
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_PEEK_FUNCTORCH = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)
_FUNCTORCH_STACK = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)


def _under_functorch() -> bool:
    """Whether a functorch transform (vmap, grad, jvp) is active: only the custom op's registrations
    serve its wrapped tensors."""
    return _PEEK_FUNCTORCH() is not None


def _differentiating_transform(tensors) -> Optional[str]:
    """The transform that differentiates this call other than reverse-mode autograd, or None:
    torch.func.grad / vjp / jacrev / jvp / jacfwd (a functorch level other than vmap) or forward-mode
    AD (a dual tensor among the inputs)."""
    if _PEEK_FUNCTORCH() is not None:
        for interp in _FUNCTORCH_STACK() or ():
            kind = interp.key().name
            if kind in ("Grad", "Jvp"):
                return f"torch.func ({kind.lower()} transform)"
    if _forward_ad._current_level >= 0 and any(
            t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return "forward-mode AD (dual tensors)"
    return None


def kernels_serve(backend: str, *tensors) -> bool:
    """Whether the kernel backends' autograd serves this call: reverse-mode autograd (torch.autograd,
    .backward()) and torch.vmap, not torch.func's grad / jvp transforms nor forward-mode AD, which only
    the PyTorch reference differentiates. False sends backend "auto" to the reference; a kernel backend
    asked for by name raises ValueError naming `backend`."""
    if (_PEEK_FUNCTORCH() is None and _forward_ad._current_level < 0) or torch.compiler.is_compiling():
        return True
    what = _differentiating_transform(tensors)
    if what is None:
        return True
    if backend != "auto":
        raise ValueError(f"backend {backend!r} cannot differentiate under {what}: its kernels have "
                         f"reverse-mode gradients (torch.autograd) and vmap only; use backend='reference' "
                         f"or 'auto' (which then runs the reference)")
    return False


# ---------------------------------------------------------------- outputs
_ENV_KEYS: dict = {}  # setting name -> its key in the dict under os.environ


def env_raw(name: str):
    """The setting `name` as the dict under os.environ (CPython's `_data`) holds it (bytes on POSIX), or
    None: os.environ.get costs about a microsecond a name (Mapping layers, key encoding, value
    decoding), and the call path reads a few settings on every call. Where os.environ has no such
    dict, os.environ.get(name)."""
    env = os.environ
    try:
        return env._data.get(_ENV_KEYS[name])
    except (AttributeError, KeyError):
        if not isinstance(getattr(env, "_data", None), dict) or not hasattr(env, "encodekey"):
            return env.get(name)
        _ENV_KEYS[name] = env.encodekey(name)
        return env._data.get(_ENV_KEYS[name])


_ENV_KEY_TUPLES: dict = {}  # names -> their keys in the dict under os.environ (env_raws)


def env_raws(names: tuple) -> tuple:
    """tuple(map(env_raw, names)) in one pass over the dict under os.environ: the call path's snapshot
    of its settings, taken on every call."""
    keys = _ENV_KEY_TUPLES.get(names)
    if keys is not None:
        try:
            return tuple(map(os.environ._data.get, keys))
        except AttributeError:  # os.environ replaced by an object without that dict
            pass
    values = tuple(map(env_raw, names))
    if all(name in _ENV_KEYS for name in names):  # env_raw found the dict and encoded every name
        _ENV_KEY_TUPLES[names] = tuple(_ENV_KEYS[name] for name in names)
    return values


def env_get(name: str) -> Optional[str]:
    """os.environ.get(name), through env_raw."""
    value = env_raw(name)
    return value if value is None or isinstance(value, str) else os.environ.decodevalue(value)


def env_flag(name: str) -> bool:
    """A boolean environment variable: unset, empty, 0, false, no and off (any case) read as off."""
    # unset (the usual case) answered without decoding the value
    return env_raw(name) is not None and (env_get(name) or "").strip().lower() not in ("", "0", "false", "no", "off")


def poison_outputs() -> bool:
    """FLASHSWITCH_POISON=1 fills every kernel output with NaN before launch (tests set it)."""
    return env_flag("FLASHSWITCH_POISON")


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Kernel outputs come from here, so tests can poison them and catch unwritten elements (integer
    outputs: the dtype's minimum)."""
    if poison_outputs():
        return _poisoned(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_outputs(specs, device: torch.device) -> tuple:
    """new_output of each (shape, dtype) of `specs` (None for a None), the setting read once."""
    poison, out = poison_outputs(), []
    for spec in specs:
        if spec is None:
            out.append(None)
        else:
            out.append(_poisoned(*spec, device) if poison else torch.empty(spec[0], dtype=spec[1], device=device))
    return tuple(out)


def _poisoned(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)
