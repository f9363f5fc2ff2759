#!/usr/bin/env bash
# H200 run 21 (one device call): build; bench op 2 on the issue shapes (tuned configs, FlexAttention and
# SDPA in the same run, now with the read-flush column); then the op-2 kernels test file in full (triton,
# cuda and cupy kernels, bf16/fp16/fp32, gpu hypothesis profile) after run 20's config-lookup fix.
# Everything packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" a c d 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=200 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536 and not B1-H16-Hkv16-Nk16384" \
  bench/run_gpu.sh
pack
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=5 tests/test_eva_attention_kernels.py \
  > "$C/test_eva_attention_kernels.log" 2>&1; tail -n 1 "$C/test_eva_attention_kernels.log"
pack; rm -rf "$OUT_ROOT"/a "$OUT_ROOT"/c "$OUT_ROOT"/d
