#!/usr/bin/env bash
# H200 run 37 (one device call, branch gluon-ws, Triton only: no extension build): the Gluon kernel
# with the last block peeled (p.v only), a coalesced output store and config PINGPONG (the two
# consumer warpgroups take turns issuing their wgmma through "turn" mbarriers) against the oracle
# (test_gluon_kernel, 135 cases, NaN in the never-read ranges); then same-round A/B against the tuned
# Triton tile and FlexAttention on TUNE_SHAPES 0 (block D=128), 2 (sliding), 1 (block D=64).
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 -x tests/test_eva_attention_kernels.py -k gluon \
  > "$C/test_gluon.log" 2>&1; echo "tests rc=$?"; tail -n 8 "$C/test_gluon.log" | cut -c1-300; pack
G='"GLUON": true, "BLOCK_M": 128, "num_warps": 8'
ab() { timeout -s KILL "$1" python3 bench/config_ab.py eva_attention "${@:2}" 2>&1 | grep -v Warning; }
ab 120 0 '{}' "{$G, \"BLOCK_N\": 64, \"num_stages\": 3}" "{$G, \"BLOCK_N\": 64, \"num_stages\": 3, \"PINGPONG\": true}" \
  "{$G, \"BLOCK_N\": 64, \"num_stages\": 4, \"PINGPONG\": true}" "{$G, \"BLOCK_N\": 128, \"num_stages\": 2, \"PINGPONG\": true}" \
  '"flex"' --rounds 5 > "$C/ab_shape0.log"; cat "$C/ab_shape0.log"; pack
ab 60 2 '{}' "{$G, \"BLOCK_N\": 64, \"num_stages\": 3, \"PINGPONG\": true}" '"flex"' --rounds 3 > "$C/ab_shape2.log"; cat "$C/ab_shape2.log"; pack
ab 80 1 '{}' "{$G, \"BLOCK_N\": 64, \"num_stages\": 3, \"PINGPONG\": true}" '"flex"' --rounds 3 > "$C/ab_shape1.log"; cat "$C/ab_shape1.log"; pack; rm -rf "$C"
