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

PP_DEFAULT=4 EP_DEFAULT=8
source "$ROOT/examples/lib/megatron_moe_run.sh"
