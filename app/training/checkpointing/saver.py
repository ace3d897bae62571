"""One kind of checkpoint save (persistent, global or local), and what a save that fails does to
the run: the failed-save policy, which the run's checkpointer applies to all of them
(app.training.checkpointing.checkpointer).

A save that fails (a full disk however torch reports it, an I/O or permission error, a timeout)
is undone on every rank by the two-phase commit (app.checkpoint.commit: this save's partial
files are removed, the previous checkpoint stays the latest, and every rank raises
CheckpointSaveError at the same point, so they all decide alike). `CheckpointSaver` turns it
into one log line naming the directory and the error and a `save_failed` record in the metrics;
training goes on and the next --save-interval tries again. The run stops with `SaveFailed`
(exit code EXIT_SAVE_FAILED, never 0 as if all were saved):

- after --max-failed-saves failures in a row (a successful save resets the count);
- when the save that ends the run fails: the last iteration's, or the one after a signal or
  an exit condition.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Optional

from app.checkpoint import commit, names
from app.checkpoint.commit import CheckpointSaveError
from app.config.checkpoint import CheckpointConfig

EXIT_SAVE_FAILED = 5
"""pretrain_gpt2.py's exit code when the run stopped because its checkpoints could not be
saved (docs/reliability.md)."""


class SaveFailed(Exception):
    """The run stopped because checkpoints could not be saved; the message names --save, the
    error, the latest checkpoint and the fix."""

    exit_code = EXIT_SAVE_FAILED


class CheckpointSaver:
    """Saves of one kind (synchronous, or in the background with one in flight), counting
    failures.

    `files` writes the checkpoint files and commits them, one save at a time
    (app.checkpoint.commit.OneSaveAtATime: `save_checkpoint`, `finish_save`, `save_in_flight`,
    `abandon_save`): the engine for persistent and global saves, the local checkpoints
    (app.training.checkpointing.local.LocalCheckpoints) for local ones. Every rank calls `save`
    and `finish` at the same points. `writer` is the run's MetricsWriter
    (app.training.telemetry.metrics: the `save_failed` records); `log(text)` writes one line
    of the training log; `saving()` is a context in which a checkpoint is being written (the
    exit-signal handler's `saving` flag and the watchdog's beat, app.training.resilience.guard).
    """

    def __init__(self, cfg: CheckpointConfig, files: commit.OneSaveAtATime, writer: Any,
                 log: Callable[[str], None],
                 saving: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.cfg, self.files, self.writer, self.log = cfg, files, writer, log
        self._saving = saving
        self.failures_in_a_row = 0
        """Saves that failed since the last one that was committed."""
        self._handed_off = 0.0
        self._directory = cfg.save
        """Where the latest save went (--save, or a global non-persistent directory)."""

    def save(self, iteration: int, client_state: Dict[str, Any], *, final: bool,
             directory: Optional[str] = None) -> bool:
        """Save the checkpoint of `iteration` into `directory` (default --save; synchronously,
        or hand it to the background writer), once the save in flight is committed; False when
        it failed (logged and recorded, training goes on). Raises SaveFailed when the run must
        stop: `final` (the save that ends the run) failed, or --max-failed-saves failed in a
        row."""
        self.finish(blocking=True, final=False)  # one save at a time: the one in flight first
        t0 = time.time()
        background = self.cfg.async_save
        self._directory = directory or self.cfg.save
        try:
            with self._saving():
                path = self.files.save_checkpoint(self._directory, iteration, client_state,
                                                   asynchronous=background)
        except CheckpointSaveError as exc:
            self._failed(iteration, exc, final)
            return False
        if background:
            self._handed_off = time.time()
            self.log(f"saving checkpoint at iteration {iteration} to {path} in the background "
                     f"(training blocked {time.time() - t0:.2f} s)")
            if final:
                self.finish(blocking=True, final=True)
            return True
        self.failures_in_a_row = 0
        self.log(f"saved checkpoint at iteration {iteration} to {path} "
                 f"({time.time() - t0:.2f} s)")
        return True

    def finish(self, blocking: bool, final: bool) -> None:
        """Commit the save being written in the background once every rank has written its
        files: at once with `blocking`, else only if they all have (one agreement while a
        save is in flight). A failed commit is handled as `save` handles a failed save."""
        iteration = self.files.save_in_flight
        if iteration is None:
            return
        try:
            with self._saving():
                path = self.files.finish_save(blocking)
        except CheckpointSaveError as exc:
            self._failed(iteration, exc, final)
            return
        if path is not None:
            self.failures_in_a_row = 0
            self.log(f"saved checkpoint at iteration {iteration} to {path} (in the background, "
                     f"{time.time() - self._handed_off:.2f} s)")

    def abandon(self, timeout_s: float = 60.0) -> None:
        """On an exit path that cannot commit (an error): stop the background writer, waiting
        up to `timeout_s`, and remove this rank's files of the save in flight."""
        self.files.abandon_save(timeout_s)

    def _failed(self, iteration: int, error: CheckpointSaveError, final: bool) -> None:
        """Log and record one failed save; SaveFailed when the run must stop."""
        self.failures_in_a_row += 1
        limit = self.cfg.max_failed_saves
        latest = _latest(self._directory)
        self.writer.write("save_failed", iteration, {
            "directory": self._directory, "error": str(error), "latest": latest,
            "failures_in_a_row": self.failures_in_a_row, "max_failed_saves": limit,
            "final": final})
        if final:
            raise SaveFailed(f"the run's last checkpoint could not be saved: {error}")
        if self.failures_in_a_row >= limit:
            raise SaveFailed(f"stopping: {self.failures_in_a_row} saves in a row failed "
                             f"(--max-failed-saves {limit}); the last one: {error}")
        self.log(f"save failed ({self.failures_in_a_row} in a row; the run stops at "
                 f"{limit}, --max-failed-saves), training goes on: {error}")


def _latest(save_dir: str) -> Optional[int]:
    """The iteration the tracker of `save_dir` names, None when there is none."""
    try:
        latest = names.read_tracker(save_dir)
    except Exception:  # noqa: BLE001 - only for the record
        return None
    return latest if isinstance(latest, int) else None


__all__ = ["CheckpointSaver", "EXIT_SAVE_FAILED", "SaveFailed"]
