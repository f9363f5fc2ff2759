#!/usr/bin/env bash
# H200 run 25 (one device call): build; bench op 2 with run 24's configs on the issue shapes and the
# sequence-length sweep (FlexAttention and SDPA in the same run). Results in $OUT/d/results.tgz.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=330 BENCH_K="not cupy and not reference" \
  bench/run_gpu.sh | grep -A3 "=="
