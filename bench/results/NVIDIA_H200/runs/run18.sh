#!/usr/bin/env bash
# H200 run 18 (one device call): build; re-tune the op-2 block buckets (D=128, D=64) with config TMA in
# the space; bench op 3 (run 17's bench results did not come back); the op-2 kernel tests in full (both
# backends' kernels files: triton here, bf16/fp16/fp32). Everything packed into $OUT/all.tgz.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 230 python3 -m flashswitch autotune --ops eva_attention --first 2 --backends triton --dtypes bf16 \
  --budget 215 --no-progress > "$C/autotune_block.log" 2>&1
tail -n 4 "$C/autotune_block.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs
OUT="$OUT_ROOT/d" STAGES=bench OPS=expert_matmul BENCH_LIMIT=100 BENCH_K="not cupy and not reference" bench/run_gpu.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  > "$C/test_eva_attention_kernels.log" 2>&1; tail -n 2 "$C/test_eva_attention_kernels.log"
tar czf "$OUT_ROOT/all.tgz" -C "$OUT_ROOT" a b c d 2>/dev/null; rm -rf "$OUT_ROOT"/a "$OUT_ROOT"/c "$OUT_ROOT"/d
ls -la "$OUT_ROOT"
