#!/usr/bin/env bash
# One command on a bare GPU machine (docs/gpu.md): the GPU figures of the project in at most 8
# minutes of wall time, install included. Steps run in the order of their value (issue 28), each
# under its own time limit; the limits add up to the budget, and a step may also use the time
# that the steps before it left unused, never the time reserved for the steps after it:
#   0 offline install; the csrc/ kernel build in the background
#   1 pretrain_gpt2.py GPT-2 124M bf16 seq 1024 (fastest settings) beside the compiled
#     nanoGPT-style model on the same micro-batch: tokens/s and MFU
#   2 every csrc/ kernel against PyTorch (fwd+bwd, bf16 and fp16, 124M and 350M shapes); the
#     124M step with each fusion off and with compiled layers
#   3 GPT-2 350M bf16   4 native --fp16, dynamic loss scaling, 124M
#   5 DeepSpeed ZeRO-2 (MP_SIZE=1): trains, stops half-way, resumes bit-exactly
#   6 --dry-run memory estimate against the measured peak   7 fp32 CPU against GPU
# Every run reads --mock-data (no corpus, no tokenizer). After every step the report is
# rewritten (OUT/report.md, OUT/report.json), so a run cut short still reports what finished.
#     bash scripts/gpu_check.sh [--wheelhouse DIR [--no-venv]] [--python PY] [--out DIR]
#                               [--publish DIR] [--steps A,B] [--budget S] [--plan] [--cpu-dry-run]
# --wheelhouse DIR: scripts/setup_env.sh --wheelhouse DIR --python PY (.venv on top of PY, default
# python3; --no-venv: into PY's own environment); --python PY alone: PY as it is; neither:
# scripts/setup_env.sh. --publish DIR: after every step also copy report.md, report.json and
# logs.tar.gz (every step's command, log and figures) there (a machine that returns only a few
# files). --steps: only these steps (a rerun of what failed; the install always runs).
# --budget S: seconds in all (default: the sum of the plan's limits). --plan: print the plan and
# exit. --cpu-dry-run: every step on the CPU with tiny shapes (the GPU-only ones skipped with
# the reason) and no budget unless --budget is given (each step at most 600 s), to test the
# plumbing and the report.
# Exit status 1 when a step failed. MBS_124M (32), MBS_350M (16), ITERS (40) override the runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELHOUSE="" PY="" OUT="" PUBLISH="" ONLY="" BUDGET="" BUDGET_GIVEN="" DRY=0 PLAN_ONLY=0 NO_VENV=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        --no-venv) NO_VENV=(--no-venv); shift ;;
        --python) PY="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --publish) PUBLISH="$2"; shift 2 ;;
        --steps) ONLY=",$2,"; shift 2 ;;
        --budget) BUDGET="$2"; BUDGET_GIVEN=1; shift 2 ;;
        --plan) PLAN_ONLY=1; shift ;;
        --cpu-dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# ---- the plan: name, time limit in seconds (bg: in the background), value (issue 28), what
PLAN=(
    "setup 40 0 offline install from the wheelhouse (--wheelhouse)"
    "build_kernels bg 1 csrc/ kernels for this GPU, built while nanogpt_124M compiles"
    "nanogpt_124M 60 1 nanoGPT-style GPT-2 124M + torch.compile, bf16, the same micro-batch"
    "train_124M_bf16 50 1 pretrain_gpt2.py GPT-2 124M bf16 seq 1024, fastest settings"
    "bench_kernels_bf16 25 2 every csrc/ kernel vs PyTorch, fwd+bwd, 124M and 350M shapes, bf16"
    "bench_kernels_fp16 25 2 the same in fp16"
    "bench_train_124M 75 2 the 124M step with each fusion off, and with compiled layers"
    "train_350M_bf16 45 3 pretrain_gpt2.py GPT-2 350M bf16 seq 1024"
    "train_124M_fp16 30 4 native --fp16 with dynamic loss scaling, 124M"
    "ds_zero2_straight 30 5 ZeRO-2 fp16, MP_SIZE=1: the uninterrupted run"
    "ds_zero2_first 25 5 the same run stopped half-way (--exit-interval)"
    "ds_zero2_resumed 25 5 resumed from its checkpoint: compared bit for bit"
    "memory_124M 10 6 --dry-run memory estimate, 124M (vs train_124M_bf16's peak)"
    "memory_350M 10 6 --dry-run memory estimate, 350M (vs train_350M_bf16's peak)"
    "fp32_cpu 15 7 a tiny fp32 run on the CPU"
    "fp32_gpu 15 7 the same run on the GPU: losses within TF32 rounding"
)
BG_LIMIT=180  # the background kernel build's own limit (train_124M_bf16 waits for it)
DRY_LIMIT=600  # each step's limit in the CPU dry run, which has no budget
declare -A RESERVE
PLANNED=0
selected() { [ -z "$ONLY" ] || [ "$1" = setup ] || [[ "$ONLY" == *",$1,"* ]]; }
for entry in "${PLAN[@]}"; do
    read -r name limit _ <<< "$entry"
    if [ "$limit" != bg ] && selected "$name"; then PLANNED=$((PLANNED + limit)); fi
