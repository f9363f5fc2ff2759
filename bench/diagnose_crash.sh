#!/usr/bin/env bash
# Run one pytest selection in a child under gdb (backtrace of every thread on a crash), falling back to
# Python's faulthandler when gdb is missing:   bench/diagnose_crash.sh 'tests/test_x.py::test_y' [-k expr]
set -u
PY="${PY:-python3}"
if command -v gdb >/dev/null; then
  gdb -q -batch -ex "set pagination off" -ex run -ex "thread apply all bt 25" --args \
    "$PY" -X faulthandler -m pytest -x -q -p no:cacheprovider "$@" 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited" | tail -n 150
else
  echo "(no gdb here: faulthandler only)"
  "$PY" -X faulthandler -m pytest -x -q -p no:cacheprovider "$@" 2>&1 | tail -n 60
fi
