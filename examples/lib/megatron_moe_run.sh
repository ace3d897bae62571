# The part the MoE examples share (examples/train_*.sh), with the training, parallel and
# logging flags of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh: sourced
# after MODEL_ARGS, MOE_ARGS and DATA_ARGS are set, with ROOT, CHECKPOINT_PATH and the
# example's PP_DEFAULT and EP_DEFAULT; runs pretrain_gpt2.py with them and "$@".
# Environment: MICRO_BATCH [1] GLOBAL_BATCH [256] TRAIN_ITERS [500000] EVAL_ITERS [10] TP [1]
# PP EP PRECISION [--bf16] NPROC [8] ranks per node, NNODES [1], NODE_RANK, MASTER_ADDR,
# MASTER_PORT (torchrun; NPROC=1 runs one python process). --sequence-parallel comes with
# TP > 1 (Megatron turns it off with a warning at TP 1, this trainer refuses it there).
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
    --pipeline-model-parallel-size "${PP:-$PP_DEFAULT}"
    --expert-model-parallel-size "${EP:-$EP_DEFAULT}"
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