done
left_after="$PLANNED"
for entry in "${PLAN[@]}"; do  # RESERVE: the seconds the selected steps after each one need
    read -r name limit _ <<< "$entry"
    if [ "$limit" != bg ] && selected "$name"; then left_after=$((left_after - limit)); fi
    RESERVE[$name]="$left_after"
done
BUDGET="${BUDGET:-$PLANNED}"
print_plan() {
    echo "GPU check plan: budget $BUDGET s (limits add up to $PLANNED s), install included"
    printf '  %-5s %-19s %6s  %s\n' value step limit what
    for entry in "${PLAN[@]}"; do
        read -r name limit value what <<< "$entry"
        selected "$name" || continue
        [ "$limit" = bg ] && limit="bg" || limit="$limit s"
        printf '  %-5s %-19s %6s  %s\n' "$value" "$name" "$limit" "$what"
    done
}
print_plan
[ "$PLAN_ONLY" = 1 ] && exit 0

OUT="${OUT:-$ROOT/runs/gpu_check/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/steps"
OUT="$(cd "$OUT" && pwd)"
STEPS="$OUT/steps"
: > "$OUT/steps.order"
MODE=gpu; [ "$DRY" = 1 ] && MODE=cpu-dry-run
for entry in "${PLAN[@]}"; do  # the plan, for the report: name, limit, value, what
    read -r name limit value what <<< "$entry"
    selected "$name" && printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$value" "$what"
done > "$OUT/plan.tsv"
echo "$BUDGET" > "$OUT/budget"
T0=$SECONDS

report() {  # report [--quiet]: rewrite (and publish) the report; its status: 1 if a step failed
    local rc=0
    "${PY:-python3}" "$ROOT/tools/gpu_report.py" --out "$OUT" --mode "$MODE" "$@" || rc=$?
    if [ -n "$PUBLISH" ]; then
        mkdir -p "$PUBLISH"
        cp "$OUT/report.md" "$OUT/report.json" "$PUBLISH/" 2> /dev/null
        tar -czf "$PUBLISH/logs.tar.gz" -C "$OUT" --exclude='ck' --exclude='*.pt' steps \
            steps.order plan.tsv 2> /dev/null
    fi
    return "$rc"
}
# allowed NAME: the seconds step NAME may take: its limit plus what the steps before it left
# (the budget less the time spent and the reserve of the steps after it); in the dry run 600,
# unless --budget was given
allowed() {
    if [ "$DRY" = 1 ] && [ -z "$BUDGET_GIVEN" ]; then echo "$DRY_LIMIT"; else
        echo $((BUDGET - (SECONDS - T0) - RESERVE[$1])); fi
}
begin() {  # begin NAME CMD...: the step's folder, its command and its place in the order
    mkdir -p "$STEPS/$1"
    echo "$1" >> "$OUT/steps.order"
    printf '%q ' "${@:2}" > "$STEPS/$1/command"
}
# step NAME CMD...: run CMD within its time, output in $STEPS/NAME/log; never stops the script
step() {
    local name="$1" start=$SECONDS rc=0 limit
    selected "$name" || return 0
    limit="$(allowed "$name")"
    if [ "$limit" -lt 3 ]; then skip "$name" "budget spent ($((SECONDS - T0)) s of $BUDGET s)"; return 0; fi
    shift
    begin "$name" "$@"
    echo "$limit" > "$STEPS/$name/limit"
    echo "== $name (limit $limit s, at $((SECONDS - T0)) s$([ "$DRY" = 0 ] && echo " of $BUDGET s"))"
    timeout --kill-after=10 "$limit" "$@" > "$STEPS/$name/log" 2>&1 || rc=$?
    echo "$rc" > "$STEPS/$name/rc"
    echo $((SECONDS - start)) > "$STEPS/$name/seconds"
    if [ "$rc" = 0 ]; then echo "   ok, $((SECONDS - start)) s"; else
        echo "   FAILED (exit $rc) after $((SECONDS - start)) s; last lines of $STEPS/$name/log:"
        tail -n 5 "$STEPS/$name/log" | sed 's/^/   | /'
    fi
    report --quiet
}
# background NAME CMD...: start CMD now, within BG_LIMIT and the budget; finish_background waits
BG_PIDS=()
background() {
    local name="$1" limit="$BG_LIMIT"
    selected "$name" || return 0
    shift
    [ "$DRY" = 0 ] && [ $((BUDGET - (SECONDS - T0))) -lt "$limit" ] && limit=$((BUDGET - (SECONDS - T0)))
    begin "$name" "$@"
    echo "$limit" > "$STEPS/$name/limit"
    echo "== $name (in the background, limit $limit s)"
    ( start=$SECONDS; rc=0
      timeout --kill-after=10 "$limit" "$@" > "$STEPS/$name/log" 2>&1 || rc=$?
      echo $((SECONDS - start)) > "$STEPS/$name/seconds"; echo "$rc" > "$STEPS/$name/rc" ) &
    BG_PIDS+=($!)
}
skip() {  # skip NAME REASON
    selected "$1" || return 0
    mkdir -p "$STEPS/$1"
    echo "$1" >> "$OUT/steps.order"
    echo "$2" > "$STEPS/$1/skipped"
    echo "== $1: skipped ($2)"
}

