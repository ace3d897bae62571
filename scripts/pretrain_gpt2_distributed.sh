#!/usr/bin/env bash
# Data-parallel GPT-2 pretraining with torchrun (native path). Megatron's variables:
#   GPUS_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=6000 bash scripts/pretrain_gpt2_distributed.sh
# On a CPU-only machine it runs GPUS_PER_NODE (default 2) CPU ranks with gloo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-6000}"
DATA="${DATA:-$ROOT/data/stdlib_content_document}"
VOCAB="${VOCAB:-$ROOT/data/tokenizer/vocab.json}"
MERGES="${MERGES:-$ROOT/data/tokenizer/merges.txt}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_dp}"
MICRO_BATCH="${MICRO_BATCH:-4}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * GPUS_PER_NODE * NNODES))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$ROOT/pretrain_gpt2.py" \
    --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-256}" --num-attention-heads "${HEADS:-4}" \
    --seq-length "${SEQ:-256}" --max-position-embeddings "${SEQ:-256}" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "${TRAIN_ITERS:-300}" --lr "${LR:-1e-3}" --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-fraction 0.02 --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-100}" \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-10}" \
    "$@"
