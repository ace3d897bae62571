"""The `--save` directory: one writer at a time, writable before training, no stale temporaries.

Two runs saving into one directory interleave their checkpoints (one run's tracker names the
other's files, rotation deletes the other's iterations). A run therefore holds a lock file,
`{save}/writer.lock`, for as long as it trains: a JSON record of the holder (host, pid, the
process's start time, the command, a heartbeat time refreshed every `heartbeat_s`). A second
run fails at start with an error naming the holder.

A lock is stale, and taken over with a warning, when its holder cannot be running any more:

- the holder is on this host and its pid is gone, or now belongs to a process started at
  another time (the pid was reused);
- the holder is on another host and its heartbeat has not advanced for `stale_after_s`: when
  the recorded heartbeat is older than that the lock is taken at once; otherwise the new run
  watches the heartbeat for up to `stale_after_s` (a job requeued onto another node right
  after its predecessor died waits this long instead of failing).

Hosts are compared by name and heartbeats by wall clock, so hosts sharing a directory need
roughly synchronised clocks (minutes of skew are tolerated with the defaults).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import psutil

from app.utils.fileio import atomic_write_bytes, pid_alive, remove_temporaries

logger = logging.getLogger(__name__)

LOCK_FILENAME = "writer.lock"


class SaveDirError(ValueError):
    """The --save directory cannot be used; the message names it, the reason and the fix."""


class SaveDirLocked(SaveDirError):
    """Another live run holds the --save directory's writer lock."""


@dataclass
class LockRecord:
    """Who holds a writer lock, as stored in the lock file."""

    host: str
    pid: int
    process_start: float
    """The holder's process start time (psutil), to tell a reused pid from the holder."""
    heartbeat: float
    """Wall-clock time of the holder's last refresh."""
    command: str = ""

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return (f"host {self.host}, pid {self.pid} (last heartbeat {age:.0f} s ago; command: "
                f"{self.command[:160]})")


