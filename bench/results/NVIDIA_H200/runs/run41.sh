#!/usr/bin/env bash
# H200 run 41 (one device call, branch gluon-ws, Triton only: no extension build): why the Gluon tile
# is slow on short calls (run 40: 0.45 ms at N = 4096 and 8192, where the Triton tile takes 0.15 and
# 0.21): host time per call (enqueued without synchronizing) and CUDA-graph kernel time of the Gluon
# and the Triton tile on the issue's block D=128 problem at N = 4096 and 32768, with a cProfile of
# the Gluon calls; then same-round A/B on TUNE_SHAPES 7 (N = 8192: the borrowed Gluon config, the
# Triton tile, FlexAttention). Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 100 python3 - > "$C/host.log" 2>&1 <<'PY'
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "bench")
from common import graph_ms
from flashswitch import registry
spec = registry.get("eva_attention")
cfgs = {"gluon": {"GLUON": True, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        "triton": {"BLOCK_M": 128, "BLOCK_N": 64, "FUSE": True, "TMA": True, "num_stages": 4, "num_warps": 8}}
for n in (4096, 32768):
    p = spec.random_problem(B=1, H=16, Hkv=16, Nk=n, D=128, C=16, W=2048, window="block", dtype="bf16",
                            device="cuda", seed=0)
    for name, cfg in cfgs.items():
        fn = spec.kernel_callable("triton", cfg, p)
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"N={n} {name:6s} host {(t1 - t0) * 1e4:7.1f} us/call, wall {(t2 - t0) * 1e4:7.1f} us/call, "
              f"graph {graph_ms([fn]) * 1e3:7.1f} us", flush=True)
        if n == 4096:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
PY
cat "$C/host.log" | grep "^N="; pack
T='"BLOCK_M": 128, "BLOCK_N": 64, "FUSE": true, "TMA": true, "num_stages": 4, "num_warps": 8'
timeout -s KILL 80 python3 bench/config_ab.py eva_attention 7 '{}' "{$T}" '"flex"' --rounds 3 2>&1 | grep -v Warning \
  > "$C/ab_shape7.log"; cat "$C/ab_shape7.log"; pack; rm -rf "$C"
