#!/usr/bin/env bash
# One command on a bare GPU machine (docs/gpu.md): install (offline from a wheelhouse), build the
# data and the csrc/ kernels, run every CUDA test, the kernel and fusion benchmarks,
# pretrain_gpt2.py itself at GPT-2 124M and 350M (bf16) beside a compiled nanoGPT-style model,
# native fp16, DeepSpeed ZeRO-2 train + resume (bit-exact), the --dry-run memory estimate
# against the measured peak, and fp32 CPU against GPU; one report, OUT/report.md and
# OUT/report.json. Designed to finish in under 20 minutes on one H100.
#     bash scripts/gpu_check.sh [--wheelhouse DIR [--no-venv]] [--python PY] [--out DIR] [--cpu-dry-run]
# --wheelhouse DIR: scripts/setup_env.sh --wheelhouse DIR --python PY (.venv on top of PY, default
# python3, and its torch; --no-venv: into PY's own environment); --python PY alone: run with PY
# as it is; neither: scripts/setup_env.sh.
# --cpu-dry-run: every step on the CPU with tiny shapes (GPU-only steps skipped with the
# reason), to test the plumbing, the parsing and the report. A failed step is recorded and the
# others still run; exit status 1 when a step failed. MBS_124M (16), MBS_350M (8) and ITERS (60)
# override the training runs' micro-batch sizes and length; DATA_DIR reuses a data build.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELHOUSE="" PY="" OUT="" DRY=0 NO_VENV=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        --no-venv) NO_VENV=(--no-venv); shift ;;
        --python) PY="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --cpu-dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
OUT="${OUT:-$ROOT/runs/gpu_check/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/steps"
OUT="$(cd "$OUT" && pwd)"
STEPS="$OUT/steps"
: > "$OUT/steps.order"
MODE=gpu; [ "$DRY" = 1 ] && MODE=cpu-dry-run

# step NAME SECONDS CMD...: run CMD, output in $STEPS/NAME/log; never stops the script
step() {
    local name="$1" limit="$2" start=$SECONDS rc=0
    shift 2
    mkdir -p "$STEPS/$name"
    echo "$name" >> "$OUT/steps.order"
    printf '%q ' "$@" > "$STEPS/$name/command"
    echo "== $name ($(date +%H:%M:%S))"
    timeout --kill-after=30 "$limit" "$@" > "$STEPS/$name/log" 2>&1 || rc=$?
    echo "$rc" > "$STEPS/$name/rc"
    echo $((SECONDS - start)) > "$STEPS/$name/seconds"
    if [ "$rc" = 0 ]; then echo "   ok, $((SECONDS - start)) s"; else
        echo "   FAILED (exit $rc) after $((SECONDS - start)) s; last lines of $STEPS/$name/log:"
        tail -n 5 "$STEPS/$name/log" | sed 's/^/   | /'
    fi
}
# skip NAME REASON
skip() {
    mkdir -p "$STEPS/$1"
    echo "$1" >> "$OUT/steps.order"
    echo "$2" > "$STEPS/$1/skipped"
    echo "== $1: skipped ($2)"
}
report() {
    "${PY:-python3}" "$ROOT/tools/gpu_report.py" --out "$OUT" --mode "$MODE"
}

