#!/usr/bin/env bash
# GPT-2 pretraining through DeepSpeed on one node (ZeRO-2 by default).
#   NUM_GPUS=8 DS_CONFIG=ds_configs/zero2_fp16.json bash scripts/ds_pretrain_gpt2.sh --fp16
# On a CPU-only machine it runs NUM_GPUS CPU ranks with gloo and the fp32 ZeRO-2 config.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_BIN="${VENV_BIN:-$ROOT/.venv/bin}"
DATA="${DATA:-$ROOT/data/stdlib_content_document}"
VOCAB="${VOCAB:-$ROOT/data/tokenizer/vocab.json}"
MERGES="${MERGES:-$ROOT/data/tokenizer/merges.txt}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_ds}"
if "$VENV_BIN/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    NUM_GPUS="${NUM_GPUS:-$(nvidia-smi -L | wc -l)}"; DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_fp16.json}"
    PRECISION="${PRECISION:---fp16}"
else
    NUM_GPUS="${NUM_GPUS:-2}"; DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_fp32.json}"; PRECISION="${PRECISION:-}"
fi
MICRO_BATCH="${MICRO_BATCH:-4}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * NUM_GPUS))}"
export PATH="$VENV_BIN:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

exec deepspeed --num_nodes 1 --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}" \
    "$ROOT/pretrain_gpt2.py" \
    --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-256}" --num-attention-heads "${HEADS:-4}" \
    --seq-length "${SEQ:-256}" --max-position-embeddings "${SEQ:-256}" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "${TRAIN_ITERS:-300}" --lr "${LR:-1e-3}" --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-fraction 0.02 --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-100}" \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-10}" \
    --deepspeed --deepspeed_config "$DS_CONFIG" $PRECISION \
    "$@"
