"""Fault handling as the training loop sees it: one object the trainer asks after each step.

The trainer holds one `RunGuard` and asks it, at fixed points of every iteration:

- `beat(phase)`: the loop's progress, for the peer watchdog (app.training.resilience.watchdog);
- `observe(step)`: the non-finite policy (app.training.resilience.nonfinite), then with
  --rollback-on-spike the spike check (app.training.resilience.rollback), which turns the
  policy's stop into a rollback through the run's checkpointer while the budget lasts;
- `should_exit()`: --exit-interval, the --exit-duration-in-mins budget and an exit signal
  (app.training.resilience.signals), agreed by every rank in one all-reduce;
- `snapshot()`: --inprocess-restart's in-memory snapshots (app.training.resilience.inprocess);
- `failure(exc)`: a collective that failed because another rank died or timed out, as the
  PeerFailure naming this rank and the phase.

The checkpointer (app.training.checkpointing) never asks the guard; saves run in the guard's
`saving()` context (the exit-signal handler's flag, so a second signal waits for the save, and
the watchdog's beat).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Optional

import torch

from app.checkpoint import CheckpointError
from app.config import RunConfig
from app.launch.distributed import world_group
from app.mpu import collectives
from app.training.checkpointing.checkpointer import Checkpointer
from app.training.resilience.inprocess import InProcessRestart
from app.training.resilience.nonfinite import NonFinitePolicy, TrainingAborted
from app.training.resilience.rollback import SpikeRollback
from app.training.resilience.signals import ExitSignalHandler, signal_name
from app.training.resilience.watchdog import Watchdog, is_peer_failure
from app.training.state import RunState, StepOutput


class RunGuard:
    """Fault handling of one training attempt over `state` (the trainer's RunState, moved back
    in place by a rollback). `signals`, `watchdog` and `inprocess` are optional (None: not on)."""

    def __init__(self, cfg: RunConfig, engine: Any, device: torch.device, state: RunState,
                 checkpointer: Checkpointer, train_samples: Optional[int] = None, *,
                 signals: Optional[ExitSignalHandler] = None,
                 watchdog: Optional[Watchdog] = None,
                 inprocess: Optional[InProcessRestart] = None) -> None:
        t = cfg.training
        self.cfg, self.engine, self.device, self.state = cfg, engine, device, state
        self.signals, self.watchdog, self.inprocess = signals, watchdog, inprocess
        self.nonfinite = NonFinitePolicy(t.max_consecutive_skipped_iterations,
                                         t.check_for_nan_in_loss_and_grad)
        self.rollback = (SpikeRollback(cfg, checkpointer, device, train_samples)
                         if cfg.rollback.enabled else None)
        self.stop_signal = 0
        """The signal that stopped training (0 when none did)."""
        self.start_time = time.time()

    @property
    def in_streak(self) -> bool:
        """Inside a run of non-finite iterations (no checkpoint is saved then)."""
        return self.nonfinite.in_streak

    def beat(self, phase: str) -> None:
        """This rank is now in `phase` of the coming iteration (the watchdog's heartbeat)."""
        if self.watchdog is not None:
            self.watchdog.beat(phase, self.state.iteration + 1)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The context a checkpoint is written in: the watchdog's 'checkpoint save' beat, and
        the exit-signal handler's `saving` flag (a second signal then waits for the save)."""
        self.beat("checkpoint save")
        if self.signals is not None:
            self.signals.saving = True
        try:
            yield
        finally:
            if self.signals is not None:
                self.signals.saving = False

    def observe(self, step: StepOutput) -> bool:
        """After an iteration: the non-finite policy, then (with --rollback-on-spike) the spike
        check, which turns the policy's stop into a rollback while the budget lasts. True when
        the state was rolled back (the caller rebuilds its data iterators and sums)."""
        s = self.state
        try:
            self.nonfinite.observe(s.iteration, step.nonfinite, step.nonfinite_loss,
                                   step.skipped)
            stop = None
        except TrainingAborted as exc:
            if self.rollback is None:
                raise
            stop = exc
        if self.rollback is None or not self.rollback.check(s, step.loss, stop):
            return False
        self.nonfinite.streak = 0
        if self.inprocess is not None:  # its snapshots hold the window just skipped
            self.inprocess.after_rollback(self.engine, s)
        return True

    def should_exit(self) -> bool:
        """Whether every rank stops after this iteration: --exit-interval, the
        --exit-duration-in-mins budget, or an exit signal (agreed by all ranks: one all-reduce
        (max) of both, so all ranks stop at the same iteration)."""
        t = self.cfg.training
        out_of_time = False
        if t.exit_duration_in_mins or self.signals is not None:
            self.beat("stop agreement")
            over = 1.0 if t.exit_duration_in_mins and (
                time.time() - self.start_time) / 60.0 > t.exit_duration_in_mins else 0.0
            signum = float(self.signals.pending()) if self.signals is not None else 0.0
            over, signum = collectives.agree([over, signum], world_group(), self.device)
            out_of_time, self.stop_signal = over > 0, int(signum)
        at_interval = bool(t.exit_interval and self.state.iteration % t.exit_interval == 0)
        return at_interval or out_of_time or bool(self.stop_signal)

    @property
    def stop_signal_name(self) -> str:
        """The name of the signal that stopped training ('' when none did)."""
        return signal_name(self.stop_signal) if self.stop_signal else ""

    def snapshot(self) -> None:
        """--inprocess-restart: hand the state after this iteration to its snapshots."""
        if self.inprocess is not None:
            self.inprocess.after_iteration(self.engine, self.state)

    def failure(self, exc: RuntimeError) -> Optional[BaseException]:
        """The PeerFailure to raise for `exc` when it is a collective that failed because
        another rank died or timed out (with a watchdog attached), else None (always for the
        run's own stops: TrainingAborted, CheckpointError)."""
        if isinstance(exc, (TrainingAborted, CheckpointError)):
            return None
        if self.watchdog is not None and is_peer_failure(exc):
            return self.watchdog.failure(exc)
        return None

    def idle(self) -> None:
        """Outside the loop: the watchdog stops watching."""
        if self.watchdog is not None:
            self.watchdog.idle()
