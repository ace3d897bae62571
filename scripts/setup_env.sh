#!/usr/bin/env bash
# Create .venv (if missing), install requirements.txt and the project (editable) into it;
# idempotent and quick when done.
# torch is installed first and pinned, so deepspeed does not pull a newer (CUDA) torch build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.requirements.sha256"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "[setup] installing requirements into $VENV (first time: a few minutes)"
    "$VENV/bin/pip" install -q --disable-pip-version-check "$(grep -E '^torch==' "$ROOT/requirements.txt")"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements.txt"
    # the project itself, editable: `app`, `arguments` and `pretrain_gpt2` import from anywhere
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
    echo "$WANT" > "$STAMP"
fi
