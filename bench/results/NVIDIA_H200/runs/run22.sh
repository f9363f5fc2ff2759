#!/usr/bin/env bash
# H200 run 22 (one device call): build; re-tune the op-2 block D=64 bucket with the register-capped
# 64 x 64 TMA tiles in the space; bench op 2 on the issue shapes (FlexAttention and SDPA in the same
# run); then the GPU tests of every config of the spaces and of the TMA tiles. Everything packed into
# $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" a c d 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 130 python3 -m flashswitch autotune --ops eva_attention --shape 1 --backends triton --dtypes bf16 \
  --budget 115 --no-progress > "$C/autotune_d64.log" 2>&1
tail -n 3 "$C/autotune_d64.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=190 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536 and not B1-H16-Hkv16-Nk16384" \
  bench/run_gpu.sh
pack
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "explicit_configs_from_the_space or tma" > "$C/test_eva_space_tma.log" 2>&1; tail -n 1 "$C/test_eva_space_tma.log"
pack; rm -rf "$OUT_ROOT"/a "$OUT_ROOT"/c "$OUT_ROOT"/d
