#!/usr/bin/env bash
# From a fresh clone: set up .venv, build the default corpus (this machine's Python standard
# library sources), train a byte-level BPE tokenizer on it, preprocess to Megatron .bin/.idx,
# train a small GPT-2 through the DeepSpeed launcher (two ranks, ZeRO-2) with evaluation and
# checkpoints, export it to Hugging Face and sample from the export (seeded).
# Re-running reuses the corpus, tokenizer and data; training resumes from the checkpoint
# (QUICKSTART_FRESH=1 starts over).
#
# Every setting can be changed from the environment (defaults in brackets):
#   DATA_DIR [data]  RUN_DIR [runs/quickstart]  CKPT [checkpoints/quickstart]   where things go
#   CORPUS_BYTES [25165824]  VOCAB_SIZE [8192]                                  corpus, tokenizer
#   TRAIN_ITERS [600]  LR [2e-3]  NUM_GPUS [2]  DS_CONFIG [ds_configs/zero2.json]   training
#   NUM_LAYERS HIDDEN HEADS SEQ EVAL_INTERVAL EVAL_ITERS SAVE_INTERVAL LOG_INTERVAL   the model
#       and its schedule, as scripts/lib/gpt2_args.sh reads them [4 256 4 256 100 10 100 10]
#   SAMPLE_SEED [1]                                                             the closing sample
#   QUICKSTART_CHECK_LOSS [1]   0 skips the closing check that the validation loss fell 2 nats
#       below ln(vocab) (for runs made small on purpose, e.g. tests/integration/
#       test_documented_commands.py, whose few iterations cannot get there)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
PY="$ROOT/.venv/bin/python"
DATA_DIR="${DATA_DIR:-$ROOT/data}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/quickstart}"
CKPT="${CKPT:-$ROOT/checkpoints/quickstart}"
CORPUS_BYTES="${CORPUS_BYTES:-$((24 * 1024 * 1024))}"
VOCAB_SIZE="${VOCAB_SIZE:-8192}"
TRAIN_ITERS="${TRAIN_ITERS:-600}"
mkdir -p "$DATA_DIR" "$RUN_DIR"
if [ "${QUICKSTART_FRESH:-0}" = 1 ]; then rm -rf "$CKPT" "$RUN_DIR"; mkdir -p "$RUN_DIR"; fi

if [ ! -s "$DATA_DIR/stdlib.jsonl" ]; then
    echo "== 1/5 building the standard-library corpus"
    "$PY" tools/build_stdlib_corpus.py --output "$DATA_DIR/stdlib.jsonl" --max-bytes "$CORPUS_BYTES"
fi
if [ ! -s "$DATA_DIR/tokenizer/merges.txt" ]; then
    echo "== 2/5 training a GPT-2 byte-level BPE tokenizer (vocab $VOCAB_SIZE)"
    "$PY" tools/train_tokenizer.py --input "$DATA_DIR/stdlib.jsonl" --json-keys content \
        --vocab-size "$VOCAB_SIZE" --output-dir "$DATA_DIR/tokenizer"
fi
if [ ! -s "$DATA_DIR/stdlib_content_document.idx" ]; then
    echo "== 3/5 preprocessing to Megatron .bin/.idx"
    "$PY" tools/preprocess_data.py --input "$DATA_DIR/stdlib.jsonl" --json-keys content \
        --output-prefix "$DATA_DIR/stdlib" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$DATA_DIR/tokenizer/vocab.json" --merge-file "$DATA_DIR/tokenizer/merges.txt" \
        --append-eod --workers 2 --log-interval 2000
fi

# the banner reads the flags the launch script will build (same environment, same helper)
MODEL="$(MICRO_BATCH=4 TRAIN_ITERS="$TRAIN_ITERS" bash -c \
    'source scripts/lib/gpt2_args.sh && gpt2_args 8 unused && model_summary')"
echo "== 4/5 training GPT-2 ($MODEL) for $TRAIN_ITERS iterations:"
echo "        deepspeed launcher, ${NUM_GPUS:-2} ranks, ${DS_CONFIG:-ZeRO-2 (fp32 on CPU, fp16 on GPU)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
DATA="$DATA_DIR/stdlib_content_document" VOCAB="$DATA_DIR/tokenizer/vocab.json" \
MERGES="$DATA_DIR/tokenizer/merges.txt" CHECKPOINT_PATH="$CKPT" NUM_GPUS="${NUM_GPUS:-2}" \
TRAIN_ITERS="$TRAIN_ITERS" LR="${LR:-2e-3}" MICRO_BATCH=4 GLOBAL_BATCH=8 \
    bash scripts/ds_pretrain_gpt2.sh \
    --data-cache-path "$DATA_DIR/index-cache" --num-workers 1 \
    --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl" \
    2>&1 | tee "$RUN_DIR/train.log"

LOSS_CHECK=()
if [ "${QUICKSTART_CHECK_LOSS:-1}" = 0 ]; then LOSS_CHECK=(--no-check); fi
"$PY" scripts/lib/quickstart_report.py loss "$RUN_DIR/metrics.jsonl" --vocab-size "$VOCAB_SIZE" \
    "${LOSS_CHECK[@]}"

echo "== 5/5 exporting to Hugging Face GPT-2, plotting the metrics, sampling from the export"
rm -rf "$RUN_DIR/hf"
"$PY" tools/convert_checkpoint.py --output-format hf --load "$CKPT" --save "$RUN_DIR/hf" \
    --vocab-file "$DATA_DIR/tokenizer/vocab.json" --merge-file "$DATA_DIR/tokenizer/merges.txt" \
    --metrics-file "$RUN_DIR/metrics.jsonl"
PLOT="$("$PY" tools/plot_metrics.py --metrics-file "$RUN_DIR/metrics.jsonl" --label quickstart \
    --output "$RUN_DIR/metrics.png")"
HF_HUB_OFFLINE=1 "$PY" scripts/lib/quickstart_report.py sample "$RUN_DIR/hf" --seed "${SAMPLE_SEED:-1}"
echo
echo "logs:        $RUN_DIR/train.log"
echo "metrics:     $RUN_DIR/metrics.jsonl"
echo "tensorboard: $RUN_DIR/tensorboard   (tensorboard --logdir $RUN_DIR/tensorboard)"
echo "checkpoint:  $CKPT (latest: $(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo none))"
echo "plot:        $PLOT"
echo "hf model:    $RUN_DIR/hf   (GPT2LMHeadModel.from_pretrained / pipeline(\"text-generation\"))"
