"""(runs 23-24: carried as build/ab/ab_prev.py, with build/ab/eva_attention_prev.py = `git show HEAD:flashswitch/kernels_triton/eva_attention.py`.)
A/B in one process: the committed (HEAD) op-2 Triton kernel vs the working tree's, same configs and
inputs; per call (do_bench), read flush and graph replay, median over rounds."""
import importlib.util, json, statistics, sys
import torch
from triton.testing import do_bench, do_bench_cudagraph
sys.path.insert(0, "bench")
from common import read_flush_ms
from flashswitch import registry
from flashswitch.autotune import space
import flashswitch.kernels_triton.eva_attention as cur

spec_ = importlib.util.spec_from_file_location("eva_prev", "build/ab/eva_attention_prev.py")
prev = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(prev)
new_fwd = cur._eva_fwd

def swapped(fn):
    def call():
        cur._eva_fwd = prev._eva_fwd
        try:
            fn()
        finally:
            cur._eva_fwd = new_fwd
    return call

spec = registry.get("eva_attention")
for idx, cfgs in ((1, [{"BLOCK_M": 64, "BLOCK_N": 64, "FUSE": True, "num_stages": 3, "num_warps": 4},
                       {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": True, "num_stages": 3, "num_warps": 4}]),
                  (2, [{"BLOCK_M": 64, "BLOCK_N": 64, "FUSE": True, "num_stages": 3, "num_warps": 4}])):
    shape = space.TUNE_SHAPES["eva_attention"][idx]
    problem = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
    fns, names = [], []
    for c in cfgs:
        f = spec.kernel_callable("triton", c, problem)
        fns += [swapped(f), f]
        names += ["prev " + json.dumps(c), "new  " + json.dumps(c)]
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    res = {n: ([], [], []) for n in names}
    for _ in range(3):
        for n, fn in zip(names, fns):
            res[n][0].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
            res[n][1].append(read_flush_ms(fn, reps=60))
            res[n][2].append(do_bench_cudagraph(fn, rep=40, return_mode="median"))
    print(f"shape {idx}: {shape}")
    print(f"{'variant':100s} {'per call':>9s} {'rflush':>9s} {'graph':>9s}  (median of 3 rounds, ms)")
    for n in names:
        a, b, c = (statistics.median(x) for x in res[n])
        print(f"{n:100s} {a:9.4f} {b:9.4f} {c:9.4f}")
    sys.stdout.flush()
