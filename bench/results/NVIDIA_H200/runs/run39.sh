#!/usr/bin/env bash
# H200 run 39 (one device call, branch gluon-ws, Triton only: no extension build): the Gluon kernel
# without the losing PINGPONG / LAZY_RESCALE options against the oracle (test_gluon_kernel,
# test_gluon_peaked_logits) and every prefill config of the op-2 spaces, which now start with the
# Gluon tiles (test_explicit_configs_from_the_space); then re-tune TUNE_SHAPES 0 (block D=128).
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "gluon or (explicit_configs and prefill)" > "$C/test_gluon.log" 2>&1; echo "tests rc=$?"
tail -n 8 "$C/test_gluon.log" | cut -c1-300; pack
timeout 150 python3 -m flashswitch autotune --ops eva_attention --shape 0 --backends triton \
  --dtypes bf16 --budget 90 --no-progress > "$C/autotune_shape0.log" 2>&1; tail -n 3 "$C/autotune_shape0.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack; rm -rf "$C"
