"""Build script: the package, plus the CUDA extension `flashswitch._C` when a GPU is visible or when asked.

Knobs (environment):
  FLASHSWITCH_BUILD_CUDA         unset: build the extension when a GPU is visible; 1: build it anyway (CI, a
                                 build machine without a GPU), failing if it cannot be built (CPU-only torch,
                                 no nvcc); 0: do not build it
  FLASHSWITCH_SKIP_CUDA_BUILD=1  install without the CUDA extension (backends triton/cupy/reference remain)
  TORCH_CUDA_ARCH_LIST           target archs, e.g. "9.0" or "9.0a"; default: the visible GPUs, else "9.0"
  CUDA_HOME                      CUDA toolkit root; default: /usr/local/cuda, else the real nvcc on PATH
  MAX_JOBS                       parallel compile jobs for ninja

Without a GPU the extension cannot run, and compiling it takes minutes of nvcc. "A GPU is visible" means
torch.cuda.is_available() in the process running this file (pip's; torch is importable there with
--no-build-isolation): the same test the library makes at run time, so it honours CUDA_VISIBLE_DEVICES
and is false when the driver cannot run this torch. nvidia-smi is not asked: it can be on PATH where no
device is usable, missing where one is, and it ignores CUDA_VISIBLE_DEVICES.
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


def _flag(name):
    """None when `name` is unset or empty, else whether it is on (off: 0, false, no, off, as the library reads
    its boolean variables)."""
    value = os.environ.get(name, "").strip().lower()
    return None if value == "" else value not in ("0", "false", "no", "off")


def _without(reason, asked):
    """No extension, said on stderr; an error when FLASHSWITCH_BUILD_CUDA=1 asked for it."""
    if asked:
        raise SystemExit(f"flashswitch setup: FLASHSWITCH_BUILD_CUDA=1, but {reason}")
    _say(f"{reason}: installing without the CUDA extension")
    return [], {}


def cuda_extensions():
    """(ext_modules, cmdclass) for setup()."""
    if _flag("FLASHSWITCH_SKIP_CUDA_BUILD"):
        return _without("FLASHSWITCH_SKIP_CUDA_BUILD is set", False)
    asked = _flag("FLASHSWITCH_BUILD_CUDA")
    if asked is False:
        return _without("FLASHSWITCH_BUILD_CUDA=0", False)
    try:
        import torch
    except ImportError:
        return _without("torch is not importable (pip: --no-build-isolation builds against the installed one)",
                        asked)
    if torch.version.cuda is None:
        return _without(f"torch {torch.__version__} is a CPU build", asked)
    gpu = torch.cuda.is_available()
    if not gpu and not asked:
        _say("no GPU visible (torch.cuda.is_available() is False): installing without the CUDA extension; "
             "FLASHSWITCH_BUILD_CUDA=1 builds it anyway")
        return [], {}
    cuda_home = find_cuda_home()
    if cuda_home is None:
        return _without("no CUDA toolkit (nvcc) found", asked)
    os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension computes its own guess
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not gpu:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return cuda_extension(cuda_home)


def cuda_extension(cuda_home):
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


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it for cuda_extensions()
    ext_modules, cmdclass = cuda_extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
