#!/usr/bin/env bash
# H200 run 27 (one device call, on the machine run 26 left warm): build; the op-2 CUDA-extension test
# file and every op-2 kernel test without a triton backend (cuda, cupy, argument checks), pytest-xdist.
# As called, the two files in one pytest with -k selected only the kernel file's 27 tests; the CUDA
# file ran in a second call on the same machine (the last command below).
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build BUILD_LIMIT=120 bench/run_gpu.sh | grep "=="; rm -rf "$OUT_ROOT/a"
timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=3 \
  tests/test_eva_attention_kernels.py -k "not triton and not tma" > "$C/test_eva_not_triton.log" 2>&1
echo "tests rc=$?"; tail -n 6 "$C/test_eva_not_triton.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=3 tests/test_eva_attention_cuda.py \
  > "$C/test_eva_attention_cuda.log" 2>&1; echo "tests rc=$?"; tail -n 6 "$C/test_eva_attention_cuda.log"
