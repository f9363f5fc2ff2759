#!/usr/bin/env bash
# H200 run 46 (a second command on run 45's warm machine and build): tests/test_eva_attention_cuda.py
# in full (run 45's -k filter had left it out).
set -u
cd "$(dirname "$0")/../../../.."
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
python3 -c "import flashswitch._C" && timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 \
  tests/test_eva_attention_cuda.py > $OUT/test_eva_attention_cuda.log 2>&1; echo rc=$?; tail -n 3 $OUT/test_eva_attention_cuda.log
