#!/usr/bin/env bash
# GPT-2 with tensor (MP_SIZE) and pipeline (PP_SIZE) model parallelism + ZeRO + DeepSpeed
# activation checkpointing (the DeepSpeed Megatron tutorial's script). ZeRO-2 without pipeline
# stages; with PP_SIZE > 1 DeepSpeed allows ZeRO-1 only, so the default JSON becomes zero1.json.
# Multi-node: NUM_WORKERS nodes listed in HOSTFILE ("hostname slots=N" lines); the deepspeed
# launcher starts the ranks over ssh (docs/deepspeed.md).
#   NUM_WORKERS=2 NUM_GPUS_PER_WORKER=8 MP_SIZE=4 PP_SIZE=2 HOSTFILE=hostfile bash scripts/ds_zero2_pretrain_gpt2_model_parallel.sh
# On a CPU-only machine: two CPU ranks, MP_SIZE=2 (or MP_SIZE=1 PP_SIZE=2), in fp32.
# PRECISION=--bf16 (or --fp16, or empty for fp32) picks the precision; the JSON holds none.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/gpt2_args.sh"
NUM_WORKERS="${NUM_WORKERS:-1}"
MP_SIZE="${MP_SIZE:-2}"
PP_SIZE="${PP_SIZE:-1}"
if [ "$PP_SIZE" -gt 1 ]; then ZERO=zero1; else ZERO=zero2; fi
if has_cuda; then
    NUM_GPUS_PER_WORKER="${NUM_GPUS_PER_WORKER:-$(nvidia-smi -L | wc -l)}"
    DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/${ZERO}.json}"; PRECISION="${PRECISION---fp16}"
else
    NUM_GPUS_PER_WORKER="${NUM_GPUS_PER_WORKER:-2}"
    DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/${ZERO}.json}"; PRECISION="${PRECISION:-}"
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # the CPU accelerator, without DeepSpeed's warning
fi
DP_SIZE=$((NUM_WORKERS * NUM_GPUS_PER_WORKER / (MP_SIZE * PP_SIZE)))
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * DP_SIZE))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_ds_mp}"
# the launcher's own log: warnings and errors across hosts, errors only on one node
HOST_ARGS=(--log_level "${DS_LOG_LEVEL:-error}")
if [ -n "${HOSTFILE:-}" ]; then HOST_ARGS=(--hostfile "$HOSTFILE" --log_level "${DS_LOG_LEVEL:-warning}"); fi
export PATH="$VENV_BIN:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec deepspeed "${HOST_ARGS[@]}" --num_nodes "$NUM_WORKERS" --num_gpus "$NUM_GPUS_PER_WORKER" \
    --master_port "${MASTER_PORT:-29500}" "$ROOT/pretrain_gpt2.py" "${GPT2_ARGS[@]}" \
    --model-parallel-size "$MP_SIZE" --pipeline-model-parallel-size "$PP_SIZE" --checkpoint-activations --deepspeed-activation-checkpointing \
    --deepspeed --deepspeed_config "$DS_CONFIG" $PRECISION "$@"
