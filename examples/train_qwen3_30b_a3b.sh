#!/usr/bin/env bash
# Qwen3-30B-A3B with Megatron-LM's flags: the model of Megatron-LM's
# examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh (Llama block + QK-norm, 128
# experts of width 768, top-8, fp32 router, aux loss 1e-3, alltoall dispatcher) trained with
# the training flags of its Mixtral example, the trainer's path changed (docs/moe.md):
#
#   bash examples/train_qwen3_30b_a3b.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [flags...]
#
# TOKENIZER_MODEL is a Hugging Face tokenizer (Qwen/Qwen3-30B-A3B's directory); without it and
# DATA_PATH it trains on Megatron's mock data (--mock-data, NullTokenizer). The environment
# shrinks it (the defaults are Qwen3-30B-A3B's): NUM_LAYERS [48] HIDDEN [2048] FFN [6144]
# HEADS [32] KV_GROUPS [4] KV_CHANNELS [128] EXPERTS [128] MOE_FFN [768] TOPK [8] SEQ [4096]
# MICRO_BATCH [1] GLOBAL_BATCH [256] TRAIN_ITERS [500000] EVAL_ITERS [10] TP [1] PP [1] EP [8]
# PRECISION [--bf16], NPROC [8] ranks per node, NNODES [1] (torchrun; NPROC=1 runs one python
# process). A CPU-sized run:
#   NPROC=1 NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 KV_GROUPS=2 KV_CHANNELS=16 EXPERTS=8 \
#   MOE_FFN=32 TOPK=2 SEQ=64 MICRO_BATCH=2 GLOBAL_BATCH=4 TRAIN_ITERS=3 EP=1 PRECISION= \
#   bash examples/train_qwen3_30b_a3b.sh /tmp/qwen3_moe
# Megatron's configuration also passes --use-mcore-models and --no-rope-fusion (this trainer
# has one model and its RoPE is one PyTorch function) and --sequence-parallel at TP 1 (which
# Megatron turns off with a warning and this trainer refuses): here SP comes with TP > 1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=${1:-$ROOT/checkpoints/qwen3_30b_a3b}
TOKENIZER_MODEL=${2:-}
DATA_PATH=${3:-}
shift $(( $# < 3 ? $# : 3 ))

MODEL_ARGS=(
    --no-masked-softmax-fusion
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --num-layers "${NUM_LAYERS:-48}"
    --hidden-size "${HIDDEN:-2048}"
    --ffn-hidden-size "${FFN:-6144}"
    --num-attention-heads "${HEADS:-32}"
    --group-query-attention
    --num-query-groups "${KV_GROUPS:-4}"
    --kv-channels "${KV_CHANNELS:-128}"
    --qk-layernorm
    --seq-length "${SEQ:-4096}"
    --max-position-embeddings 40960
    --rotary-percent 1.0
    --rotary-base 1000000
    --no-bias-swiglu-fusion
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts "${EXPERTS:-128}"
    --moe-ffn-hidden-size "${MOE_FFN:-768}"
    --moe-router-topk "${TOPK:-8}"
    --moe-router-dtype fp32
    --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss
)

if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
               --make-vocab-size-divisible-by 1187 --data-path "$DATA_PATH" --split 99990,8,2)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-151936}")
fi

PP_DEFAULT=1 EP_DEFAULT=8
source "$ROOT/examples/lib/megatron_moe_run.sh"
