"""The CUDA backends' build and glue: the AOT extension flashswitch._C, the NVRTC (CuPy) path, the
launch plan shared by both, and a small GPU smoke test of each against the PyTorch reference.

Correctness over many shapes is in test_chunk_summaries_kernels.py (via the `backend` fixture).
"""
import importlib.util
import itertools
import re
from pathlib import Path

import pytest
import torch

from conftest import DEVICE
from cuda_helpers import need_extension, need_loader, nvrtc_compile

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "flashswitch" / "kernels_cuda"
SOURCES = sorted(p for p in KERNEL_DIR.iterdir() if p.suffix in (".cu", ".cuh", ".h"))


# ---------------------------------------------------------------- sources
def test_kernel_sources_have_no_torch():
    assert SOURCES, f"no kernel sources in {KERNEL_DIR}"
    bad = re.compile(r'#\s*include\s*[<"](torch/|ATen/|c10/|pybind11/|Python\.h)')
    for path in SOURCES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not bad.search(line), f"{path.name}:{n} includes a torch/Python header: {line.strip()}"


def test_host_code_is_guarded_from_nvrtc():
    """Host-only includes and launchers sit behind #ifndef __CUDACC_RTC__ (NVRTC compiles the same file)."""
    host_include = re.compile(r'#\s*include\s*<(cuda_runtime[^>]*|cstdint|cstdio|cstdlib|vector|string)>')
    for path in SOURCES:
        depth, guarded = 0, []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            s = line.strip()
            if s.startswith("#if"):
                guarded.append("__CUDACC_RTC__" in s and s.startswith("#ifndef"))
            elif s.startswith("#endif"):
                guarded.pop()
            elif host_include.search(s):
                assert any(guarded), f"{path.name}:{n}: host include outside #ifndef __CUDACC_RTC__"
            depth = len(guarded)
        assert depth == 0, f"{path.name}: unbalanced #if/#endif"


