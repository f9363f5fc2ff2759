"""Which raw-op argument errors crash the process? Each case runs in its own child process (a fresh CUDA
context, nothing run before it unless the case says so) with bench/segv_trace.c preloaded when a C
compiler is there, and reports its exit status and, for a crash, the native stack:
    python bench/crash_probe.py            (all cases)      python bench/crash_probe.py CASE ...
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _route_args():
    import torch
    return torch.randint(0, 5, (64, 6), device="cuda", dtype=torch.int32)


def _expect_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the point is that it raises at all
        print(f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    print("did not raise")


def case_env():
    import torch
    import flashswitch._C as ext
    built = [kv.strip() for kv in torch.__config__.show().split(",") if "CXX_COMPILER" in kv]
    print("torch", torch.__version__, "| built with:", built)
    for cc in ("gcc", "g++", "c++"):
        path = shutil.which(cc)
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1] if path else []
        print(cc, path, ver)
    print("CXX env:", os.environ.get("CXX"), "| extension:", ext.__file__)
    with open("/proc/self/maps") as fh:
        libs = sorted({ln.split()[-1] for ln in fh if "libstdc++" in ln or "libgcc_s" in ln})
    print("loaded:", libs)
    print(subprocess.run(["ldd", ext.__file__], capture_output=True, text=True).stdout)
    comment = subprocess.run(["readelf", "-p", ".comment", ext.__file__], capture_output=True, text=True).stdout
    print("extension .comment:", " | ".join(ln.strip() for ln in comment.splitlines() if "GCC" in ln or "clang" in ln))


def case_torch_error():  # torch's own C++ error on CUDA tensors: the baseline
    import torch
    a = torch.ones(3, 4, device="cuda")
    _expect_error(lambda: torch.mm(a, a))


def case_route_cpu():  # the dispatcher's error (no extension code runs)
    import torch
    import flashswitch._C  # noqa: F401
    _expect_error(lambda: torch.ops.flashswitch_C.route_fwd(_route_args().cpu(), 5))


def case_route_num_experts():  # an integer in the message: the run-10 crash (test line `fwd(idx, 0)`)
    import torch
    import flashswitch._C  # noqa: F401
    _expect_error(lambda: torch.ops.flashswitch_C.route_fwd(_route_args(), 0))


def case_route_float():  # a message of strings only (raised cleanly even before the fix)
    import torch
    import flashswitch._C  # noqa: F401
    _expect_error(lambda: torch.ops.flashswitch_C.route_fwd(_route_args().float(), 5))


def case_route_float_after_launch():
    import torch
    import flashswitch._C  # noqa: F401
    idx = _route_args()
    torch.ops.flashswitch_C.route_fwd(idx, 5)
    torch.cuda.synchronize()
    _expect_error(lambda: torch.ops.flashswitch_C.route_fwd(idx.float(), 5))


def case_route_float_twice():  # the num_experts error first, then the float one, in one process
    case_route_num_experts()
    case_route_float()


def case_expert_y_shape():  # sizes in the message: the run-8/9 crash
    import torch
    import flashswitch._C  # noqa: F401
    from flashswitch.ops.expert_matmul import _torch_route
    T, S, E = 8, 2, 3
    x3 = torch.randn(T, 1, 16, device="cuda", dtype=torch.float16)
    w = torch.randn(E, 16, 8, device="cuda", dtype=torch.float16)
    token, slot, offsets = _torch_route(torch.randint(0, E, (T, S), device="cuda"), E)
    y = torch.empty(T, 1, 8, device="cuda", dtype=torch.float16)
    _expect_error(lambda: torch.ops.flashswitch_C.expert_matmul_fwd(x3, w, None, token, slot, offsets, y, S, 2,
                                                                    False, 0, 0, 0))


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def _preload():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    so = os.path.join(tempfile.gettempdir(), "segv_trace.so")
    rc = subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", so, os.path.join(HERE, "segv_trace.c")]).returncode
    return so if rc == 0 else None


def _resolve(stderr):
    out = []
    for ln in stderr.splitlines():
        if ln.startswith("@ ") and shutil.which("addr2line"):
            _, obj, off = ln.split()
            sym = subprocess.run(["addr2line", "-f", "-C", "-e", obj, off], capture_output=True, text=True).stdout
            out.append(f"  {os.path.basename(obj)} {off}: {' '.join(sym.split())[:200]}")
    return out


def main(names):
    so = _preload()
    for name in names or CASES:
        env = dict(os.environ, PYTHONFAULTHANDLER="0")
        if so and name != "env":
            env["LD_PRELOAD"] = so
        if name.endswith("_cppstack"):
            env["TORCH_SHOW_CPP_STACKTRACES"] = "1"
        p = subprocess.run([sys.executable, __file__, "--child", name.removesuffix("_cppstack")], env=env,
                           capture_output=True, text=True, timeout=40)
        print(f"== {name}: rc={p.returncode}")
        print("\n".join(ln for ln in p.stdout.splitlines()))
        if p.returncode != 0:
            err = [ln for ln in p.stderr.splitlines() if not ln.startswith("@ ")]
            print("\n".join(err[-40:]))
            print("\n".join(_resolve(p.stderr)[:40]))
        sys.stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        CASES[sys.argv[2]]()
    else:
        main(sys.argv[1:])
