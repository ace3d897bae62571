#!/usr/bin/env bash
# Single-process GPT-2 pretraining with Megatron-LM's flags (native path). Settings come from
# the environment (see scripts/lib/gpt2_args.sh); extra flags are appended:
#   TRAIN_ITERS=100 bash scripts/pretrain_gpt2.sh --tensorboard-dir runs/tb
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/gpt2_args.sh"
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * 2))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_small}"
exec "$PYTHON" "$ROOT/pretrain_gpt2.py" "${GPT2_ARGS[@]}" "$@"
