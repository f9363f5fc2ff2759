#!/usr/bin/env bash
# H200 run 11 (one device call): build; native stack of the raw-op error crash; device-route tests
# (now the default route); tune op-2 block D=128 (FUSE now in its space) and op-3 SwitchHead V
# (256-row tiles); bench op 2 on the issue shapes and op 3. Logs under $OUT.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT_ROOT/c"
OUT="$OUT_ROOT/a" STAGES=build,test OPS=expert_matmul STAGE_LIMIT=60 TESTS=tests/test_expert_matmul_cuda.py \
  PYTEST_ARGS="-k route --deselect tests/test_expert_matmul_cuda.py::test_device_route_strided_input_and_errors" \
  bench/run_gpu.sh
timeout 60 bench/diagnose_crash.sh tests/test_expert_matmul_cuda.py::test_device_route_strided_input_and_errors \
  > "$OUT_ROOT/c/crash.log" 2>&1
tail -n 25 "$OUT_ROOT/c/crash.log"
timeout 150 python3 - > "$OUT_ROOT/c/autotune.log" 2>&1 <<'PY'
from flashswitch.autotune import space, tune
shapes = {"eva_attention": space.TUNE_SHAPES["eva_attention"][:1],
          "expert_matmul": space.TUNE_SHAPES["expert_matmul"][:1]}
r = tune.tune(ops=["eva_attention", "expert_matmul"], backends=["triton"], shapes=shapes,
              dtypes=["bf16"], budget_s=135, progress=False, log=print)
print("tuned", r["buckets"], "->", r["path"])
PY
tail -n 6 "$OUT_ROOT/c/autotune.log"
tar czf "$OUT_ROOT/c/configs.tgz" flashswitch/autotune/configs
OUT="$OUT_ROOT/b" STAGES=bench OPS=expert_matmul STAGE_LIMIT=70 BENCH_K="not cupy and not reference" bench/run_gpu.sh
OUT="$OUT_ROOT/d" STAGES=bench OPS=eva_attention STAGE_LIMIT=230 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536 and not B1-H16-Hkv16-Nk16384" \
  bench/run_gpu.sh
