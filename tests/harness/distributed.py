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
  text; the other ranks (possibly blocked in a collective) are killed. A rank that exits
  without reporting is named first, as the cause, even when its peers' errors (a closed
  connection) reached the parent before its exit did. Ranks still running at
  `timeout` seconds are killed and `TimeoutError` names them. A failure never hangs.
- Children are forked from a forkserver that has torch, torch._dynamo (which torch.optim
  imports when an optimizer is built) and the trainer (pretrain_gpt2, app) pre-imported, so
  only the first call of a session pays for importing them.
- `run_pretrain(world_size, argv)` trains `pretrain_gpt2.py argv` on that many ranks this way
  (as torchrun would, without its launcher and a fresh interpreter per rank; the ranks see the
  caller's environment, as a launched command would) and returns each rank's output: for tests
  whose point is the numbers, not the launcher.
- `run_pretrain_each(world_size, argvs)` runs several command lines one after the other on
  the same ranks (one spawn), each one's outcome apart (a refused run does not stop the next).
- `run_main(argv, cwd, environ)` runs `python pretrain_gpt2.py argv` the same way on one
  process with no process group (its exit code, stdout and stderr apart): a command line's
  outcome without the seconds of a fresh interpreter importing torch; `run_mains` several
  command lines one after the other in one such child.

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
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Callable, Dict, List, Mapping, Optional

_CTX: Optional[Any] = None

_POLL_LOCK = threading.Lock()
"""Held while a harness child is started or polled. A forkserver child's exit code comes back
as 8 bytes on a pipe that poll() reads, and Process.start() polls every other live child
(multiprocessing.process._cleanup): two threads polling one child at once (run_main's pool,
ForkedPython's server threads) can both find the pipe readable, one reads the code and the
other reads end-of-file, which CPython's popen_forkserver records as exit code 255."""


class DistributedTestError(RuntimeError):
    """A rank raised; the message holds its rank and traceback text."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # the trainer too (pretrain_gpt2 imports app's training path, not DeepSpeed): ~1.5 s of
        # imports per rank that every rank of every test would otherwise repeat. torch._dynamo
        # (~1.5 s more): torch.optim's Optimizer.add_param_group imports it on its first call
        # (torch._disable_dynamo), so every rank that builds an optimizer paid for it; it reads
        # no test's settings (no TORCH_COMPILE_* / TORCHDYNAMO_* variable is set by any test)
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy", "pretrain_gpt2",
                                     "torch._dynamo"])
    return _CTX


def start_child(proc: Any) -> None:
    """proc.start(), under _POLL_LOCK."""
    with _POLL_LOCK:
        proc.start()


def wait_child(proc: Any, timeout: Optional[float]) -> Optional[int]:
    """Wait up to `timeout` seconds (None: for ever) for `proc` to end; its exit code (negative:
    the signal that killed it), or None while it still runs. The wait reads nothing; the exit
    code is read under _POLL_LOCK."""
    wait_for_sentinels([proc.sentinel], timeout)
    with _POLL_LOCK:
        if proc.is_alive():
            return None
        proc.join(0)
        return proc.exitcode


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
                    timeout: float = 120.0, backend: str = "gloo",
                    daemon: bool = True) -> List[Any]:
    """fn(*args) on `world_size` gloo ranks; returns [rank 0's value, rank 1's value, ...].
    With daemon=False a rank may start processes of its own (data-loader workers); it is
    killed all the same when the call ends.

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
                               args, backend), daemon=daemon)
             for rank in range(world_size)]
    try:
        for p in procs:
            start_child(p)
        return _collect(procs, results, world_size, timeout)
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if wait_child(p, 0) is None:
                p.kill()
        for p in started:
            wait_child(p, 5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)


REPORT_GRACE_S = 5.0
"""After a rank reports an error, how long the parent still waits for every other rank to report
or exit before it names the cause: a rank that leaves without reporting makes its peers fail
(gloo's "Connection closed by peer"), and their reports can reach the parent before it sees
that rank's exit (the forkserver reports an exit some scheduling delay after it: over 2 s in
4 of 200 runs on a 2-core machine at load 25). Ranks that report or exit sooner end the wait."""


def _collect(procs: List[Any], results: Any, world_size: int, timeout: float) -> List[Any]:
    """Wait for every rank's report; raise on a failure (a reported error, or a rank that
    exited without reporting, which is named first: its peers' errors follow from it) or at
    the timeout."""
    deadline = time.monotonic() + timeout
    values: Dict[int, Any] = {}
    errors: Dict[int, str] = {}  # in the order they arrived
    while len(values) < world_size:
        received = _receive(results, values, errors, wait=0.2)
        silent = _exited_silently(procs, values, errors)
        if errors or silent:
            # a rank's report is in the pipe before it exits: take what was sent, and after an
            # error give the others the grace to report or exit, then judge
            grace = time.monotonic() + (REPORT_GRACE_S if errors and not silent else 0.0)
            while _receive(results, values, errors, wait=0.5) or (
                    time.monotonic() < grace and not _all_settled(procs, values, errors)):
                pass
            if errors or _exited_silently(procs, values, errors):
                raise DistributedTestError(_failure_text(procs, values, errors, world_size))
            continue  # the exited ranks' reports were in the pipe
        if not received and time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"run_distributed: ranks {missing} of {world_size} did not "
                               f"finish within {timeout:.0f} s (killed)")
    return [values[rank] for rank in range(world_size)]


