#!/usr/bin/env bash
# Create .venv (if missing), install requirements.txt and the project (editable) into it;
# idempotent and quick when done.
# torch is installed first and pinned, so deepspeed does not pull a newer (CUDA) torch build.
#
# Offline, onto a machine's own Python and torch (docs/gpu.md), from a folder made by
# scripts/wheelhouse.sh:
#     bash scripts/setup_env.sh --wheelhouse DIR [--python PY] [--venv DIR | --no-venv]
# makes VENV (default .venv) with --system-site-packages on top of PY (default python3), so PY's
# torch stays and nothing replaces it, and installs requirements.txt without its torch line and
# the project from DIR with pip --no-index. --no-venv installs into PY's own environment instead
# (a venv or conda environment that already has torch). Refuses a torch older than the oldest
# supported (scripts/lib/offline_install.py: MIN_TORCH). Environment: WHEELHOUSE, PYTHON, VENV.
#
# --with-test-deps (scripts/test.sh) also installs requirements-test.txt (lm-eval, wandb, selenium)
# and, as root with apt-get, Debian's chromium and chromium-driver for the browser test and
# slurm-wlm and munge for the Slurm tests (tests/integration/test_slurm.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
WHEELHOUSE="${WHEELHOUSE:-}"
NO_VENV=0
TEST_DEPS=0
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --venv) VENV="$2"; shift 2 ;;
        --no-venv) NO_VENV=1; shift ;;
        --with-test-deps) TEST_DEPS=1; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "setup_env.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
HELPER="$ROOT/scripts/lib/offline_install.py"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"

if [ -n "$WHEELHOUSE" ]; then
    "$PY" "$HELPER" check-manifest "$WHEELHOUSE" --requirements "$ROOT/requirements.txt"
    "$PY" "$HELPER" check-torch
    if [ "$NO_VENV" = 1 ]; then
        TARGET="$PY"
    else
        if [ ! -x "$VENV/bin/python" ]; then
            echo "[setup] creating $VENV on top of $PY (--system-site-packages: its torch stays)"
            "$PY" -m venv --system-site-packages "$VENV"
        fi
        TARGET="$VENV/bin/python"
        if ! "$TARGET" "$HELPER" check-torch > /dev/null 2>&1; then
            echo "setup: $VENV does not see $PY's torch ($VENV predates this install, or $PY is" \
                 "itself a venv whose base Python has no torch): remove $VENV, or pass --no-venv" \
                 "to install into $PY's environment" >&2
            exit 1
        fi
    fi
    STAMP="$VENV/.requirements.sha256"  # --no-venv: no stamp, pip finds it all installed
    if [ "$NO_VENV" = 1 ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
        PREFIX="$("$TARGET" -c 'import sys; print(sys.prefix)')"
        echo "[setup] installing from $WHEELHOUSE into $PREFIX (no network; its torch kept)"
        REQS="$(mktemp)"
        trap 'rm -f "$REQS"' EXIT
        "$PY" "$HELPER" filter-requirements "$ROOT/requirements.txt" --drop torch > "$REQS"
        OFFLINE=(--disable-pip-version-check --no-index --find-links "$WHEELHOUSE")
        "$TARGET" -m pip install -q "${OFFLINE[@]}" -r "$REQS"
        # the project, editable; its build backend (setuptools) comes from the wheelhouse too
        "$TARGET" -m pip install -q "${OFFLINE[@]}" --no-deps -e "$ROOT"
        "$TARGET" "$HELPER" check-torch
        [ "$NO_VENV" = 1 ] || echo "$WANT" > "$STAMP"
    fi
    exit 0
fi

STAMP="$VENV/.requirements.sha256"
# pip compiles every file it installs to bytecode (~20,000 files, ~60 s of one core: half of a
# first set-up) while the other core idles. Here pip installs with --no-compile and
# compile_in_background compiles what is installed so far on every core (scripts/lib/bytecode.py)
# while the next pip runs; the set-up ends with every file compiled, as pip leaves it (and as an
# environment with PYTHONDONTWRITEBYTECODE set, which never writes the files itself, needs).
PIP_QUICK=(-q --disable-pip-version-check --no-compile)
COMPILING=""
STAMPS=()  # "hash>file": written once everything is installed and compiled
compile_in_background() {
    [ -z "$COMPILING" ] || wait "$COMPILING" || true
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$VENV/bin/python" "$ROOT/scripts/lib/bytecode.py" "$site" > /dev/null 2>&1 &
    COMPILING=$!
}
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "[setup] installing requirements into $VENV (first time: a few minutes)"
    "$VENV/bin/pip" install "${PIP_QUICK[@]}" "$(grep -E '^torch==' "$ROOT/requirements.txt")"
    compile_in_background
    "$VENV/bin/pip" install "${PIP_QUICK[@]}" -r "$ROOT/requirements.txt"
    compile_in_background
    # the project itself, editable: `app`, `arguments` and `pretrain_gpt2` import from anywhere
    "$VENV/bin/pip" install "${PIP_QUICK[@]}" --no-deps --no-build-isolation -e "$ROOT"
    "$VENV/bin/python" "$HELPER" check-torch
    STAMPS+=("$WANT>$STAMP")
fi

# apt_install_for_tests "PACKAGES" WHAT COMMAND...: as root with apt-get, install PACKAGES
# unless every COMMAND is already there; on failure the tests for WHAT skip and say why
apt_install_for_tests() {
    local packages="$1" what="$2" missing=0 cmd
    shift 2
    for cmd in "$@"; do
        command -v "$cmd" > /dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing=1
    done
    [ "$missing" = 1 ] && command -v apt-get > /dev/null 2>&1 && [ "$(id -u)" = 0 ] || return 0
    echo "[setup] installing $packages ($what)"
    # shellcheck disable=SC2086 # the package list splits on purpose
    if ! { timeout 600 apt-get install -y -qq $packages > /dev/null 2>&1 || {
            timeout 300 apt-get update -qq > /dev/null 2>&1 &&
            timeout 600 apt-get install -y -qq $packages > /dev/null 2>&1; }; }; then
        echo "[setup] could not install $packages; $what will skip and say so"
    fi
}

if [ "$TEST_DEPS" = 1 ]; then
    TEST_STAMP="$VENV/.test-requirements.sha256"
    TEST_WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$TEST_STAMP" 2>/dev/null)" != "$TEST_WANT" ]; then
        echo "[setup] installing requirements-test.txt into $VENV"
        # the pinned torch line keeps the test packages from pulling another torch
        "$VENV/bin/pip" install "${PIP_QUICK[@]}" -r "$ROOT/requirements-test.txt" \
            "$(grep -E '^torch==' "$ROOT/requirements.txt")"
        compile_in_background
        STAMPS+=("$TEST_WANT>$TEST_STAMP")
    fi
    apt_install_for_tests "chromium chromium-driver" "the browser test" chromedriver
    apt_install_for_tests "slurm-wlm munge" "the Slurm tests" slurmctld slurmd munged sbatch
fi
if [ -n "$COMPILING" ]; then
    wait "$COMPILING" || true
    compile_in_background  # what the last pip installed while the previous pass ran
    wait "$COMPILING" || true
fi
for stamp in ${STAMPS[@]+"${STAMPS[@]}"}; do
    echo "${stamp%%>*}" > "${stamp#*>}"
done
