#!/usr/bin/env bash
# H200 run 34 (one device call, branch q-regs with run 33's configs, Triton only: no extension
# build): every op-2 kernel test with a triton backend or TMA tiles (gpu hypothesis profile; the
# spaces now hold QREG and 256 x 64 tiles); then block D=128's tuned tile paired with FlexAttention
# in the same rounds (bench/config_ab.py, 7 rounds), SM clock and power logged. Packed into
# $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=3 tests/test_eva_attention_kernels.py \
  -k "triton or tma" > "$C/test_eva_triton.log" 2>&1; echo "tests rc=$?"; tail -n 6 "$C/test_eva_triton.log"; pack
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$C/smi.csv" 2>&1 &
SMI=$!
timeout 90 python3 bench/config_ab.py eva_attention 0 '{}' '"flex"' --rounds 7 2>&1 | grep -v Warning > "$C/ab_flex.log"
cat "$C/ab_flex.log"; kill $SMI; pack; rm -rf "$C"