def _exited_silently(procs: List[Any], values: Dict[int, Any], errors: Dict[int, str]
                     ) -> List[int]:
    """The ranks that have exited without a report received."""
    return [rank for rank, p in enumerate(procs)
            if rank not in values and rank not in errors and wait_child(p, 0) is not None]


def _all_settled(procs: List[Any], values: Dict[int, Any], errors: Dict[int, str]) -> bool:
    """Every rank has reported or exited."""
    return all(rank in values or rank in errors or wait_child(p, 0) is not None
               for rank, p in enumerate(procs))


def _failure_text(procs: List[Any], values: Dict[int, Any], errors: Dict[int, str],
                  world_size: int) -> str:
    """The ranks that exited without reporting first (the cause), then the reported errors in
    the order they arrived."""
    lines = [f"rank {rank} of {world_size} exited with code {procs[rank].exitcode} without "
             f"reporting" for rank in _exited_silently(procs, values, errors)]
    if lines and errors:
        lines.append("(the errors its peers reported after it left follow)")
    lines += [f"rank {rank} of {world_size} failed:\n{text}" for rank, text in errors.items()]
    return "\n".join(lines)


def _receive(results: Any, values: Dict[int, Any], errors: Dict[int, str], wait: float) -> bool:
    """Take one report off the queue into `values` or `errors`; False when none came within
    `wait` seconds."""
    try:
        rank, status, payload = results.get(timeout=wait)
    except queue_module.Empty:
        return False
    if status == "error":
        errors[rank] = payload
    else:
        values[rank] = pickle.loads(payload)
    return True


_SOFT_FAILURES: List[str] = []


def write_json_once(path: str, data: Any) -> str:
    """Rank side: rank 0 writes `data` as JSON to `path` (atomically); every rank returns `path`
    once the file is there (a barrier over the world)."""
    import json

    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
    dist.barrier()
    return path


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


def _pretrain_on_rank(argv: List[str], log_dir: str, environ: Dict[str, str],
                      setup: Optional[Callable[[int], None]] = None) -> str:
    """Rank side of run_pretrain: the caller's environment plus the variables a launcher gives
    this rank, its output (file descriptors 1 and 2) to a file of its own, setup(rank), then
    pretrain_gpt2.run(argv), which adopts the process group already started; returns the
    output, or raises with its end."""
    import sys

    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")
    from pretrain_gpt2 import run

    path = os.path.join(log_dir, f"rank{rank}.log")
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if setup is not None:
        setup(rank)
    try:
        run(list(argv))
    except BaseException as exc:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(path, errors="replace") as f:
            raise RuntimeError(f"rank {rank}'s output ended:\n{f.read()[-4000:]}") from exc
    sys.stdout.flush()
    sys.stderr.flush()
    with open(path, errors="replace") as f:
        return f.read()


def run_pretrain(world_size: int, argv: List[str], timeout: float = 300.0,
                 setup: Optional[Callable[[int], None]] = None) -> List[str]:
    """`pretrain_gpt2.py argv` on `world_size` gloo ranks as under torchrun, but in children
    forked from run_distributed's forkserver (no launcher, no fresh interpreter per rank): for
    tests whose point is what a layout trains to, not the launcher. The ranks run with this
    process's environment (os.environ now, not the forkserver's of the session's first call);
    `setup` (picklable), if given, is called with the rank's number before it trains.
    Returns each rank's output (stdout and stderr), in rank order; raises as run_distributed,
    with the failing rank's output."""
    log_dir = tempfile.mkdtemp(prefix="run_pretrain_")
    try:
        return run_distributed(_pretrain_on_rank, world_size, list(argv), log_dir,
                               dict(os.environ), setup, timeout=timeout, daemon=False)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _pretrain_each_on_rank(argvs: List[List[str]], log_dir: str, environ: Dict[str, str]
                           ) -> List["tuple[bool, str]"]:
    """Rank side of run_pretrain_each: each command line trained in turn in this rank's
    process (the process group adopted by each); (finished, its output) per command line, the
    output of one that raised starting with the exception."""
    outcomes = []
    for index, argv in enumerate(argvs):
        run_dir = os.path.join(log_dir, str(index))
        os.makedirs(run_dir, exist_ok=True)
        try:
            outcomes.append((True, _pretrain_on_rank(argv, run_dir, environ)))
        except RuntimeError as exc:
            cause = exc.__cause__
            outcomes.append((False, f"{type(cause).__name__}: {cause}\n{exc}"))
    return outcomes


