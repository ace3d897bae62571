# Shared by the sbatch scripts (sourced, not run), after scripts/lib/gpt2_args.sh: the launch of
# pretrain_gpt2.py on every node of the job, the job's end time on Slurm before 23.02, and the
# requeue of a run that stopped early with a checkpoint. docs/launch.md explains each step.
#
#   LAUNCHER=srun      (default) one task per rank: srun python pretrain_gpt2.py; the ranks
#                      come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
#   LAUNCHER=torchrun  one task per node running torchrun with the job's tasks per node
#   LAUNCHER=deepspeed `deepspeed --launcher slurm` (DeepSpeed's runner calls srun; --deepspeed
#                      scripts only)
#   REQUEUE=1          (default) requeue the job when the run exits 0 before --train-iters with
#                      a newer checkpoint (a USR1 before the time limit, --exit-duration-in-mins)

# last_flag_value FLAG DEFAULT ARGS...: the value of the last FLAG in ARGS (argparse's rule)
last_flag_value() {
    local flag="$1" value="$2" i
    shift 2
    local args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        case "${args[$i]}" in
            "$flag") value="${args[$((i + 1))]:-$value}" ;;
            "$flag="*) value="${args[$i]#*=}" ;;
        esac
    done
    echo "$value"
}

# saved_iteration SAVE_DIR: the iteration of the latest checkpoint there (0 when none)
saved_iteration() {
    local it
    it="$(cat "$1/latest_checkpointed_iteration.txt" 2> /dev/null || true)"
    case "$it" in ''|*[!0-9]*) echo 0 ;; *) echo "$it" ;; esac
}

# slurm_export_end_time: SLURM_JOB_END_TIME (seconds since the epoch) from squeue when Slurm
# (before 23.02) does not set it; pretrain_gpt2.py derives --exit-duration-in-mins from it
slurm_export_end_time() {
    local end
    [ -z "${SLURM_JOB_END_TIME:-}" ] && [ -n "${SLURM_JOB_ID:-}" ] || return 0
    end="$(squeue --noheader --jobs "$SLURM_JOB_ID" --format=%e 2> /dev/null || true)"
    case "$end" in ''|N/A|Unknown|NONE|None) return 0 ;; esac
    end="$(date -d "$end" +%s 2> /dev/null || true)"
    if [ -n "$end" ]; then export SLURM_JOB_END_TIME="$end"; fi
}

# slurm_launch ARGS...: pretrain_gpt2.py ARGS on the job's nodes with $LAUNCHER
slurm_launch() {
    local nodes procs host port
    case "${LAUNCHER:-srun}" in
        srun)
            srun --kill-on-bad-exit=1 "$PYTHON" -u "$ROOT/pretrain_gpt2.py" "$@" ;;
        torchrun)
            read -r nodes procs host port < <("$PYTHON" -m app.launch.slurm torchrun) || return 2
            # each task's node rank is its SLURM_NODEID (torchrun reads PET_NODE_RANK). Slurm's
            # --signal sends SIGUSR1 to every process of the step and torchrun does not handle
            # it (it would die): ignored there, the ranks install their own handler
            srun --kill-on-bad-exit=1 --ntasks="$nodes" --ntasks-per-node=1 \
                --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
                ${SLURM_GPUS_ON_NODE:+--gpus-per-node="$SLURM_GPUS_ON_NODE"} \
                bash -c 'trap "" USR1; PET_NODE_RANK="$SLURM_NODEID" exec "$@"' torchrun \
                "$PYTHON" -u -m torch.distributed.run --nnodes "$nodes" --nproc-per-node "$procs" \
                --master-addr "$host" --master-port "$port" "$ROOT/pretrain_gpt2.py" "$@" ;;
        deepspeed)
            local hostfile="${TMPDIR:-/tmp}/hostfile.${SLURM_JOB_ID:-0}"
            "$PYTHON" -m app.launch.slurm hostfile > "$hostfile" || return 2
            read -r nodes procs host port < <("$PYTHON" -m app.launch.slurm torchrun) || return 2
            PATH="$VENV_BIN:$PATH" deepspeed --launcher slurm --force_multi --no_ssh_check \
                --hostfile "$hostfile" --master_addr "$host" --master_port "$port" \
                "$ROOT/pretrain_gpt2.py" "$@" ;;
        *)
            echo "error: LAUNCHER=$LAUNCHER: use srun, torchrun or deepspeed" >&2; return 2 ;;
    esac
}

# slurm_train ARGS...: log the job, launch, and requeue a run that stopped early with progress
slurm_train() {
    local save iters before after status=0
    save="$(last_flag_value --save "" "$@")"
    iters="$(last_flag_value --train-iters 0 "$@")"
    before="$(saved_iteration "$save")"
    slurm_export_end_time
    echo "[sbatch] job ${SLURM_JOB_ID:-none} (restart ${SLURM_RESTART_COUNT:-0}) on" \
         "${SLURM_JOB_NODELIST:-this host}: LAUNCHER=${LAUNCHER:-srun}, checkout $ROOT," \
         "latest checkpoint $before of $iters iterations"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    slurm_launch "$@" || status=$?
    after="$(saved_iteration "$save")"
    if [ "$status" = 0 ] && [ "${REQUEUE:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ] \
            && [ -n "$save" ] && [ "$after" -lt "$iters" ]; then
        if [ "$after" -gt "$before" ]; then
            echo "[sbatch] stopped at iteration $after of $iters with a checkpoint: requeueing" \
                 "job $SLURM_JOB_ID (REQUEUE=0 turns this off)"
            scontrol requeue "$SLURM_JOB_ID"
        else
            echo "[sbatch] stopped at iteration $after of $iters without a newer checkpoint:" \
                 "not requeueing" >&2
        fi
    fi
    return "$status"
}
