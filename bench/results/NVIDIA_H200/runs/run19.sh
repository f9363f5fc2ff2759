#!/usr/bin/env bash
# H200 run 19 (one device call, with run 18's tuned op-2 configs): build; bench op 2 on the issue shapes
# (FlexAttention and SDPA in the same run); then the op-2 kernel tests that run 18's cut-off left
# unfinished, for the changed Triton kernel (every test not specific to the unchanged cuda/cupy
# kernels; those passed in run 14), plus the tuned TMA tiles test. Everything in $OUT/all.tgz.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" a c d 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention BENCH_LIMIT=230 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536 and not B1-H16-Hkv16-Nk16384" \
  bench/run_gpu.sh
pack
timeout 130 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "not cuda and not cupy" > "$C/test_eva_attention_kernels_triton.log" 2>&1
tail -n 2 "$C/test_eva_attention_kernels_triton.log"
pack; rm -rf "$OUT_ROOT"/a "$OUT_ROOT"/c "$OUT_ROOT"/d
