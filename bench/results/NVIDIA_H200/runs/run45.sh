#!/usr/bin/env bash
# H200 run 45 (one device call, run 42's configs): build; the op-2 tests that run 43 left out (the
# cuda and cupy backends, argument checks: tests/test_eva_attention_cuda.py and the kernel file's
# non-Triton tests); then block D=128 at N = 4096 (which borrows the N = 8192 bucket's Gluon tile):
# the tuned config, the Triton tile and FlexAttention in the same 5 rounds.
# Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=200 bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_cuda.py \
  tests/test_eva_attention_kernels.py -k "not (triton or tma or gluon)" > "$C/test_op2_cuda.log" 2>&1
echo "tests rc=$?"; tail -n 4 "$C/test_op2_cuda.log" | cut -c1-300; pack
T='"GLUON": false, "FUSE": true, "TMA": true, "num_stages": 4'
PYTHONPATH=$PWD timeout -s KILL 250 python3 bench/config_ab.py eva_attention 0 '{}' "{$T}" '"flex"' --set Nk=4096 --rounds 5 \
  2>&1 | grep -v Warning > "$C/ab_n4096.log"; cat "$C/ab_n4096.log"; pack; rm -rf "$C"
