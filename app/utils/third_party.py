"""Third-party start-up noise that says nothing to our users, silenced where it comes from, once.

- DeepSpeed warns at every import on a machine without a GPU that it "set the accelerator to
  CPU". Naming the CPU accelerator ourselves (DS_ACCELERATOR=cpu, unless the user chose one)
  before importing it gives the same accelerator without the warning; our launch scripts do
  the same for the `deepspeed` launcher process (scripts/lib/gpt2_args.sh).
- DeepSpeed's ZeRO calls `torch.distributed.all_gather_into_tensor`, which torch 2.13 marks
  deprecated with a FutureWarning on every rank; the call is DeepSpeed's, not the user's, so
  the engine that imports DeepSpeed silences exactly that message.
- DeepSpeed's CPU all-reduce leaves a 69 MB buffer per rank in /dev/shm (RAM) after every run;
  each rank unlinks its own name once every rank has mapped it.
"""
from __future__ import annotations

import os
import warnings

DEEPSPEED_DEPRECATIONS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                          r"`torch\.distributed\.reduce_scatter_tensor` is deprecated")
"""Messages of torch FutureWarnings raised by DeepSpeed's own calls."""


def prepare_deepspeed_import() -> None:
    """Call before `import deepspeed`: DS_ACCELERATOR=cpu when CUDA is not available and the
    user has not set DS_ACCELERATOR (the accelerator DeepSpeed would pick, without its warning)."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def silence_deepspeed_deprecations() -> None:
    """Ignore the torch FutureWarnings that DeepSpeed's calls raise (DEEPSPEED_DEPRECATIONS)."""
    for message in DEEPSPEED_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer"
"""Prefix of the RAM-backed file of DeepSpeed's CPU all-reduce, one per rank
(csrc/cpu/comm/shm.cpp: <prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, 69 MB)."""


def unlink_shm_buffer() -> None:
    """Call after `deepspeed.init_distributed` on every rank: remove this rank's name of
    DeepSpeed's shared-memory all-reduce buffer, which DeepSpeed creates at init (its shm_comm op,
    where every rank is on this machine: LOCAL_SIZE equals the world size) and never unlinks: 69 MB
    of RAM per rank per run stayed in /dev/shm after the run, killed or not. Every rank maps every
    peer's buffer inside init (it waits for each name to appear), so after a barrier no rank
    opens a name again; the mappings stay valid until the processes end, whatever ends them, and
    the memory then goes back."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm

    if getattr(ds_comm.cdb, "shm_comm_op", None) is None:  # the same on every rank
        return
    dist.barrier()
    name = (f"{SHM_BUFFER}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    try:
        os.unlink(name)
    except FileNotFoundError:  # not on one machine (no buffer), or already removed
        pass
