#!/usr/bin/env bash
# H200 run 43 (one device call, run 42's configs: block D=128 on the Gluon tiles at N = 8192, 32768,
# 65536): every op-2 Triton / TMA / Gluon test (bf16, fp16, fp32; the small test problems borrow the
# tuned configs, so they reach the Gluon kernel through the public API; D=16 Gluon cases for the first
# time) while the extension builds beside them (for run 44). Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
(OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=400 MAX_JOBS=6 bench/run_gpu.sh > "$C/build.log" 2>&1) &
build=$!
PYTHONPATH=$PWD timeout -s KILL 420 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 \
  tests/test_eva_attention_kernels.py -k "triton or tma or gluon" > "$C/test_op2_triton.log" 2>&1
echo "tests rc=$?"; tail -n 12 "$C/test_op2_triton.log" | cut -c1-300; pack
wait $build; grep "==" "$C/build.log"; cp "$OUT_ROOT/a/logs/build.log" "$C/build_full.log" 2>/dev/null
rm -rf "$OUT_ROOT/a"; pack; rm -rf "$C"
