#!/usr/bin/env bash
# H200 run 14 (one device call): build with the libstdc++ fix (setup.py hides a statically linked copy);
# the crash probe again; the op-3 CUDA tests in full (raw-op error tests included) and the build tests;
# the op-2 kernel and CUDA tests (both backends, bf16/fp16/fp32); op-3 host time per call with a
# profile, and the SwitchHead V call with the atomic and the ordered reduction. Logs under $OUT.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT_ROOT/c"
python3 -m pip install -q --no-deps .whl/*.whl > "$OUT_ROOT/c/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 45 python3 bench/crash_probe.py route_num_experts expert_y_shape > "$OUT_ROOT/c/crash_probe.log" 2>&1
head -n 8 "$OUT_ROOT/c/crash_probe.log"
OUT="$OUT_ROOT/b" STAGES=test HYPOTHESIS_PROFILE=ci TEST_LIMIT=240 PYTEST_ARGS="-n 8" \
  TESTS="tests/test_expert_matmul_cuda.py tests/test_cuda_build.py tests/test_eva_attention_cuda.py tests/test_eva_attention_kernels.py" \
  bench/run_gpu.sh
cd bench
timeout 60 python3 host_time.py --ops expert_matmul --backends triton --calls 100 --profile \
  > "$OUT_ROOT/c/host_time_expert.log" 2>&1
grep "us/call" "$OUT_ROOT/c/host_time_expert.log"
timeout 40 python3 - > "$OUT_ROOT/c/v_reduce.log" 2>&1 <<'PY'
import json
from common import graph_ms
from host_time import host_us
from flashswitch import registry
from flashswitch.autotune.tune import bench_ms
spec = registry.get("expert_matmul")
shape = dict(T=16384, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True)
problem = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
base = {"BLOCK_K": 64, "BLOCK_M": 128, "BLOCK_N": 128, "GROUP_N": 1, "INTERLEAVE": True, "num_stages": 3, "num_warps": 8}
for reduce in ("atomic", "ordered"):
    fn = spec.kernel_callable("triton", {**base, "REDUCE": reduce}, problem)
    print(json.dumps({"REDUCE": reduce, "do_bench_ms": bench_ms(fn, warmup=25, rep=100),
                      "host_us": host_us(fn, 100), "graph_ms": graph_ms([fn])}), flush=True)
PY
cat "$OUT_ROOT/c/v_reduce.log"
