"""Self-healing from loss spikes (--rollback-on-spike): reload the last checkpoint, skip the data
that led to the spike, continue; stop after --max-rollbacks.

Triggers, checked after every iteration:

- a spike: the iteration's loss is above mean + zscore x std AND above mean x (1 + min_increase),
  with mean and std over the last `window` finite losses (no spike is called before the
  window is full; a spike is never added to the history);
- the non-finite limit: --max-consecutive-skipped-iterations consecutive non-finite steps
  (app.training.resilience.nonfinite), which would otherwise stop the run.

All ranks agree on a trigger (one max all-reduce per iteration: the loss lives on the last
pipeline stage), then every rank reloads the newest checkpoint with everything in it (weights,
optimizer, LR schedule, RNG), whatever --finetune/--no-load-* said at start: with
non-persistent checkpoints the newest one (local: complete over all ranks; global: the one its
directory's tracker names) when it is at least as new as the latest persistent one under
--save, else that persistent one: the choice a resume makes, which the run's checkpointer
makes for both (app.training.checkpointing.checkpointer.rollback_target), and the log says
which. The
data of the window that led to the spike, samples [checkpoint's consumed samples, samples
consumed through the spike iteration), is skipped: the iteration count goes back to the
checkpoint's, the consumed-sample count does not, and the sampler resumes from it. The run
then needs more samples than train_iters x global batch; `app.config.samples_per_split` adds
max_rollbacks x (save_interval + max_consecutive_skipped_iterations) global batches to the
training split for this (no checkpoint is saved during a run of non-finite iterations, so one
window can be that long). A window can be longer still (several non-finite runs hiding several
save points); before reloading, every rank checks from numbers all ranks share (the data set's
length, the run's position, the checkpoint's iteration) that the samples left reach
--train-iters, and otherwise all stop alike with TrainingAborted: running out of data inside
the loop would stop only the tensor-parallel rank that reads it.

Nothing is saved from the poisoned state: the trigger is handled before the iteration's save.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Deque, Optional

import torch

from app.config import RollbackConfig, RunConfig
from app.mpu import collectives
from app.launch.distributed import world_group
from app.training.checkpointing.checkpointer import Checkpointer
from app.training.checkpointing.latest import NewestCheckpoint
from app.training.resilience.nonfinite import TrainingAborted
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)


def _nonfinite_reason(stop: TrainingAborted) -> str:
    """The policy's 'iteration N: <what>; <advice>' message cut down to <what>."""
    text = str(stop)
    what = text.split(": ", 1)[-1].split(";", 1)[0]
    return f"the non-finite limit was reached ({what})"


class SpikeDetector:
    """Running statistics of the recent losses and the spike rule (pure, no I/O)."""

    def __init__(self, config: RollbackConfig) -> None:
        self.config = config
        self.history: Deque[float] = deque(maxlen=config.window)

    def observe(self, loss: Optional[float]) -> Optional[str]:
        """Record `loss`; return why it is a spike (it is then not recorded), else None."""
        if loss is None or not math.isfinite(loss):
            return None  # non-finite steps are the non-finite policy's business
        if len(self.history) == self.config.window:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            bound = max(mean + self.config.zscore * std, mean * (1.0 + self.config.min_increase))
            if loss > bound:
                return (f"loss {loss:.4f} is above {bound:.4f} (mean {mean:.4f}, std {std:.4f} "
                        f"over the last {len(self.history)} iterations; --spike-zscore "
                        f"{self.config.zscore:g}, --spike-min-increase "
                        f"{self.config.min_increase:g})")
        self.history.append(loss)
        return None


