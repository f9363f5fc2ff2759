#!/usr/bin/env bash
# H200 run 48 (one device call, branch direct-launch, Triton only: no build): the Triton launchers of
# all three ops go through kernels_triton/_launch.py (a repeated call launches its compiled kernel
# directly). Tests first: tests/test_launch.py, then op-2 Gluon / decode / property / strided /
# never-reads tests and the op-1 and op-3 kernel-vs-reference tests, all in processes that repeat
# calls with varying arguments; then host time per call and CUDA-graph kernel time on run 42's
# block D=128 N=4096 problem (Gluon and Triton tiles) and on the decode problem. Packed as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
export PYTHONPATH=$PWD
timeout -s KILL 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_launch.py \
  tests/test_eva_attention_kernels.py tests/test_chunk_summaries_kernels.py tests/test_expert_matmul_kernels.py \
  -k "launch or gluon or (triton and (decode or property or strided or never_reads or matches))" \
  > "$C/test_direct_launch.log" 2>&1; echo "tests rc=$?"; tail -n 4 "$C/test_direct_launch.log" | cut -c1-300; pack
timeout 90 python3 - > "$C/host.log" 2>&1 <<'PY'
import sys, time, torch
sys.path.insert(0, "bench")
from common import graph_ms
from flashswitch import registry
from flashswitch.autotune import store
spec = registry.get("eva_attention")
block = dict(B=1, H=16, Hkv=16, Nk=4096, D=128, C=16, W=2048, window="block")
cases = {"N4096 gluon": (block, {"GLUON": True, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4}),
         "N4096 triton": (block, {"BLOCK_M": 128, "BLOCK_N": 64, "FUSE": True, "TMA": True, "num_stages": 4, "num_warps": 8}),
         "decode B32": (dict(B=32, H=16, Hkv=16, Nq=1, Nk=32768, D=128, C=32, W=256, window="block"), None)}
for name, (shape, cfg) in cases.items():
    p = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
    cfg = cfg or store.lookup("eva_attention", "triton", spec.features(p))
    fn = spec.kernel_callable("triton", cfg, p)
    for _ in range(10):
        fn()
    best = 1e9
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        best = min(best, (time.perf_counter() - t0) * 5e3)
        torch.cuda.synchronize()
    print(f"{name:13s} host {best:6.1f} us/call (best of 3 x 200), graph {graph_ms([fn]) * 1e3:7.1f} us", flush=True)
PY
cat "$C/host.log" | grep -v Warn | tail -n 4; pack; rm -rf "$C"
