#!/usr/bin/env bash
# GPT-2 with tensor model parallelism + ZeRO-2 + DeepSpeed activation checkpointing (the
# DeepSpeed Megatron tutorial's script). Multi-node: set NUM_WORKERS and HOSTFILE
# (lines "host slots=N"); the deepspeed launcher starts the ranks over ssh (see docs/launch.md).
#   NUM_WORKERS=2 NUM_GPUS_PER_WORKER=8 MP_SIZE=4 HOSTFILE=hostfile bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh --fp16
# On a CPU-only machine: two CPU ranks, MP_SIZE=2, the fp32 ZeRO-2 config.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_BIN="${VENV_BIN:-$ROOT/.venv/bin}"
DATA="${DATA:-$ROOT/data/stdlib_content_document}"
VOCAB="${VOCAB:-$ROOT/data/tokenizer/vocab.json}"
MERGES="${MERGES:-$ROOT/data/tokenizer/merges.txt}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_ds_mp}"
NUM_WORKERS="${NUM_WORKERS:-1}"
if "$VENV_BIN/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    NUM_GPUS_PER_WORKER="${NUM_GPUS_PER_WORKER:-$(nvidia-smi -L | wc -l)}"
    DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_fp16.json}"
else
    NUM_GPUS_PER_WORKER="${NUM_GPUS_PER_WORKER:-2}"; DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_fp32.json}"
fi
MP_SIZE="${MP_SIZE:-2}"
MICRO_BATCH="${MICRO_BATCH:-4}"
DP_SIZE=$(( NUM_WORKERS * NUM_GPUS_PER_WORKER / MP_SIZE ))
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * DP_SIZE))}"
HOST_ARGS=()
if [ -n "${HOSTFILE:-}" ]; then HOST_ARGS=(--hostfile "$HOSTFILE"); fi
export PATH="$VENV_BIN:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

exec deepspeed "${HOST_ARGS[@]}" --num_nodes "$NUM_WORKERS" --num_gpus "$NUM_GPUS_PER_WORKER" \
    --master_port "${MASTER_PORT:-29500}" "$ROOT/pretrain_gpt2.py" \
    --model-parallel-size "$MP_SIZE" \
    --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-256}" --num-attention-heads "${HEADS:-4}" \
    --seq-length "${SEQ:-256}" --max-position-embeddings "${SEQ:-256}" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "${TRAIN_ITERS:-100}" --lr "${LR:-1e-3}" --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-fraction 0.02 --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1 \
    --save "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-50}" \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-50}" --eval-iters "${EVAL_ITERS:-5}" \
    --checkpoint-activations --deepspeed-activation-checkpointing \
    --deepspeed --deepspeed_config "$DS_CONFIG" \
    "$@"
