"""Small real file systems for tests: a tmpfs of a given size, and a ballast that fills it.

    with small_tmpfs(tmp_path / "disk", 16 * 2**20) as disk:   # skips the test without root
        with Ballast(disk):                                    # the disk is full inside
            ...                                                # writes fail with ENOSPC

`small_tmpfs` mounts in a `finally`-guarded block and always unmounts (lazily when a process
still has a file open there), so a failing test leaves no mount behind.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size_bytes: int) -> Iterator[str]:
    """A tmpfs of `size_bytes` mounted at `path` (created) for the block; the test is skipped
    where mounting is not allowed (not root, no tmpfs)."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip() or mount.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


class Ballast:
    """A file that fills the file system of `directory` (writes until ENOSPC); `remove()`
    (or leaving the `with` block) frees the space again."""

    def __init__(self, directory: str, name: str = ".ballast") -> None:
        self.path = os.path.join(directory, name)

    def fill(self) -> int:
        """Write until the file system is full; the bytes written."""
        written = 0
        with open(self.path, "ab", buffering=0) as f:
            chunk = b"\0" * 65536
            while True:
                try:
                    written += f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return written
                    chunk = chunk[:len(chunk) // 2]

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def __enter__(self) -> "Ballast":
        self.fill()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
