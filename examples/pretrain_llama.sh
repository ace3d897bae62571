#!/usr/bin/env bash
# A Llama-style model on the default corpus with a Llama-style tokenizer, trained as
# scripts/quickstart.sh trains GPT-2 (the DeepSpeed launcher, ZeRO-2, scripts/lib/gpt2_args.sh's
# schedule and checkpoint flags): SwiGLU (Megatron's 8h/3 halves rounded down to a multiple of
# 64), RMSNorm, rotary positions, grouped-query attention, no biases, an output layer untied
# from the embeddings.
#
#   bash examples/pretrain_llama.sh                    # GPT-2 small's shape in the Llama recipe
#   NUM_LAYERS=4 HIDDEN=256 HEADS=4 KV_GROUPS=2 SEQ=256 bash examples/pretrain_llama.sh  # CPU size
#
# Its tokenizer is its own, a Hugging Face tokenizer as Llama's are (--tokenizer-type
# HuggingFaceTokenizer --tokenizer-model DIR): a byte-level BPE of VOCAB_SIZE [8192] tokens that
# puts <|begin_of_text|> before every document and ends it with <|end_of_text|>, trained on
# the corpus on the first run (tools/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer),
# which also tokenizes the corpus with it (tools/preprocess_data.py); both go to LLAMA_DATA
# [data/llama]. The corpus is CORPUS [data/stdlib.jsonl, the quickstart's; built here when
# missing, CORPUS_BYTES [25165824] of the standard library].
#
# Default shape: 12 layers, hidden 768, 12 heads in 4 key/value groups, SwiGLU halves of 2048,
# sequence 1024: 88M parameters with an 8192-token vocabulary. Every setting of
# scripts/lib/gpt2_args.sh can be changed from the environment (NUM_LAYERS HIDDEN HEADS SEQ
# TRAIN_ITERS LR MICRO_BATCH GLOBAL_BATCH CHECKPOINT_PATH ...), plus KV_GROUPS [4] and
# ROPE_BASE [10000]; extra arguments go to pretrain_gpt2.py.
# Export: python tools/convert_checkpoint.py --output-format hf --load CKPT --save DIR writes a
# LlamaForCausalLM directory with this tokenizer (named by the checkpoint; docs/conversion.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib/gpt2_args.sh"   # ROOT, PYTHON
LLAMA_DATA="${LLAMA_DATA:-$ROOT/data/llama}"
CORPUS="${CORPUS:-$ROOT/data/stdlib.jsonl}"
export TOKENIZER_MODEL="$LLAMA_DATA/tokenizer" DATA="$LLAMA_DATA/stdlib_content_document"
if [ ! -s "$CORPUS" ]; then
    "$PYTHON" "$ROOT/tools/build_stdlib_corpus.py" --output "$CORPUS" \
        --max-bytes "${CORPUS_BYTES:-$((24 * 1024 * 1024))}"
fi
if [ ! -s "$TOKENIZER_MODEL/tokenizer.json" ]; then
    "$PYTHON" "$ROOT/tools/train_tokenizer.py" --input "$CORPUS" --json-keys content \
        --vocab-size "${VOCAB_SIZE:-8192}" --output-dir "$TOKENIZER_MODEL" \
        --tokenizer-type HuggingFaceTokenizer
fi
if [ ! -s "$DATA.idx" ]; then
    "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$CORPUS" --json-keys content \
        --output-prefix "$LLAMA_DATA/stdlib" --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model "$TOKENIZER_MODEL" --append-eod --workers 2
fi
export NUM_LAYERS="${NUM_LAYERS:-12}" HIDDEN="${HIDDEN:-768}" HEADS="${HEADS:-12}"
export SEQ="${SEQ:-1024}" LR="${LR:-2e-3}" MICRO_BATCH="${MICRO_BATCH:-4}"
export GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
export CHECKPOINT_PATH="${CHECKPOINT_PATH:-$ROOT/checkpoints/llama}"
exec bash "$ROOT/scripts/ds_pretrain_gpt2.sh" \
    --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
    --position-embedding-type rope --rotary-base "${ROPE_BASE:-10000}" \
    --group-query-attention --num-query-groups "${KV_GROUPS:-4}" \
    --untie-embeddings-and-output-weights "$@"
