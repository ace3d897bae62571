#!/usr/bin/env bash
# Tensor- and pipeline-parallel GPT-2 pretraining with torchrun (native path); the launch
# variables are those of scripts/pretrain_gpt2_distributed.sh (GPUS_PER_NODE, NNODES,
# NODE_RANK, MASTER_ADDR, MASTER_PORT), plus TP and PP:
#   GPUS_PER_NODE=8 TP=4 PP=2 bash scripts/pretrain_gpt2_model_parallel.sh
# On a CPU-only machine: two CPU ranks with TP=2 (PP=2 with TP=1 also fits).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TP="${TP:-2}"
PP="${PP:-1}"
export CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_tp${TP}_pp${PP}}"
exec bash "$ROOT/scripts/pretrain_gpt2_distributed.sh" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "$@"
