#!/usr/bin/env bash
# H200 run 12 (one device call): build; which raw-op argument errors crash (bench/crash_probe.py, each
# case in its own process, native stack on a crash); the op-3 CUDA and kernel tests (the two raw-op
# error tests deselected: the probe covers them); tune op-3 SwitchHead V (256-row tiles, triton and
# cuda) and finish the op-2 decode bucket; bench op 3. Logs and configs under $OUT.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT_ROOT/c"
python3 -m pip install -q --no-deps .whl/*.whl > "$OUT_ROOT/c/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 90 python3 bench/crash_probe.py env torch_error route_cpu route_num_experts route_float \
  route_float_after_launch route_float_twice expert_y_shape route_float_cppstack > "$OUT_ROOT/c/crash_probe.log" 2>&1
grep "^== " "$OUT_ROOT/c/crash_probe.log"
CM=tests/test_expert_matmul_cuda.py
OUT="$OUT_ROOT/b" STAGES=test HYPOTHESIS_PROFILE=ci TEST_LIMIT=75 \
  TESTS="$CM tests/test_expert_matmul_kernels.py" PYTEST_ARGS="-n 8 --deselect $CM::test_extension_rejects_bad_arguments \
  --deselect $CM::test_device_route_strided_input_and_errors" bench/run_gpu.sh
timeout 90 python3 -m flashswitch autotune --ops expert_matmul --first 1 --backends triton cuda --dtypes bf16 \
  --budget 75 --no-progress > "$OUT_ROOT/c/autotune_v.log" 2>&1
tail -n 3 "$OUT_ROOT/c/autotune_v.log"
timeout 80 python3 -m flashswitch autotune --ops eva_attention --first 4 --resume --backends triton cuda \
  --dtypes bf16 --budget 65 --no-progress > "$OUT_ROOT/c/autotune_decode.log" 2>&1
tail -n 3 "$OUT_ROOT/c/autotune_decode.log"
tar czf "$OUT_ROOT/c/configs.tgz" flashswitch/autotune/configs
OUT="$OUT_ROOT/d" STAGES=bench OPS=expert_matmul BENCH_LIMIT=90 BENCH_K="not cupy and not reference" bench/run_gpu.sh
