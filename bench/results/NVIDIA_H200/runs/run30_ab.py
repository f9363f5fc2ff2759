"""Run 30 (carried with build/ab/eva_attention_prev.py = `git show main:flashswitch/kernels_triton/eva_attention.py`):
A/B in one process on block D=64 (TUNE_SHAPES 1), the sliding window (2) and block D=128 (0): main's
op-2 Triton kernel ("prev") with its tuned config against the working tree's one-loop walk with TMA
tiles (FUSE + TMA). Per call (do_bench), read flush and graph replay, median over rounds."""
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


def with_prev(fn):
    new_launch = cur.launch

    def call():
        cur.launch = prev.launch  # the ops layer looks the launcher up at call time
        try:
            fn()
        finally:
            cur.launch = new_launch
    return call


FT = {"FUSE": True, "TMA": True}
CASES = ((1, {"BLOCK_M": 64, "BLOCK_N": 64, "FUSE": True, "num_stages": 3, "num_warps": 4},
          [{"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4, **FT},
           {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 4, "num_warps": 4, **FT},
           {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "num_warps": 8, **FT}]),
         (2, {"BLOCK_M": 64, "BLOCK_N": 64, "FUSE": True, "num_stages": 3, "num_warps": 4},
          [{"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4, **FT}]),
         (0, {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": True, "num_stages": 3, "num_warps": 4},
          [{"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4, **FT},
           {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 3, "num_warps": 8, **FT}]))
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
spec = registry.get("eva_attention")
for idx, tuned, extra in CASES:
    shape = space.TUNE_SHAPES["eva_attention"][idx]
    problem = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
    fns = [with_prev(spec.kernel_callable("triton", tuned, problem))]
    names = ["prev " + json.dumps(tuned)]
    for c in extra:
        fns.append(spec.kernel_callable("triton", c, problem))
        names.append("new  " + json.dumps(c))
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    res = {n: ([], [], []) for n in names}
    for _ in range(rounds):
        for n, fn in zip(names, fns):
            res[n][0].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
            res[n][1].append(read_flush_ms(fn, reps=60))
            res[n][2].append(do_bench_cudagraph(fn, rep=40, return_mode="median"))
    print(f"shape {idx}: {shape}")
    print(f"{'variant':110s} {'per call':>9s} {'rflush':>9s} {'graph':>9s}  (median of {rounds} rounds, ms)")
    for n in names:
        a, b, c = (statistics.median(x) for x in res[n])
        print(f"{n:110s} {a:9.4f} {b:9.4f} {c:9.4f}")
    sys.stdout.flush()
