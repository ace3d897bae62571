"""Crash-safe file writes: the one write-to-a-temporary-name-then-rename helper of the project.

A reader never sees a half-written file under the final name: data goes to
`<path>.tmp.<pid>` first and is renamed over `path` (atomic on POSIX) only once complete. With
`durable=True` the data and the directory entry are fsynced, so the new file also survives a
power loss. A failed write removes its temporary file and leaves `path` as it was.
"""
from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Callable, Iterator, List, Optional

TMP_MARKER = ".tmp."
"""Temporary files are named `<final name>.tmp.<pid>` (see `is_temporary` / `tmp_path`)."""


def tmp_path(path: str) -> str:
    """The temporary name this process writes `path` under before renaming it."""
    return f"{path}{TMP_MARKER}{os.getpid()}"


def is_temporary(name: str) -> bool:
    """True for a name written by `tmp_path` (left behind only by a process that was killed)."""
    head, sep, pid = name.rpartition(TMP_MARKER)
    return bool(head and sep and pid.isdigit())


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists on this host (it may belong to another user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_temporaries(root: str, *, only_dead: bool = True, prefix: str = "") -> List[str]:
    """Delete the temporary files (`is_temporary` names) under `root`, recursively; return them.

    They are what a killed writer leaves behind (a save or a preprocess that never reached its
    rename), and they can be as large as a whole checkpoint. With `only_dead` (the default) a
    file is removed only when the process named by its pid suffix no longer runs on this host,
    so a writer that is still at work keeps its file; pass False when the caller owns `root`
    exclusively (the checkpoint directory under its writer lock). `prefix` limits the search to
    names starting with it. A file that cannot be removed is skipped.
    """
    removed: List[str] = []
    if not os.path.isdir(root):
        return removed
    for directory, _, names in os.walk(root):
        for name in names:
            if not (name.startswith(prefix) and is_temporary(name)):
                continue
            if only_dead and pid_alive(int(name.rpartition(TMP_MARKER)[2])):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                os.remove(path)
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


def write_durably(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Call `write(f)` on a new binary file at `path`, then flush and fsync it (no rename).

    On any failure (a full disk, say) the partial file is removed before the error propagates.
    """
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", *, durable: bool = False,
                before_replace: Optional[Callable[[], None]] = None,
                **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on a clean exit rename it to `path`.

    `mode` is "wb" or "w" (text; `open_kwargs` such as encoding are passed on). On an
    exception the temporary file is removed and the exception propagates. `before_replace` is
    called after the data is written and before the rename (a seam for crash tests).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes new files only (mode 'w' or 'wb'), got {mode!r}")
    tmp = tmp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: str, write: Callable[[IO[bytes]], Any], *, durable: bool = False,
                 before_replace: Optional[Callable[[], None]] = None) -> None:
    """`write(f)` into a temporary binary file, then rename it to `path` (see `atomic_open`)."""
    with atomic_open(path, "wb", durable=durable, before_replace=before_replace) as f:
        write(f)


def atomic_write_bytes(path: str, data: bytes, *, durable: bool = False,
                       before_replace: Optional[Callable[[], None]] = None) -> None:
    """Replace `path` with `data` atomically (see `atomic_open`)."""
    atomic_write(path, lambda f: f.write(data), durable=durable, before_replace=before_replace)
