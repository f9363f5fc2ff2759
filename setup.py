"""Build script: the package, plus the CUDA extension `flashswitch._C` when it can be built.

Knobs (environment):
  FLASHSWITCH_SKIP_CUDA_BUILD=1  install without the CUDA extension (backends triton/cupy/reference remain)
  TORCH_CUDA_ARCH_LIST           target archs, e.g. "9.0" or "9.0a"; default: the visible GPUs, else "9.0"
  CUDA_HOME                      CUDA toolkit root; default: /usr/local/cuda, else the real nvcc on PATH
  MAX_JOBS                       parallel compile jobs for ninja
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _say(msg):
    print(f"flashswitch setup: {msg}", file=sys.stderr)


def _is_cuda_root(path):
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(path, "include", "cuda_runtime.h"))


def find_cuda_home():
    """A toolkit root that really holds nvcc and the headers (a wrapper script on PATH misleads torch)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        try:  # a shell wrapper (`exec /real/nvcc "$@"`) names the real one inside
            with open(nvcc, "rb") as fh:
                head = fh.read(4096)
            if head.startswith(b"#!"):
                for token in head.decode(errors="ignore").split():
                    if token.endswith("/bin/nvcc"):
                        candidates.append(os.path.dirname(os.path.dirname(token)))
        except OSError:
            pass
    for c in candidates:
        if _is_cuda_root(c):
            return os.path.realpath(c)
    return None


def cuda_extensions():
    if os.environ.get("FLASHSWITCH_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        _say("FLASHSWITCH_SKIP_CUDA_BUILD is set: installing without the CUDA extension")
        return [], {}
    try:
        import torch
    except ImportError:
        _say("torch is not installed: installing without the CUDA extension")
        return [], {}
    if torch.version.cuda is None:
        _say(f"torch {torch.__version__} is a CPU build: installing without the CUDA extension")
        return [], {}
    cuda_home = find_cuda_home()
    if cuda_home is None:
        _say("no CUDA toolkit (nvcc) found: installing without the CUDA extension")
        return [], {}
    os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension computes its own guess
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    nvcc_version = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
    _say(f"building flashswitch._C with {nvcc_version} from {cuda_home} for archs "
         f"{os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPUs')}")
    sources = sorted(glob.glob("flashswitch/bindings/*.cpp")) + sorted(glob.glob("flashswitch/kernels_cuda/*.cu"))
    ext = CUDAExtension(
        "flashswitch._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "flashswitch", "kernels_cuda")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]},
        # A toolchain that links libstdc++ statically (the H200 machine's /opt/gcc g++) would export
        # the extension's private copy of it; with -Bsymbolic-functions its code then binds to its own
        # functions but to the process's libstdc++ data (locale facet ids), and formatting an integer
        # into a TORCH_CHECK message crashed. Hidden, the copy stays self-consistent.
        extra_link_args=["-Wl,--exclude-libs,ALL"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
