"""Shared by the tests of the CUDA backends: the AOT extension's presence, the loaders usable here, and
an NVRTC compile of a kernel source (no GPU needed). Each helper skips the calling test when what it
needs is missing."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch


# ---------------------------------------------------------------- AOT extension
def extension_missing() -> str:
    """'' when the extension should have been built here, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if os.environ.get("FLASHSWITCH_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return "FLASHSWITCH_SKIP_CUDA_BUILD is set"
    if importlib.util.find_spec("flashswitch._C") is None:
        return ("flashswitch._C is not built (pip install --no-build-isolation -e . builds it, given nvcc, where a "
                "GPU is visible or with FLASHSWITCH_BUILD_CUDA=1)")
    return ""


def need_extension():
    """Skip unless flashswitch._C is built here; import it (which registers its ops)."""
    why = extension_missing()
    if why:
        pytest.skip(why)
    import flashswitch._C  # noqa: F401


def extension_op(name):
    """torch.ops.flashswitch_C.<name>; skips when the extension, or that op of it, is not built."""
    need_extension()
    if not hasattr(torch.ops.flashswitch_C, name):
        pytest.skip(f"flashswitch._C was built without {name}")
    return getattr(torch.ops.flashswitch_C, name)


# ---------------------------------------------------------------- loaders
def available_loaders() -> dict:
    """{name: module} of the CUDA loaders (AOT `cuda`, NVRTC `cupy`) that work here."""
    from flashswitch.bindings import cuda, cupy
    return {name: mod for name, mod in (("cuda", cuda), ("cupy", cupy)) if mod.available()}


def need_loader(loader):
    if loader not in available_loaders():
        pytest.skip(f"backend {loader} is not available")


# ---------------------------------------------------------------- NVRTC
def nvrtc():
    """cupy's NVRTC binding."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as err:  # no cupy, or a cupy without NVRTC
        pytest.skip(f"cupy's NVRTC binding is not importable ({type(err).__name__})")
    return nvrtc


def cuda_include() -> str:
    """A folder with cuda_bf16.h: a toolkit, else the headers of torch's nvidia-cuda-runtime wheel."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        import nvidia
        roots += [str(Path(p) / f"cu{(torch.version.cuda or '0').split('.')[0]}") for p in nvidia.__path__]
    except ImportError:
        pass
    for root in roots:
        if root and (Path(root) / "include" / "cuda_bf16.h").exists():
            return str(Path(root) / "include")
    pytest.skip("no CUDA headers (cuda_bf16.h) for NVRTC")


def nvrtc_compile(filename, names, *options):
    """Compile kernels_cuda/<filename> under NVRTC for sm_90 with the loader's options (plus `options`),
    the way the CuPy backend does; fails the test with NVRTC's log on an error.

    Returns ({name expression: lowered name} for `names`, size of the CUBIN in bytes)."""
    lib = nvrtc()
    from flashswitch.bindings import cupy as loader
    include = cuda_include()
    prog = lib.createProgram(loader.source(filename), filename, [], [])
    try:
        for name in names:
            lib.addNameExpression(prog, name)
        opts = list(loader.compile_options()) + [f"-I{include}", "-arch=sm_90", *options,
                                                   "--device-as-default-execution-space"]
        try:
            lib.compileProgram(prog, opts)
        except Exception:
            pytest.fail("NVRTC failed:\n" + lib.getProgramLog(prog))
        return {name: lib.getLoweredName(prog, name) for name in names}, len(lib.getCUBIN(prog))
    finally:
        lib.destroyProgram(prog)
