#!/usr/bin/env bash
# GPT-2 pretraining through DeepSpeed on one node (ZeRO-2 by default):
#   NUM_GPUS=8 bash scripts/ds_pretrain_gpt2.sh          # GPUs: ds_configs/zero2.json with --fp16
# On a CPU-only machine it runs NUM_GPUS (default 2) CPU ranks with gloo and zero2.json in fp32.
# PRECISION=--bf16 (or --fp16, or empty for fp32) picks the precision; the JSON holds none.
# DS_CONFIG picks another JSON; model and data settings: scripts/lib/gpt2_args.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/gpt2_args.sh"
if has_cuda; then
    NUM_GPUS="${NUM_GPUS:-$(nvidia-smi -L | wc -l)}"
    DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2.json}"; PRECISION="${PRECISION---fp16}"
else
    NUM_GPUS="${NUM_GPUS:-2}"; DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2.json}"; PRECISION="${PRECISION:-}"
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # the CPU accelerator, without DeepSpeed's warning
fi
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * NUM_GPUS))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_ds}"
export PATH="$VENV_BIN:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# one node, no hostfile: the launcher's own log (its command lines, "no hostfile") says nothing
# to the user, so it reports errors only unless DS_LOG_LEVEL says otherwise
exec deepspeed --num_nodes 1 --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}" \
    --log_level "${DS_LOG_LEVEL:-error}" \
    "$ROOT/pretrain_gpt2.py" "${GPT2_ARGS[@]}" \
    --deepspeed --deepspeed_config "$DS_CONFIG" $PRECISION "$@"
