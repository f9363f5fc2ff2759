#!/usr/bin/env bash
# Run one pytest selection in a child under gdb (backtrace of every thread on a crash); where gdb is
# missing, preload bench/segv_trace.c (native stack of the faulting thread, resolved with addr2line):
#   bench/diagnose_crash.sh 'tests/test_x.py::test_y' [-k expr]
set -u
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
if command -v gdb >/dev/null; then
  gdb -q -batch -ex "set pagination off" -ex run -ex "thread apply all bt 25" --args \
    "$PY" -X faulthandler -m pytest -x -q -p no:cacheprovider "$@" 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited" | tail -n 150
  exit 0
fi
echo "(no gdb here: native stack from bench/segv_trace.c)"
so="${TMPDIR:-/tmp}/segv_trace.so"
cc -shared -fPIC -O0 -o "$so" bench/segv_trace.c || exit 1
log="${TMPDIR:-/tmp}/diagnose_crash.log"
LD_PRELOAD="$so" "$PY" -m pytest -x -q -s -p no:cacheprovider -p no:faulthandler "$@" > "$log" 2>&1
echo "rc=$?"
grep -v "^@ " "$log" | tail -n 60
if command -v addr2line >/dev/null; then  # the frames inside shared objects, as function (file:line)
  echo "=== resolved frames ==="
  grep "^@ " "$log" | while read -r _ obj off; do
    echo "$obj $off: $(addr2line -f -C -e "$obj" "$off" 2>/dev/null | tr '\n' ' ')"
  done | head -n 40
fi
