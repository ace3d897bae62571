#!/usr/bin/env bash
# Data-parallel GPT-2 pretraining with torchrun (native path). Megatron's variables:
#   GPUS_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=6000 bash scripts/pretrain_gpt2_distributed.sh
# On a CPU-only machine it runs GPUS_PER_NODE (default 2) CPU ranks with gloo. Model and data
# settings: scripts/lib/gpt2_args.sh; extra flags are appended.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/gpt2_args.sh"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"
NNODES="${NNODES:-1}"
WORLD=$((GPUS_PER_NODE * NNODES))
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * WORLD))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_dp}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
    --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "${MASTER_PORT:-6000}" \
    "$ROOT/pretrain_gpt2.py" "${GPT2_ARGS[@]}" "$@"
