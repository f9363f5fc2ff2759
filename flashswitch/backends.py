"""The backends, defined once: each one's name, whether it runs on a device in this process (and why
not), and its launchers per op and pass. Ops, call plans, the CLI, the tuner and the benchmarks take
them from here.

A launcher is named "module:attribute" ({op}: the op's name) and imported on first use, so importing
flashswitch loads no kernel module and no extension.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

from flashswitch import _common as C


@dataclass(frozen=True)
class Backend:
    name: str
    status: Callable  # device -> (runs on tensors there, a one-line reason)
    forward: str  # the forward: reference: the differentiable torch function; kernels: launch(inputs, outputs, ...)
    prepare: Optional[str] = None  # the forward prepared once per call signature -> an enqueue (call plans)
    backward: Optional[str] = None  # the backward prepared once per signature -> an enqueue
    gradients: Optional[str] = None  # the backend whose backward kernels (and .bwd configs) serve this one's;
    # None: autograd differentiates the forward

    @property
    def kernels(self) -> bool:
        """Launches kernels (not the torch reference)."""
        return self.gradients is not None


# ---------------------------------------------------------------- status
@functools.lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # a broken optional dependency counts as missing
        return False


@functools.lru_cache(maxsize=None)
def _found(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def cupy_version() -> Optional[str]:
    """"<version> (<distribution>)": cupy ships as cupy, cupy-cuda12x, ..."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-"):
            return f"{dist.version} ({name})"
    return None


def _loader_status(name: str) -> tuple[bool, str]:
    """bindings/<name>.py's own answer (it loads the extension or reaches the driver once)."""
    try:
        loader = importlib.import_module(f"flashswitch.bindings.{name}")
        if loader.available():
            return True, "loaded"
        return False, str(loader.unavailable_reason() or "failed to load")
    except Exception as err:
        return False, f"loader failed: {type(err).__name__}: {err}"


def _reference(device) -> tuple[bool, str]:
    return True, "PyTorch reference (vectorized, differentiable)"


def _triton(device) -> tuple[bool, str]:
    if not _importable("triton"):
        return False, "triton is not installed (or fails to import)"
    if device.type == "cuda":
        return True, f"triton {triton_version()}"
    if device.type == "cpu" and C.triton_interpret():
        return True, "Triton interpreter on CPU tensors (TRITON_INTERPRET=1; slow, no bf16)"
    return False, "no GPU (set TRITON_INTERPRET=1 to run on CPU)"


def _cuda(device) -> tuple[bool, str]:
    if not _found("flashswitch._C"):
        why = ("FLASHSWITCH_SKIP_CUDA_BUILD was set" if os.environ.get("FLASHSWITCH_SKIP_CUDA_BUILD", "0") not in ("", "0")
               else "no GPU visible at install, no nvcc, or FLASHSWITCH_SKIP_CUDA_BUILD; FLASHSWITCH_BUILD_CUDA=1 "
                    "forces the build")
        return False, f"extension not built ({why})"
    if device.type != "cuda":
        return False, "extension flashswitch._C built, but no GPU"
    return _loader_status("cuda")


def _cupy(device) -> tuple[bool, str]:
    version = cupy_version()
    if version is None:
        return False, "cupy is not installed (in the checkout: pip install -e '.[cupy]')"
    if device.type != "cuda":
        return False, f"cupy {version} installed, but no GPU"
    return _loader_status("cupy")


# ---------------------------------------------------------------- the table
_TRITON = "flashswitch.kernels_triton.{op}"
TABLE = {b.name: b for b in (
    Backend("reference", _reference, forward="flashswitch.reference.{op}:torch_{op}"),
    Backend("triton", _triton, forward=_TRITON + ":launch", prepare=_TRITON + ":prepare",
            backward=_TRITON + "_bwd:prepare", gradients="triton"),
    Backend("cuda", _cuda, forward="flashswitch.bindings.cuda:{op}", gradients="triton"),
    Backend("cupy", _cupy, forward="flashswitch.bindings.cupy:{op}", gradients="triton"),
)}
NAMES = tuple(TABLE)
KERNELS = tuple(name for name, b in TABLE.items() if b.kernels)  # the ones that launch kernels


def _get(name: str) -> Backend:
    try:
        return TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {NAMES} or 'auto', got {name!r}") from None


def status(name: str, device) -> tuple[bool, str]:
    """(whether backend `name` runs on tensors living on `device` in this process, a one-line reason)."""
    return _get(name).status(device)


def available(name: str, device) -> bool:
    return status(name, device)[0]


def usable(device, names=NAMES) -> list[str]:
    """The backends among `names` that run on `device` here (a loader that raises counts as unusable)."""
    out = []
    for name in names:
        try:
            if available(name, device):
                out.append(name)
        except Exception:
            pass
    return out


def launcher(name: str, op: str, role: str = "forward") -> Callable:
    """Backend `name`'s launcher of `op`: role "forward", "prepare" (the forward prepared per
    signature) or "backward" (the backward prepared per signature: the kernels of the backend that
    serves its gradients). Looked up on each call (a replaced module attribute is seen)."""
    module, attribute = _location(name, op, role)
    return getattr(module, attribute)


@functools.lru_cache(maxsize=None)
def _location(name: str, op: str, role: str):
    b = _get(name)
    if role == "backward" and b.gradients not in (None, name):
        b = TABLE[b.gradients]
    where = getattr(b, role)
    if where is None:
        raise ValueError(f"the {name} backend has no {role} launcher")
    module, _, attribute = where.format(op=op).partition(":")
    return importlib.import_module(module), attribute


__all__ = ["Backend", "TABLE", "NAMES", "KERNELS", "status", "available", "usable", "launcher"]
