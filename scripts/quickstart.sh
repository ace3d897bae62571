#!/usr/bin/env bash
# From a fresh clone: set up .venv, build the default corpus (this machine's Python standard
# library sources), train a byte-level BPE tokenizer on it, preprocess to Megatron .bin/.idx,
# and train a small GPT-2 through the DeepSpeed launcher (two ranks, ZeRO-2) with evaluation
# and checkpoints (about 10 minutes on 2 CPU cores).
# Re-running reuses the corpus, tokenizer and data; training resumes from the checkpoint
# (QUICKSTART_FRESH=1 starts over).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
PY="$ROOT/.venv/bin/python"
DATA_DIR="${DATA_DIR:-$ROOT/data}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/quickstart}"
CKPT="${CKPT:-$ROOT/checkpoints/quickstart}"
VOCAB_SIZE="${VOCAB_SIZE:-8192}"
TRAIN_ITERS="${TRAIN_ITERS:-600}"
mkdir -p "$DATA_DIR" "$RUN_DIR"
if [ "${QUICKSTART_FRESH:-0}" = 1 ]; then rm -rf "$CKPT" "$RUN_DIR"; mkdir -p "$RUN_DIR"; fi

if [ ! -s "$DATA_DIR/stdlib.jsonl" ]; then
    echo "== 1/5 building the standard-library corpus"
    "$PY" tools/build_stdlib_corpus.py --output "$DATA_DIR/stdlib.jsonl" --max-bytes $((24 * 1024 * 1024))
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
    2>&1 | grep --line-buffered -v "real_accelerator.py" | tee "$RUN_DIR/train.log"

"$PY" - "$RUN_DIR/metrics.jsonl" "$VOCAB_SIZE" <<'PYEOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
valid = [r for r in rows if r["kind"] == "valid"]
start = math.log(int(sys.argv[2]))  # the loss of a model that knows nothing: ln(vocab)
if not valid:
    sys.exit("quickstart: no validation loss was logged")
last = valid[-1]["lm_loss"]
print(f"validation loss: {valid[0]['lm_loss']:.3f} at iteration {valid[0]['iteration']} -> "
      f"{last:.3f} at iteration {valid[-1]['iteration']} (start: ln vocab = {start:.3f})")
if last > start - 2.0:
    sys.exit(f"quickstart: validation loss {last:.3f} did not fall well below ln(vocab) = {start:.3f}")
PYEOF

echo "== 5/5 exporting to Hugging Face GPT-2, plotting the metrics, sampling from the export"
rm -rf "$RUN_DIR/hf"
"$PY" tools/convert_checkpoint.py --input-format deepspeed --output-format hf --load "$CKPT" \
    --save "$RUN_DIR/hf" --vocab-file "$DATA_DIR/tokenizer/vocab.json" \
    --merge-file "$DATA_DIR/tokenizer/merges.txt" 2>&1 | grep -v "real_accelerator.py"
PLOT="$("$PY" tools/plot_metrics.py --metrics-file "$RUN_DIR/metrics.jsonl" --label quickstart \
    --output "$RUN_DIR/metrics.png")"
HF_HUB_OFFLINE=1 "$PY" - "$RUN_DIR/hf" <<'PYEOF' 2>/dev/null
import sys
from transformers import pipeline
generator = pipeline("text-generation", model=sys.argv[1])
prompt = "def main(argv):\n    "
text = generator(prompt, max_new_tokens=40, do_sample=False)[0]["generated_text"]
print("sample from the exported model (transformers pipeline, greedy):")
print("    " + text.replace("\n", "\n    "))
PYEOF
echo
echo "logs:        $RUN_DIR/train.log"
echo "metrics:     $RUN_DIR/metrics.jsonl"
echo "tensorboard: $RUN_DIR/tensorboard   (tensorboard --logdir $RUN_DIR/tensorboard)"
echo "checkpoint:  $CKPT (latest: $(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo none))"
echo "plot:        $PLOT"
echo "hf model:    $RUN_DIR/hf   (GPT2LMHeadModel.from_pretrained / pipeline(\"text-generation\"))"
