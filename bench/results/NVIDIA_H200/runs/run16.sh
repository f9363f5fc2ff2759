#!/usr/bin/env bash
# H200 run 16 (one device call): build (route.cu: counting sort for few experts); the op-3 tests in full
# (both backends, the new device-route cases and PARTIALS configs) and the op-2 LAZY/EVICT config test;
# A/B of the new knobs against the tuned configs (bench/config_ab.py: op-2 LAZY rescale and EVICT
# loads on the four issue shapes, op-3 V with PARTIALS "out" and route() alone); re-tune the op-3 V
# bucket with PARTIALS in the space. Logs under $OUT/c, tuned configs in $OUT/c/configs.tgz.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
OUT="$OUT_ROOT/b" STAGES=test HYPOTHESIS_PROFILE=ci TEST_LIMIT=150 PYTEST_ARGS="-n 8" \
  TESTS="tests/test_expert_matmul_cuda.py tests/test_expert_matmul_kernels.py" bench/run_gpu.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_eva_attention_kernels.py -k "lazy_rescale" \
  > "$C/test_eva_lazy.log" 2>&1; tail -n 2 "$C/test_eva_lazy.log"
ab() {  # ab NAME OP INDEX VARIANT...
  local name=$1; shift
  timeout 100 python3 bench/config_ab.py --rounds 3 "$@" > "$C/ab_$name.log" 2>&1; echo "== ab $name: rc=$?"
  tail -n 6 "$C/ab_$name.log"
}
ab decode eva_attention 3 '{}' '{"EVICT": true}' '{"LAZY": true}' '{"EVICT": true, "LAZY": true}'
ab d128 eva_attention 0 '{}' '{"LAZY": true}' '{"LAZY": true, "FUSE": true}'
ab d64 eva_attention 1 '{}' '{"LAZY": true}' '{"LAZY": true, "FUSE": false}'
ab sliding eva_attention 2 '{}' '{"LAZY": true}'
ab v expert_matmul 0 '"route"' '{}' '{"PARTIALS": "out"}' '{"PARTIALS": "out", "REDUCE": "atomic"}' \
  '{"PARTIALS": "out", "REDUCE": "atomic", "BLOCK_M": 256, "GROUP_N": 1}'
timeout 150 python3 -m flashswitch autotune --ops expert_matmul --first 1 --backends triton --dtypes bf16 \
  --budget 130 --no-progress > "$C/autotune_v.log" 2>&1
tail -n 3 "$C/autotune_v.log"
tar czf "$C/configs.tgz" flashswitch/autotune/configs
tar czf "$OUT_ROOT/logs.tgz" -C "$OUT_ROOT" a/logs b/logs c
