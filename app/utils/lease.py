"""Lease locks: one owner at a time for a path, kept by a heartbeat, taken over once it is gone.

A lease is a lock file created exclusively (O_EXCL) that holds a JSON record of its owner: host,
pid, the process's start time, a random token, when the lease was taken (`started`) and the last
heartbeat (`heartbeat`; both on the owner's clock, for people), plus fields of the caller's
(the command line, say). While the lease is held a thread rewrites the record every
`heartbeat_s` through the descriptor that created the file, which moves the file's mtime; a
holder whose lease was taken over therefore never writes into its successor's file.

A lease is stale, and is taken over, when its owner cannot be running any more:

- the owner was on this host and its process is gone, or its pid now belongs to a process
  started at another time (`app.utils.processes.process_gone`): seen at once;
- its heartbeat has been silent for `stale_s`: the file's mtime is compared with the file
  system's own clock (`fs_now`, a file touched beside it), so hosts sharing the directory over
  NFS need no synchronised clocks. With `trust_local_pid` (the default) a running owner on this
  host keeps its lease however long it is silent (a stopped process may resume and write), so
  the rule applies to owners on other hosts only.

Taking over renames the stale file aside, checks that it is still the record that was judged
(else puts it back) and deletes it; the taker then creates the file exclusively like anyone
else, so of two takers only one wins. (With three or more at the same instant, a put-back can
fail because a third created the file meanwhile; the displaced holder's heartbeat notices that
its file is gone and warns.) A waiter that has waited `notice_after_s` logs once
which path it waits for, who holds it since when, and how to clear it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable, Dict, Optional

from app.utils.fileio import fs_now, tmp_path
from app.utils.processes import on_this_host, process_gone, process_start, this_host
from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)

_RECORD_FIELDS = ("host", "pid", "process_start", "token", "started", "heartbeat")


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclasses.dataclass
class LeaseOwner:
    """Who holds a lease, as recorded in the lock file."""

    host: str
    pid: int
    process_start: float = 0.0
    """The owner's process start time (0.0: unknown), to tell a reused pid from the owner."""
    token: str = ""
    """Random per lease: tells this holding from a later one by the same process."""
    started: float = 0.0
    """When the lease was taken (the owner's wall clock; 0.0: unknown)."""
    heartbeat: float = 0.0
    """The owner's wall clock at its last heartbeat (for people: staleness uses the mtime)."""
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_this_process(cls, extra: Optional[Dict[str, Any]] = None) -> "LeaseOwner":
        """A new owner record for this process, with a fresh token."""
        now = time.time()
        return cls(this_host(), os.getpid(), process_start(os.getpid()), secrets.token_hex(8),
                   now, now, dict(extra or {}))

    def to_json(self) -> Dict[str, Any]:
        """The record as stored: the fields above at the top level, then `extra`'s."""
        return {**self.extra, "host": self.host, "pid": self.pid,
                "process_start": self.process_start, "token": self.token,
                "started": self.started, "heartbeat": self.heartbeat}

    @classmethod
    def from_json(cls, data: Any) -> Optional["LeaseOwner"]:
        """The owner in a stored record; None when it names no host and pid. Missing times read
        as 0.0 (unknown), other keys go to `extra`."""
        if not isinstance(data, dict):
            return None
        host, pid = data.get("host"), data.get("pid")
        if not isinstance(host, str) or isinstance(pid, bool) or not isinstance(pid, int):
            return None
        times = {k: _number(data.get(k, 0.0)) for k in ("process_start", "started", "heartbeat")}
        if None in times.values():
            return None
        token = data.get("token", "")
        extra = {k: v for k, v in data.items() if k not in _RECORD_FIELDS}
        return cls(host, pid, token=token if isinstance(token, str) else str(token),
                   extra=extra, **times)

    def describe(self, heartbeat_age_s: Optional[float] = None) -> str:
        """`host H, pid P (since <time>, last heartbeat N s ago; <extra>: <value>)`."""
        facts = []
        if self.started:
            facts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S",
                                                  time.localtime(self.started)))
        if heartbeat_age_s is not None:
            facts.append(f"last heartbeat {max(0.0, heartbeat_age_s):.0f} s ago")
        details = ", ".join(facts)
        if self.extra:
            extras = "; ".join(f"{k}: {str(v)[:160]}" for k, v in self.extra.items())
            details = f"{details}; {extras}" if details else extras
        return f"host {self.host}, pid {self.pid}" + (f" ({details})" if details else "")


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """One look at a lock file: its owner (None: unreadable: being written, or garbled), its
    mtime, and the age of that mtime on the file system's clock (the heartbeat's age)."""

    owner: Optional[LeaseOwner]
    mtime: float
    age_s: float

    def describe(self) -> str:
        """The holder as `LeaseOwner.describe` puts it, or what is known of an unreadable one."""
        if self.owner is None:
            return f"an unreadable record last written {max(0.0, self.age_s):.0f} s ago"
        return self.owner.describe(self.age_s)