# ---- install
if [ -n "$WHEELHOUSE" ]; then
    step setup 1200 bash scripts/setup_env.sh --wheelhouse "$WHEELHOUSE" --python "${PY:-python3}" \
        "${NO_VENV[@]}"
    [ ${#NO_VENV[@]} -gt 0 ] && PY="${PY:-python3}" || PY="${VENV:-$ROOT/.venv}/bin/python"
elif [ -z "$PY" ]; then
    step setup 1800 bash scripts/setup_env.sh
    PY="$ROOT/.venv/bin/python"
else
    skip setup "using $PY as it is (--python)"
fi
if [ -f "$STEPS/setup/rc" ] && [ "$(cat "$STEPS/setup/rc")" != 0 ]; then
    PY=python3; report; exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# the Python's bin folder first: ninja (DeepSpeed's and our kernels' JIT builds), deepspeed
export VENV_BIN="$(dirname "$PY")" PYTHON="$PY"
export PATH="$VENV_BIN:$PATH"
if [ "$DRY" = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA device: run it on a GPU machine, or pass --cpu-dry-run')" || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi

# ---- sizes: GPT-2 124M / 350M at seq 1024 on the GPU, tiny models in the dry run
if [ "$DRY" = 1 ]; then
    # DeepSpeed's JIT-built CPU ops in a cache of this Python's own: the shared default
    # (~/.cache/torch_extensions) is rebuilt, a minute each time, whenever another environment
    # built it with other flags
    KEY="$(printf '%s' "$PY" | sha256sum | cut -c1-12)"
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/gpt2-megatron/torch_extensions-$KEY}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    CORPUS_BYTES=300000 VOCAB_SIZE=512 PADDED_VOCAB=512 WORKERS=1
    MBS_124M="${MBS_124M:-4}" MBS_350M="${MBS_350M:-4}" ITERS="${ITERS:-4}" LOG_INTERVAL=2 WARMUP=1
    M124=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64)
    M350=(--num-layers 3 --hidden-size 96 --num-attention-heads 4 --seq-length 64)
    DS_SIZE=(NUM_LAYERS=2 HIDDEN=64 HEADS=4 SEQ=64) DS_ITERS=4
    BENCH=(--device cpu --threads 1 --num-layers 2 --hidden-size 64 --num-attention-heads 4
           --seq-length 64 --vocab-size 512 --micro-batch-size 4 --steps 2 --warmup 1
           --peak-flops 1e11)
    NANO=(--device cpu --no-compile --warmup 1 --steps 3)
else
    CORPUS_BYTES=$((16 * 1024 * 1024)) VOCAB_SIZE=50257 PADDED_VOCAB=50304
    WORKERS="$(nproc)"; [ "$WORKERS" -gt 16 ] && WORKERS=16
    MBS_124M="${MBS_124M:-16}" MBS_350M="${MBS_350M:-8}" ITERS="${ITERS:-60}" LOG_INTERVAL=10 WARMUP=5
    M124=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024)
    M350=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024)
    DS_SIZE=() DS_ITERS=20
    BENCH=(--device cuda --preset 124M --micro-batch-size 8 --steps 10 --warmup 3)
    NANO=(--precision bf16 --warmup 10 --steps 20)
fi

# ---- data: the standard-library corpus, a GPT-2 byte-level BPE, Megatron .bin/.idx (once)
DATA_DIR="${DATA_DIR:-$OUT/data}"
mkdir -p "$DATA_DIR"
CORPUS="$DATA_DIR/stdlib.jsonl" VOCAB="$DATA_DIR/tokenizer/vocab.json"
MERGES="$DATA_DIR/tokenizer/merges.txt" DATA="$DATA_DIR/stdlib_content_document"
if [ -s "$CORPUS" ]; then skip data_corpus "reused $CORPUS"; else
    step data_corpus 600 "$PY" tools/build_stdlib_corpus.py --output "$CORPUS" \
        --max-bytes "$CORPUS_BYTES"
fi
if [ -s "$MERGES" ]; then skip data_tokenizer "reused $MERGES"; else
    step data_tokenizer 1200 "$PY" tools/train_tokenizer.py --input "$CORPUS" --json-keys content \
        --vocab-size "$VOCAB_SIZE" --output-dir "$DATA_DIR/tokenizer"
fi
if [ -s "$DATA.idx" ]; then skip data_preprocess "reused $DATA.idx"; else
    step data_preprocess 1200 "$PY" tools/preprocess_data.py --input "$CORPUS" --json-keys content \
        --output-prefix "$DATA_DIR/stdlib" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" \
        --merge-file "$MERGES" --append-eod --workers "$WORKERS"
fi

# ---- kernels and the CUDA tests
GPU_TESTS=($(grep -rlE 'skipif\(not torch\.cuda\.is_available' tests --include='test_*.py' | sort))
if [ "$DRY" = 1 ]; then
    skip build_kernels "no GPU (--cpu-dry-run)"
    step tests 600 "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$STEPS/tests/junit.xml" \
        "${GPU_TESTS[@]}"
else
    step build_kernels 900 "$PY" tools/build_kernels.py
    step tests 1200 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout=900 \
        --junitxml="$STEPS/tests/junit.xml" tests/unit/test_kernels_compile.py \
        tests/unit/test_kernels_build.py tests/unit/test_fused_ops.py "${GPU_TESTS[@]}"
fi

# ---- kernel benchmark (each csrc kernel against PyTorch) and the step with each fusion on/off
VARIANTS="ours,ours-nofuse,ours-eager,ours-no-masked-softmax,ours-no-bias-gelu,ours-no-bias-dropout"
VARIANTS="$VARIANTS,ours-no-layernorm,ours-no-cross-entropy-loss,nano"
for dtype in bf16 fp16; do
    if [ "$DRY" = 1 ] && [ "$dtype" = fp16 ]; then
        skip bench_kernels_fp16 "fp16 kernels need a GPU (--cpu-dry-run)"; continue
    fi
    if [ "$DRY" = 1 ]; then KB=(--device cpu --models tiny --no-compile --warmup 1 --iters 2)
    else KB=(--models 124M 350M --warmup 3 --iters 10); fi
    step "bench_kernels_$dtype" 900 "$PY" bench/bench_kernels.py "${KB[@]}" --dtype "$dtype" \
        --json "$STEPS/bench_kernels_$dtype/bench.json"