# ---------------------------------------------------------------- setup.py: whether the extension is built
SETUP_VARS = ("FLASHSWITCH_BUILD_CUDA", "FLASHSWITCH_SKIP_CUDA_BUILD", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")


def _setup(monkeypatch, *, gpu, torch_cuda="13.0", cuda_home="/opt/cuda", **env):
    """setup.py's cuda_extensions() as on a machine with or without a GPU, torch of CUDA `torch_cuda` (None: a
    CPU build) and a toolkit at `cuda_home`, the extension itself stubbed: (built, what it said on stderr)."""
    spec = importlib.util.spec_from_file_location("flashswitch_setup", ROOT / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # not as __main__: no setup() call
    for name in SETUP_VARS:  # set, so that what cuda_extensions() sets is undone after the test
        monkeypatch.setenv(name, env.get(name, ""))
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(setup, "find_cuda_home", lambda: cuda_home)
    monkeypatch.setattr(setup, "cuda_extension", lambda home: (["flashswitch._C"], {}))
    ext_modules, _ = setup.cuda_extensions()
    return bool(ext_modules)


@pytest.mark.parametrize("gpu,env,built", [
    (False, {}, False),
    (False, {"FLASHSWITCH_BUILD_CUDA": "1"}, True),
    (True, {}, True),
    (True, {"FLASHSWITCH_BUILD_CUDA": "0"}, False),
    (True, {"FLASHSWITCH_SKIP_CUDA_BUILD": "1"}, False),
    (False, {"FLASHSWITCH_BUILD_CUDA": "1", "FLASHSWITCH_SKIP_CUDA_BUILD": "1"}, False),
])
def test_setup_builds_the_extension_with_a_gpu_or_when_asked(monkeypatch, capsys, gpu, env, built):
    """A GPU-less install compiles no CUDA (minutes of nvcc for nothing it can run) unless
    FLASHSWITCH_BUILD_CUDA=1 asks (.ci/run does); FLASHSWITCH_SKIP_CUDA_BUILD=1 always skips."""
    assert _setup(monkeypatch, gpu=gpu, **env) == built
    if not gpu and not env:
        assert "FLASHSWITCH_BUILD_CUDA=1" in capsys.readouterr().err  # says how to get it


@pytest.mark.parametrize("missing", ["CUDA torch", "nvcc"])
def test_setup_fails_when_asked_for_what_it_cannot_build(monkeypatch, missing):
    """FLASHSWITCH_BUILD_CUDA=1 is a request: a CI run must not pass with the build silently skipped."""
    kw = dict(torch_cuda=None) if missing == "CUDA torch" else dict(cuda_home=None)
    with pytest.raises(SystemExit, match="FLASHSWITCH_BUILD_CUDA=1, but"):
        _setup(monkeypatch, gpu=False, FLASHSWITCH_BUILD_CUDA="1", **kw)
    assert not _setup(monkeypatch, gpu=True, **kw)  # not asked: installs without it


# ---------------------------------------------------------------- AOT extension
def test_extension_imports_and_registers():
    need_extension()
    from flashswitch.bindings import cuda
    assert cuda.available(), cuda.unavailable_reason()
    schema = str(torch.ops.flashswitch_C.chunk_summaries_fwd.default._schema)
    for arg in ("Tensor? omega", "Tensor? key_weight", "Tensor? valid", "Tensor(a!) k_sum", "Tensor(b!) v_sum",
                "Tensor(c!) lse", "int chunk_size", "float scale", "int threads", "int unroll", "int split"):
        assert arg in schema, schema


def test_extension_exports_no_private_libstdcxx():
    """A toolchain that links libstdc++ statically must not leave its copy exported: half-bound to the
    process's libstdc++ (data) and half to its own (code), an integer in a TORCH_CHECK message crashed
    the process on the H200 machine. setup.py hides static archives."""
    need_extension()
    import shutil
    import subprocess
    import flashswitch._C as ext
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    out = subprocess.run(["nm", "-D", "--defined-only", ext.__file__], capture_output=True, text=True, check=True)
    private = re.compile(r"\s(_ZNSt6locale|_ZNSt8ios_base|_ZNSo9_M_insert|_ZNSt7num_put|__gxx_personality_v0)")
    leaked = [ln.split()[-1] for ln in out.stdout.splitlines() if private.search(ln)]
    assert not leaked, f"the extension exports libstdc++ internals: {leaked[:5]}"


def test_loaders_never_raise():
    from flashswitch.bindings import cuda, cupy
    assert isinstance(cuda.available(), bool)
    assert isinstance(cupy.available(), bool)
    if not torch.cuda.is_available():
        assert not cupy.available()
        assert cupy.unavailable_reason()


def _plan_cases():
    for D, es, align, C, nch, thr, unr, spl in itertools.product(
            (0, 1, 2, 3, 8, 12, 16, 33, 64, 76, 96, 128, 200, 256), (2, 4), (1, 2, 4, 8, 16),
            (1, 3, 16, 64, 512), (0, 1, 100, 40000), (0, 32, 100, 128, 256, 1024), (1, 3, 4, 8), (0, 1, 3, 64)):
        if align < es and align != 1:
            continue
        yield D, es, max(align, 1), C, nch, thr, unr, spl


def test_plan_mirror_matches_c():
    """bindings/cupy.plan is a line-for-line mirror of fs_chunk_summaries_plan_for."""
    need_extension()
    from flashswitch.bindings.cupy import plan
    cases = list(_plan_cases())
    for case in cases[::7]:  # a spread of about 2k cases
        assert list(plan(*case)) == list(torch.ops.flashswitch_C.chunk_summaries_plan(*case)), case


def test_plan_invariants():
    from flashswitch.bindings.cupy import CS_MAX_ELEMS, CS_MAX_THREADS, plan
    for D, es, align, C, nch, thr, unr, spl in list(_plan_cases())[::5]:
        p = plan(D, es, align, C, nch, thr, unr, spl)
        vb = p.vec * es
        assert vb in (16, 8, 4, es) and D % p.vec == 0 and (vb == es or align % vb == 0)
        assert p.lanes in (1, 2, 4, 8, 16, 32) and p.lanes * p.vpl * p.vec >= D
        assert p.vec * p.vpl <= CS_MAX_ELEMS
        assert 32 <= p.threads <= CS_MAX_THREADS and p.threads & (p.threads - 1) == 0
        groups = p.threads // 32 * (32 // p.lanes)
        assert p.split & (p.split - 1) == 0 and 1 <= p.split <= groups
        assert p.grid * (groups // p.split) >= nch or p.grid == 0x7FFFFFFF
        assert (p.smem_bytes > 0) == (p.split > 32 // p.lanes)
        assert p.smem_bytes <= 48 * 1024
    with pytest.raises(ValueError, match="D"):
        plan(257, 2, 16, 16, 1, 128, 4, 0)


def test_plan_vector_width():
    from flashswitch.bindings.cupy import plan
    assert plan(128, 2, 16, 16, 32768, 128, 4, 0)[:3] == (8, 1, 16)   # bf16 D=128: 16-byte loads, 16 lanes/row
    assert plan(76, 2, 16, 16, 10, 128, 4, 0)[:3] == (4, 1, 32)       # 152-byte rows: 8-byte loads
    assert plan(75, 2, 16, 16, 10, 128, 4, 0)[:3] == (1, 4, 32)       # odd D: scalar
    assert plan(128, 2, 4, 16, 10, 128, 4, 0)[0] == 2                 # 4-byte aligned strides
    assert plan(256, 4, 16, 16, 10, 128, 4, 0)[:3] == (4, 2, 32)      # fp32 D=256


# ---------------------------------------------------------------- NVRTC
NVRTC_NAMES = ["flashswitch::chunk_summaries_fwd_kernel<2,8,1,4,false>",
               "flashswitch::chunk_summaries_fwd_kernel<1,2,4,2,true>",
               "flashswitch::chunk_summaries_fwd_kernel<0,1,8,1,true>"]


def test_nvrtc_compiles_source_without_gpu():
    """The .cu compiles under NVRTC for sm_90 (no device needed): the same code path CuPy takes."""
    lowered, cubin_bytes = nvrtc_compile("chunk_summaries.cu", NVRTC_NAMES, "-ftz=true")
    for name in NVRTC_NAMES:
        assert lowered[name].startswith("_ZN11flashswitch26chunk_summaries_fwd_kernel")
    assert cubin_bytes > 1000


@pytest.mark.gpu
def test_cupy_compiles_source():
    from flashswitch.bindings import cupy as loader
    if not loader.available():
        pytest.skip(loader.unavailable_reason())
    fn = loader.kernel(torch.cuda.current_device(), "chunk_summaries.cu", NVRTC_NAMES[0])
    assert fn.num_regs > 0 and fn.local_size_bytes < 1024


# ---------------------------------------------------------------- GPU smoke test of both backends
@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,mode", [((2, 3, 70, 128, 16), dict(omega="head")),
                                        ((1, 2, 600, 76, 512), dict(omega="chunk", key_weight=True, valid=True)),
                                        ((2, 2, 33, 64, 5), dict(key_weight=True, valid=True,
                                                                 layout="strided"))])
def test_smoke_vs_torch_reference(loader, dtype, shape, mode):
    need_loader(loader)
    from flashswitch.ops import chunk_summaries as op
    from flashswitch.reference.chunk_summaries import random_problem, torch_chunk_summaries
    B, H, N, D, C = shape
    p = random_problem(B, H, N, D, C, dtype=dtype, device=DEVICE, **mode)
    ref = torch_chunk_summaries(**p, return_lse=True)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2}[dtype]
    configs = [None, {"threads": 64, "unroll": 1, "split": 1}, {"threads": 256, "unroll": 2, "split": 8}]
    for config in configs:
        out = op.run_kernel(loader, config, **p)
        torch.cuda.synchronize()
        for name, o, r in zip(("k_sum", "v_sum", "lse"), out, ref):
            assert not torch.isnan(o).any(), (name, config)
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(o), fin), (name, config)
            err = (o.float()[fin] - r.float()[fin]).norm() / r.float()[fin].norm().clamp_min(1e-30)
            assert err <= (1e-5 if name == "lse" else tol), (name, config, float(err))
