# Shared by the launch scripts (sourced, not run): repository paths, the data defaults, and
# GPT2_ARGS, the Megatron flags of the example model. Every value can be overridden from the
# environment: NUM_LAYERS HIDDEN HEADS SEQ MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS LR MIN_LR
# SAVE_INTERVAL LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS DATA VOCAB MERGES CHECKPOINT_PATH LOAD_PATH;
# MOCK_DATA=1 trains on synthetic tokens (--mock-data --vocab-size VOCAB_SIZE, default 50257)
# instead of DATA, VOCAB and MERGES; TOKENIZER_MODEL=DIR reads DATA with that Hugging Face
# tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR) instead of VOCAB and
# MERGES, which it would not read.
# The caller sets GLOBAL_BATCH (or its data-parallel size) before calling gpt2_args.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_BIN="${VENV_BIN:-$ROOT/.venv/bin}"
PYTHON="${PYTHON:-$VENV_BIN/python}"
DATA="${DATA:-$ROOT/data/stdlib_content_document}"
VOCAB="${VOCAB:-$ROOT/data/tokenizer/vocab.json}"
MERGES="${MERGES:-$ROOT/data/tokenizer/merges.txt}"
MICRO_BATCH="${MICRO_BATCH:-4}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

has_cuda() { "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }

# gpt2_args GLOBAL_BATCH CHECKPOINT_PATH: fill the GPT2_ARGS array
gpt2_args() {
    local global_batch="$1" ckpt="$2" seq="${SEQ:-256}" data
    if [ "${MOCK_DATA:-0}" = 1 ]; then
        data=(--mock-data --vocab-size "${VOCAB_SIZE:-50257}")
    elif [ -n "${TOKENIZER_MODEL:-}" ]; then
        data=(--data-path "$DATA" --tokenizer-type HuggingFaceTokenizer
              --tokenizer-model "$TOKENIZER_MODEL" --split 969,30,1)
    else
        data=(--data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1)
    fi
    GPT2_ARGS=(
        --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-256}" --num-attention-heads "${HEADS:-4}"
        --seq-length "$seq" --max-position-embeddings "$seq"
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$global_batch"
        --train-iters "${TRAIN_ITERS:-300}" --lr "${LR:-1e-3}" --min-lr "${MIN_LR:-1e-4}"
        --lr-decay-style cosine --lr-warmup-fraction 0.02 --weight-decay 0.01 --clip-grad 1.0
        "${data[@]}"
        --save "$ckpt" --load "${LOAD_PATH:-$ckpt}" --save-interval "${SAVE_INTERVAL:-100}"
        --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}"
        --eval-iters "${EVAL_ITERS:-10}"
    )
}

# flag_value FLAG: the value that follows FLAG in GPT2_ARGS (call gpt2_args first)
flag_value() {
    local i
    for ((i = 0; i < ${#GPT2_ARGS[@]} - 1; i++)); do
        if [ "${GPT2_ARGS[$i]}" = "$1" ]; then echo "${GPT2_ARGS[$((i + 1))]}"; return; fi
    done
}

# model_summary: one line naming the model and batch sizes GPT2_ARGS will train
model_summary() {
    echo "$(flag_value --num-layers) layers, hidden $(flag_value --hidden-size)," \
         "heads $(flag_value --num-attention-heads), seq $(flag_value --seq-length)," \
         "micro-batch $(flag_value --micro-batch-size), global batch $(flag_value --global-batch-size)"
}
