#!/usr/bin/env bash
# Set up .venv if needed and run the whole test suite (CPU; GPU-only tests skip without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k checkpoint`.
# The test files run in TEST_WORKERS pytest-xdist workers (default: the CPU count, at most 4; 1
# runs them in this process), a file's tests in one worker, in order (--dist loadfile: a module's
# fixtures are built once). On the 2-core machine, 2 workers keep both cores busy (serially
# they were 70 % busy); 3 were slower (more processes runnable than cores).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" --with-test-deps
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# the checkout's own bytecode, once: its ~300 fresh interpreters (launchers' ranks, tools) would
# each compile the modules they import (~0.25 s of CPU apiece) where PYTHONDONTWRITEBYTECODE is
# set, and a fresh clone has none yet
"$ROOT/.venv/bin/python" scripts/lib/bytecode.py app tests tools bench scripts > /dev/null
"$ROOT/.venv/bin/python" -m compileall -qq ./*.py > /dev/null || true
source scripts/lib/torch_extensions.sh
own_torch_extensions "$ROOT/.venv/bin/python"  # one build of each op per environment
WORKERS="${TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"  # nproc obeys those
[ "$WORKERS" -gt 4 ] && WORKERS=4  # each worker holds torch, its ranks and fixtures
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
    if "$ROOT/.venv/bin/python" -c "import xdist" 2>/dev/null; then
        PARALLEL=(-n "$WORKERS" --dist loadfile)
    else
        echo "[test] pytest-xdist is not installed (requirements-test.txt): running serially" >&2
    fi
fi
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=600 "${PARALLEL[@]}" \
    tests "$@"