class LeaseHeld(RuntimeError):
    """A live owner holds the lease (`state`), or other processes kept taking it (`contended`)."""

    def __init__(self, path: str, state: Optional[LeaseState], contended: bool = False) -> None:
        self.path, self.state, self.contended = path, state, contended
        if contended or state is None:
            text = (f"could not take {path}: other processes keep taking it; make sure only "
                    "one process at a time uses it")
        else:
            text = (f"{path} is held by {state.describe()}; wait for that process to finish "
                    f"or stop it; if it is gone for good, delete {path}")
        super().__init__(text)


def read_owner(path: str) -> Optional[LeaseOwner]:
    """The owner recorded in the lock file `path`; None when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return LeaseOwner.from_json(json.loads(f.read()))
    except (OSError, ValueError):
        return None


class Lease:
    """The lease on one lock file `path` (see the module docstring for the rules).

    `what` names the lock in messages ("writer lock of --save ck"); `extra` goes into the
    owner record; `sleep` is the pause while watching another host's heartbeat (a test seam).
    """

    def __init__(self, path: str, *, stale_s: float, heartbeat_s: float,
                 what: str = "lock", trust_local_pid: bool = True,
                 extra: Optional[Dict[str, Any]] = None, notice_after_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep,
                 thread_name: str = "lease-heartbeat") -> None:
        if heartbeat_s <= 0 or stale_s < 0:
            raise ValueError(f"a lease needs heartbeat_s > 0 and stale_s >= 0, got "
                             f"heartbeat_s={heartbeat_s}, stale_s={stale_s} (for {path})")
        self.path = path
        self.directory = os.path.dirname(os.path.abspath(path))
        self.stale_s, self.heartbeat_s = stale_s, heartbeat_s
        self.what, self.trust_local_pid, self.extra = what, trust_local_pid, dict(extra or {})
        self.notice_after_s = notice_after_s
        self._sleep, self._thread_name = sleep, thread_name
        self._owner: Optional[LeaseOwner] = None
        self._fd: Optional[int] = None
        self._size = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._noticed = False

    @property
    def token(self) -> Optional[str]:
        """This holding's token while the lease is held, else None."""
        return self._owner.token if self._owner is not None else None

    # ------------------------------------------------------------------ looking

    def _fs_age(self, mtime: float, read_only: bool = False) -> float:
        if read_only:  # this host's clock: judging the file system's writes a probe file
            return time.time() - mtime
        try:
            return fs_now(self.directory) - mtime
        except OSError:  # nothing can be written here: fall back on this host's clock
            return time.time() - mtime

    def look(self, read_only: bool = False) -> Optional[LeaseState]:
        """The lock file's owner, mtime and heartbeat age now; None when there is no lock file.
        `read_only` writes nothing (the age is then on this host's clock, not the file
        system's)."""
        try:
            with open(self.path, "rb") as f:  # open() revalidates NFS's cached attributes
                mtime = os.fstat(f.fileno()).st_mtime
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            owner = LeaseOwner.from_json(json.loads(text))
        except ValueError:
            owner = None
        return LeaseState(owner, mtime, self._fs_age(mtime, read_only))

    def stale_reason(self, state: LeaseState, *, watch: bool = False) -> Optional[str]:
        """Why the holder seen in `state` cannot be running any more, or None when it may be.

        With `watch`, a readable holder on another host whose heartbeat is not yet `stale_s`
        old is watched until it is (stale) or until the record or mtime changes (alive).
        """
        owner = state.owner
        if owner is None:
            if state.age_s > self.stale_s:
                return f"its lock file is unreadable and {state.age_s:.0f} s old"
            return None
        gone = process_gone(owner.host, owner.pid, owner.process_start)
        if gone is not None:
            return gone
        local = on_this_host(owner.host)
        if local and self.trust_local_pid:
            return None
        if state.age_s > self.stale_s:
            return f"no heartbeat from host {owner.host} for {state.age_s:.0f} s"
        return self._watch(state) if watch and not local else None

    def _watch(self, state: LeaseState) -> Optional[str]:
        begun = time.monotonic()
        while True:
            self.notice_wait(state, time.monotonic() - begun)
            self._sleep(min(self.heartbeat_s, 5.0))
            now = self.look()
            if now is None:
                return "it was released"
            if now.owner != state.owner or now.mtime != state.mtime:
                return None  # the heartbeat moved (or another process took it): alive
            if now.age_s > self.stale_s or time.monotonic() - begun > self.stale_s:
                assert state.owner is not None
                return (f"the heartbeat of host {state.owner.host} did not advance for "
                        f"{self.stale_s:.0f} s")

    def notice_wait(self, state: Optional[LeaseState], waited_s: float) -> None:
        """Log once per lease, when a wait has lasted `notice_after_s`, what it waits for: the
        path, who holds it since when, and how to clear it if its holder is gone."""
        if self._noticed or state is None or waited_s < self.notice_after_s:
            return
        self._noticed = True
        logger.warning("waiting for the %s %s (%.0f s so far): held by %s. It is taken over once "
                       "its holder is gone (a heartbeat silent for %.0f s counts as gone); if "
                       "that process is gone for good, delete %s to go on at once",
                       self.what, self.path, waited_s, state.describe(), self.stale_s,
                       self.path, extra=ALL_RANKS)

    # ------------------------------------------------------------------ taking

    def try_acquire(self) -> bool:
        """Create the lock file for this process and start the heartbeat; False when a lock
        file exists (this never judges or waits)."""
        if self._owner is not None:
            raise RuntimeError(f"the {self.what} {self.path} is already held by this lease")
        owner = LeaseOwner.of_this_process(self.extra)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        data = json.dumps(owner.to_json()).encode("utf-8")
        try:
            os.write(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise
        self._owner, self._fd, self._size = owner, fd, len(data)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=self._thread_name, daemon=True)
        self._thread.start()
        return True

    def take_over(self, state: LeaseState, reason: str) -> bool:
        """Delete the stale lock judged in `state` (for `reason`), unless it changed hands or
        beat since: renamed aside first, so of several takers one removes it and a newer
        record is put back. True when this call removed it."""
        aside = tmp_path(self.path + ".stale", unique=True)
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if read_owner(aside) != state.owner:
            with contextlib.suppress(OSError):  # back, unless yet another owner exists now
                os.link(aside, self.path)
            with contextlib.suppress(OSError):
                os.remove(aside)
            return False
        with contextlib.suppress(OSError):
            os.remove(aside)
        logger.warning("took over the stale %s (%s; held by %s): %s", self.what, self.path,
                       state.describe(), reason)
        return True

    def acquire(self, attempts: int = 5) -> None:
        """Take the lease, taking over a stale one (another host's holder is watched for up to
        `stale_s` first); LeaseHeld when a live holder has it or other takers keep winning."""
        state: Optional[LeaseState] = None
        for _ in range(attempts):
            if self.try_acquire():
                return
            state = self.look()
            if state is None:
                continue  # released meanwhile
            if state.owner is None and state.age_s < 2.0:
                self._sleep(0.2)  # being written this instant
                continue
            reason = self.stale_reason(state, watch=True)
            if reason is None:
                raise LeaseHeld(self.path, self.look() or state)
            self.take_over(state, reason)
        raise LeaseHeld(self.path, state, contended=True)

    # ------------------------------------------------------------------ holding

    def _still_ours(self, fd: int) -> bool:
        try:
            now, ours = os.stat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            owner, fd = self._owner, self._fd
            if owner is None or fd is None:
                return
            if not self._still_ours(fd):
                current = self.look()
                logger.warning("the %s %s no longer names this process (%s); another process may "
                               "be using what it guards", self.what, self.path,
                               current.describe() if current else "the file is gone",
                               extra=ALL_RANKS)
                return
            owner.heartbeat = time.time()
            data = json.dumps(owner.to_json()).encode("utf-8").ljust(self._size)
            with contextlib.suppress(OSError):  # in place: a reader sees old or new bytes
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                if os.utime in os.supports_fd:
                    os.utime(fd)  # on NFS: the server's clock, the one stale_s is judged on
            self._size = len(data)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it still holds this lease's token."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        owner, fd = self._owner, self._fd
        self._owner, self._fd = None, None
        if owner is None:
            return
        current = read_owner(self.path)
        if current is not None and current.token == owner.token:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


__all__ = ["Lease", "LeaseHeld", "LeaseOwner", "LeaseState", "read_owner"]
