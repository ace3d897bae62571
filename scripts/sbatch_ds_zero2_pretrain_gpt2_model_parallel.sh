#!/usr/bin/env bash
#SBATCH --job-name=gpt2-ds
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --signal=USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# scripts/ds_zero2_pretrain_gpt2_model_parallel.sh as a Slurm batch job: GPT-2 with tensor
# (MP_SIZE) and pipeline (PP_SIZE) model parallelism + ZeRO-2 (ZeRO-1 with PP_SIZE > 1) + DeepSpeed
# activation checkpointing, one rank per task (--ntasks-per-node = GPUs per node), no hostfile
# and no ssh. The same variables as that script (MP_SIZE, PP_SIZE, DS_CONFIG, PRECISION, and
# scripts/lib/gpt2_args.sh's); extra flags are appended. Submit from the checkout:
#   MP_SIZE=4 PP_SIZE=2 sbatch --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 --partition gpu \
#       scripts/sbatch_ds_zero2_pretrain_gpt2_model_parallel.sh
# LAUNCHER=srun (default: the ranks from Slurm), torchrun (one per node) or deepspeed
# (`deepspeed --launcher slurm`, which calls srun itself); REQUEUE=0 as in sbatch_pretrain_gpt2.sh.
# On a CPU cluster: two ranks per node, MP_SIZE=2, fp32 (PRECISION empty).
set -euo pipefail
# sbatch runs a copy of this script from Slurm's spool folder: the checkout is where it was
# submitted from (SLURM_SUBMIT_DIR, or a folder above it), or ROOT when exported
ROOT="${ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}"
while [ "$ROOT" != / ] && [ "$ROOT" != . ] && [ ! -f "$ROOT/scripts/lib/slurm.sh" ]; do ROOT="$(dirname "$ROOT")"; done
[ -f "$ROOT/scripts/lib/slurm.sh" ] || { echo "error: no checkout in ${SLURM_SUBMIT_DIR:-$ROOT} or above: submit from the repository (cd <checkout> && sbatch scripts/$(basename "$0")) or export ROOT=<checkout>" >&2; exit 2; }
source "$ROOT/scripts/lib/gpt2_args.sh"
source "$ROOT/scripts/lib/slurm.sh"
MP_SIZE="${MP_SIZE:-2}"
PP_SIZE="${PP_SIZE:-1}"
if [ "$PP_SIZE" -gt 1 ]; then ZERO=zero1; else ZERO=zero2; fi
DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/${ZERO}.json}"
if has_cuda; then PRECISION="${PRECISION---fp16}"; else PRECISION="${PRECISION:-}"; fi
DP_SIZE=$((${SLURM_NTASKS:-1} / (MP_SIZE * PP_SIZE)))
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * (DP_SIZE > 0 ? DP_SIZE : 1)))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_ds_slurm}"
slurm_train "${GPT2_ARGS[@]}" --model-parallel-size "$MP_SIZE" \
    --pipeline-model-parallel-size "$PP_SIZE" --checkpoint-activations \
    --deepspeed-activation-checkpointing --deepspeed --deepspeed_config "$DS_CONFIG" $PRECISION "$@"
