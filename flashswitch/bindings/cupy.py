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
    C = min(C, max(N, 1))  # a chunk longer than N holds tokens [0, N)
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


# ---------------------------------------------------------------- op 3: expert_matmul
# FS_EM_* in kernels_cuda/expert_matmul.h
EM_THREADS = 128
EM2_THREADS = 256  # FS_EM2_THREADS: variant 2
EM_MIN_TILE = 32
EM_MAX_TILE = 128
EM_MAX_TILE_ELEMS = 8192
EM_FINISH_THREADS = 256
EM_FINISH_MAX_GRID = 65536
EM_STORE, EM_STORE_F32, EM_ATOMIC = 0, 1, 2


class ExpertMatmulPlan(NamedTuple):
    """Launch shape of the op-3 kernels (fields as in fs_expert_matmul_plan)."""
    block_m: int
    block_n: int
    mode: int
    grid_m: int
    n_tiles_n: int
    group_n: int
    tiles: int
    grid: int
    workspace_elems: int
    finish_grid: int


def expert_matmul_plan(T: int, S: int, E: int, G_out: int, d_out: int, deterministic: bool, block_m: int,
                       block_n: int, group_n: int) -> ExpertMatmulPlan:
    """Mirror of fs_expert_matmul_plan_for (kernels_cuda/expert_matmul.cu), line for line."""
    if T < 0 or S < 1 or E < 1 or G_out < 1 or S % G_out or d_out < 0:
        raise ValueError(f"expert_matmul: unsupported sizes (T={T}, S={S}, E={E}, G_out={G_out}, d_out={d_out})")
    clamp = lambda v: min(max(v, EM_MIN_TILE), EM_MAX_TILE)  # noqa: E731
    bm = 64 if block_m <= 0 else clamp(_floor_pow2(block_m))
    bn_fit = _ceil_pow2(d_out)  # BLOCK_N never wider than d_out needs
    bn = clamp(min(bn_fit if block_n <= 0 else _floor_pow2(block_n), bn_fit))
    while bm * bn > EM_MAX_TILE_ELEMS:
        if bn >= bm:
            bn //= 2
        else:
            bm //= 2
    P = T * S
    grid_m = (P + bm - 1) // bm + min(E, P)
    n_tiles_n = (d_out + bn - 1) // bn
    gn = n_tiles_n if group_n <= 0 else min(group_n, n_tiles_n)
    gn = max(gn, 1)
    tiles = grid_m * n_tiles_n
    mode = EM_STORE if G_out == S else EM_STORE_F32 if deterministic else EM_ATOMIC
    out_elems = T * G_out * d_out
    ws = out_elems if mode == EM_ATOMIC else P * d_out if mode == EM_STORE_F32 else 0
    fg = 0 if mode == EM_STORE else (out_elems + EM_FINISH_THREADS - 1) // EM_FINISH_THREADS
    return ExpertMatmulPlan(bm, bn, mode, grid_m, n_tiles_n, gn, tiles, min(tiles, 0x7FFFFFFF), ws,
                            min(fg, EM_FINISH_MAX_GRID))


def _em_v2_fits(x3, weight, out, dt, wdt, p, sx, sw, o_st, o_sg) -> bool:
    """Mirror of em_v2_fits (kernels_cuda/expert_matmul.cu): where variant 2 can run."""
    d_in, d_out = x3.shape[2], weight.shape[2]
    return (dt in (1, 2) and wdt == dt and p.block_m in (64, 128) and p.block_n in (64, 128)
            and d_in % 8 == 0 and d_out % 8 == 0 and (d_out <= 1 or weight.stride(2) == 1)
            and x3.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and all(v % 8 == 0 for v in (sx[0], sx[1], sw[0], sw[1]))
            and out.data_ptr() % 8 == 0 and o_st % 2 == 0 and o_sg % 2 == 0)


