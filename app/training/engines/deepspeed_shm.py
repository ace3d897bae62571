"""DeepSpeed's CPU all-reduce buffer in /dev/shm, removed once mapped: DeepSpeed leaves a 69 MB
RAM-backed file per rank behind after every run on a CPU machine (its shm_comm op creates it at
init and never unlinks it); the DeepSpeed engine (engines.deepspeed) calls `unlink_shm_buffer`
after `deepspeed.init_distributed`. Needs no deepspeed import."""
from __future__ import annotations

import os

SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer"
"""Prefix of the RAM-backed file of DeepSpeed's CPU all-reduce, one per rank
(csrc/cpu/comm/shm.cpp: <prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, 69 MB)."""


def unlink_shm_buffer(in_use: bool) -> None:
    """Call after `deepspeed.init_distributed` on every rank, with `in_use` True where DeepSpeed's
    communication backend loaded its shm_comm op (the same on every rank: a CPU run): remove this
    rank's name of the op's shared-memory all-reduce buffer, which DeepSpeed creates at init when
    every rank is on one machine (LOCAL_SIZE equals the world size) and never unlinks (69 MB of
    RAM per rank per run stayed in /dev/shm after the run, killed or not). Every rank maps every
    peer's buffer inside init (it waits for each name to appear), so after a barrier no rank
    opens a name again; the mappings stay valid until the processes end, whatever ends them,
    and the memory then goes back."""
    import torch.distributed as dist

    if not in_use:
        return
    dist.barrier()
    name = (f"{SHM_BUFFER}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    try:
        os.unlink(name)
    except FileNotFoundError:  # ranks on several hosts (DeepSpeed made no buffer), or removed
        pass
