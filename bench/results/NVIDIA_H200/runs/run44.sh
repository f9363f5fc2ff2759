#!/usr/bin/env bash
# H200 run 44 (one device call right after run 43, on its build; run 42's configs): the op-2 bench
# (issue shapes and the N sweep, FlexAttention and SDPA in the same run); then the tuned configs
# against FlexAttention in interleaved rounds on TUNE_SHAPES 0 (N = 32768) and 7 (N = 8192).
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=200 bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
OUT="$C/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=280 BENCH_K="not cupy and not reference" \
  bench/run_gpu.sh | grep -A3 "=="; pack
PYTHONPATH=$PWD timeout 90 python3 bench/config_ab.py eva_attention 0 '{}' '"flex"' --rounds 7 2>&1 \
  | grep -v Warning > "$C/ab_shape0.log"; cat "$C/ab_shape0.log"; pack
PYTHONPATH=$PWD timeout -s KILL 150 python3 bench/config_ab.py eva_attention 7 '{}' '"flex"' --rounds 5 2>&1 \
  | grep -v Warning > "$C/ab_shape7.log"; cat "$C/ab_shape7.log"; pack; rm -rf "$C"