# ---- 0. install
if [ -n "$WHEELHOUSE" ]; then
    step setup bash scripts/setup_env.sh --wheelhouse "$WHEELHOUSE" --python "${PY:-python3}" \
        "${NO_VENV[@]}"
    [ ${#NO_VENV[@]} -gt 0 ] && PY="${PY:-python3}" || PY="${VENV:-$ROOT/.venv}/bin/python"
elif [ -z "$PY" ]; then
    step setup bash scripts/setup_env.sh
    PY="$ROOT/.venv/bin/python"
else
    skip setup "using $PY as it is (--python)"
fi
if [ -f "$STEPS/setup/rc" ] && [ "$(cat "$STEPS/setup/rc")" != 0 ]; then
    PY=python3; report; exit 1
fi
PY="$(command -v "$PY" || echo "$PY")"  # a path: its folder goes first on PATH below
report --quiet  # the environment (GPU, driver, torch, CUDA) is read once, now
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
    source "$ROOT/scripts/lib/torch_extensions.sh"
    own_torch_extensions "$PY"  # DeepSpeed's JIT-built CPU ops: this Python's own folder
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    VOCAB_SIZE=512 PADDED_VOCAB=512
    MBS_124M="${MBS_124M:-4}" MBS_350M="${MBS_350M:-4}" ITERS="${ITERS:-4}" LOG_INTERVAL=2 WARMUP=1
    FP16_ITERS=24  # enough for the loss scale to come down from 2^32 (~17 skips) and step
    M124=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64)
    M350=(--num-layers 3 --hidden-size 96 --num-attention-heads 4 --seq-length 64)
    DS_SIZE=(NUM_LAYERS=2 HIDDEN=64 HEADS=4 SEQ=64) DS_ITERS=4
    BENCH=(--device cpu --threads 1 "${M124[@]}" --vocab-size 512 --micro-batch-size 4
           --steps 2 --warmup 1 --peak-flops 1e11 --precision fp32)
    NANO=(--device cpu --no-compile --warmup 1 --steps 3 "${M124[@]}")
    KB=(--device cpu --models tiny --no-compile --warmup 1 --iters 2)
else
    VOCAB_SIZE=50257 PADDED_VOCAB=50304
    MBS_124M="${MBS_124M:-32}" MBS_350M="${MBS_350M:-16}" ITERS="${ITERS:-40}" LOG_INTERVAL=5 WARMUP=5
    FP16_ITERS="$ITERS"
    M124=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024)
    M350=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024)
    DS_SIZE=() DS_ITERS=20
    BENCH=(--device cuda --preset 124M --micro-batch-size 8 --steps 8 --warmup 2 --precision bf16)
    NANO=(--precision bf16 --warmup 5 --steps 20 --preset 124M)
    KB=(--models 124M 350M --warmup 3 --iters 10 --no-compile)
fi
# pretrain_gpt2.py's flags for every run: synthetic tokens, GPT-2's optimizer, dropout off
TRAIN=(--mock-data --vocab-size "$VOCAB_SIZE" --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine
       --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0
       --attention-dropout 0 --seed 1234 --num-workers 2 --eval-iters 0)
run_args() {  # run_args SIZE: RUN, the model and batch flags of GPT-2 SIZE
    local mbs
    if [ "$1" = 124M ]; then RUN=("${M124[@]}"); mbs="$MBS_124M"; else RUN=("${M350[@]}"); mbs="$MBS_350M"; fi
    RUN+=(--max-position-embeddings "${RUN[-1]}" --micro-batch-size "$mbs" --global-batch-size "$mbs"
          "${TRAIN[@]}")
}

# ---- 1. pretrain_gpt2.py 124M beside the compiled nanoGPT-style model (same micro-batch)
if [ "$DRY" = 1 ]; then skip build_kernels "no GPU (--cpu-dry-run)"; else
    background build_kernels "$PY" tools/build_kernels.py