def expert_matmul(x3, weight, gates, route, y, *, G_in, G_out, deterministic, config=None):
    """Op 3 (SPEC.md), same contract as bindings.cuda.expert_matmul (config variant 2: the cp.async /
    ldmatrix kernel where it applies)."""
    from flashswitch.bindings.cuda import expert_matmul_config, expert_matmul_ordered, expert_matmul_variant

    if not isinstance(x3, torch.Tensor) or x3.dim() != 3 or not x3.is_cuda or x3.dtype not in DTYPE_CODES:
        raise ValueError("expert_matmul: x3 must be a CUDA float16/bfloat16/float32 tensor [T, G_in, d_in]")
    T, Gi, d_in = x3.shape
    S = int(route.S)
    G_out = int(G_out)
    if Gi != G_in or S % Gi:
        raise ValueError(f"expert_matmul: x3 has G_in = {Gi} groups (expected {G_in}), which must divide S = {S}")
    if x3.shape[2] > 1 and x3.stride(2) != 1:
        raise ValueError("expert_matmul: x3 must be contiguous in its last dim")
    if weight.dim() != 3 or weight.device != x3.device or weight.shape[1] != d_in:
        raise ValueError(f"expert_matmul: weight must be [E, d_in={d_in}, d_out] on {x3.device}, "
                         f"got shape {tuple(weight.shape)} on {weight.device}")
    if not (weight.dtype == x3.dtype or (weight.dtype == torch.float32 and x3.dtype != torch.float32)):
        raise TypeError(f"expert_matmul: weight has dtype {weight.dtype} but x has {x3.dtype}")
    E, _, d_out = weight.shape
    if gates is not None and (tuple(gates.shape) != (T, S) or gates.dtype not in DTYPE_CODES
                              or gates.device != x3.device):
        raise ValueError(f"expert_matmul: gates must be a float [T, S] = [{T}, {S}] tensor on {x3.device}")
    if tuple(y.shape) != (T, G_out, d_out) or y.dtype != x3.dtype or (d_out > 1 and y.stride(2) != 1):
        raise ValueError(f"expert_matmul: y must be [{T}, {G_out}, {d_out}] in {x3.dtype}, last dim contiguous")
    for name, t, dt, n in (("token", route.token, torch.int32, T * S), ("slot", route.slot, torch.int32, T * S),
                           ("offsets", route.offsets, torch.int64, E + 1)):
        if t.dtype != dt or t.dim() != 1 or t.numel() != n or not t.is_contiguous() or t.device != x3.device:
            raise ValueError(f"expert_matmul: route.{name} must be a contiguous {dt} [{n}] tensor on {x3.device}")

    block_m, block_n, group_n = expert_matmul_config(config)
    deterministic = expert_matmul_ordered(config, deterministic)
    p = expert_matmul_plan(T, S, E, G_out, d_out, deterministic, block_m, block_n, group_n)
    if T * G_out * d_out == 0:
        return
    dev = x3.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if p.mode == EM_STORE:
        out, o_st, o_sg, spg_out = y, (y.stride(0) if T > 1 else 0), (y.stride(1) if G_out > 1 else 0), 1
    elif p.mode == EM_STORE_F32:
        out = torch.empty(p.workspace_elems, dtype=torch.float32, device=dev)
        o_st, o_sg, spg_out = S * d_out, d_out, 1
    else:
        out = torch.zeros(p.workspace_elems, dtype=torch.float32, device=dev)
        o_st, o_sg, spg_out = G_out * d_out, d_out, S // G_out

    i64, i32 = np.int64, np.int32
    dt, wdt = DTYPE_CODES[x3.dtype], DTYPE_CODES[weight.dtype]
    if p.grid > 0:
        # the same stride normalisation as em_launch: dims of size 1 get stride 0
        sx = (x3.stride(0) if T > 1 else 0, x3.stride(1) if G_in > 1 else 0)
        sw = (weight.stride(0) if E > 1 else 0, weight.stride(1) if d_in > 1 else 0,
              weight.stride(2) if d_out > 1 else 0)
        sg = gates.stride() if gates is not None else (0, 0)
        if expert_matmul_variant(config) == 2 and _em_v2_fits(x3, weight, out, dt, wdt, p, sx, sw, o_st, o_sg):
            name, threads = f"flashswitch::expert_matmul_fwd_v2_kernel<{dt},{p.block_m},{p.block_n}>", EM2_THREADS
            sw = (sw[0], sw[1], 1)  # as em_launch_v2 passes it
        else:
            name, threads = f"flashswitch::expert_matmul_fwd_kernel<{dt},{wdt},{p.block_m},{p.block_n}>", EM_THREADS
        fn = kernel(index, "expert_matmul.cu", name)
        args = (
            _ptr(x3), _ptr(weight), _ptr(gates), _ptr(route.token), _ptr(route.slot), _ptr(route.offsets), _ptr(out),
            i64(E), i64(d_in), i64(d_out), i64(S // G_in), i64(spg_out),
            i64(sx[0]), i64(sx[1]), i64(sw[0]), i64(sw[1]), i64(sw[2]), i64(sg[0]), i64(sg[1]), i64(o_st), i64(o_sg),
            i64(p.grid_m), i64(p.n_tiles_n), i64(p.group_n), i64(p.tiles),
            i32(DTYPE_CODES[gates.dtype] if gates is not None else 0), i32(p.mode),
        )
        launch(fn, index, p.grid, threads, 0, args)
    if p.finish_grid > 0:
        fn = kernel(index, "expert_matmul.cu", f"flashswitch::expert_matmul_finish_kernel<{dt}>")
        spg = 1 if p.mode == EM_ATOMIC else S // G_out
        args = (_ptr(out), _ptr(y), i64(T * G_out), i64(G_out), i64(d_out), i64(spg), i64(y.stride(0)),
                i64(y.stride(1)))
        launch(fn, index, p.finish_grid, EM_FINISH_THREADS, 0, args)


__all__ += ["expert_matmul", "expert_matmul_plan", "ExpertMatmulPlan"]


# ---------------------------------------------------------------- op 2: eva_attention
# FS_EVA_* in kernels_cuda/eva_attention.h
EVA_MAX_D = 256
EVA_BLOCK_M = 64
EVA_THREADS = 128
EVA_F32_ROWS = 4
EVA_DEC_WARPS = 8
EVA_DEC_MAX_Q = 16
EVA_BIAS_NONE, EVA_BIAS_TENSOR, EVA_BIAS_LOG_COUNT = 0, 1, 2
EVA_KERNEL_TC, EVA_KERNEL_F32, EVA_KERNEL_DECODE = 0, 1, 2  # FS_EVA_KERNEL_*
_EVA_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


class EvaPlan(NamedTuple):
    """Launch shape of the op-2 kernels (fields as in fs_eva_attention_plan)."""
    head_dim: int
    block_m: int
    block_n: int
    vec_bytes: int
    threads: int
    grid: int
    smem_bytes: int
    kernel: int


def eva_plan(D: int, dtype: int, align: int, B: int, H: int, Nq: int, decode: int = 0) -> EvaPlan:
    """Mirror of fs_eva_attention_plan_for (kernels_cuda/eva_attention.cu), line for line. dtype: an
    FS_DTYPE_* code (DTYPE_CODES); decode: the decode kernel where it applies."""
    if D < 0 or D > EVA_MAX_D or align < 1 or B < 0 or H < 0 or Nq < 0 or dtype not in (0, 1, 2):
        raise ValueError(f"eva_attention: unsupported launch (D={D}, dtype={dtype}, align={align}); "
                         f"D must be <= {EVA_MAX_D}")
    if decode and dtype != 0 and Nq <= EVA_DEC_MAX_Q and D > 0:  # one block per query row
        epl = 2 if D <= 64 else 4 if D <= 128 else 8
        vb = 2 * epl if align >= 2 * epl and D % epl == 0 else 0  # one access per lane and row
        return EvaPlan(32 * epl, 1, 0, vb, EVA_DEC_WARPS * 32, min(B * H * Nq, 0x7FFFFFFF), 0, EVA_KERNEL_DECODE)
    if dtype == 0:
        epl = 2 if D <= 64 else 4 if D <= 128 else 8
        hd, bm, bn, vb, smem = 32 * epl, EVA_F32_ROWS, 0, 0, 0
        grid = (B * H * Nq + EVA_F32_ROWS - 1) // EVA_F32_ROWS
    else:
        hd = next(h for h in _EVA_HEAD_DIMS if D <= h)
        bm, bn = EVA_BLOCK_M, 32 if hd > 128 else 64
        vb = 16  # widest access dividing a row and every address / stride
        while vb > 2 and ((D * 2) % vb != 0 or align % vb != 0):
            vb //= 2
        smem = (EVA_BLOCK_M + 2 * bn) * (hd + 8) * 2
        grid = B * H * ((Nq + EVA_BLOCK_M - 1) // EVA_BLOCK_M)
    return EvaPlan(hd, bm, bn, vb, EVA_THREADS, min(grid, 0x7FFFFFFF), smem,
                   EVA_KERNEL_F32 if dtype == 0 else EVA_KERNEL_TC)


def _eva_check(name, t, shape, dtype, device, last=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"eva_attention: {name} must be a tensor")
    if t.device != device:
        raise ValueError(f"eva_attention: {name} is on {t.device}, expected {device}")
    if t.dtype != dtype:
        raise TypeError(f"eva_attention: {name} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"eva_attention: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"eva_attention: {name} must be contiguous in its last dim")


def eva_attention(q, k, v, k_sum, v_sum, bias, o, lse, *, chunk_size, window_size, sliding, scale, q_offset,
                  log_count, config=None):
    """Op 2 (SPEC.md), same contract as bindings.cuda.eva_attention (config {"decode": 1}: the decode
    kernel for fp16/bf16 with Nq <= 16)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_cuda or q.dtype not in DTYPE_CODES:
        raise ValueError("eva_attention: q must be a CUDA float16/bfloat16/float32 tensor [B, H, Nq, D]")
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or not isinstance(k_sum, torch.Tensor) or k_sum.dim() != 4:
        raise ValueError("eva_attention: k and k_sum must be 4-dim tensors [B, Hkv, N, D]")
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    C, W, q_offset = int(chunk_size), int(window_size), int(q_offset)
    if D > EVA_MAX_D:
        raise ValueError(f"eva_attention: head dim D = {D} is larger than the CUDA kernel's limit {EVA_MAX_D}")
    if C < 1 or W < 1 or W % C:
        raise ValueError(f"eva_attention: window_size must be a positive multiple of chunk_size >= 1, got "
                         f"window_size={W}, chunk_size={C}")
    if not (Hkv == 0 and H == 0 or Hkv > 0 and H % Hkv == 0):
        raise ValueError(f"eva_attention: q has {H} heads and k has {Hkv}: H must be a multiple of Hkv")
    if q_offset < 0 or q_offset + Nq > Nk:
        raise ValueError(f"eva_attention: q_offset must satisfy 0 <= q_offset and q_offset + Nq <= Nk, got "
                         f"q_offset={q_offset}, Nq={Nq}, Nk={Nk}")
    dev = q.device
    _eva_check("q", q, (B, H, Nq, D), q.dtype, dev)
    _eva_check("k", k, (B, Hkv, Nk, D), q.dtype, dev)
    _eva_check("v", v, (B, Hkv, Nk, D), q.dtype, dev)
    _eva_check("k_sum", k_sum, (B, Hkv, Nc, D), q.dtype, dev)
    _eva_check("v_sum", v_sum, (B, Hkv, Nc, D), q.dtype, dev)
    _eva_check("o", o, (B, H, Nq, D), q.dtype, dev)
    _eva_check("lse", lse, (B, H, Nq), torch.float32, dev, last=False)
    if bias is not None:
        _eva_check("bias", bias, (B, Hkv, Nc), torch.float32, dev, last=False)
        bias_mode = EVA_BIAS_TENSOR
    else:
        bias_mode = EVA_BIAS_LOG_COUNT if log_count else EVA_BIAS_NONE
    if B * H * Nq == 0:
        return
    if Nc == 0:  # no summaries: nothing reads k_sum, v_sum or a bias, which may be empty tensors
        bias, bias_mode = None, EVA_BIAS_NONE

    code = DTYPE_CODES[q.dtype]
    qs, ks = (B, H, Nq), (B, Hkv, Nk)
    align = alignment((q, k, v, k_sum, v_sum, o), (qs, ks, ks, (B, Hkv, Nc), (B, Hkv, Nc), qs))
    p = eva_plan(D, code, align, B, H, Nq, int(bool((config or {}).get("decode"))))
    if p.grid == 0:
        return
    if p.kernel == EVA_KERNEL_DECODE:
        name = f"flashswitch::eva_attention_decode_kernel<{code},{p.head_dim // 32}>"
    elif p.kernel == EVA_KERNEL_F32:
        name = f"flashswitch::eva_attention_fwd_f32_kernel<{p.head_dim // 32}>"
    else:
        name = f"flashswitch::eva_attention_fwd_kernel<{code},{p.head_dim}>"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    fn = kernel(index, "eva_attention.cu", name)
    if p.smem_bytes > 48 * 1024:
        import cupy
        with cupy.cuda.Device(index):
            fn.max_dynamic_shared_size_bytes = p.smem_bytes

    i64 = np.int64
    sb = bias.stride() if bias is not None else (0, 0, 0)
    # the C launcher passes (float)((double)(float)scale * log2 e)
    scale_log2 = np.float32(float(np.float32(scale)) * _LOG2E)
    args = (
        _ptr(q), _ptr(k), _ptr(v), _ptr(k_sum), _ptr(v_sum), _ptr(bias), _ptr(o), _ptr(lse),
        i64(B), i64(H), i64(H // Hkv), i64(Nq), i64(Nk), i64(Nc), i64(D), i64(C), i64(W), i64(q_offset),
        *(i64(q.stride(i)) for i in range(3)), *(i64(k.stride(i)) for i in range(3)),
        *(i64(v.stride(i)) for i in range(3)), *(i64(k_sum.stride(i)) for i in range(3)),
        *(i64(v_sum.stride(i)) for i in range(3)), *(i64(s) for s in sb),
        *(i64(o.stride(i)) for i in range(3)), *(i64(lse.stride(i)) for i in range(3)),
        scale_log2, np.int32(1 if sliding else 0), np.int32(bias_mode), np.int32(p.vec_bytes),
    )
    launch(fn, index, p.grid, p.threads, p.smem_bytes, args)


__all__ += ["eva_attention", "eva_plan", "EvaPlan"]
