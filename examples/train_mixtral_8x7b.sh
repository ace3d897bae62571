#!/usr/bin/env bash
# Mixtral 8x7B with Megatron-LM's flags: examples/mixtral/train_mixtral_8x7b_distributed.sh of
# Megatron-LM, the trainer's path changed (docs/moe.md). Megatron-LM's arguments:
#
#   bash examples/train_mixtral_8x7b.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags...]
#
# Without TOKENIZER_MODEL and DATA_PATH it trains on Megatron's mock data (--mock-data,
# NullTokenizer). The environment shrinks it (the defaults are Mixtral's): NUM_LAYERS [32]
# HIDDEN [4096] FFN [14336] HEADS [32] KV_GROUPS [8] EXPERTS [8] SEQ [4096] MICRO_BATCH [1]
# GLOBAL_BATCH [256] TRAIN_ITERS [500000] EVAL_ITERS [10] TP [1] PP [4] EP [8] PRECISION
# [--bf16], and NPROC [8] ranks per node, NNODES [1] (torchrun; NPROC=1 runs one python
# process). Megatron's layout (PP 4 x EP 8 = 32 ranks) needs four 8-GPU nodes.
# A CPU-sized run: NPROC=1 NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 KV_GROUPS=2 EXPERTS=4 SEQ=64
#   MICRO_BATCH=2 GLOBAL_BATCH=4 TRAIN_ITERS=3 TP=1 PP=1 EP=1 PRECISION= \
#   bash examples/train_mixtral_8x7b.sh /tmp/mixtral
# Megatron's script also passes --use-mcore-models and --no-position-embedding (this trainer
# has one model, and rotary positions have no table) and --sequence-parallel at TP 1 (which
# Megatron turns off with a warning and this trainer refuses): here SP comes with TP > 1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=${1:-$ROOT/checkpoints/mixtral_8x7b}
TOKENIZER_MODEL=${2:-}
DATA_PATH=${3:-}
shift $(( $# < 3 ? $# : 3 ))

MODEL_ARGS=(
    --disable-bias-linear
    --seq-length "${SEQ:-4096}"
    --max-position-embeddings 32768
    --num-layers "${NUM_LAYERS:-32}"
    --hidden-size "${HIDDEN:-4096}"
    --ffn-hidden-size "${FFN:-14336}"
    --num-attention-heads "${HEADS:-32}"
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups "${KV_GROUPS:-8}"
    --no-masked-softmax-fusion
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts "${EXPERTS:-8}"
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
               --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH" --split 99990,8,2)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-32000}")
fi

TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-1}"
    --global-batch-size "${GLOBAL_BATCH:-256}"
    --lr 1e-4
    --train-iters "${TRAIN_ITERS:-500000}"
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    ${PRECISION---bf16}
)

TP=${TP:-1}
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "${PP:-4}"
    --expert-model-parallel-size "${EP:-8}"
    --use-distributed-optimizer
)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters "${EVAL_ITERS:-10}"
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --no-load-optim
    --no-load-rng
)

NPROC=${NPROC:-8}
if [ "$NPROC" -eq 1 ]; then
    LAUNCH=(python)
else
    LAUNCH=(torchrun --nproc-per-node "$NPROC" --nnodes "${NNODES:-1}"
            --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}"
            --master-port "${MASTER_PORT:-29500}")
fi
exec "${LAUNCH[@]}" "$ROOT/pretrain_gpt2.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
