"""`pretrain_gpt2.py` with the disk-full fault on one rank: the saves numbered in
$DISK_FULL_SAVES (comma-separated, 1 = the first save of the process) of the rank named by
$DISK_FULL_RANK fail as torch.save fails on a full disk (faults.disk_full, app/utils/faults.py);
the other ranks write theirs.

    DISK_FULL_RANK=1 DISK_FULL_SAVES=2 torchrun ... tests/harness/children/disk_full_once.py <flags>
"""
import os
import sys

import pretrain_gpt2
from app.utils import faults

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == os.environ["DISK_FULL_RANK"]:
        saves = {int(n) for n in os.environ["DISK_FULL_SAVES"].split(",")}
        faults.arm(faults.SAVE_STAGE, faults.disk_full(saves=saves))
    sys.exit(pretrain_gpt2.main())
