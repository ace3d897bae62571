"""The intra-op threads of a process: chosen from the cores it may run on and the ranks on its
node, said at start-up, the user's OMP_NUM_THREADS winning.

torch starts with one intra-op thread per physical core of the machine, however many ranks
share the node and whatever CPUs the process may run on. torchrun sets OMP_NUM_THREADS=1 when
it starts several ranks (with a warning), the deepspeed launcher sets cores per rank with
--bind_cores_to_rank, and a plain `python pretrain_gpt2.py`, mpirun or an srun task set
nothing. Threads that outnumber the free cores are not just idle: a parallel op waits for its
slowest thread, and OpenMP's threads spin while they wait, so a process sharing its cores with
another job can run many times slower than with one thread (10-24x measured on a 2-core
machine, docs/launch.md).

`choose_threads`: OMP_NUM_THREADS when it is set (a positive whole number), else the physical
cores among the CPUs this process may run on (`os.sched_getaffinity`, cores told apart by
/sys/devices/system/cpu/cpuN/topology) divided by the ranks on this node (DeepSpeed's
--bind_cores_to_rank rule), at least one. `apply_threads` sets it (torch.set_num_threads).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count a process uses and where it came from."""

    threads: int
    reason: str
    user_set: bool
    """OMP_NUM_THREADS gave it (None of ours to choose)."""

    def describe(self) -> str:
        """The start-up line: "intra-op threads: N (why)"."""
        return f"intra-op threads: {self.threads} ({self.reason})"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def physical_cores(cpus: Iterable[int], read: Callable[[str], Optional[str]] = _read) -> int:
    """The physical cores among logical CPUs `cpus`: distinct (package, core) pairs of their
    sysfs topology; the CPU count where the topology cannot be read."""
    cpus = list(cpus)
    cores = set()
    for cpu in cpus:
        package = read(_TOPOLOGY.format(cpu, "physical_package_id"))
        core = read(_TOPOLOGY.format(cpu, "core_id"))
        if package is None or core is None:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def available_cpus() -> Iterable[int]:
    """The logical CPUs this process may run on (its affinity; all of them where the platform
    has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)


def choose_threads(environ: Mapping[str, str], ranks_on_node: Optional[int],
                   cores: Optional[int] = None) -> ThreadChoice:
    """The intra-op threads of one of `ranks_on_node` ranks (None: one) given the environment
    and its physical `cores` (None: counted here); the module docstring has the rule."""
    given = environ.get("OMP_NUM_THREADS")
    if given is not None:
        if given.strip().isdigit() and int(given) > 0:
            return ThreadChoice(int(given), f"OMP_NUM_THREADS={given.strip()}", True)
        return ThreadChoice(torch.get_num_threads(), f"OMP_NUM_THREADS={given!r} is not a "
                            "positive whole number, so torch's own reading of it applies", True)
    ranks = max(1, ranks_on_node or 1)
    cores = cores if cores is not None else physical_cores(available_cpus())
    threads = max(1, cores // ranks)
    rank_text = "1 rank" if ranks == 1 else f"{ranks} ranks"
    return ThreadChoice(threads, f"{cores} physical core(s) this process may run on / "
                        f"{rank_text} on this node; OMP_NUM_THREADS is not set: set it to "
                        "choose, e.g. OMP_NUM_THREADS=1 when other jobs share these cores",
                        False)


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    """torch.set_num_threads(choice.threads) unless it is already so; returns `choice`."""
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice
