#!/usr/bin/env bash
# A Llama-style model on the default corpus, trained as scripts/quickstart.sh trains GPT-2 (the
# DeepSpeed launcher, ZeRO-2, scripts/lib/gpt2_args.sh's data, schedule and checkpoint flags):
# SwiGLU (Megatron's 8h/3 halves rounded down to a multiple of 64), RMSNorm, rotary positions,
# grouped-query attention, no biases, an output layer untied from the embeddings.
#
#   bash scripts/quickstart.sh                         # once: the corpus, tokenizer and .bin/.idx
#   bash examples/pretrain_llama.sh                    # GPT-2 small's shape in the Llama recipe
#   NUM_LAYERS=4 HIDDEN=256 HEADS=4 KV_GROUPS=2 SEQ=256 bash examples/pretrain_llama.sh  # CPU size
#
# Default shape: 12 layers, hidden 768, 12 heads in 4 key/value groups, SwiGLU halves of 2048,
# sequence 1024: 88M parameters with the corpus' 8192-token vocabulary (GPT-2 small in this
# shape and vocabulary: 92M). Every setting of
# scripts/lib/gpt2_args.sh can be changed from the environment (NUM_LAYERS HIDDEN HEADS SEQ
# TRAIN_ITERS LR MICRO_BATCH GLOBAL_BATCH DATA VOCAB MERGES CHECKPOINT_PATH ...), plus
# KV_GROUPS [4] and ROPE_BASE [10000]; extra arguments go to pretrain_gpt2.py.
# Export: python tools/convert_checkpoint.py --output-format hf --load CKPT --save DIR
#   --vocab-file data/tokenizer/vocab.json --merge-file data/tokenizer/merges.txt
# writes a LlamaForCausalLM directory (docs/conversion.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NUM_LAYERS="${NUM_LAYERS:-12}" HIDDEN="${HIDDEN:-768}" HEADS="${HEADS:-12}"
export SEQ="${SEQ:-1024}" LR="${LR:-2e-3}" MICRO_BATCH="${MICRO_BATCH:-4}"
export GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
export CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/llama}"
exec bash "$ROOT/scripts/ds_pretrain_gpt2.sh" \
    --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
    --position-embedding-type rope --rotary-base "${ROPE_BASE:-10000}" \
    --group-query-attention --num-query-groups "${KV_GROUPS:-4}" \
    --untie-embeddings-and-output-weights "$@"
