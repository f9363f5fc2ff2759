"""Host (CPU) time per call of each backend on the issue shapes: how long the Python/C++ side takes to
enqueue one call, measured without synchronizing (the GPU queue absorbs the kernels), next to the
kernel-only time of a CUDA-graph replay. When host time > kernel time, a per-call timing measures the
host, not the kernel.

    python bench/host_time.py [--ops chunk_summaries ...] [--backends triton ...] [--calls 200] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from common import graph_ms, make_callable, backend_usable
from flashswitch import registry

SHAPES = {
    "chunk_summaries": [dict(B=1, H=16, N=32768, D=128, C=16), dict(B=2, H=16, N=8192, D=128, C=16)],
    "eva_attention": [dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=16, W=2048, window="block"),
                      dict(B=32, H=16, Hkv=16, Nq=1, Nk=32768, D=128, C=32, W=256, window="block")],
    "expert_matmul": None,  # the paper shapes
}


def host_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=list(SHAPES))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--backends", nargs="+", default=["triton", "cuda", "cupy"])
    ap.add_argument("--profile", action="store_true", help="cProfile 50 calls of each shape and backend")
    args = ap.parse_args()
    for op in args.ops:
        spec = registry.get(op)
        shapes = SHAPES[op]
        if shapes is None:
            from flashswitch.reference.expert_matmul import paper_shapes
            shapes = list(paper_shapes(16384).values())[:4]
        for shape in shapes:
            problem = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
            for backend in args.backends:
                if not backend_usable(backend):
                    continue
                fn = make_callable(spec, backend, problem)
                h = host_us(fn, args.calls)
                g = graph_ms([fn])
                g_txt = f"{g * 1e3:8.1f}" if g else "     n/a"
                print(f"{op:16s} {registry.describe(shape):48s} {backend:7s} host {h:8.1f} us/call  "
                      f"kernel (graph) {g_txt} us", flush=True)
                if args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(50):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