fi
step nanogpt_124M "$PY" bench/nanogpt_reference.py "${NANO[@]}" --vocab-size "$PADDED_VOCAB" \
    --micro-batch-size "$MBS_124M" --json "$STEPS/nanogpt_124M/bench.json"
run_args 124M
step train_124M_bf16 "$PY" pretrain_gpt2.py "${RUN[@]}" --bf16 --train-iters "$ITERS" \
    --log-interval "$LOG_INTERVAL" --metrics-file "$STEPS/train_124M_bf16/metrics.jsonl"

# ---- 2. each csrc/ kernel against PyTorch; the step with each fusion off, compiled layers
for dtype in bf16 fp16; do
    if [ "$DRY" = 1 ] && [ "$dtype" = fp16 ]; then
        skip bench_kernels_fp16 "fp16 kernels need a GPU (--cpu-dry-run)"; continue
    fi
    step "bench_kernels_$dtype" "$PY" bench/bench_kernels.py "${KB[@]}" --dtype "$dtype" \
        --json "$STEPS/bench_kernels_$dtype/bench.json"
done
VARIANTS="ours,ours-nofuse,ours-no-masked-softmax,ours-no-bias-gelu,ours-no-bias-dropout"
VARIANTS="$VARIANTS,ours-no-layernorm,ours-no-cross-entropy-loss,ours-compiled"
step bench_train_124M "$PY" bench/bench_train.py "${BENCH[@]}" --impls "$VARIANTS" \
    --json "$STEPS/bench_train_124M/bench.json"

# ---- 3. 350M; 4. native fp16 (dynamic loss scaling from Megatron's 2^32), every iteration logged
run_args 350M
step train_350M_bf16 "$PY" pretrain_gpt2.py "${RUN[@]}" --bf16 --train-iters "$ITERS" \
    --log-interval "$LOG_INTERVAL" --metrics-file "$STEPS/train_350M_bf16/metrics.jsonl"
run_args 124M
step train_124M_fp16 "$PY" pretrain_gpt2.py "${RUN[@]}" --fp16 --train-iters "$FP16_ITERS" \
    --log-interval 1 --metrics-file "$STEPS/train_124M_fp16/metrics.jsonl"

# ---- 5. DeepSpeed ZeRO-2 (fp16 on the GPU, fp32 on the CPU), MP_SIZE=1 on one device:
# uninterrupted, then the same run stopped half-way and resumed; compared bit for bit
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
DS_ENV=(MP_SIZE=1 NUM_GPUS_PER_WORKER=1 MOCK_DATA=1 VOCAB_SIZE="$VOCAB_SIZE" MICRO_BATCH=4
        GLOBAL_BATCH=4 TRAIN_ITERS="$DS_ITERS" LOG_INTERVAL=1 EVAL_ITERS=0 SAVE_INTERVAL=100000
        "${DS_SIZE[@]}")
DS=(bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh --num-workers 1)
CK="$STEPS/ds_zero2_first/ck"
step ds_zero2_straight env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" \
    CHECKPOINT_PATH="$STEPS/ds_zero2_straight/ck" "${DS[@]}" \
    --metrics-file "$STEPS/ds_zero2_straight/metrics.jsonl"
step ds_zero2_first env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" CHECKPOINT_PATH="$CK" \
    "${DS[@]}" --exit-interval $((DS_ITERS / 2)) --metrics-file "$STEPS/ds_zero2_first/metrics.jsonl"
step ds_zero2_resumed env "${DS_ENV[@]}" MASTER_PORT="$(free_port)" CHECKPOINT_PATH="$CK" \
    "${DS[@]}" --metrics-file "$STEPS/ds_zero2_resumed/metrics.jsonl"

# ---- 6. the --dry-run memory estimate of the runs of 1 and 3
for size in 124M 350M; do
    run_args "$size"
    step "memory_$size" "$PY" pretrain_gpt2.py "${RUN[@]}" --bf16 --train-iters "$ITERS" \
        --dry-run --dry-run-device-memory 80
done

# ---- 7. the same tiny fp32 run on the CPU and on the GPU
TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
      --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 --lr 1e-3
      --train-iters 8 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0
      --mock-data --vocab-size 512 --num-workers 0 --seed 1234)
step fp32_cpu env CUDA_VISIBLE_DEVICES= "$PY" pretrain_gpt2.py "${TINY[@]}" \
    --metrics-file "$STEPS/fp32_cpu/metrics.jsonl"
if [ "$DRY" = 1 ]; then skip fp32_gpu "no GPU (--cpu-dry-run)"; else
    step fp32_gpu "$PY" pretrain_gpt2.py "${TINY[@]}" --metrics-file "$STEPS/fp32_gpu/metrics.jsonl"
fi

for pid in "${BG_PIDS[@]}"; do wait "$pid"; done
report
