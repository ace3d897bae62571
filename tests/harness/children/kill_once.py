"""`pretrain_gpt2.py` with one fault: the rank named by $KILL_RANK SIGKILLs itself in the forward
pass of the iteration that starts at training sample $KILL_AT_SAMPLE, on torchrun's first
attempt only (TORCHELASTIC_RESTART_COUNT 0), so that a restarted attempt trains undisturbed
(through the fault-injection point faults.TRAINING_LOSS, app/utils/faults.py).

    KILL_RANK=0 KILL_AT_SAMPLE=20 torchrun ... tests/harness/children/kill_once.py <pretrain flags>

Optionally, with $WAIT_AT_SAMPLE and $WAIT_FOR_FILE (a path with `{rank}` in it), every rank
first waits, in the forward pass of the iteration starting at that sample, until its file
exists (a background save's file is durable, so the save commits at that iteration's end
whatever the machine's load: the kill then finds that checkpoint committed).
"""
import os
import signal
import sys
import time

import pretrain_gpt2
from app.utils import faults


def _wait_for_file(first_sample):
    """The optional wait of the module docstring (up to 60 s)."""
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and first_sample == int(os.environ.get("WAIT_AT_SAMPLE", "-1"))):
        path = os.environ["WAIT_FOR_FILE"].format(rank=os.environ.get("RANK", "0"))
        deadline = time.time() + 60
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the writer thread ends right after its last rename


def _kill_once(first_sample, loss):
    _wait_for_file(first_sample)
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and first_sample == int(os.environ["KILL_AT_SAMPLE"])
            and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]):
        if os.environ.get("KILL_FIRED"):  # a file the test checks: the kill, no other failure
            open(os.environ["KILL_FIRED"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return loss


def arm(environ: dict, rank: int) -> None:
    """tests.harness.distributed.run_pretrain's `setup` for the first attempt of a job that its
    test restarts itself (forked ranks, no torchrun): this rank takes the variables above from
    `environ` (and $KILL_FIRED, a file created just before the kill) and arms the kill."""
    del rank  # _kill_once reads RANK, which run_pretrain sets as a launcher does
    os.environ.update(environ)
    faults.arm(faults.TRAINING_LOSS, _kill_once)


if __name__ == "__main__":
    faults.arm(faults.TRAINING_LOSS, _kill_once)
    sys.exit(pretrain_gpt2.main())
