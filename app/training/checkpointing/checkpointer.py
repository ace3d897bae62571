"""The run's one checkpointer: every save and every load of a training run, in one object.

As torchtitan's CheckpointManager, it owns when to save, what to save into where, and what a
resume or a rollback loads; the trainer holds it and asks `maybe_save(state, ...)` after every
iteration, and the start-up sequence asks `load_latest(...)`. What it decides:

- persistent saves into --save every --save-interval iterations and when the run stops early
  (an exit signal, --exit-interval, --exit-duration-in-mins), synchronous or with --async-save
  in the background (the engine's files; one save in flight, committed once every rank wrote);
- non-persistent saves every --non-persistent-save-interval iterations that are not persistent
  saves: local ones into --non-persistent-local-ckpt-dir (app.training.checkpointing.local,
  always in the background) or global ones, the run's own checkpoint into
  --non-persistent-global-ckpt-dir (default <--save>/non_persistent) through the persistent
  saver, the older non-persistent iterations removed before each (Megatron's
  cleanup_old_non_persistent_checkpoint: the newest committed one survives a crash);
- no save during a run of non-finite iterations (the previous checkpoint stays the one to
  resume from); the final save of a finished run (`save_final`); the exit line after a signal
  (`signal_exit_note`);
- what a failed save does (app.training.checkpointing.saver: logged and recorded, training
  goes on, SaveFailed after --max-failed-saves in a row or when the run's last save fails), for
  every kind alike;
- which checkpoint a resume (`load_latest`) or a --rollback-on-spike (`rollback_target`, then
  `load`) takes: the one choice of app.training.checkpointing.latest, newest non-persistent or
  persistent.

Fault handling (exit signals, the watchdog, in-process restart, spike rollback:
app.training.resilience) asks it; it never asks them: what it needs from them is the context
a save runs in (`saving`, given to `prepare_saves`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Optional

from app.checkpoint import CheckpointError, commit, names
from app.config.checkpoint import CheckpointConfig
from app.mpu.parallel_state import ParallelState
from app.data.plan import ORDER_VERSION
from app.training.checkpointing.data_order import check_data_order, resume_order
from app.training.checkpointing.latest import NewestCheckpoint, load_newest, newest_checkpoint
from app.training.checkpointing.local import LocalCheckpoints
from app.training.checkpointing.resume import LoadResult
from app.training.checkpointing.saver import CheckpointSaver
from app.training.state import RunState
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)


def _log(message: str) -> None:
    """One line of the training log, printed by the last rank (app.utils.rank_logging)."""
    logger.info(message, extra=LAST_RANK)


class Checkpointer:
    """Every save and load under `config` (the checkpoint flags) of one run of `engine`
    (app.training.engines.base.Engine) on this rank of `parallel_state` (the ranks' agreements
    on `device`), which trains to iteration `train_iters`. Built with the run
    (app.training.run.build_run): the start-up sequence loads through it before the trainer
    exists; the trainer then calls `prepare_saves` once and the save methods after every
    iteration, on every rank alike."""

    def __init__(self, config: CheckpointConfig, engine: Any, parallel_state: ParallelState,
                 device: Any, train_iters: int) -> None:
        self.c, self.engine, self.device, self.train_iters = config, engine, device, train_iters
        self.rank, self.world_size = parallel_state.rank, parallel_state.world_size
        self.last_saved: Optional[int] = None
        """The iteration the last persistent save was made at (None: none yet)."""
        self._persistent: Optional[CheckpointSaver] = None
        self._local: Optional[CheckpointSaver] = None
        self._global_dir: Optional[str] = None

    # ------------------------------------------------------------------ loading

    def latest(self, directory: Optional[str], non_persistent: bool,
               at_most: Optional[int] = None) -> NewestCheckpoint:
        """The checkpoint a load of `directory` takes (app.training.checkpointing.latest
        .newest_checkpoint); every rank calls it."""
        return newest_checkpoint(self.c, directory, non_persistent, at_most)

    def load(self, chosen: NewestCheckpoint, *, restore_all: bool = False,
             doing: str = "resuming from") -> Optional[LoadResult]:
        """Load `chosen` on every rank: under --finetune/--no-load-optim/--no-load-rng, or
        everything it holds with `restore_all` (a rollback); None when it is persistent and
        its directory holds no checkpoint (any more)."""
        c = self.c
        if restore_all:
            c = dataclasses.replace(c, finetune=False, no_load_optim=False, no_load_rng=False)
        return load_newest(self.engine, chosen, c, self.device, doing=doing)

    def load_latest(self, load: Optional[str],
                    data_order: Callable[[int], Optional[Dict[str, Any]]]) -> RunState:
        """The run's position at start-up: fresh (no `load` and no non-persistent checkpoint),
        or the newest checkpoint loaded on every rank (with --load and not --finetune a
        non-persistent one competes with --load's). `data_order(version)` is this run's
        data-order record in the sample order of that version: a new run reads Megatron Core's
        (ORDER_VERSION), a resume the checkpoint's, which it keeps
        (app.training.checkpointing.data_order.resume_order; every rank decides alike)."""
        c = self.c
        chosen = self.latest(load, non_persistent=(
            c.non_persistent_ckpt_type is not None and bool(c.load) and not c.finetune))
        if chosen.local is None and chosen.global_iteration is None and load is None:
            return RunState(data_order=data_order(ORDER_VERSION))
        loaded = self.load(chosen)
        if loaded is None:
            raise CheckpointError(f"--load {load}: its tracker disappeared while starting")
        logger.info("checkpoint %s was written by %s", loaded.path, loaded.writer.describe())
        record = data_order(ORDER_VERSION)
        if loaded.iteration > 0:  # weights-only loads start at 0: no position to keep
            version, why = resume_order(loaded.data_order, loaded.writer,
                                        c.allow_data_order_change)
            logger.info("data order of this resume: %s", why)
            record = data_order(version)
            consumed = {"train": loaded.consumed_train_samples,
                        "valid": loaded.consumed_valid_samples}
            for line in check_data_order(loaded.data_order, record, loaded.path, consumed,
                                         c.allow_data_order_change):
                logger.info(line)
        logger.info("loaded checkpoint %s: resuming at iteration %d, consumed samples %d",
                    loaded.path, loaded.iteration, loaded.consumed_train_samples)
        return RunState(loaded.iteration, loaded.consumed_train_samples,
                        loaded.consumed_valid_samples, data_order=record)

    def rollback_target(self, iteration: int) -> NewestCheckpoint:
        """What a rollback at `iteration` goes back to: the choice a resume from --save makes,
        leaving out non-persistent checkpoints after `iteration` (another run's)."""
        return self.latest(self.c.save, non_persistent=self.c.non_persistent_ckpt_type is not None,
                           at_most=iteration)

    def nothing_to_roll_back_to(self, chosen: NewestCheckpoint) -> str:
        """Where a rollback looked when `chosen` is no checkpoint, for the message."""
        c = self.c
        return f"--save {c.save}" + (
            f" or --non-persistent-local-ckpt-dir {c.non_persistent_local_ckpt_dir}"
            if c.local_checkpoints else f" or {chosen.global_dir}" if chosen.global_dir
            else "")

    # ------------------------------------------------------------------ saving

    def prepare_saves(self, writer: Any, saving: Callable[[], Any] = contextlib.nullcontext,
                      ) -> None:
        """Get ready to save (the trainer, once, on every rank): `writer` records failed saves
        (the run's MetricsWriter), `saving()` is the context a persistent or global save runs
        in (the exit-signal handler's flag and the watchdog's beat). Builds the local
        checkpoints' writer (its folder, its replica groups: a collective) when they are on."""
        c = self.c
        self._persistent = CheckpointSaver(c, self.engine, writer, _log, saving=saving)
        if not c.non_persistent_save_interval:
            return
        if c.non_persistent_ckpt_type == "global":
            self._global_dir = c.global_non_persistent_dir(c.save)
            return
        local = LocalCheckpoints(c, self.engine, self.rank, self.world_size, self.device)
        own = dataclasses.replace(c, save=local.folder, async_save=True,
                                  keep_last_n_checkpoints=None)
        self._local = CheckpointSaver(own, local, writer, lambda line: _log(f"local: {line}"))

    def maybe_save(self, state: RunState, *, exiting: bool, nonfinite: bool) -> None:
        """After iteration `state.iteration` on every rank: commit the saves in flight (at once
        when `exiting`, else only if every rank has written them), then the persistent save
        when it is due (every --save-interval, or `exiting`) and the non-persistent one when it
        is due and no persistent one is; none while `nonfinite` (a run of non-finite
        iterations). SaveFailed when the run must stop."""
        self.finish(blocking=exiting)
        c, iteration = self.c, state.iteration
        if c.save and ((c.save_interval and iteration % c.save_interval == 0) or exiting):
            if nonfinite:
                logger.warning("iteration %d: not saving a checkpoint during a run of "
                               "non-finite iterations", iteration, extra=LAST_RANK)
            elif self._save_persistent(state, final=exiting or self._last(iteration)):
                self.last_saved = iteration
        interval = c.non_persistent_save_interval
        if (nonfinite or not interval or iteration % interval
                or self.last_saved == iteration or self._last(iteration)):
            return
        if self._local is not None:
            self._local.save(iteration, state.client_state(), final=False)
        elif self._global_dir is not None:
            self._save_global(state)

    def save_final(self, state: RunState, nonfinite: bool) -> None:
        """The finished run's last save (its failure stops the run), unless it was saved at this
        iteration already or its state is not finite (`nonfinite`)."""
        if self.c.save and self.last_saved != state.iteration and not nonfinite:
            if self._save_persistent(state, final=True):
                self.last_saved = state.iteration

    def finish(self, blocking: bool, final: bool = False) -> None:
        """Commit the saves written in the background (--async-save, local ones) once every
        rank has written its files: at once with `blocking`, else only if they all have
        (checked every iteration; one agreement while a save is in flight). `final`: the
        persistent one in flight is the save that ends the run (its failure stops the run)."""
        if self.engine.save_in_flight is not None:
            self._saver().finish(blocking, final)
        if self._local is not None and self._local.files.save_in_flight is not None:
            self._local.finish(blocking, final=False)

    def finish_last(self, state: RunState) -> None:
        """After the last iteration: the save in flight committed, its failure stopping the run
        when it is of that iteration."""
        self.finish(blocking=True, final=self.engine.save_in_flight == state.iteration)

    def abandon(self) -> None:
        """On an exit path that cannot commit (an error): stop the background writers and
        remove this rank's files of the saves in flight."""
        if self._persistent is not None and self.engine.save_in_flight is not None:
            self._persistent.abandon()
        if self._local is not None and self._local.files.save_in_flight is not None:
            self._local.abandon()

    def signal_exit_note(self, state: RunState, signal: str) -> str:
        """The log line of a run that stops after `signal` at `state.iteration`: which
        checkpoint it saved, or why none."""
        c, iteration = self.c, state.iteration
        if c.save and self.last_saved != iteration:  # a non-finite streak: no checkpoint of it
            return (f"exiting after {signal} at iteration {iteration} without a checkpoint of it "
                    "(its state is not finite); exit status 0. The latest checkpoint in "
                    f"{c.save} is the one to resume from")
        if c.save:
            return (f"exiting after {signal}: saved the checkpoint of iteration {iteration} to "
                    f"{names.checkpoint_dir(c.save, iteration)}; exit status 0. Relaunch with "
                    f"--load {c.save} to resume")
        return (f"exiting after {signal} at iteration {iteration} without a checkpoint (no "
                "--save); exit status 0")

    def _saver(self) -> CheckpointSaver:
        if self._persistent is None:  # loads need no saver; saving needs prepare_saves
            raise RuntimeError("Checkpointer.prepare_saves was not called before saving")
        return self._persistent

    def _save_persistent(self, state: RunState, final: bool) -> bool:
        """Save iteration `state.iteration` into --save; False when it failed and training
        goes on."""
        return self._saver().save(state.iteration, state.client_state(), final=final)

    def _last(self, iteration: int) -> bool:
        return iteration >= self.train_iters

    def _save_global(self, state: RunState) -> None:
        """A global non-persistent save of `state.iteration` through the persistent saver,
        once the save in flight is committed and (rank 0) the iterations older than the one
        the global tracker then names are removed (Megatron's clean-up leaves 1, so the newest
        committed one survives a crash in this save)."""
        saver, directory = self._saver(), self._global_dir
        saver.finish(blocking=True, final=False)
        committed = names.read_tracker(directory) if os.path.isdir(directory) else None
        if self.rank == 0 and isinstance(committed, int):
            commit.rotate_checkpoints(directory, 1, committed)
        saver.save(state.iteration, state.client_state(), final=False, directory=directory)
