"""The non-finite policy: when training stops because of NaN/inf losses or gradients.

Every rank sees the same StepResult (the engines agree on non-finite values over the whole
world before anything is updated), so every rank reaches the same decision at the same
iteration and no rank is left waiting in a collective.

- A non-finite step (`StepResult.nonfinite`: any skipped step in fp32/bf16; in fp16 an overflow
  with the loss scale already at --min-loss-scale, or at a static scale; on DeepSpeed a
  non-finite loss) extends a streak; an applied step ends it.
- `--max-consecutive-skipped-iterations N` (default 10; 0 disables): a streak of N stops the run.
- `--check-for-nan-in-loss-and-grad`: the first non-finite step, or non-finite loss, stops it.

Stopping raises `TrainingAborted` (exit code 3 from pretrain_gpt2.py) before any checkpoint of
that iteration is written; while a streak lasts, interval saves are skipped too, so no
checkpoint is ever written from a non-finite state.
"""
from __future__ import annotations

from dataclasses import dataclass


class TrainingAborted(RuntimeError):
    """Training cannot go on (non-finite values); the message names the iteration and the fix."""


@dataclass
class NonFinitePolicy:
    """Counts consecutive non-finite iterations and decides when to stop (pure, no I/O)."""

    max_consecutive: int = 10
    check_for_nan: bool = False
    streak: int = 0

    def observe(self, iteration: int, nonfinite: bool, nonfinite_loss: bool, skipped: bool) -> None:
        """Record iteration `iteration`'s step; raise TrainingAborted when the run must stop."""
        if self.check_for_nan and (nonfinite or nonfinite_loss):
            what = "loss" if nonfinite_loss else "gradients"
            raise TrainingAborted(
                f"iteration {iteration}: non-finite {what} and --check-for-nan-in-loss-and-grad is "
                "set; stopping without saving a checkpoint. Lower --lr, check the data around "
                "this iteration, or drop the flag to skip such steps")
        if nonfinite:
            self.streak += 1
        elif not skipped:
            self.streak = 0
        if self.max_consecutive and self.streak >= self.max_consecutive:
            raise TrainingAborted(
                f"iteration {iteration}: {self.streak} consecutive iterations with non-finite "
                "loss or gradients (updates skipped); stopping without saving a checkpoint. The "
                "last checkpoint is the one to resume from: lower --lr, check the data, or raise "
                "--max-consecutive-skipped-iterations (0 disables)")

    @property
    def in_streak(self) -> bool:
        """True while the latest iterations were non-finite (no checkpoint should be written)."""
        return self.streak > 0
