#!/usr/bin/env bash
# One GPU session in one command: build the extension, run the suite, cross-check, measure the
# ceilings, tune, benchmark and plot. Everything lands in bench/results/<device>/ and the config
# folder; logs and a tarball of both go to $OUT (default ./gpu_out).
#   STAGES=build,test,check,ceilings,autotune,bench OPS=chunk_summaries TUNE_BUDGET=240 bench/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-16}"
STAGES=",${STAGES:-build,test,check,ceilings,autotune,bench},"
OPS="${OPS:-chunk_summaries}"
PY="${PY:-python3}"
status=0
stage() { [[ "$STAGES" == *",$1,"* ]]; }
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures, keep going
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stage build && run build $PY -m pip install --no-build-isolation --no-deps -v -e .
$PY -m flashswitch info | tee "$OUT/info.log"
stage test && run test $PY -m pytest tests -q -x -p no:cacheprovider ${PYTEST_ARGS:-}
stage check && run check $PY -m flashswitch check
stage ceilings && run ceilings $PY bench/ceilings.py
stage autotune && run autotune $PY -m flashswitch autotune --ops ${OPS//,/ } --budget "${TUNE_BUDGET:-240}" --resume
if stage bench; then
  for op in ${OPS//,/ }; do run "bench_$op" $PY -m flashswitch bench --ops "$op"; done
fi
tar czf "$OUT/results.tgz" bench/results flashswitch/autotune/configs 2>/dev/null
exit $status
