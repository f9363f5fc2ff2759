#!/usr/bin/env bash
# H200 run 10 (one device call): build; op-3 CUDA tests with the device route (the bad-arguments
# test apart, under bench/diagnose_crash.sh); re-tune the op-2 issue buckets (new kernel: in-place
# p·v, FMA scale, FUSE) and op-3 SwitchHead V (256-row tiles); bench both ops. Logs under $OUT.
set -u
cd "$(dirname "$0")/../../../.."
export FLASHSWITCH_ROUTE=device
OUT_ROOT="${OUT:-$PWD/gpu_out}"
OUT="$OUT_ROOT/a" STAGES=build,test OPS=expert_matmul HYPOTHESIS_PROFILE=ci STAGE_LIMIT=80 \
  TESTS=tests/test_expert_matmul_cuda.py \
  PYTEST_ARGS="--deselect tests/test_expert_matmul_cuda.py::test_extension_rejects_bad_arguments" bench/run_gpu.sh
mkdir -p "$OUT_ROOT/c"
timeout 60 bench/diagnose_crash.sh tests/test_expert_matmul_cuda.py::test_extension_rejects_bad_arguments \
  > "$OUT_ROOT/c/crash.log" 2>&1
tail -n 30 "$OUT_ROOT/c/crash.log"
timeout 205 python3 - > "$OUT_ROOT/c/autotune.log" 2>&1 <<'PY'
from flashswitch.autotune import space, tune
shapes = {"eva_attention": space.TUNE_SHAPES["eva_attention"][:4],
          "expert_matmul": space.TUNE_SHAPES["expert_matmul"][:1]}
r = tune.tune(ops=["eva_attention", "expert_matmul"], backends=["triton", "cuda"], shapes=shapes,
              dtypes=["bf16"], budget_s=190, progress=False, log=print)
print("tuned", r["buckets"], "->", r["path"])
PY
tail -n 12 "$OUT_ROOT/c/autotune.log"
OUT="$OUT_ROOT/b" STAGES=bench OPS=eva_attention,expert_matmul STAGE_LIMIT=150 \
  BENCH_K="not cupy and not reference and not Nk4096 and not Nk8192 and not Nk65536" bench/run_gpu.sh
tar czf "$OUT_ROOT/c/configs.tgz" flashswitch/autotune/configs
