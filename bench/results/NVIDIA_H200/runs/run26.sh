#!/usr/bin/env bash
# H200 run 26 (one device call, Triton only): the GPU tests of the op-2 Triton kernel as committed
# after runs 24-25 (every test with a triton backend or TMA tiles, hypothesis gpu profile), then Nsight
# Compute's SpeedOfLight / occupancy / launch sections of the tuned block D=64 kernel (one-loop walk).
# Logs packed into $OUT/all.tgz. As called, the ncu step failed (no build: flashswitch not importable);
# it ran in a second call on the same machine with PYTHONPATH set and --section WarpStateStats added
# (the command below is that one).
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
timeout 270 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --durations=5 tests/test_eva_attention_kernels.py \
  -k "triton or tma" > "$C/test_eva_triton.log" 2>&1; echo "tests rc=$?"; tail -n 9 "$C/test_eva_triton.log"; pack
PYTHONPATH="$PWD" timeout 100 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section ComputeWorkloadAnalysis --section WarpStateStats -k "regex:_eva_fwd" --launch-skip 2 --launch-count 1 \
  python3 bench/ncu_kernel.py eva_attention 1 > "$C/ncu_eva_d64.log" 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|highest-utilized" "$C/ncu_eva_d64.log" | head -n 8
pack; rm -rf "$C"
