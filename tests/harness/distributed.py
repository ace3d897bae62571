"""run_distributed(): run a function on N gloo ranks in child processes and collect the results.

    results = run_distributed(check_layers, 2, hidden_size, timeout=60)

- `fn` must be a picklable top-level function (defined at module level of an importable
  module, e.g. a test file). Each rank calls `fn(*args)` after
  `torch.distributed.init_process_group("gloo")`; it reads its rank with
  `torch.distributed.get_rank()`. Return values must be picklable; they come back as a list
  indexed by rank. A rank pickles its value itself, with the standard pickle, and sends bytes:
  torch's multiprocessing pickler would send a tensor as a file descriptor that the parent
  fetches from the rank's process, which fails (EOFError, FileNotFoundError) once the rank has
  exited, as it may before a busy parent reads.
- Rendezvous is a FileStore in a fresh temporary directory; each rank runs torch with one
  thread (the machine has few cores and several ranks share them).
- A rank that raises makes the parent raise `DistributedTestError` with that rank's traceback
  text; the other ranks (possibly blocked in a collective) are killed. Ranks still running at
  `timeout` seconds are killed and `TimeoutError` names them. A failure never hangs.
- Children are forked from a forkserver that has torch pre-imported, so only the first call
  of a session pays for importing torch.

To check many things in one spawn, a rank function can call `run_checks({name: check}, *args)`
and return its {name: None or traceback text}; inside checks, `expect_close` records a
mismatch without raising, so every rank keeps issuing the same collectives and a wrong number
shows up as a failed check rather than as ranks out of step (which would hang until timeout).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional

_CTX: Optional[Any] = None


class DistributedTestError(RuntimeError):
    """A rank raised; the message holds its rank and traceback text."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy"])
    return _CTX


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_file: str,
               results: Any, args: tuple, backend: str) -> None:
    """Child entry: init the process group, run fn, report ("ok", pickled value) or ("error",
    text); a value that cannot be pickled is reported as an error."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        value = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already reported
        pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 120.0, backend: str = "gloo") -> List[Any]:
    """fn(*args) on `world_size` gloo ranks; returns [rank 0's value, rank 1's value, ...].

    Raises DistributedTestError with the first failing rank's traceback, or TimeoutError when
    ranks are still running after `timeout` seconds; surviving ranks are killed either way.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="run_distributed_")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"rank{rank}",
                         args=(fn, rank, world_size, os.path.join(tmp, "rendezvous"), results,
                               args, backend), daemon=True)
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: List[Any], results: Any, world_size: int, timeout: float) -> List[Any]:
    """Wait for every rank's report; raise on the first error, a rank that exited without
    reporting, or the timeout."""
    deadline = time.monotonic() + timeout
    values: Dict[int, Any] = {}
    while len(values) < world_size:
        if _receive(results, values, world_size, wait=0.2):
            continue
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"run_distributed: ranks {missing} of {world_size} did not "
                               f"finish within {timeout:.0f} s (killed)")
        exited = [rank for rank, p in enumerate(procs) if rank not in values and not p.is_alive()]
        if exited:
            # a rank's report is in the pipe before it exits: take what was sent, then judge
            while len(values) < world_size and _receive(results, values, world_size, wait=0.5):
                pass
            for rank in exited:
                if rank not in values:
                    raise DistributedTestError(f"rank {rank} of {world_size} exited with code "
                                               f"{procs[rank].exitcode} without reporting")
    return [values[rank] for rank in range(world_size)]


def _receive(results: Any, values: Dict[int, Any], world_size: int, wait: float) -> bool:
    """Take one report off the queue into `values`, raising a rank's reported error; False when
    none came within `wait` seconds."""
    try:
        rank, status, payload = results.get(timeout=wait)
    except queue_module.Empty:
        return False
    if status == "error":
        raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{payload}")
    values[rank] = pickle.loads(payload)
    return True


_SOFT_FAILURES: List[str] = []


def expect_close(actual: Any, expected: Any, what: str, atol: float = 1e-5,
                 rtol: float = 1e-5) -> None:
    """torch.testing.assert_close that records the mismatch (for run_checks) instead of raising."""
    import torch

    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    except AssertionError as err:
        _SOFT_FAILURES.append(f"{what}: {err}")


def run_checks(checks: Mapping[str, Callable[..., None]], *args: Any) -> Dict[str, Optional[str]]:
    """Rank side: run each check(*args) in order; {name: None, or the failure text}.

    After each check the ranks agree (all-reduce over the world) on whether any failed; after a
    failure the remaining checks are reported as not run, since the ranks may be out of step.
    """
    import torch
    import torch.distributed as dist

    outcome: Dict[str, Optional[str]] = {}
    stopped: Optional[str] = None
    for name, check in checks.items():
        if stopped is not None:
            outcome[name] = f"not run: an earlier check ({stopped}) failed on some rank"
            continue
        _SOFT_FAILURES.clear()
        try:
            check(*args)
            outcome[name] = "\n".join(_SOFT_FAILURES) or None
        except Exception:  # noqa: BLE001 - reported per check by the parent
            outcome[name] = "\n".join(_SOFT_FAILURES + [traceback.format_exc()])
        failed = torch.tensor([0.0 if outcome[name] is None else 1.0])
        if dist.is_initialized():
            dist.all_reduce(failed)
        if failed.item() > 0:
            stopped = name
    return outcome


def assert_checks_passed(outcomes: List[Dict[str, Optional[str]]]) -> None:
    """Parent side: raise AssertionError listing every (rank, check) that run_checks reported
    as failed, given the ranks' outcomes in rank order."""
    failures = [f"rank {rank}: {name}:\n{text}" for rank, outcome in enumerate(outcomes)
                for name, text in outcome.items() if text]
    assert not failures, "\n".join(failures)
