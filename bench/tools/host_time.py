"""Host (CPU) time per public call of each op and backend: how long validation, backend choice, config
lookup and launch take to enqueue one call, measured without synchronizing (the GPU queue absorbs the
kernels), next to a bare Triton launch of a trivial kernel, SDPA on the same tiny problem, and the
kernel-only time of a CUDA-graph replay. When host time > kernel time, a per-call timing measures the
host, not the kernel. Targets at the tiny shapes: <= 40 us on the Triton backend, <= 25 us on CUDA.

    python bench/tools/host_time.py [--ops chunk_summaries ...] [--backends triton cuda ...] [--calls 300]
                              [--tiny-only] [--stub] [--jit-launch] [--profile] [--no-backward] [--out DIR]

At the tiny shapes each op also gets a "fwd+bwd" row: the call with inputs that need gradients and
torch.autograd.grad of its outputs, the host time a training step pays per op (every kernel backend
runs the Triton backward).

--stub replaces Triton's kernel launch (JITFunction.run, the interpreter's run on the CPU) by a no-op:
the rows then show flashswitch's own Python cost. Without a GPU the Triton backend runs on CPU tensors
under TRITON_INTERPRET=1 and --stub is implied. --jit-launch sets FLASHSWITCH_FAST_LAUNCH=0 (every
launch through Triton's launcher instead of the direct launches of the compiled kernels that are the
default on CUDA, kernels_triton/kernel_call.py; no effect with --stub). Writes host_time.json and host_time.md under
bench/results/<device>/ (or --out); without a GPU only with --out (a CPU run is no device's result).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common`
from common import (backend_usable, device_name, env_info, graph_ms, provenance, provenance_line,  # noqa: E402
                    results_dir)
import flashswitch  # noqa: E402
from flashswitch import backends, registry  # noqa: E402
from flashswitch.kernels_triton.kernel_call import normal_launches  # noqa: E402

# (label, shape): the tiny shapes of the target first, then the shapes
SHAPES = {
    "chunk_summaries": [("tiny", dict(B=1, H=2, N=64, D=64, C=16)),
                        ("issue", dict(B=1, H=16, N=32768, D=128, C=16)),
                        ("issue", dict(B=2, H=16, N=8192, D=128, C=16))],
    "eva_attention": [("tiny decode", dict(B=1, H=8, Hkv=8, Nq=1, Nk=256, D=64, C=16, W=64, window="block")),
                      ("tiny prefill", dict(B=1, H=2, Hkv=2, Nk=128, D=64, C=16, W=64, window="block")),
                      ("issue", dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=16, W=2048, window="block")),
                      ("issue", dict(B=32, H=16, Hkv=16, Nq=1, Nk=32768, D=128, C=32, W=256, window="block"))],
    "expert_matmul": [("tiny", dict(T=16, S=2, E=4, d_in=64, d_out=64)),
                      ("issue", dict(T=16384, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True)),
                      ("issue", dict(T=16384, S=8, E=512, d_in=1024, d_out=128, G_out=8, gated=False))],
    "switchhead_output": [("tiny", dict(T=16, H=2, E=4, k=2, D=64, d=64)),
                          ("issue", dict(T=16384, H=4, E=4, k=2, D=112, d=1024))],
}
CPU_SHAPES = {"chunk_summaries": 1, "eva_attention": 2, "expert_matmul": 1,  # tiny ones only without a GPU
              "switchhead_output": 1}


def public_calls(op: str, problem: dict, backend: str) -> dict:
    """{row name: a no-argument public call} for one problem."""
    if op == "expert_matmul":
        p = dict(problem)
        idx, E = p.pop("expert_idx"), p.pop("num_experts")
        rt = flashswitch.route(idx, E)
        x, w = p.pop("x"), p.pop("weight")
        calls = {op: lambda: flashswitch.expert_matmul(x, rt, w, **p, backend=backend)}
        if backend == "triton":  # route has no backend argument: one row per shape
            calls["route"] = lambda: flashswitch.route(idx, E, check=False)
        return calls
    fn = getattr(registry.get(op).ops(), op)
    return {op: lambda: fn(**problem, backend=backend)}


def training_call(op: str, problem: dict, backend: str):
    """The public call with its floating-point inputs as leaves that need gradients, then the gradients
    of its outputs: the host time of one forward + backward as a training step pays it."""
    p = dict(problem)
    if op == "expert_matmul":
        p["route"] = flashswitch.route(p.pop("expert_idx"), p.pop("num_experts"))
    leaves = {n: t.detach().requires_grad_() for n, t in p.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    kw = {**p, **leaves}
    fn = getattr(registry.get(op).ops(), op)
    if op == "expert_matmul":
        x, rt, w = kw.pop("x"), kw.pop("route"), kw.pop("weight")
        call = lambda: fn(x, rt, w, **kw, backend=backend)  # noqa: E731
    else:
        call = lambda: fn(**kw, backend=backend)  # noqa: E731

    def forward():
        out = call()
        return [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]

    with torch.enable_grad():
        ups = [torch.ones_like(o) for o in forward()]

    def step():
        with torch.enable_grad():
            torch.autograd.grad(forward(), list(leaves.values()), ups)
    return step


def bare_triton():
    """A launch of a kernel that stores one element: Triton's own cost per call."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)

    x = torch.empty(16, device="cuda" if torch.cuda.is_available() else "cpu")
    return lambda: _store_one[(1,)](x, 1, BLOCK=16)


