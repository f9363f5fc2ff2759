"""JIT backend: the CUDA kernel sources of `flashswitch/kernels_cuda/` compiled at run time with NVRTC
through CuPy, and launched zero-copy on torch's current stream.

Same kernels and launch shapes as the AOT extension (`bindings/cuda.py`): `plan` mirrors the C
function `fs_chunk_summaries_plan_for` in `kernels_cuda/chunk_summaries.cu` (tests compare the two).
CuPy adds `-arch=sm_XX` for the current device itself; each kernel instantiation is compiled on
first use and cached per (device, source hash, name), in memory and in CuPy's on-disk cache.
"""
from __future__ import annotations

import functools
import hashlib
import threading
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from flashswitch.bindings.cuda import chunk_summaries_config

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels_cuda"
# FS_DTYPE_* in kernels_cuda/common.cuh
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# FS_CS_MAX_* in kernels_cuda/chunk_summaries.h
CS_MAX_ELEMS = 8
CS_MAX_D = 32 * CS_MAX_ELEMS
CS_MAX_THREADS = 256
_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------- availability
@functools.lru_cache(maxsize=None)
def _probe() -> Optional[str]:
    try:
        import cupy
    except Exception as err:
        return f"cupy is not importable ({type(err).__name__}: {err})"
    try:
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
    except Exception as err:
        return f"cupy cannot reach the CUDA driver ({type(err).__name__}: {err})"
    return None


def available() -> bool:
    """cupy importable and a CUDA device visible (cached; never raises)."""
    try:
        return _probe() is None
    except Exception:
        return False


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True)."""
    try:
        return _probe()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


# ---------------------------------------------------------------- sources and compilation
@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Hash of every kernel source and header (an edit to an included header changes it too)."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of kernels_cuda/<name> (includes are resolved by NVRTC through -I)."""
    return (KERNEL_DIR / name).read_text()


def compile_options() -> tuple[str, ...]:
    # the hash define keys CuPy's on-disk cache on the headers as well as on the main source
    return ("-std=c++17", f"-I{KERNEL_DIR}", f"-DFLASHSWITCH_SOURCE_HASH=0x{source_hash()}")


_kernels: dict = {}
_kernels_lock = threading.Lock()


def kernel(device_index: int, file: str, name: str):
    """The compiled kernel `name` (a C++ name expression) of kernels_cuda/<file> on a device."""
    key = (device_index, source_hash(), file, name)
    fn = _kernels.get(key)
    if fn is None:
        import cupy
        with _kernels_lock:
            fn = _kernels.get(key)
            if fn is None:
                with cupy.cuda.Device(device_index):
                    module = cupy.RawModule(code=source(file), options=compile_options(), name_expressions=[name])
                    fn = module.get_function(name)
                _kernels[key] = fn
    return fn


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


_streams: dict = {}


def _external_stream(device_index: int, ptr: int):
    """A CuPy wrapper of torch's stream handle `ptr` (cached; it owns nothing)."""
    key = (device_index, ptr)
    s = _streams.get(key)
    if s is None:
        import cupy
        with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy.cuda.ExternalStream(ptr, device_index)
        if len(_streams) > 64:
            _streams.clear()
        _streams[key] = s
    return s


def launch(fn, device_index: int, grid: int, threads: int, smem: int, args: tuple) -> None:
    """Run a compiled kernel on torch's current stream of the device."""
    import cupy
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    with cupy.cuda.Device(device_index), _external_stream(device_index, ptr):
        fn((grid,), (threads,), args, shared_mem=smem)


# ---------------------------------------------------------------- op 1: chunk_summaries
class Plan(NamedTuple):
    """Launch shape of the op-1 kernel (fields as in fs_chunk_summaries_plan)."""
    vec: int
    vpl: int
    lanes: int
    split: int
    threads: int
    unroll: int
    grid: int
    smem_bytes: int


