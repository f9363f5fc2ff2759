#!/usr/bin/env bash
# H200 run 28 (one device call, on branch gluon-eva at 7855939, Triton/Gluon only: no extension build): the Gluon
# kernel's GPU tests against the oracle and the space's explicit configs (GLUON ones first); on a
# failure, run28_dbg.py localizes it; else same-process A/B of GLUON configs against the tuned config
# on TUNE_SHAPES 1 (block D=64), 0 (block D=128), 2 (sliding). Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
R=bench/results/NVIDIA_H200/runs
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$C/nvidia-smi.log"
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "gluon or from_the_space" > "$C/test_gluon.log" 2>&1; rc=$?
echo "tests rc=$rc"; tail -n 4 "$C/test_gluon.log"; pack
if [ $rc -ne 0 ]; then
  timeout 120 python3 $R/run28_dbg.py > "$C/dbg.log" 2>&1; cat "$C/dbg.log" | cut -c1-600 | tail -n 20; pack; exit 1
fi
G64='{"GLUON": true, "BLOCK_N": 64, "num_stages": 3}'
G64R='{"GLUON": true, "BLOCK_N": 64, "num_stages": 3, "maxnreg": 128}'
G128='{"GLUON": true, "BLOCK_N": 128, "num_stages": 2}'
for s in 1 0 2; do
  timeout 100 python3 bench/config_ab.py eva_attention $s '{}' "$G64" "$G64R" "$G128" --rounds 3 \
    > "$C/ab_shape$s.log" 2>&1; tail -n 6 "$C/ab_shape$s.log"; pack
done
