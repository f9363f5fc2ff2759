#!/usr/bin/env bash
# H200 run 33 (one device call, branch q-regs with run 32's configs): same-round A/B on TUNE_SHAPES 0
# (block D=128): the tuned tile against 128 x 128 and 256 x 64 FUSE + TMA tiles, FlexAttention in
# the same rounds, SM clock and power logged; re-tune shape 0 (the tuner now re-times its 5 fastest
# configs in 5 interleaved rounds and ranks them by the median); build; the op-2 bench (issue shapes
# and N sweep, FlexAttention and SDPA in the same run). Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$C/smi.csv" 2>&1 &
SMI=$!
PYTHONPATH=$PWD timeout 100 python3 bench/config_ab.py eva_attention 0 '{}' \
  '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "QREG": false}' \
  '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "QREG": false, "num_stages": 2}' \
  '{"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 16, "QREG": false, "num_stages": 2}' \
  '{"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 16, "QREG": false}' '"flex"' --rounds 5 2>&1 \
  | grep -v Warning > "$C/ab_shape0.log"; cat "$C/ab_shape0.log"; pack
PYTHONPATH=$PWD timeout 100 python3 -m flashswitch autotune --ops eva_attention --shape 0 --backends triton \
  --dtypes bf16 --budget 70 --no-progress > "$C/autotune_shape0.log" 2>&1; tail -n 2 "$C/autotune_shape0.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack
OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=120 bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
OUT="$C/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=280 BENCH_K="not cupy and not reference" \
  bench/run_gpu.sh | grep -A3 "=="
kill $SMI; pack; rm -rf "$C"
