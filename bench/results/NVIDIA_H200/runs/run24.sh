#!/usr/bin/env bash
# H200 run 24 (one device call, Triton only: no extension build): A/B of the committed op-2 kernel
# against the working tree's one-loop walk (scale folded into one FMA per logit without a tensor-valued
# branch, which Triton 3.6's pipeliner rejected in run 23; build/ab/ab_prev.py, carried with the HEAD
# kernel beside it), stopping there if the walk does not compile; re-tune the block D=64 and D=128
# buckets; the GPU tests of the Triton kernel (all but the long hypothesis test against the oracle).
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$C/nvidia-smi.log"
timeout 60 python3 build/ab/ab_prev.py > "$C/ab_prev.log" 2>&1; rc=$?; grep -v "^$" "$C/ab_prev.log" | tail -n 8; pack
if [ $rc -ne 0 ]; then echo "A/B failed (rc=$rc): stop"; exit 1; fi
timeout 150 python3 -m flashswitch autotune --ops eva_attention --shape 1 --backends triton --dtypes bf16 \
  --budget 130 --no-progress > "$C/autotune_d64.log" 2>&1; tail -n 2 "$C/autotune_d64.log"
timeout 100 python3 -m flashswitch autotune --ops eva_attention --shape 0 --backends triton --dtypes bf16 \
  --budget 85 --no-progress > "$C/autotune_d128.log" 2>&1; tail -n 2 "$C/autotune_d128.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "(triton or tma) and not matches_reference" > "$C/test_eva_triton.log" 2>&1; tail -n 3 "$C/test_eva_triton.log"
pack; rm -rf "$C"
