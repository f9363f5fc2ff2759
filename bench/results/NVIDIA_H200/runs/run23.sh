#!/usr/bin/env bash
# H200 run 23 (one device call, Triton only: no extension build): A/B of the committed op-2 kernel
# against the working tree's (the one-loop walk with the scale folded into one FMA per logit on blocks
# without mask or bias; build/ab/ab_prev.py, carried with the HEAD kernel beside it); GPU tests of the
# Triton paths that changed and of every config of the spaces; re-tune the block D=64 and D=128
# buckets. Everything packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$C/nvidia-smi.log"
timeout 100 python3 build/ab/ab_prev.py > "$C/ab_prev.log" 2>&1; cat "$C/ab_prev.log" | grep -v "^$" | tail -n 14; pack
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "(triton or tma) and not matches_reference" > "$C/test_eva_triton.log" 2>&1; tail -n 2 "$C/test_eva_triton.log"; pack
timeout 150 python3 -m flashswitch autotune --ops eva_attention --shape 1 --backends triton --dtypes bf16 \
  --budget 135 --no-progress > "$C/autotune_d64.log" 2>&1; tail -n 2 "$C/autotune_d64.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack
timeout 120 python3 -m flashswitch autotune --ops eva_attention --shape 0 --backends triton --dtypes bf16 \
  --budget 105 --no-progress > "$C/autotune_d128.log" 2>&1; tail -n 2 "$C/autotune_d128.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack; rm -rf "$C"
