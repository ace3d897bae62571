"""Crash-safe file writes and the one temporary-name scheme of the project.

A reader never sees a half-written file under the final name: data goes to a temporary name
(`tmp_path`) first and is renamed over `path` (atomic on POSIX) only once complete. With
`durable=True` the data and the directory entry are fsynced, so the new file also survives a
power loss. A failed write removes its temporary file and leaves `path` as it was.

Every temporary file or directory the project makes (checkpoint and dataset writes, the
preprocess outputs, the converter's staged directory, kernel build directories, lock asides,
probes) is named by `tmp_path`: `<final name>.tmp.<host>.<pid>`, plus `.<thread id>` where
threads of one process may write the same name at once. The name says who owns it, so
`remove_temporaries` can delete what a killed process left without touching a live writer's
files, on this host or (over a shared file system) on another.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from typing import IO, Any, Callable, Iterator, List, NamedTuple, Optional

from app.utils.processes import host_tag, on_this_host, process_gone, this_host

TMP_MARKER = ".tmp."
"""Temporary names are `<final name>.tmp.<host>.<pid>[.<thread id>]` (see `tmp_path`)."""

_TEMPORARY = re.compile(r"(?P<final>.+?)\.tmp\.(?:(?P<host>[A-Za-z0-9_-]+)\.)?(?P<pid>\d+)"
                        r"(?:\.(?P<thread>\d+))?")


class TemporaryOwner(NamedTuple):
    """The writer a temporary name records: its host tag (None in the names of older versions,
    `<final>.tmp.<pid>`, which are taken to be this host's) and its pid."""

    host: Optional[str]
    pid: int


def tmp_path(path: str, *, unique: bool = False) -> str:
    """The temporary name this process writes `path` under before renaming it:
    `<path>.tmp.<host>.<pid>`, with `.<thread id>` appended when `unique` (for writers that
    may run in several threads of one process)."""
    name = f"{path}{TMP_MARKER}{host_tag()}.{os.getpid()}"
    return f"{name}.{threading.get_native_id()}" if unique else name


def temporary_owner(name: str) -> Optional[TemporaryOwner]:
    """The owner recorded in a `tmp_path` name (a base name or a path), None for other names."""
    match = _TEMPORARY.fullmatch(os.path.basename(name))
    if match is None:
        return None
    return TemporaryOwner(match["host"], int(match["pid"]))


def is_temporary(name: str) -> bool:
    """True for a name made by `tmp_path` (left behind only by a process that was killed)."""
    return temporary_owner(name) is not None


def fs_now(directory: str) -> float:
    """The current time of the file system holding `directory`: the mtime of a probe file
    touched now (on NFS the server's clock, the one that stamps files' mtimes). OSError when
    nothing can be written there."""
    probe = tmp_path(os.path.join(directory, ".clock"), unique=True)
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.utime(fd if os.utime in os.supports_fd else probe)
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(probe)


class _LocalClock:
    """Converts file-system times under `root` to this host's clock (measured once, lazily)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._offset: Optional[float] = None
        self._measured = False

    def local(self, fs_time: float) -> Optional[float]:
        if not self._measured:
            self._measured = True
            with contextlib.suppress(OSError):
                self._offset = fs_now(self.root) - time.time()
        return None if self._offset is None else fs_time - self._offset


def _writer_gone(path: str, owner: TemporaryOwner, clock: _LocalClock) -> bool:
    """True when the process that wrote temporary `path` certainly no longer runs: it was on
    this host and its pid is gone or was reused (`process_gone`). Another host's writer is never
    judged gone from here."""
    if owner.host is not None and not on_this_host(owner.host):
        return False
    try:
        changed = os.lstat(path).st_mtime  # the writer was running then
    except OSError:
        return False
    return process_gone(this_host(), owner.pid, active_at=clock.local(changed)) is not None


def _remove_path(path: str) -> bool:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except OSError:
        return False
    return True


def remove_temporaries(root: str, *, only_dead: bool = True, prefix: str = "") -> List[str]:
    """Delete the temporary files and directories (`is_temporary` names) under `root`,
    recursively; return their paths.

    They are what a killed writer leaves behind (a save or a preprocess that never reached its
    rename), and they can be as large as a whole checkpoint. With `only_dead` (the default) one
    is removed only when its writer certainly no longer runs: it was on this host and its pid
    is gone or now belongs to a process started after the temporary last changed; another
    host's are kept (their writer cannot be seen from here). Pass False when the caller owns
    `root` exclusively (the checkpoint directory under its writer lock). `prefix` limits the
    search to names starting with it. A temporary directory is removed whole and never searched;
    one that cannot be removed is skipped.
    """
    removed: List[str] = []
    if not os.path.isdir(root):
        return removed
    clock = _LocalClock(root)
    for directory, subdirs, files in os.walk(root):
        temporary_dirs = [name for name in subdirs if is_temporary(name)]
        subdirs[:] = [name for name in subdirs if name not in temporary_dirs]
        for name in temporary_dirs + files:
            owner = temporary_owner(name)
            if owner is None or not name.startswith(prefix):
                continue
            path = os.path.join(directory, name)
            if only_dead and not _writer_gone(path, owner, clock):
                continue
            if _remove_path(path):
                removed.append(path)
    return removed


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it is durable (best effort: not every FS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", *, durable: bool = False,
                before_replace: Optional[Callable[[str], None]] = None,
                **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on a clean exit rename it to `path`.

    The project's one write-to-a-temporary-then-rename: checkpoint files
    (app.checkpoint.commit.write_checked_file), pointer files, dataset caches, the .bin/.idx
    builder. `mode` is "wb" or "w" (text; `open_kwargs` such as encoding are passed on). On an
    exception (a full disk, or one raised by `before_replace`) the temporary file is removed,
    `path` is left as it was and the exception propagates. `before_replace(tmp)` is called with
    the complete temporary file's path (fsynced when `durable`) just before the rename: what
    must be on disk before the new file appears (a checksum sidecar, the .bin of an .idx) and
    the crash tests' seam.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes new files only (mode 'w' or 'wb'), got {mode!r}")
    tmp = tmp_path(path, unique=True)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: str, write: Callable[[IO[bytes]], Any], *, durable: bool = False,
                 before_replace: Optional[Callable[[str], None]] = None) -> None:
    """`write(f)` into a temporary binary file, then rename it to `path` (see `atomic_open`)."""
    with atomic_open(path, "wb", durable=durable, before_replace=before_replace) as f:
        write(f)


def atomic_write_bytes(path: str, data: bytes, *, durable: bool = False,
                       before_replace: Optional[Callable[[str], None]] = None) -> None:
    """Replace `path` with `data` atomically (see `atomic_open`)."""
    atomic_write(path, lambda f: f.write(data), durable=durable, before_replace=before_replace)
