#!/usr/bin/env bash
# H200 run 29 (one device call, on branch gluon-eva: the tree of its commit c0bd5c5, Triton/Gluon only: no extension build): GPU tests of
# the Gluon kernel (64- and 128-row tiles) and of the space's explicit configs on the working tree's
# Triton kernel (ROW_STRIDE); run29_ab.py (main's kernel vs the working tree's, Gluon tiles) with the
# SM clock, power and throttle reasons logged every 200 ms beside it; Nsight Compute's warp-stall and
# pipe metrics of the block D=64 FUSE kernel. Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
R=bench/results/NVIDIA_H200/runs
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "gluon or from_the_space or tma_tuned" > "$C/test_gluon.log" 2>&1; echo "tests rc=$?"; tail -n 3 "$C/test_gluon.log"; pack
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$C/smi.csv" 2>&1 &
SMI=$!
timeout 200 python3 $R/run29_ab.py 3 > "$C/ab.log" 2>&1; echo "ab rc=$?"; cat "$C/ab.log" | cut -c1-150
kill $SMI; pack
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active|smsp__cycles_active.avg|sm__cycles_elapsed.avg.per_second'
timeout 120 ncu --clock-control none --metrics "$M" -k "regex:_eva_fwd" --launch-skip 2 --launch-count 1 \
  python3 bench/ncu_kernel.py eva_attention 1 > "$C/ncu_d64.log" 2>&1; echo "ncu rc=$?"
grep -E "stalled_(long|short|wait|barrier|math|mio|no_inst|not_sel|selected|dispatch|lg|branch|membar|sleep|gmma|tex)" \
  "$C/ncu_d64.log" | awk '{print $1, $NF}' | sort -k2 -g -r | head -n 12
pack; rm -rf "$C"
