#!/usr/bin/env bash
# Single-process GPT-2 pretraining with Megatron-LM's flags (native path).
# Usage: DATA=data/stdlib_content_document VOCAB=data/tokenizer/vocab.json MERGES=data/tokenizer/merges.txt \
#        bash scripts/pretrain_gpt2.sh [extra flags, e.g. --train-iters 100]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DATA="${DATA:-$ROOT/data/stdlib_content_document}"
VOCAB="${VOCAB:-$ROOT/data/tokenizer/vocab.json}"
MERGES="${MERGES:-$ROOT/data/tokenizer/merges.txt}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_small}"

exec "$PYTHON" "$ROOT/pretrain_gpt2.py" \
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
    --seq-length 256 --max-position-embeddings 256 \
    --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 300 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.02 \
    --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 100 \
    --log-interval 10 --eval-interval 100 --eval-iters 10 \
    --distributed-backend gloo \
    "$@"
