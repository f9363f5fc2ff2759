#!/usr/bin/env bash
# H200 run 30 (one device call, branch fuse-tma, Triton only: no extension build): GPU tests of the
# one-loop walk with TMA tiles (FUSE + TMA: descriptor and tuned-tile tests, every config of the
# spaces, the never-read ranges); stop there on a failure; run30_ab.py (main's kernel and tuned
# configs vs FUSE + TMA tiles on TUNE_SHAPES 1, 2, 0); re-tune shapes 1, 2 and 0 (FUSE + TMA configs
# first in their spaces; the tuner now records the runners-up). Packed into $OUT/all.tgz as it goes.
set -u
cd "$(dirname "$0")/../../../.."
OUT_ROOT="${OUT:-$PWD/gpu_out}"
C="$OUT_ROOT/c"; mkdir -p "$C"
R=bench/results/NVIDIA_H200/runs
python3 -m pip install -q --no-deps .whl/*.whl > "$C/pip.log" 2>&1  # pytest-xdist
pack() { tar czf "$OUT_ROOT/all.tgz.tmp" -C "$OUT_ROOT" c 2>/dev/null; mv "$OUT_ROOT/all.tgz.tmp" "$OUT_ROOT/all.tgz"; }
export PYTHONPATH=$PWD
timeout 130 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_eva_attention_kernels.py \
  -k "triton and (tma or from_the_space or never_reads)" > "$C/test_fuse_tma.log" 2>&1; rc=$?
echo "tests rc=$rc"; tail -n 3 "$C/test_fuse_tma.log"; pack
if [ $rc -ne 0 ]; then exit 1; fi
timeout 100 python3 $R/run30_ab.py 3 > "$C/ab.log" 2>&1; echo "ab rc=$?"; cut -c1-150 "$C/ab.log"; pack
for sb in "1 165" "2 75" "0 100"; do
  set -- $sb
  timeout $(($2 + 20)) python3 -m flashswitch autotune --ops eva_attention --shape $1 --backends triton --dtypes bf16 \
    --budget $2 --no-progress > "$C/autotune_shape$1.log" 2>&1; tail -n 2 "$C/autotune_shape$1.log"
done
tar czf "$C/configs.tgz" flashswitch/autotune/configs; pack; rm -rf "$C"
