#!/usr/bin/env bash
# H200 run 17 (one device call): build; op-3 kernel tests (16-bit atomics only for <= 2 slots per group)
# and the op-2 TMA-descriptor test; A/B of config TMA against the tuned op-2 configs on the four issue
# shapes (bench/config_ab.py); op-3 bench with run 16's V config (grouped_mm and the dense roof in the
# same run). Logs under $OUT/c (packed in $OUT/logs.tgz with the bench results).
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_expert_matmul_kernels.py > "$C/test_expert_kernels.log" 2>&1
tail -n 1 "$C/test_expert_kernels.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_eva_attention_kernels.py -k "tma_descriptors" \
  > "$C/test_eva_tma.log" 2>&1; tail -n 1 "$C/test_eva_tma.log"
ab() {  # ab NAME OP INDEX VARIANT...
  local name=$1; shift
  timeout 120 python3 bench/config_ab.py --rounds 3 "$@" > "$C/ab_$name.log" 2>&1; echo "== ab $name: rc=$?"
  tail -n 7 "$C/ab_$name.log"
}
ab d128_tma eva_attention 0 '{}' '{"TMA": true}' '{"TMA": true, "num_stages": 4}' '{"TMA": true, "BLOCK_N": 128}' \
  '{"TMA": true, "BLOCK_M": 128, "num_warps": 8}' '{"TMA": true, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}'
ab d64_tma eva_attention 1 '{}' '{"TMA": true, "FUSE": false}' '{"TMA": true, "FUSE": false, "BLOCK_N": 128}' \
  '{"TMA": true, "FUSE": false, "BLOCK_M": 128, "num_warps": 8}' '{"TMA": true, "FUSE": false, "num_stages": 4}'
ab sliding_tma eva_attention 2 '{}' '{"TMA": true, "FUSE": false}'
ab decode_tma eva_attention 3 '{}' '{"TMA": true, "FUSE": false}' '{"TMA": true, "FUSE": false, "BLOCK_N": 128}'
OUT="$OUT_ROOT/d" STAGES=bench OPS=expert_matmul BENCH_LIMIT=110 BENCH_K="not cupy and not reference" bench/run_gpu.sh
tar czf "$OUT_ROOT/logs.tgz" -C "$OUT_ROOT" c d/logs
