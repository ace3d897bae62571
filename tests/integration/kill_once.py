"""`pretrain_gpt2.py` with one fault: the rank named by $KILL_RANK SIGKILLs itself in the forward
pass of the iteration that starts at training sample $KILL_AT_SAMPLE, on torchrun's first
attempt only (TORCHELASTIC_RESTART_COUNT 0), so that a restarted attempt trains undisturbed
(through the fault-injection point faults.TRAINING_LOSS, app/utils/faults.py).

    KILL_RANK=0 KILL_AT_SAMPLE=20 torchrun ... tests/integration/kill_once.py <pretrain flags>
"""
import os
import signal
import sys

import pretrain_gpt2
from app.utils import faults


def _kill_once(first_sample, loss):
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and first_sample == int(os.environ["KILL_AT_SAMPLE"])
            and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return loss


if __name__ == "__main__":
    faults.arm(faults.TRAINING_LOSS, _kill_once)
    sys.exit(pretrain_gpt2.main())
