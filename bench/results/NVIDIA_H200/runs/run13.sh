#!/usr/bin/env bash
# H200 run 13 (one device call, right after run 12 with its configs): re-tune the op-2 block buckets
# (D=128 and D=64) with the register-capped tiles in the space; bench op 2 on the four issue shapes
# (FlexAttention and SDPA in the same run). The build is skipped when run 12's extension is still there.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT_ROOT/c"
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 175 python3 -m flashswitch autotune --ops eva_attention --first 2 --backends triton --dtypes bf16 \
  --budget 160 --no-progress > "$OUT_ROOT/c/autotune_block.log" 2>&1
tail -n 4 "$OUT_ROOT/c/autotune_block.log"
tar czf "$OUT_ROOT/c/configs.tgz" flashswitch/autotune/configs
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=300 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536 and not B1-H16-Hkv16-Nk16384" \
  bench/run_gpu.sh
