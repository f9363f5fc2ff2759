#!/usr/bin/env bash
# H200 run 31 (one device call, branch fuse-tma with run 30's configs): build; the op-2 bench (issue
# shapes and N sweep, FlexAttention and SDPA in the same run); then every op-2 kernel test with a
# triton backend or TMA tiles (gpu hypothesis profile), as far as the call's time allows. As called,
# the tests were cut at 170 s (94%, no failure); they ran whole in a second call on the same warm
# machine: `timeout 250 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=3
# tests/test_eva_attention_kernels.py -k "triton or tma"` (logs/run31b_*).
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=120 bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
OUT="$C/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=300 BENCH_K="not cupy and not reference" \
  bench/run_gpu.sh | grep -A3 "=="; pack
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=3 tests/test_eva_attention_kernels.py \
  -k "triton or tma" > "$C/test_eva_triton.log" 2>&1; echo "tests rc=$?"; tail -n 6 "$C/test_eva_triton.log"
pack; rm -rf "$C"
