"""Start-up waits that say what they wait for, since when, and how to clear them.

A start-up step that can block on something outside this process (the rendezvous with the other
ranks, a torch extension build lock) runs inside `WaitReport`: if the step has not finished
after `report_after_s()` seconds (30 by default; the environment variable
`APP_STARTUP_WAIT_REPORT_S` sets it), a thread logs one warning naming what is awaited, since
when, what is known about it and the fix, and repeats it at doubling intervals (up to every
5 minutes) until the step ends.

Torch extension builds (DeepSpeed's ops are built through `torch.utils.cpp_extension`) take a
`lock` file in the op's build directory for the duration of the build and every other process
building the same op waits, without a message or a time limit, until the file is gone. A build
that was killed leaves the file behind and every later start waits forever. The file holds no
pid, so a lock is judged from this host's processes: the builder keeps the lock file open and
its compilers run in the build directory (`BuildLock.holders`); a lock that no process on this
host holds is stale, unless a build on another host shares the directory, which cannot be seen
from here (the message says so).
"""
from __future__ import annotations

import glob
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional

import psutil

from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)

REPORT_ENV = "APP_STARTUP_WAIT_REPORT_S"
DEFAULT_REPORT_AFTER_S = 30.0
MAX_REPORT_INTERVAL_S = 300.0


def report_after_s(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds a start-up step may take before it is reported: $APP_STARTUP_WAIT_REPORT_S, else
    30. A value that is not a positive number is refused naming the variable."""
    text = environ.get(REPORT_ENV, "")
    if not text:
        return DEFAULT_REPORT_AFTER_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{REPORT_ENV}={text!r} is not a positive number of seconds; unset it "
                         f"(default {DEFAULT_REPORT_AFTER_S:.0f}) or set e.g. {REPORT_ENV}=30")
    return value


def _clock_time(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class WaitReport:
    """While the `with` block runs longer than `after_s`, log what it waits for, repeatedly.

    Each report is one warning on every rank: "start-up has waited 30 s (since 08:31:02) for
    <what>: <details()>". `details` is called at report time (in the reporting thread) for
    what is known then and the fix; an exception in it is reported instead of raised. `log`
    receives each message (tests pass a list's append).
    """

    def __init__(self, what: str, details: Callable[[], str] = lambda: "", *,
                 after_s: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.what, self.details = what, details
        self.after_s = report_after_s() if after_s is None else after_s
        self.log = log or (lambda message: logger.warning(message, extra=ALL_RANKS))
        self.since = 0.0
        self.reports = 0
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def message(self) -> str:
        """The report as of now."""
        try:
            details = self.details()
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the wait
            details = f"(could not inspect it: {type(exc).__name__}: {exc})"
        return (f"start-up has waited {_duration(time.time() - self.since)} (since "
                f"{_clock_time(self.since)}) for {self.what}" + (f": {details}" if details else ""))

    def _watch(self) -> None:
        interval = self.after_s
        while not self._done.wait(interval):
            self.log(self.message())
            self.reports += 1
            interval = min(interval * 2, max(MAX_REPORT_INTERVAL_S, self.after_s))

    def __enter__(self) -> "WaitReport":
        self.since = time.time()
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="startup-wait-report",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


# ---------------------------------------------------------------------------- build locks

def extension_build_root(environ: Mapping[str, str] = os.environ) -> str:
    """The directory torch.utils.cpp_extension builds extensions under (one folder per op):
    $TORCH_EXTENSIONS_DIR as given, else torch's per-user cache folder with the
    `py<version>_<accelerator>` subfolder torch adds (the same rule as torch's own)."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


@dataclass
class BuildLock:
    """A torch extension build lock (`<root>/<op>/lock`) and this host's processes holding it."""

    path: str
    age_s: float
    holders: List[str] = field(default_factory=list)
    """"pid N (name)" of each process on this host with the lock open or working in its
    directory (the builder, ninja, the compilers); "this process" for our own."""
    uninspected: int = 0
    """Processes whose open files and directory could not be read (other users')."""

    @property
    def stale(self) -> bool:
        """No process on this host holds it (a build on another host sharing the directory
        cannot be seen from here)."""
        return not self.holders

    def describe(self) -> str:
        """One sentence: the path, its age, who holds it and what to do."""
        head = f"the torch extension build lock {self.path} (created {_duration(self.age_s)} ago)"
        if self.holders:
            return (f"{head} is held by {', '.join(self.holders)}: a build of this op is running; "
                    "it ends when that build does (if that process hangs, stop it and remove "
                    f"the lock: rm {self.path})")
        unseen = (f" ({self.uninspected} could not be inspected)" if self.uninspected else "")
        return (f"{head} is held by no process on this host{unseen}: it was left by a build "
                "that was killed, and every start that needs this op waits for it forever. "
                "If no build of this op runs on another host sharing this directory, remove "
                f"it: rm {self.path}")


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + os.sep)


def _lock_holders(lock_path: str) -> tuple:
    """(["pid N (name)", ...], processes not inspected) for the processes of this host that
    have `lock_path` open or their working directory in its directory."""
    lock_path = os.path.realpath(lock_path)
    directory = os.path.dirname(lock_path)
    holders, uninspected = [], 0
    for proc in psutil.process_iter(["name"]):
        try:
            holds = _inside(os.path.realpath(proc.cwd()), directory) or any(
                os.path.realpath(f.path) == lock_path for f in proc.open_files())
        except psutil.AccessDenied:
            uninspected += 1
            continue
        except (psutil.Error, OSError):
            continue  # gone meanwhile
        if holds:
            me = proc.pid == os.getpid()
            holders.append("this process" if me else f"pid {proc.pid} ({proc.info['name']})")
    return holders, uninspected


def build_locks(root: str) -> List[BuildLock]:
    """The build locks under `root` now (`<root>/<op>/lock`), each with its holders."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", "lock"))):
        try:
            age = time.time() - os.path.getmtime(path)
        except OSError:
            continue  # released meanwhile
        holders, uninspected = _lock_holders(path)
        if os.path.exists(path):
            found.append(BuildLock(path, age, holders, uninspected))
    return found


def describe_build_locks(root: str) -> str:
    """What a wait on torch extension builds under `root` may be waiting for, as one text."""
    locks = build_locks(root)
    if not locks:
        return f"no torch extension build lock is held under {root}"
    return "; ".join(lock.describe() for lock in locks)


def warn_stale_build_locks(root: str) -> List[BuildLock]:
    """Log a warning for each stale build lock under `root` (before anything waits for one);
    return them."""
    stale = [lock for lock in build_locks(root) if lock.stale]
    for lock in stale:
        logger.warning("stale build lock: %s", lock.describe(), extra=ALL_RANKS)
    return stale


__all__ = ["BuildLock", "DEFAULT_REPORT_AFTER_S", "REPORT_ENV", "WaitReport", "build_locks",
           "describe_build_locks", "extension_build_root", "report_after_s",
           "warn_stale_build_locks"]