class SpikeRollback:
    """The rollback of one run: detection, agreement across ranks, reload, data skip, budget."""

    def __init__(self, cfg: RunConfig, checkpointer: Checkpointer, device: torch.device,
                 train_samples: Optional[int] = None) -> None:
        """`checkpointer`: the run's (what to go back to, and the load); `train_samples`: the
        training data set's length (None: not checked)."""
        self.cfg, self.checkpointer, self.device = cfg, checkpointer, device
        self.train_samples = train_samples
        self.detector = SpikeDetector(cfg.rollback)
        self.rollbacks = 0

    def _agree(self, triggered: bool) -> bool:
        return collectives.agree([triggered], world_group(), self.device)[0] > 0

    def check(self, state: Any, loss: Optional[float],
              nonfinite_stop: Optional[TrainingAborted]) -> bool:
        """After iteration `state.iteration`: roll back when its loss spiked or the non-finite
        limit was reached. Returns True when `state` was moved back (the caller rebuilds its
        data iterators and resets its interval sums); raises TrainingAborted when the rollback
        budget is spent or there is no checkpoint to go back to."""
        reason = (_nonfinite_reason(nonfinite_stop) if nonfinite_stop
                  else self.detector.observe(loss))
        if not self._agree(reason is not None):
            return False
        reason = reason or "another rank saw the trigger"
        # a save still being written (--async-save, a local one) counts
        self.checkpointer.finish(blocking=True)
        chosen = self.checkpointer.rollback_target(state.iteration)  # as a resume chooses
        budget = self.cfg.rollback.max_rollbacks
        if self.rollbacks >= budget or chosen.iteration is None:
            where = self.checkpointer.nothing_to_roll_back_to(chosen)
            why = (f"{budget} rollback(s) already made (--max-rollbacks)"
                   if chosen.iteration is not None
                   else f"no checkpoint under {where} to roll back to yet")
            raise TrainingAborted(
                f"iteration {state.iteration}: {reason}; {why}: stopping without saving a "
                f"checkpoint. The last good checkpoint is "
                f"{chosen.describe() if chosen.iteration is not None else 'none'}: check "
                "the data after it, lower --lr, or raise --max-rollbacks")
        self._check_data_left(state, reason, chosen)
        self.rollbacks += 1
        logger.warning("iteration %d: %s: rolling back (%d of %d)", state.iteration, reason,
                       self.rollbacks, budget, extra=LAST_RANK)
        # everything the checkpoint holds, whatever the start-up flags said
        loaded = self.checkpointer.load(chosen, restore_all=True, doing="rolling back to")
        if loaded is None:
            raise TrainingAborted(f"iteration {state.iteration}: {reason}; {chosen.describe()} "
                                  "disappeared while rolling back: stopping")
        skipped = (loaded.consumed_train_samples, state.consumed_train_samples)
        logger.warning("rolled back to iteration %d from %s (%s); skipping training samples "
                       "[%d, %d) (the %d iterations of data that led to the spike)",
                       loaded.iteration, chosen.describe(), loaded.path, skipped[0], skipped[1],
                       state.iteration - loaded.iteration, extra=LAST_RANK)
        state.iteration = loaded.iteration
        state.consumed_valid_samples = loaded.consumed_valid_samples
        return True

    def _check_data_left(self, state: Any, reason: str, chosen: NewestCheckpoint) -> None:
        """Raise TrainingAborted (on every rank alike: the numbers are the same everywhere)
        when going back to checkpoint `chosen` and skipping the data read since would leave too
        few training samples to reach --train-iters."""
        if self.train_samples is None:
            return
        t = self.cfg.training
        back_to = chosen.iteration if isinstance(chosen.iteration, int) else 0  # "release": 0
        needed = state.consumed_train_samples + self.cfg.batch_schedule.samples_in(
            t.train_iters - back_to, state.consumed_train_samples)
        if needed <= self.train_samples:
            return
        raise TrainingAborted(
            f"iteration {state.iteration}: {reason}; rolling back to iteration {back_to} would "
            f"skip the data read since it, and the {t.train_iters - back_to} iterations left to "
            f"--train-iters {t.train_iters} would then need training samples up to {needed}, "
            f"but the training data set holds {self.train_samples}: stopping without saving a "
            f"checkpoint. The last good checkpoint is {chosen.describe()}: "
            "check the data after it, or resume from it with a lower --save-interval or a "
            "higher --max-rollbacks (each sizes the training data for (--save-interval + "
            "--max-consecutive-skipped-iterations) more iterations)")