def sdpa(device: str, dtype: torch.dtype):
    """SDPA on a tiny decode problem (B=1, H=8, one query, 256 keys, D=64)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, 8, 256, 64, generator=g, device=device, dtype=dtype)
    v = torch.randn(1, 8, 256, 64, generator=g, device=device, dtype=dtype)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)


def stub_triton_launches() -> None:
    """Make every Triton kernel launch a no-op (the binding and argument handling before it remain)."""
    from triton.runtime import jit
    jit.JITFunction.run = lambda self, *args, **kwargs: None
    try:
        from triton.runtime import interpreter
        interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None
    except ImportError:
        pass


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` rounds of the host time per call (CPU time of this process: other
    processes on the host do not count)."""
    for _ in range(10):
        fn()
    sync()
    rounds = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        rounds.append((time.process_time() - t0) / calls * 1e6)
        sync()
    return sorted(rounds)[len(rounds) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=list(SHAPES))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--backends", nargs="+", default=list(backends.KERNELS))
    ap.add_argument("--tiny-only", action="store_true", help="only the tiny shapes")
    ap.add_argument("--stub", action="store_true", help="Triton launches as no-ops (flashswitch's own cost)")
    ap.add_argument("--jit-launch", action="store_true",
                    help="FLASHSWITCH_FAST_LAUNCH=0: every Triton launch through Triton's launcher")
    ap.add_argument("--profile", action="store_true", help="cProfile 100 calls of each row")
    ap.add_argument("--no-backward", action="store_true",
                    help="skip the forward + backward rows (at the tiny shapes: a training step's call)")
    ap.add_argument("--out", type=Path, default=None, help="folder for host_time.json/.md")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    stub = args.stub or not gpu
    if args.jit_launch:
        os.environ["FLASHSWITCH_FAST_LAUNCH"] = "0"
    # direct launches happen only where Triton compiles and really launches
    from flashswitch.kernels_triton.kernel_call import fast_launch_wanted
    fast = gpu and not stub and fast_launch_wanted(torch.device(device))
    if stub:
        stub_triton_launches()
    dtype = "bf16" if gpu else "fp32"
    rows = []

    def record(op, label, shape, backend, fn):
        with torch.no_grad():  # a training row's call turns gradients on itself
            h = host_us(fn, args.calls)
            n0 = normal_launches()
            for _ in range(20):
                fn()
            slow = (normal_launches() - n0) / 20  # direct launches that fell back to Triton's normal path
            g = graph_ms([fn]) if gpu and not stub else None
        rows.append(dict(op=op, label=label, shape=registry.describe(shape), backend=backend, host_us=round(h, 2),
                         kernel_us=None if g is None else round(g * 1e3, 2), normal_launches_per_call=slow))
        g_txt = f"{g * 1e3:9.1f}" if g else "      n/a"
        print(f"{op:16s} {label:13s} {registry.describe(shape):52s} {backend:9s} host {h:8.1f} us/call  "
              f"kernel (graph) {g_txt} us" + (f"  ({slow:g} normal launches/call)" if slow else ""), flush=True)
        if args.profile:
            prof = cProfile.Profile()
            with torch.no_grad():
                prof.enable()
                for _ in range(100):
                    fn()
                prof.disable()
            sync()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)

    record("baseline", "tiny", {}, "triton bare", bare_triton())
    if gpu:
        record("baseline", "tiny decode", dict(B=1, H=8, Nq=1, Nk=256, D=64), "sdpa", sdpa(device, torch.bfloat16))
    for op in args.ops:
        spec = registry.get(op)
        shapes = SHAPES[op]
        if args.tiny_only or not gpu:
            shapes = [s for s in shapes if s[0].startswith("tiny")]
        for label, shape in shapes:
            problem = spec.random_problem(**shape, dtype=dtype, device=device, seed=0)
            for backend in args.backends:
                if not (backend_usable(backend) if gpu else backend == "triton") or (
                        backend != "reference" and backend not in spec.kernel_backends):
                    continue
                for name, fn in public_calls(op, problem, backend).items():
                    record(name, label, shape, backend if name != "route" else "-", fn)
                if label.startswith("tiny") and not args.no_backward:
                    record(f"{op} fwd+bwd", label, shape, backend, training_call(op, problem, backend))

    if args.out is None and not gpu:
        print("no GPU: the rows above are not written (--out DIR keeps them)")
        return
    folder = args.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    meta = {**env_info(), **provenance(), "calls": args.calls, "stub": stub, "fast_launch": fast, "dtype": dtype,
            "device_name": device_name()}
    (folder / "host_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Host time per call ({meta['device']}, {dtype}{', Triton launches stubbed' if stub else ''}"
             f"{', direct Triton launches' if fast else ''})", "", f"Run: {provenance_line(meta)}.", "",
             "Public call path (validation, backend choice, config lookup, launch), CPU time per call; kernel: "
             "CUDA-graph replay; normal launches: a direct launch's fall back to Triton's binding (0 when every launch is direct). `python bench/tools/host_time.py" + (" --stub" if stub and gpu else "")
             + ("" if fast or stub else " --jit-launch") + "`", "",
             "| op | shape | backend | host us/call | kernel us | normal Triton launches / call |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        k = "" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
        lines.append(f"| {r['op']} | {r['label']}: {r['shape']} | {r['backend']} | {r['host_us']:.1f} | {k} | "
                     f"{r['normal_launches_per_call']:g} |")
    (folder / "host_time.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {folder / 'host_time.json'} and host_time.md")


if __name__ == "__main__":
    main()
