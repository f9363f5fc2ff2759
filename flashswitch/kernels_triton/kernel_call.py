"""One prepared launch of a @triton.jit kernel: everything but its tensor arguments fixed once.

A launcher's host work (strides, vector widths, grid, constexprs: ~50 arguments) depends only on its
arguments' metadata, which a call plan fixes. Each kernels_triton/<op>.py has `prepare(...)` (the
launcher's arguments, of which only the metadata is read; outputs may be meta tensors) returning an
enqueue that takes the call's tensors and launches one or more `KernelCall`s: the kernel, its grid,
the arguments after the leading tensor ones (scalars and constexprs, in the kernel's signature order)
and the launch options. `launch(...)` of each op is `prepare(...)` then the enqueue. Launchers without a
call plan (the layers' fused kernels, EvaCache's) go through `launch()` here, which keeps one KernelCall
per metadata.

Direct launch (`fast=True`: on CUDA unless FLASHSWITCH_FAST_LAUNCH=0): Triton's JITFunction.run binds
every argument and computes a specialization key on each launch. With all but the tensors fixed that
key varies only with the tensors' 16-byte alignment (pointers are specialized on data_ptr % 16 == 0)
and the current device. So the CompiledKernel a normal launch returns is kept per (device, alignment)
and launched directly next time: `compiled[grid](*args)` with every argument in signature order,
constexprs included (Triton 3.6 and 3.8 launchers skip those). An exception there retires the direct
launch of that key and launches normally. Not re-checked on a direct launch: Triton's test that the
kernel's global constants are unchanged and its debug / instrumentation knobs (development settings).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

FAST_LAUNCH_ENV = "FLASHSWITCH_FAST_LAUNCH"


def fast_launch_wanted(device: torch.device) -> bool:
    """The tensors live on a GPU, Triton compiles (no interpreter) and FLASHSWITCH_FAST_LAUNCH is not
    turned off (0, false, no, off): direct launches are the default."""
    from flashswitch._common import env_get, triton_interpret
    off = (env_get(FAST_LAUNCH_ENV) or "").strip().lower() in ("0", "false", "no", "off")
    return device.type == "cuda" and not off and not triton_interpret()


def _alignment(tensors: Sequence) -> int:
    """Bit i: whether tensor i (or a TMA descriptor's base) starts at a multiple of 16 bytes."""
    bits = 0
    for t in tensors:
        ptr = t.data_ptr() if isinstance(t, torch.Tensor) else t.base.data_ptr()
        bits = (bits << 1) | (ptr % 16 == 0)
    return bits


class KernelCall:
    """`kernel[grid](*tensors, *scalars, **constexprs, **options)` with all but the tensors fixed.

    scalars: the runtime arguments after the tensors, in signature order; constexprs: the rest, by
    name (every remaining parameter, checked). Calling it with the tensors enqueues the launch."""

    __slots__ = ("kernel", "grid", "tail", "options", "fast", "_direct")

    def __init__(self, kernel, grid: Sequence[int], n_tensors: int, scalars: Sequence, constexprs: Mapping,
                 options: Mapping, *, fast: bool = False):
        names = list(kernel.arg_names)
        rest = names[n_tensors + len(scalars):]
        if sorted(rest) != sorted(constexprs):
            raise ValueError(f"{names[0]}...: constexprs {sorted(constexprs)} do not match the parameters {rest}")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = tuple(scalars) + tuple(constexprs[n] for n in rest)
        self.options = dict(options)
        self.fast = fast
        self._direct: dict = {}  # (device, alignment) -> the compiled kernel's launcher, or None after a failure

    def __call__(self, *tensors) -> None:
        args = tensors + self.tail
        if not self.fast:
            self.kernel[self.grid](*args, **self.options)
            return
        key = (torch.cuda.current_device(), _alignment(tensors))
        direct = self._direct.get(key, False)
        if direct:
            try:
                direct(*args)
                return
            except Exception:  # whatever went wrong, the normal launch decides (and raises if it must)
                self._direct[key] = None
        global _normal_launches
        _normal_launches += 1
        compiled = self.kernel[self.grid](*args, **self.options)
        if direct is False and _is_compiled(compiled):
            self._direct[key] = compiled[self.grid]


_LAUNCHES: dict = {}  # launch(): the KernelCall of each (kernel, device, dtypes, grid, scalars, constexprs, options)
_LAUNCHES_MAX = 4096


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: Mapping, options: Mapping) -> None:
    """`kernel[grid](*tensors, *scalars, **constexprs, **options)` through a KernelCall kept for the next
    launch with the same metadata: for launchers without a call plan (the layers' fused kernels, the
    cache's), whose per-call host cost would otherwise be JITFunction.run's (tens of us). The key holds
    the tensors' device and dtypes (a compiled kernel is specialized on them) and every other argument."""
    dev = tensors[0].device
    key = (kernel, dev, *(t.dtype for t in tensors), grid, scalars, *constexprs.items(), *options.items())
    call = _LAUNCHES.get(key)
    if call is None:
        if len(_LAUNCHES) >= _LAUNCHES_MAX:  # shapes that keep changing: start again rather than grow
            _LAUNCHES.clear()
        call = _LAUNCHES[key] = KernelCall(kernel, grid, len(tensors), scalars, constexprs, options,
                                             fast=fast_launch_wanted(dev))
    call(*tensors)


_normal_launches = 0  # launches of fast KernelCalls that went through JITFunction.run (first ones, fallbacks)


def normal_launches() -> int:
    """How many launches of direct-launch KernelCalls took Triton's normal path so far: after a
    signature's first call, none should (bench/tools/host_time.py reports it per row)."""
    return _normal_launches


def _is_compiled(kernel) -> bool:
    from triton.compiler import CompiledKernel
    return isinstance(kernel, CompiledKernel)


def direct_launches(call: KernelCall) -> int:
    """How many (device, alignment) keys of `call` launch directly (tests)."""
    return sum(1 for d in call._direct.values() if d)


__all__ = ["FAST_LAUNCH_ENV", "KernelCall", "direct_launches", "fast_launch_wanted", "launch", "normal_launches"]
