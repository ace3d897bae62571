"""`pretrain_gpt2.py` with one SIGKILL per torchrun attempt, as $CHAOS_PLAN schedules.

$CHAOS_PLAN is a JSON list with one entry per attempt (TORCHELASTIC_RESTART_COUNT 0, 1, ...):
[rank, kind, n]. The process of that rank SIGKILLs itself

- kind "iteration": in the forward pass of the n-th iteration this attempt trains (n >= 1);
- kind "write": at the first checkpoint file it writes in the n-th save of this attempt, once
  the file's temporary copy is complete (with --async-save, from the thread writing it in the
  background; a save starts only once the one before it is committed).

Attempts past the plan's end run undisturbed. The kills strike at the fault-injection points
faults.TRAINING_LOSS and faults.SAVE_STAGE (app/utils/faults.py). `arm_attempt` arms the same
kills in ranks forked by tests.harness.distributed.run_pretrain (its `setup`), attempt by
attempt, where a test restarts the job itself instead of torchrun.

    CHAOS_PLAN='[[1, "iteration", 5], [0, "write", 2]]' torchrun --max-restarts 2 ... \
        tests/harness/children/chaos_child.py <pretrain flags>
"""
import json
import os
import signal
import sys

import pretrain_gpt2
from app.utils import faults


def _install(rank: int, kind: str, n: int, fired: str = "") -> None:
    """Arm this process's kill: the n-th iteration, or the n-th save, of this attempt; the file
    `fired`, if named, is created just before it."""
    iterations, saves = set(), []

    def kill():
        if fired:
            open(fired, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_in_iteration(first_sample, loss):
        iterations.add(first_sample)  # every micro-batch of an iteration has the same one
        if len(iterations) == n:
            kill()
        return loss

    def kill_in_write(stage):
        if stage == "start":
            saves.append(stage)
        elif stage == "rank_tmp_written" and len(saves) == n:
            kill()

    if int(os.environ.get("RANK", "0")) != rank:
        return
    if kind == "iteration":
        faults.arm(faults.TRAINING_LOSS, kill_in_iteration)
    elif kind == "write":
        faults.arm(faults.SAVE_STAGE, kill_in_write)
    else:
        raise ValueError(f"CHAOS_PLAN: unknown kind {kind!r} (iteration or write)")


def arm_attempt(plan: list, attempt: int, fired: str, rank: int) -> None:
    """run_pretrain's `setup` for the attempt numbered `attempt` (0 first) of a job restarted by
    its test: this rank arms plan[attempt] as under torchrun; `fired` is created just before
    the kill, so the test tells the planned kill from any other failure."""
    del rank  # _install reads RANK, which run_pretrain sets as a launcher does
    if attempt < len(plan):
        _install(*plan[attempt], fired=fired)


if __name__ == "__main__":
    plan = json.loads(os.environ.get("CHAOS_PLAN", "[]"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(plan):
        _install(*plan[attempt])
    sys.exit(pretrain_gpt2.main())
