#!/usr/bin/env bash
# On a GPU machine: build the csrc/ kernels, run their CUDA parity tests, then the kernel and the
# end-to-end training benchmarks (docs/kernels.md). One command; everything goes to stdout:
#     bash scripts/gpu_kernels.sh 2>&1 | tee kernels-gpu.log
# Extra arguments go to every bench_train.py run (e.g. --steps 40).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
export PATH="$ROOT/.venv/bin:$PATH"  # ninja for the kernel build, from the venv when not on PATH
PY="$ROOT/.venv/bin/python"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

echo "== build (tools/build_kernels.py)"
"$PY" tools/build_kernels.py
echo "== tests: compile check, build cache, fused-op references, CUDA parity/determinism/training"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/unit/test_kernels_compile.py \
    tests/unit/test_kernels_build.py tests/unit/test_model_fused.py \
    tests/integration/test_kernels_cuda.py
for dtype in bf16 fp16; do
    echo "== bench/bench_kernels.py --dtype $dtype"
    "$PY" bench/bench_kernels.py --models 124M 350M --dtype "$dtype"
done
for preset in 124M 350M; do
    for precision in bf16 fp16; do
        echo "== bench/bench_train.py --preset $preset --precision $precision"
        "$PY" bench/bench_train.py --device cuda --preset "$preset" --precision "$precision" \
            --impls ours,ours-nofuse,ours-eager,nano --micro-batch-size 8 --steps 20 "$@"
    done
done
