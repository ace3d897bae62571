"""The `--save` directory: one writer at a time, writable before training, no stale temporaries.

Two runs saving into one directory interleave their checkpoints (one run's tracker names the
other's files, rotation deletes the other's iterations). A run therefore holds a lease
(`app.utils.lease`) on the lock file `{save}/writer.lock` for as long as it trains: a JSON record
of the holder (host, pid, the process's start time, since when, the command, a heartbeat
refreshed every `heartbeat_s`). A second run fails at start with an error naming the holder.

A lock is stale, and taken over with a warning, when its holder cannot be running any more:

- the holder is on this host and its pid is gone, or now belongs to a process started at
  another time (the pid was reused); a running holder on this host keeps the lock, even while
  stopped (it may resume and write);
- the holder is on another host and its heartbeat has been silent for `stale_after_s`: when
  the lock file's mtime is older than that the lock is taken at once; otherwise the new run
  watches the heartbeat for up to `stale_after_s` (a job requeued onto another node right
  after its predecessor died waits this long instead of failing).

Ages are measured on the file system's clock, so hosts sharing the directory need no
synchronised clocks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from typing import Callable, Optional

from app.checkpoint import names
from app.utils.fileio import remove_temporaries, tmp_path
from app.utils.lease import Lease, LeaseHeld

logger = logging.getLogger(__name__)

LOCK_FILENAME = "writer.lock"


class SaveDirError(ValueError):
    """The --save directory cannot be used; the message names it, the reason and the fix."""


class SaveDirLocked(SaveDirError):
    """Another live run holds the --save directory's writer lock."""


class SaveDirLock:
    """The writer lock of one --save directory (see the module docstring for the rules)."""

    def __init__(self, directory: str, *, heartbeat_s: float = 20.0,
                 stale_after_s: float = 120.0, notice_after_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILENAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._lease = Lease(self.path, stale_s=stale_after_s, heartbeat_s=heartbeat_s,
                            what=f"writer lock of --save {directory}",
                            extra={"command": " ".join(sys.argv)},
                            notice_after_s=notice_after_s, sleep=sleep,
                            thread_name="save-dir-lock-heartbeat")

    def acquire(self) -> None:
        """Create the lock file for this process, taking over a stale one; SaveDirLocked when a
        live run holds it."""
        try:
            self._lease.acquire()
        except LeaseHeld as held:
            raise SaveDirLocked(self._held_message(held)) from None

    def _held_message(self, held: LeaseHeld) -> str:
        state = held.state
        if held.contended or state is None:
            return (f"could not take the writer lock {self.path}: other runs keep taking it; "
                    "make sure only one run uses this --save directory")
        if state.owner is None:
            return (f"--save {self.directory} has an unreadable writer lock {self.path} "
                    f"written {state.age_s:.0f} s ago; if no other run uses this directory, "
                    "delete the file and start again")
        return (f"--save {self.directory} is in use by another run: {state.describe()}. Two "
                "runs writing one directory would interleave and delete each other's "
                "checkpoints: wait for that run to finish or stop it, or choose another "
                f"--save. If that run is gone for good, delete {self.path}.")

    def live_holder(self) -> Optional[str]:
        """The message `acquire` would fail with if a live run holds the lock now, else None;
        reads only (a holder on another host is not watched)."""
        state = self._lease.look(read_only=True)
        if state is None or self._lease.stale_reason(state) is not None:
            return None
        return self._held_message(LeaseHeld(self.path, state))

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it still names this process."""
        self._lease.release()

    def __enter__(self) -> "SaveDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_by_live_run(directory: str, stale_after_s: float = 120.0) -> Optional[str]:
    """Why a run starting now could not take the writer lock of `directory` (the message
    `SaveDirLock.acquire` would raise), or None when the lock is free or stale and would be taken
    over. Only reads: the lock is never taken, broken or waited for. A holder is judged by the
    lease's own rule (`Lease.stale_reason`) without watching: one on another host counts as live
    while its heartbeat is younger than `stale_after_s`."""
    return SaveDirLock(directory, stale_after_s=stale_after_s).live_holder()


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
    probe = tmp_path(os.path.join(directory, ".write-probe"))
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
    for iteration in names.interrupted_saves(directory):  # killed before their commit
        shutil.rmtree(names.checkpoint_dir(directory, iteration), ignore_errors=True)
        logger.warning("removed %s: a save killed before it was committed (not a checkpoint)",
                       names.checkpoint_dir(directory, iteration))
    if removed:
        logger.warning("removed %d temporary file(s) left in --save %s by an interrupted save: %s",
                       len(removed), directory, ", ".join(os.path.relpath(p, directory)
                                                          for p in removed[:5]))
    return lock


__all__ = ["LOCK_FILENAME", "SaveDirError", "SaveDirLock", "SaveDirLocked",
           "claim_save_dir", "ensure_writable_dir", "held_by_live_run", "save_dir_problem"]
