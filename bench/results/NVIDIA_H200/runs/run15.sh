#!/usr/bin/env bash
# H200 run 15 (one device call): build; bench op 3 again (run 12's SwitchHead V row was host-bound in
# that process: 0.458 ms per call against 0.159-0.161 ms in run 14's own process); Nsight Compute
# sections of the tuned op-2 block kernels (D=128, D=64) and the op-3 V kernel. Logs under $OUT.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT_ROOT/c"
OUT="$OUT_ROOT/a" STAGES=build bench/run_gpu.sh
OUT="$OUT_ROOT/d" STAGES=bench OPS=expert_matmul BENCH_LIMIT=80 BENCH_K="not cupy and not reference" bench/run_gpu.sh
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats"
prof() {  # prof NAME KERNEL_REGEX OP INDEX
  timeout 70 ncu --clock-control none $SECTIONS -k "regex:$2" --launch-skip 2 --launch-count 1 \
    python3 bench/ncu_kernel.py "$3" "$4" > "$OUT_ROOT/c/ncu_$1.log" 2>&1
  echo "== ncu $1: rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy" \
    "$OUT_ROOT/c/ncu_$1.log" | head -n 6
}
prof eva_d128 _eva_fwd eva_attention 0
prof eva_d64 _eva_fwd eva_attention 1
prof expert_v _expert_matmul_fwd expert_matmul 0
