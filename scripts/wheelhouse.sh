#!/usr/bin/env bash
# Build a wheelhouse: a folder of wheels from which scripts/setup_env.sh --wheelhouse DIR installs
# the project with no network onto a machine's own Python and torch (docs/gpu.md). Run it where
# the package index is reachable:
#     bash scripts/wheelhouse.sh --output DIR [--python 3.12] [--platform manylinux_2_28_x86_64 ...]
#                                [--build-python PY] [--omit-present FILE]
# It holds DeepSpeed as a pure-Python wheel built from its source distribution (DS_BUILD_OPS=0:
# no op compiled, neither torch nor CUDA needed; DeepSpeed JIT-builds its ops on the cluster),
# every requirement of requirements.txt but torch with its dependencies, torch's own pure-Python
# dependencies (not its CUDA/NVIDIA ones), setuptools and wheel (for `pip install -e .`
# offline), the project as a wheel, requirements.txt without its torch line, and MANIFEST.json.
# --python: the target CPython (default: the build Python's); --platform: the target's platform
# tags (default manylinux_2_28_<this machine's arch>; manylinux_2_N_ARCH stands for every
# manylinux tag up to glibc 2.N); --build-python: the Python whose pip builds and downloads
# (default .venv/bin/python, else python3); --omit-present FILE: leave out the wheels of the
# distributions FILE names, which the target already has (pure-Python ones under 1 MiB stay),
# e.g. scripts/lib/gpu_image_packages.txt for the lent GPU machines (docs/gpu.md).
# Dependencies' environment markers are evaluated by pip for the build Python: give a
# --build-python of the target's version where one exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTPUT="" TARGET_PY="" BUILD_PY="" PLATFORMS=() OMIT_PRESENT="" OMITTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --output) OUTPUT="$2"; shift 2 ;;
        --python) TARGET_PY="$2"; shift 2 ;;
        --platform) PLATFORMS+=("$2"); shift 2 ;;
        --build-python) BUILD_PY="$2"; shift 2 ;;
        --omit-present) OMIT_PRESENT="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -n "$OUTPUT" ] || { echo "wheelhouse.sh: --output DIR is required" >&2; exit 2; }
if [ -z "$BUILD_PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then BUILD_PY="$ROOT/.venv/bin/python"; else BUILD_PY=python3; fi
fi
HELPER=("$BUILD_PY" "$ROOT/scripts/lib/offline_install.py")
PIP=("$BUILD_PY" -m pip --disable-pip-version-check)
BUILD_VERSION="$("$BUILD_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
TARGET_PY="${TARGET_PY:-$BUILD_VERSION}"
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=("manylinux_2_28_$(uname -m)")
if [ "$TARGET_PY" != "$BUILD_VERSION" ]; then
    echo "wheelhouse.sh: warning: building for Python $TARGET_PY with Python $BUILD_VERSION's pip:" \
         "dependencies behind python_version markers are resolved for $BUILD_VERSION" >&2
fi
mkdir -p "$OUTPUT"
OUTPUT="$(cd "$OUTPUT" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
TARGET=(--only-binary=:all: --python-version "$TARGET_PY" --implementation cp)
while read -r tag; do TARGET+=(--platform "$tag"); done < <("${HELPER[@]}" platforms "${PLATFORMS[@]}")

echo "== 1/4 DeepSpeed: a pure-Python wheel from its source distribution (DS_BUILD_OPS=0)"
DS_SPEC="$(grep -E '^[[:space:]]*deepspeed' "$ROOT/requirements.txt" | head -n1 | sed 's/#.*//')"
rm -f "$OUTPUT"/deepspeed-*.whl
DS_BUILD_OPS=0 "${PIP[@]}" wheel -q --no-deps --no-cache-dir --no-binary deepspeed \
    -w "$OUTPUT" "$DS_SPEC"
DS_WHEEL="$(ls "$OUTPUT"/deepspeed-*-py3-none-any.whl 2>/dev/null | head -n1)"
[ -n "$DS_WHEEL" ] || { echo "wheelhouse.sh: the DeepSpeed wheel is not pure Python" >&2; exit 1; }
echo "   $(basename "$DS_WHEEL")"

echo "== 2/4 requirements.txt (torch excluded) and dependencies: CPython $TARGET_PY, ${PLATFORMS[*]}"
"${HELPER[@]}" filter-requirements "$ROOT/requirements.txt" --drop torch > "$OUTPUT/requirements.txt"
{
    "${HELPER[@]}" filter-requirements "$ROOT/requirements.txt" --drop torch deepspeed
    "${HELPER[@]}" wheel-deps "$DS_WHEEL" --python "$TARGET_PY" --platform "${PLATFORMS[0]}"
    "${HELPER[@]}" torch-deps --python "$TARGET_PY" --platform "${PLATFORMS[0]}"
    printf '%s\n' "setuptools>=64" "wheel"
} > "$WORK/download.txt"
# A requirement with no wheel for the target is built here from its sdist when that is pure
# Python (py3-none-any); one with compiled code must be built on a machine like the target.
for attempt in 1 2 3 4 5 6; do
    if "${PIP[@]}" download -q "${TARGET[@]}" --find-links "$OUTPUT" -d "$OUTPUT" \
            -r "$WORK/download.txt" 2> "$WORK/err"; then
        break
    fi
    missing="$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$WORK/err" | head -n1)"
    if [ -z "$missing" ] || [ "$attempt" = 6 ]; then cat "$WORK/err" >&2; exit 1; fi
    echo "   no wheel of $missing for the target: building it from its source distribution"
    rm -rf "$WORK/sdist"
    "${PIP[@]}" wheel -q --no-deps --no-binary :all: -w "$WORK/sdist" "$missing" >&2
    built="$(ls "$WORK"/sdist/*-none-any.whl 2>/dev/null | head -n1)"
    if [ -z "$built" ]; then
        echo "wheelhouse.sh: $missing has no wheel for CPython $TARGET_PY on ${PLATFORMS[*]} and" \
             "is not pure Python: build its wheel on a machine like the target" >&2
        exit 1
    fi
    mv "$built" "$OUTPUT/"
done
if [ -n "$OMIT_PRESENT" ]; then
    while read -r wheel; do
        [ -n "$wheel" ] && OMITTED+=("${wheel%%-*}")
    done < <("${HELPER[@]}" omit-present "$OUTPUT" --present "$OMIT_PRESENT")
    echo "   left out ${#OMITTED[@]} wheels of distributions the target has ($OMIT_PRESENT)"
fi

echo "== 3/4 the project as a wheel"
rm -f "$OUTPUT"/gpt2_megatron_deepspeed-*.whl
had_build=0; [ -e "$ROOT/build" ] && had_build=1
"${PIP[@]}" wheel -q --no-deps -w "$OUTPUT" "$ROOT"
[ "$had_build" = 1 ] || rm -rf "$ROOT/build"  # setuptools' scratch folder, when it made it

echo "== 4/4 MANIFEST.json"
"${HELPER[@]}" manifest "$OUTPUT" --requirements "$ROOT/requirements.txt" --python "$TARGET_PY" \
    --platform "${PLATFORMS[@]}" --omitted "${OMITTED[@]}"
echo "$(ls "$OUTPUT"/*.whl | wc -l) wheels, $(du -sh "$OUTPUT" | cut -f1) in $OUTPUT"
echo "install with no network (keeps the Python's own torch):"
echo "    bash scripts/setup_env.sh --wheelhouse $OUTPUT --python <the Python that has torch>"
