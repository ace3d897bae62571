#!/usr/bin/env bash
#SBATCH --job-name=gpt2
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --signal=USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# Native GPT-2 pretraining as a Slurm batch job: one rank per task (--ntasks-per-node = GPUs per
# node), the ranks from Slurm. Model, data and checkpoint settings as in the other launch scripts
# (scripts/lib/gpt2_args.sh, from the environment); extra flags are appended. Submit from the
# checkout; sbatch's own options or its SBATCH_* variables choose nodes, GPUs and partition:
#   sbatch --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 --partition gpu --time 4:00:00 \
#       scripts/sbatch_pretrain_gpt2.sh --tensor-model-parallel-size 2
#   SBATCH_PARTITION=gpu SBATCH_GPUS_PER_NODE=8 sbatch --ntasks-per-node 8 scripts/sbatch_pretrain_gpt2.sh
# LAUNCHER=torchrun runs one torchrun per node instead (same sbatch options); REQUEUE=0 keeps a
# run that stopped at the time limit from requeueing itself. On a CPU cluster the ranks use gloo.
# Before the time limit (--signal=USR1@180) every rank saves after the same iteration and exits 0;
# the job then requeues itself and resumes from that checkpoint (docs/launch.md).
set -euo pipefail
# sbatch runs a copy of this script from Slurm's spool folder: the checkout is where it was
# submitted from (SLURM_SUBMIT_DIR, or a folder above it), or ROOT when exported
ROOT="${ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}"
while [ "$ROOT" != / ] && [ "$ROOT" != . ] && [ ! -f "$ROOT/scripts/lib/slurm.sh" ]; do ROOT="$(dirname "$ROOT")"; done
[ -f "$ROOT/scripts/lib/slurm.sh" ] || { echo "error: no checkout in ${SLURM_SUBMIT_DIR:-$ROOT} or above: submit from the repository (cd <checkout> && sbatch scripts/$(basename "$0")) or export ROOT=<checkout>" >&2; exit 2; }
source "$ROOT/scripts/lib/gpt2_args.sh"
source "$ROOT/scripts/lib/slurm.sh"
WORLD="${SLURM_NTASKS:-1}"
gpt2_args "${GLOBAL_BATCH:-$((MICRO_BATCH * WORLD))}" "${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_slurm}"
slurm_train "${GPT2_ARGS[@]}" "$@"