done
PRECISION=(--precision bf16); [ "$DRY" = 1 ] && PRECISION=(--precision fp32)
step bench_train_124M 900 "$PY" bench/bench_train.py "${BENCH[@]}" "${PRECISION[@]}" \
    --impls "$VARIANTS" --json "$STEPS/bench_train_124M/bench.json"

# ---- pretrain_gpt2.py itself, bf16, beside the compiled nanoGPT-style reference; memory
TRAIN=(--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1
       --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --seed 1234
       --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1
       --data-cache-path "$DATA_DIR/index-cache" --num-workers 2 --eval-iters 0
       --train-iters "$ITERS" --log-interval "$LOG_INTERVAL")
for size in 124M 350M; do
    if [ "$size" = 124M ]; then MODEL=("${M124[@]}") MBS="$MBS_124M"; else MODEL=("${M350[@]}") MBS="$MBS_350M"; fi
    SEQ="${MODEL[-1]}"
    RUN=("${MODEL[@]}" --max-position-embeddings "$SEQ" --micro-batch-size "$MBS"
         --global-batch-size "$MBS" --bf16 "${TRAIN[@]}")
    step "train_${size}_bf16" 900 "$PY" pretrain_gpt2.py "${RUN[@]}" \
        --metrics-file "$STEPS/train_${size}_bf16/metrics.jsonl"
    step "memory_$size" 300 "$PY" pretrain_gpt2.py "${RUN[@]}" --dry-run --dry-run-device-memory 80
    if [ "$DRY" = 1 ]; then NANO_MODEL=("${MODEL[@]}"); else NANO_MODEL=(--preset "$size"); fi
    step "nanogpt_$size" 900 "$PY" bench/nanogpt_reference.py "${NANO_MODEL[@]}" "${NANO[@]}" \
        --vocab-size "$PADDED_VOCAB" --micro-batch-size "$MBS" --json "$STEPS/nanogpt_$size/bench.json"
done

# ---- native fp16 (dynamic loss scaling from Megatron's 2^32), 124M
step train_124M_fp16 900 "$PY" pretrain_gpt2.py "${M124[@]}" --max-position-embeddings "${M124[-1]}" \
    --micro-batch-size "$MBS_124M" --global-batch-size "$MBS_124M" --fp16 "${TRAIN[@]}" \
    --metrics-file "$STEPS/train_124M_fp16/metrics.jsonl"

# ---- DeepSpeed ZeRO-2 (fp16 on the GPU, fp32 on the CPU), MP_SIZE=1 on one device:
# uninterrupted, then the same run stopped half-way and resumed; compared bit for bit
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
DS_ENV=(MP_SIZE=1 NUM_GPUS_PER_WORKER=1 DATA="$DATA" VOCAB="$VOCAB" MERGES="$MERGES"
        MICRO_BATCH=4 GLOBAL_BATCH=4 TRAIN_ITERS="$DS_ITERS" LOG_INTERVAL=1 EVAL_ITERS=0
        SAVE_INTERVAL=100000 "${DS_SIZE[@]}")
DS_ARGS=(--data-cache-path "$DATA_DIR/index-cache" --num-workers 1)
CK="$STEPS/ds_zero2_first/ck"
step ds_zero2_straight 900 env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" \
    CHECKPOINT_PATH="$STEPS/ds_zero2_straight/ck" bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh \
    "${DS_ARGS[@]}" --metrics-file "$STEPS/ds_zero2_straight/metrics.jsonl"
step ds_zero2_first 900 env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" CHECKPOINT_PATH="$CK" \
    bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh "${DS_ARGS[@]}" \
    --exit-interval $((DS_ITERS / 2)) --metrics-file "$STEPS/ds_zero2_first/metrics.jsonl"
step ds_zero2_resumed 900 env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" CHECKPOINT_PATH="$CK" \
    bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh "${DS_ARGS[@]}" \
    --metrics-file "$STEPS/ds_zero2_resumed/metrics.jsonl"

# ---- the same tiny fp32 run on the CPU and on the GPU
TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
      --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 --lr 1e-3
      --train-iters 8 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0
      --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 969,30,1
      --data-cache-path "$DATA_DIR/index-cache" --num-workers 0 --seed 1234)
step fp32_cpu 600 env CUDA_VISIBLE_DEVICES= "$PY" pretrain_gpt2.py "${TINY[@]}" \
    --metrics-file "$STEPS/fp32_cpu/metrics.jsonl"
if [ "$DRY" = 1 ]; then skip fp32_gpu "no GPU (--cpu-dry-run)"; else
    step fp32_gpu 600 "$PY" pretrain_gpt2.py "${TINY[@]}" --metrics-file "$STEPS/fp32_gpu/metrics.jsonl"
fi

report
