#!/usr/bin/env bash
# H200 run 32 (one device call, branch q-regs, Triton only: no extension build): GPU tests of config
# QREG (q in registers for q.k) with the TMA tiles, every config of the spaces and the tuned-tile
# tests; stop there on a failure; same-round A/B with FlexAttention timed in the same rounds
# (bench/config_ab.py) on TUNE_SHAPES 0 (block D=128), 2 (sliding), 1 (block D=64), with the SM
# clock and power logged; re-tune shapes 0 and 2 (QREG tiles first in their spaces). Packed into
# $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "(triton and (tma or from_the_space or q_in_registers)) or tma_tuned_tiles" > "$C/test_qreg.log" 2>&1; rc=$?
echo "tests rc=$rc"; tail -n 3 "$C/test_qreg.log"; pack
if [ $rc -ne 0 ]; then exit 1; fi
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$C/smi_during_ab.csv" 2>&1 &
SMI=$!
ab() { timeout 120 python3 bench/config_ab.py eva_attention "$@" --rounds 5 2>&1 | grep -v Warning; }
ab 0 '{}' '{"QREG": true}' '{"QREG": true, "num_stages": 2}' '{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "QREG": true}' \
  '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}' '"flex"' > "$C/ab_shape0.log"; cat "$C/ab_shape0.log"; pack
ab 2 '{}' '{"QREG": true}' '{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "QREG": true}' '"flex"' > "$C/ab_shape2.log"
cat "$C/ab_shape2.log"; pack
ab 1 '{}' '{"BLOCK_N": 128, "QREG": true}' '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "QREG": true}' '"flex"' \
  > "$C/ab_shape1.log"; cat "$C/ab_shape1.log"; pack
kill $SMI
for sb in "0 90" "2 60"; do
  set -- $sb
  timeout $(($2 + 20)) python3 -m flashswitch autotune --ops eva_attention --shape $1 --backends triton --dtypes bf16 \
    --budget $2 --no-progress > "$C/autotune_shape$1.log" 2>&1; tail -n 2 "$C/autotune_shape$1.log"
done
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack; rm -rf "$C"