def run_pretrain_each(world_size: int, argvs: List[List[str]], timeout: float = 300.0
                      ) -> List[List["tuple[bool, str]"]]:
    """Several `pretrain_gpt2.py argv` runs one after the other on the same `world_size` gloo
    ranks (one spawn, as run_pretrain's): per rank, per command line, (finished, output); a run
    that raised (on every rank alike, as a refused checkpoint does) does not stop the next.
    A run that fails on some ranks only leaves the others waiting: keep to runs that finish
    or fail everywhere."""
    log_dir = tempfile.mkdtemp(prefix="run_pretrain_each_")
    try:
        return run_distributed(_pretrain_each_on_rank, world_size, [list(a) for a in argvs],
                               log_dir, dict(os.environ), timeout=timeout, daemon=False)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _mains_in_child(argvs: List[List[str]], cwd: str, environ: Dict[str, str],
                    log_dir: str) -> None:
    """Child side of run_mains: each `argv` in turn as `python pretrain_gpt2.py argv` started in
    `cwd` with `environ`, its output in `log_dir`/<i>.out and <i>.err and its exit code (2 for a
    usage error, 1 and the traceback for an exception, as the interpreter would) in <i>.code;
    exits with the last one's code."""
    import sys

    os.chdir(cwd)
    if environ.get("OMP_NUM_THREADS", "").isdigit():  # torch read it when the forkserver began
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    from pretrain_gpt2 import main

    code = 0
    for i, argv in enumerate(argvs):
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = ["pretrain_gpt2.py", *argv]
        for fd, suffix in ((1, "out"), (2, "err")):
            with open(os.path.join(log_dir, f"{i}.{suffix}"), "w") as f:
                os.dup2(f.fileno(), fd)
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        with open(os.path.join(log_dir, f"{i}.code"), "w") as f:
            f.write(str(code))
    raise SystemExit(code)


def run_mains(argvs: List[List[str]], cwd: str, environ: Mapping[str, str],
              timeout: float = 300.0) -> "List[tuple[int, str, str]]":
    """[(exit code, stdout, stderr)] of `python pretrain_gpt2.py argv` for each of `argvs`, run
    one after the other in `cwd` with the environment `environ`, in ONE child forked from
    run_distributed's forkserver (torch and the trainer already imported; what the runs import
    beyond, e.g. DeepSpeed, is imported once for all). A run the child died in gets the child's
    exit code, the runs after it (-1, "", "not run"); a child still running at `timeout` seconds
    is killed and TimeoutError raised."""
    log_dir = tempfile.mkdtemp(prefix="run_main_")
    proc = _context().Process(target=_mains_in_child, name="pretrain_gpt2",
                              args=([list(a) for a in argvs], str(cwd), dict(environ), log_dir))
    try:
        start_child(proc)
        child = wait_child(proc, timeout)
        if child is None:
            proc.kill()
            wait_child(proc, 5)
            raise TimeoutError(f"run_main: pretrain_gpt2.py {' '.join(argvs[-1][:6])} ... still "
                               f"running after {timeout:.0f} s (killed)")
        results, died = [], False
        for i in range(len(argvs)):
            files = [os.path.join(log_dir, f"{i}.{suffix}") for suffix in ("code", "out", "err")]
            if died or not os.path.exists(files[1]):
                results.append((-1, "", "not run: the child died in an earlier run"))
                continue
            died = not os.path.exists(files[0])
            with open(files[1], errors="replace") as f_out:
                out = f_out.read()
            with open(files[2], errors="replace") as f_err:
                err = f_err.read()
            code = child
            if not died:
                with open(files[0]) as f:
                    code = int(f.read())
            results.append((code, out, err))
        return results
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def run_main(argv: List[str], cwd: str, environ: Mapping[str, str],
             timeout: float = 300.0) -> "tuple[int, str, str]":
    """(exit code, stdout, stderr) of `python pretrain_gpt2.py argv` run in `cwd` with the
    environment `environ`, in one child (`run_mains` of one command line)."""
    return run_mains([argv], cwd, environ, timeout)[0]


def assert_checks_passed(outcomes: List[Dict[str, Optional[str]]]) -> None:
    """Parent side: raise AssertionError listing every (rank, check) that run_checks reported
    as failed, given the ranks' outcomes in rank order."""
    failures = [f"rank {rank}: {name}:\n{text}" for rank, outcome in enumerate(outcomes)
                for name, text in outcome.items() if text]
    assert not failures, "\n".join(failures)
