#!/usr/bin/env bash
# H200 run 42 (one device call, Triton only: no extension build): host time per call and CUDA-graph
# kernel time of the Gluon and the Triton tile on the issue's block D=128 problem at N = 4096, 8192
# and 32768 (after the launcher's layout and capability caches); then re-tune TUNE_SHAPES 0, 7 and 8
# (N = 32768, 8192, 65536), one command per shape. Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 120 python3 - > "$C/host.log" 2>&1 <<'PY'
import sys, time, torch
sys.path.insert(0, "bench")
from common import graph_ms
from flashswitch import registry
spec = registry.get("eva_attention")
cfgs = {"gluon": {"GLUON": True, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        "triton": {"BLOCK_M": 128, "BLOCK_N": 64, "FUSE": True, "TMA": True, "num_stages": 4, "num_warps": 8}}
for n in (4096, 8192, 32768):
    p = spec.random_problem(B=1, H=16, Hkv=16, Nk=n, D=128, C=16, W=2048, window="block", dtype="bf16",
                            device="cuda", seed=0)
    for name, cfg in cfgs.items():
        fn = spec.kernel_callable("triton", cfg, p)
        for _ in range(10):
            fn()
        for rep in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"N={n} {name:6s} host {(t1 - t0) * 5e3:7.1f} us/call, wall {(t2 - t0) * 5e3:7.1f} us/call, "
                  f"graph {graph_ms([fn]) * 1e3:7.1f} us", flush=True)
PY
grep "^N=" "$C/host.log"; tail -n 3 "$C/host.log" | grep -v "^N="; pack
for s in 0 7 8; do
  timeout 150 python3 -m flashswitch autotune --ops eva_attention --shape $s --backends triton \
    --dtypes bf16 --budget 90 --no-progress > "$C/autotune_shape$s.log" 2>&1; tail -n 3 "$C/autotune_shape$s.log"
  tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack
done
rm -rf "$C"
