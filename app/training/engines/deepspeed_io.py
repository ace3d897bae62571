"""DeepSpeed's checkpoint I/O made crash-safe and safe to read: `CheckedCheckpointEngine`, which
the DeepSpeed engine (engines.deepspeed) installs as DeepSpeed's `checkpoint_engine`. Needs no
deepspeed import: it wraps the engine DeepSpeed built and writes through app.checkpoint.commit.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

from app.checkpoint import commit
from app.checkpoint.deepspeed import load_deepspeed_file
from app.checkpoint.snapshot import HostBuffers, host_copy


class CheckedCheckpointEngine:
    """DeepSpeed's TorchCheckpointEngine with crash-safe, checksummed writes and safe reads.

    Installed as `engine.checkpoint_engine`; everything but `save` and `load` is delegated to
    the original. `save` never raises an I/O error into DeepSpeed (that would leave the other
    ranks in DeepSpeed's barriers): it records it, and the save's commit agrees on the outcome
    after `save_checkpoint` returns. `written` lists (path, existed before) of this save's files.
    For an asynchronous save (`begin(deferred=True)`) `save` keeps host copies of the state
    dicts and `write_deferred` writes them later, from the background thread.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.written: List[Tuple[str, bool]] = []
        self.errors: List[Tuple[str, OSError]] = []
        self.deferred: Optional[List[Tuple[str, Any]]] = None
        self.buffers = HostBuffers()  # the host copies' memory, reused save after save

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, deferred: bool = False) -> None:
        """Forget the previous save's files and errors. With `deferred`, `save` only keeps a
        host copy of each state dict, for `write_deferred` to write later."""
        self.written, self.errors = [], []
        self.deferred = [] if deferred else None
        if deferred:  # the previous save is committed: its buffers are free
            self.buffers.new_save()

    def save(self, state_dict: Any, path: str) -> None:
        if self.deferred is not None:
            self.deferred.append((path, host_copy(state_dict, self.buffers)))
            return
        self._write(state_dict, path)

    def write_deferred(self) -> Optional[Tuple[str, OSError]]:
        """Write the state dicts `save` kept, in order (any thread: no collectives); the first
        (path, error) that failed, None when all were written."""
        for path, state_dict in self.deferred or []:
            self._write(state_dict, path)
        self.deferred = None
        return self.errors[0] if self.errors else None

    def _write(self, state_dict: Any, path: str) -> None:
        zipfile = getattr(self.inner, "zipfile_serialization", True)
        existed = os.path.exists(path)
        try:
            commit.write_checked_file(path, lambda f: torch.save(
                state_dict, f, _use_new_zipfile_serialization=zipfile), hidden_sidecar=True)
        except OSError as exc:
            self.errors.append((path, exc))
            return
        self.written.append((path, existed))

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(path, map_location)

    def undo(self, stop_at: str) -> None:
        """Remove the files this save created (not those it replaced) and emptied directories."""
        for path, existed in self.written:
            if not existed:
                commit.remove_written_file(path, stop_at)