def _floor_pow2(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def _ceil_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def plan(D: int, elem_size: int, align: int, C: int, nchunks: int, threads: int, unroll: int,
         split: int) -> Plan:
    """Mirror of fs_chunk_summaries_plan_for (kernels_cuda/chunk_summaries.cu), line for line."""
    if D < 0 or D > CS_MAX_D or elem_size not in (2, 4) or C < 1 or nchunks < 0 or align < 1:
        raise ValueError(f"chunk_summaries: unsupported launch (D={D}, elem_size={elem_size}, align={align}, "
                         f"chunk_size={C}); D must be <= {CS_MAX_D}")
    vb = 16  # widest access dividing a row and every address/stride
    while vb > elem_size and ((D * elem_size) % vb != 0 or align % vb != 0):
        vb //= 2
    vec = vb // elem_size
    nvec = D // vec
    lanes = _ceil_pow2(nvec) if nvec < 32 else 32
    vpl = _ceil_pow2((nvec + lanes - 1) // lanes)
    t = 128 if threads <= 0 else _floor_pow2(min(max(threads, 32), CS_MAX_THREADS))
    u = 4 if unroll >= 4 else 2 if unroll >= 2 else 1
    R = 32 // lanes
    groups = t // 32 * R
    if split > 0:
        p = _floor_pow2(min(split, groups))
    else:
        p = 1
        while 2 * p <= groups and 2 * p * u <= C and nchunks * p * lanes < 32 * 8192:
            p *= 2
    cpb = groups // p
    grid = min((nchunks + cpb - 1) // cpb, 0x7FFFFFFF)
    smem = t // 32 * (4 + 2 * lanes * vec * vpl) * 4 if p > R else 0
    return Plan(vec, vpl, lanes, p, t, u, grid, smem)


def alignment(tensors, sizes) -> int:
    """Largest power of two <= 16 dividing every base address and every byte stride of a moving dim
    (size > 1) of `tensors` (mirror of the launcher in chunk_summaries.cu). `sizes[i]` are the sizes
    of the first three dims of tensors[i]."""
    align = 16

    def fold(x: int) -> None:
        nonlocal align
        while align > 1 and x % align != 0:
            align //= 2

    for t in tensors:
        fold(t.data_ptr())
    for t, sz in zip(tensors, sizes):
        for i in range(3):
            if sz[i] > 1:
                fold(t.stride(i) * t.element_size())
    return align


def _check(name, t, shape, dtype, device, last=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"chunk_summaries: {name} must be a tensor")
    if t.device != device:
        raise ValueError(f"chunk_summaries: {name} is on {t.device}, expected {device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"chunk_summaries: {name} has dtype {t.dtype}, expected {dtype}")
    if dtype is None and t.dtype not in DTYPE_CODES:
        raise TypeError(f"chunk_summaries: {name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"chunk_summaries: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"chunk_summaries: {name} must be contiguous in its last dim")


def chunk_summaries(k, v, omega, key_weight, valid, k_sum, v_sum, lse, *, chunk_size, scale, config=None):
    """Op 1 (SPEC.md), same contract as bindings.cuda.chunk_summaries."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or not k.is_cuda or k.dtype not in DTYPE_CODES:
        raise ValueError("chunk_summaries: k must be a CUDA float16/bfloat16/float32 tensor [B, H, N, D]")
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_summaries: chunk_size must be >= 1, got {C}")
    B, H, N, D = k.shape
    Nc = -(-N // C)
    if D > CS_MAX_D:
        raise ValueError(f"chunk_summaries: head dim D = {D} is larger than the CUDA kernel's limit {CS_MAX_D}")
    dev = k.device
    _check("k", k, (B, H, N, D), k.dtype, dev)
    _check("v", v, (B, H, N, D), k.dtype, dev)
    if omega is not None:
        _check("omega", omega, (B, H, Nc, D), None, dev)
    if key_weight is not None:
        _check("key_weight", key_weight, (H, D), None, dev)
    if valid is not None:
        _check("valid", valid, (B, N), torch.bool, dev, last=False)
    _check("k_sum", k_sum, (B, H, Nc, D), k.dtype, dev)
    _check("v_sum", v_sum, (B, H, Nc, D), k.dtype, dev)
    _check("lse", lse, (B, H, Nc), torch.float32, dev, last=False)

    threads, unroll, split = chunk_summaries_config(config)
    align = alignment((k, v, k_sum, v_sum), ((B, H, N), (B, H, N), (B, H, Nc), (B, H, Nc)))
    p = plan(D, k.element_size(), align, C, B * H * Nc, threads, unroll, split)
    if p.grid == 0:
        return
    weighted = "true" if key_weight is not None else "false"
    name = (f"flashswitch::chunk_summaries_fwd_kernel<{DTYPE_CODES[k.dtype]},{p.vec},{p.vpl},{p.unroll},"
            f"{weighted}>")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    fn = kernel(index, "chunk_summaries.cu", name)

    i64 = np.int64
    om_st = (omega.stride(0), omega.stride(1), omega.stride(2)) if omega is not None else (0, 0, 0)
    va_st = (valid.stride(0), valid.stride(1)) if valid is not None else (0, 0)
    # the C launcher passes (float)((double)(float)scale * log2 e)
    scale_log2 = np.float32(float(np.float32(scale)) * _LOG2E)
    args = (
        _ptr(k), _ptr(v), _ptr(omega), _ptr(key_weight), _ptr(valid), _ptr(k_sum), _ptr(v_sum), _ptr(lse),
        i64(B), i64(H), i64(N), i64(D), i64(C),
        *(i64(k.stride(i)) for i in range(3)), *(i64(v.stride(i)) for i in range(3)),
        *(i64(s) for s in om_st), i64(key_weight.stride(0) if key_weight is not None else 0),
        *(i64(s) for s in va_st),
        *(i64(k_sum.stride(i)) for i in range(3)), *(i64(v_sum.stride(i)) for i in range(3)),
        *(i64(lse.stride(i)) for i in range(3)),
        scale_log2,
        np.int32(DTYPE_CODES[omega.dtype] if omega is not None else 0),
        np.int32(DTYPE_CODES[key_weight.dtype] if key_weight is not None else 0),
        np.int32(p.lanes), np.int32(p.split),
    )
    launch(fn, index, p.grid, p.threads, p.smem_bytes, args)


__all__ = ["available", "unavailable_reason", "chunk_summaries", "plan", "alignment", "Plan", "kernel", "launch",
           "source", "source_hash", "compile_options", "KERNEL_DIR"]
