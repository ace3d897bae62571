#!/usr/bin/env bash
# Set up .venv if needed and run the whole test suite (CPU; GPU-only tests skip without CUDA).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k checkpoint`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" --with-test-deps
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONDONTWRITEBYTECODE=1
source scripts/lib/torch_extensions.sh
own_torch_extensions "$ROOT/.venv/bin/python"  # one build of each op per environment
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=600 tests "$@"
