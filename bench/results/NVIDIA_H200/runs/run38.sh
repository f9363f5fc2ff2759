#!/usr/bin/env bash
# H200 run 38 (one device call, branch gluon-ws, Triton only: no extension build): the Gluon kernel
# with config LAZY_RESCALE (a row keeps its running max until a block's exceeds it by more than 8,
# base 2; o is rescaled only when a row of the warpgroup moved its max) against the oracle
# (test_gluon_kernel + test_gluon_lazy_rescale on peaked logits, 166 cases); then same-round A/B
# against the tuned Triton tile and FlexAttention on TUNE_SHAPES 0 (block D=128).
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout -s KILL 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 -x tests/test_eva_attention_kernels.py -k gluon \
  > "$C/test_gluon.log" 2>&1; echo "tests rc=$?"; tail -n 8 "$C/test_gluon.log" | cut -c1-300; pack
G='"GLUON": true, "BLOCK_M": 128, "num_warps": 8, "BLOCK_N": 64'
timeout -s KILL 150 python3 bench/config_ab.py eva_attention 0 '{}' "{$G, \"num_stages\": 3}" \
  "{$G, \"num_stages\": 3, \"LAZY_RESCALE\": true}" "{$G, \"num_stages\": 4, \"LAZY_RESCALE\": true}" '"flex"' \
  --rounds 7 2>&1 | grep -v Warning > "$C/ab_shape0.log"; cat "$C/ab_shape0.log"; pack; rm -rf "$C"