def _process_start(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return 0.0


def _this_process() -> LockRecord:
    pid = os.getpid()
    return LockRecord(host=socket.gethostname(), pid=pid, process_start=_process_start(pid),
                      heartbeat=time.time(), command=" ".join(sys.argv))


def _read(path: str) -> Optional[LockRecord]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
        return LockRecord(**{k: data[k] for k in ("host", "pid", "process_start", "heartbeat")},
                          command=str(data.get("command", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class SaveDirLock:
    """The writer lock of one --save directory (see the module docstring for the rules)."""

    def __init__(self, directory: str, *, heartbeat_s: float = 20.0,
                 stale_after_s: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILENAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._sleep = sleep
        self._record: Optional[LockRecord] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ taking the lock

    def acquire(self) -> None:
        """Create the lock file for this process, taking over a stale one; SaveDirLocked when a
        live run holds it."""
        for _ in range(5):
            record = _this_process()
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._judge_holder()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(asdict(record), f)
                f.flush()
                os.fsync(f.fileno())
            self._record = record
            self._start_heartbeat()
            return
        raise SaveDirLocked(f"could not take the writer lock {self.path}: other runs keep "
                            "taking it; make sure only one run uses this --save directory")

    def _judge_holder(self) -> None:
        """Return when the existing lock was stale and has been removed (or vanished), so the
        caller tries again; raise SaveDirLocked when a live run holds it."""
        holder = _read(self.path)
        if holder is None:  # being written this instant, garbled, or just removed
            age = time.time() - _mtime(self.path)
            if age < 2.0:
                self._sleep(0.2)
            elif age > self.stale_after_s:
                self._break(None, f"its lock file is unreadable and {age:.0f} s old")
            else:
                raise SaveDirLocked(
                    f"--save {self.directory} has an unreadable writer lock {self.path} "
                    f"written {age:.0f} s ago; if no other run uses this directory, delete "
                    "the file and start again")
            return
        reason = self._stale_reason(holder)
        if reason is None:
            current = _read(self.path) or holder
            raise SaveDirLocked(
                f"--save {self.directory} is in use by another run: {current.describe()}. Two "
                "runs writing one directory would interleave and delete each other's "
                "checkpoints: wait for that run to finish or stop it, or choose another "
                f"--save. If that run is gone for good, delete {self.path}.")
        self._break(holder, reason)

    def _stale_reason(self, holder: LockRecord) -> Optional[str]:
        """Why `holder` cannot be running any more, or None when it may be."""
        if holder.host == socket.gethostname():
            if not pid_alive(holder.pid):
                return f"its process {holder.pid} on this host is gone"
            start = _process_start(holder.pid)
            if holder.process_start and start and abs(start - holder.process_start) > 1.0:
                return f"pid {holder.pid} now belongs to another process"
            return None
        age = time.time() - holder.heartbeat
        if age > self.stale_after_s:
            return f"no heartbeat from host {holder.host} for {age:.0f} s"
        logger.info("the writer lock %s is held by %s; watching its heartbeat for up to %.0f s",
                    self.path, holder.describe(), self.stale_after_s)
        deadline = time.time() + self.stale_after_s
        while time.time() < deadline:
            self._sleep(min(self.heartbeat_s, 5.0))
            now = _read(self.path)
            if now is None:
                return "it was released"
            if now != holder:
                return None  # the heartbeat advanced (or another run took it): alive
        return f"the heartbeat of host {holder.host} did not advance for {self.stale_after_s:.0f} s"

    def _break(self, holder: Optional[LockRecord], reason: str) -> None:
        """Remove a stale lock (renamed first, so two runs breaking it at once do not both
        remove a fresh one)."""
        aside = f"{self.path}.stale.{socket.gethostname()}.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read(aside)
        if holder is not None and moved is not None and moved != holder:
            with contextlib.suppress(OSError):  # a new holder slipped in: give it back
                os.link(aside, self.path)
            with contextlib.suppress(OSError):
                os.remove(aside)
            return
        with contextlib.suppress(OSError):
            os.remove(aside)
        who = holder.describe() if holder else "an unknown run"
        logger.warning("took over the stale writer lock of --save %s (held by %s): %s",
                       self.directory, who, reason)

    # ------------------------------------------------------------------ holding it

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="save-dir-lock-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            record = self._record
            if record is None:
                return
            current = _read(self.path)
            if current is None or (current.host, current.pid) != (record.host, record.pid):
                logger.warning("the writer lock %s no longer names this run (%s); another run "
                               "may be writing into --save %s", self.path,
                               current.describe() if current else "missing", self.directory)
                return
            record.heartbeat = time.time()
            with contextlib.suppress(OSError):
                atomic_write_bytes(self.path, json.dumps(asdict(record)).encode("utf-8"))

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it still names this process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        record, self._record = self._record, None
        if record is None:
            return
        current = _read(self.path)
        if current is not None and (current.host, current.pid) == (record.host, record.pid):
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def __enter__(self) -> "SaveDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_by_live_run(directory: str, stale_after_s: float = 120.0) -> Optional[str]:
    """Why a run starting now could not take the writer lock of `directory` (the live holder,
    or an unreadable lock file younger than `stale_after_s`), or None when the lock is free or
    stale and would be taken over. Only reads: the lock is never taken, broken or waited for.
    A holder on this host is judged as `acquire` judges it; one on another host counts as live
    while its heartbeat is younger than `stale_after_s` (a starting run would watch it for up
    to that long, and take the lock over if it stopped)."""
    lock = SaveDirLock(directory, stale_after_s=stale_after_s)
    if not os.path.isfile(lock.path):
        return None
    holder = _read(lock.path)
    if holder is None:
        age = time.time() - _mtime(lock.path)
        return None if age > stale_after_s else (
            f"--save {directory} has an unreadable writer lock {lock.path} written {age:.0f} s "
            "ago; if no other run uses this directory, delete the file")
    if holder.host == socket.gethostname():
        live = lock._stale_reason(holder) is None
    else:
        live = time.time() - holder.heartbeat <= stale_after_s
    return (f"--save {directory} is in use by another run ({holder.describe()}); wait for it to "
            f"finish, stop it, or choose another --save (if it is gone for good, delete "
            f"{lock.path})") if live else None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()


# ---------------------------------------------------------------------------- the directory

def save_dir_problem(directory: str, flag: str = "--save") -> Optional[str]:
    """Why `directory` cannot be created or written, judged without writing anything: an
    existing file, a path under a file, no permission on it or on its nearest existing parent;
    None when nothing stands in the way. The message names the flag, the path and the fix."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{flag} {directory} is an existing file, not a directory; choose a directory path"
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return (f"{flag} {directory} cannot be created: {existing} is a file, not a directory; "
                "choose a path you can write")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == os.path.abspath(directory) else \
            f"cannot be created: {existing} is not writable"
        return (f"{flag} {directory} {what}; choose a directory you can write (and with room "
                "for checkpoints)")
    return None


def ensure_writable_dir(directory: str, flag: str = "--save") -> None:
    """Create `directory` if needed and prove a file can be written in it; SaveDirError naming
    the flag, the path and the reason otherwise: what `save_dir_problem` finds (an existing
    file, a path under a file, no permission), or what only trying finds (a read-only or full
    file system)."""
    problem = save_dir_problem(directory, flag)
    if problem:
        raise SaveDirError(problem)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SaveDirError(f"{flag} {directory} cannot be created: {exc.strerror or exc}; "
                           "choose a path you can write") from exc
    probe = os.path.join(directory, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise SaveDirError(f"{flag} {directory} is not writable: {exc.strerror or exc}; choose "
                           "a directory you can write (and with room for checkpoints)") from exc
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def claim_save_dir(directory: str, **lock_kwargs) -> SaveDirLock:
    """Make `directory` writable, take its writer lock and delete the temporary files an
    interrupted save left in it (logged). Returns the held lock; release() it at the end."""
    ensure_writable_dir(directory)
    lock = SaveDirLock(directory, **lock_kwargs)
    lock.acquire()
    removed = remove_temporaries(directory, only_dead=False)
    if removed:
        logger.warning("removed %d temporary file(s) left in --save %s by an interrupted save: %s",
                       len(removed), directory, ", ".join(os.path.relpath(p, directory)
                                                          for p in removed[:5]))
    return lock


__all__ = ["LOCK_FILENAME", "LockRecord", "SaveDirError", "SaveDirLock", "SaveDirLocked",
           "claim_save_dir", "ensure_writable_dir", "held_by_live_run", "save_dir_problem"]
