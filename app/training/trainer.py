"""The training loop: iterations of accumulated micro-batches, evaluation, and what follows each.

The loop talks only to an `Engine` (native or DeepSpeed) and to a forward/backward schedule
(no pipelining, or 1F1B when the pipeline has several stages). It keeps the run's position as
`iteration` and `consumed_train_samples` / `consumed_valid_samples`, which checkpoints carry,
so a resumed run continues exactly where it stopped. Its collaborators, one object each:

- `reporter` (app.training.telemetry.reporting): the step's metrics, the log line, Megatron's
  scalars, timers, MFU, stragglers;
- `checkpointer` (app.training.checkpointing): every save (persistent, async, local, global,
  final) and what a resume or rollback loads;
- `guard` (app.training.resilience.guard): fault handling (docs/reliability.md): the
  non-finite policy and spike rollback, the exit agreement (a signal, the
  --exit-duration-in-mins budget), the watchdog's phases, in-process restart snapshots; a
  collective that fails because another rank died or timed out becomes a PeerFailure naming
  this rank and the phase;
- `runtime` (app.training.telemetry.runtime_hooks): the per-iteration work around the steps
  (--manual-gc, --empty-unused-memory-level, --profile), at fixed points of every iteration.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from app.config import RunConfig
from app.config.batch_schedule import micro_batches
from app.mpu import ParallelState
from app.pipeline import get_forward_backward_func
from app.training.checkpointing.checkpointer import Checkpointer
from app.training.data_loading import (BatchBuilder, build_data_iterator, check_run_data,
                                       close_data_iterator)
from app.training.engines.base import Engine
from app.training.loss import DEFAULT_LOSS, LossFunction, MicroBatchObjective
from app.training.resilience.guard import RunGuard
from app.training.state import RunState, StepOutput
from app.training.telemetry.reporting import TrainingReporter
from app.training.telemetry.runtime_hooks import RuntimeHooks


class Trainer:
    """Runs training for `cfg.training.train_iters` iterations on the given engine and datasets.

    `loss_function` (app.training.loss) is the objective, Megatron's masked-mean LM loss by
    default; its metrics are averaged and logged. With `return_logits` the results of
    `train_step` and `eval_step` carry the full-vocabulary logits of every micro-batch on the
    last pipeline stage (Accelerate's `return_logits`). `checkpointer` is the run's (default:
    one built here); `signals` (ExitSignalHandler), `watchdog` (Watchdog) and `inprocess`
    (InProcessRestart) are the guard's (app.training.resilience.guard), when on.
    """

    def __init__(self, cfg: RunConfig, engine: Engine, parallel_state: ParallelState, datasets: tuple,
                 eod: int, device: torch.device, state: Optional[RunState] = None,
                 loss_function: Optional[LossFunction] = None,
                 return_logits: bool = False, *, checkpointer: Optional[Checkpointer] = None,
                 signals: Optional[Any] = None,
                 watchdog: Optional[Any] = None, inprocess: Optional[Any] = None) -> None:
        self.cfg, self.engine, self.ps, self.device = cfg, engine, parallel_state, device
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.state = state or RunState()
        self.objective = MicroBatchObjective(loss_function or DEFAULT_LOSS, parallel_state,
                                             return_logits,
                                             per_token=cfg.training.calculate_per_token_loss)
        t = cfg.training
        self.eval_micro = t.num_micro_batches(parallel_state.data_parallel_size)
        """Micro-batches of an evaluation iteration: --global-batch-size's."""
        self.num_micro = self.eval_micro
        """Micro-batches of the iteration running (the batch-size schedule's)."""
        self.global_batch = t.global_batch_size
        """The global batch of the iteration running (or of the last one)."""
        self.batches = BatchBuilder(cfg.data, eod, t.micro_batch_size, cfg.model.seq_length,
                                    parallel_state, device)
        self.reporter = TrainingReporter(cfg, parallel_state, device, engine.module)
        self.runtime = RuntimeHooks(cfg.runtime, parallel_state.rank, device, t.tensorboard_dir,
                                    log=self.log)
        self.checkpointer = checkpointer or Checkpointer(cfg.checkpoint, engine, parallel_state,
                                                         device, t.train_iters)
        self.guard = RunGuard(cfg, engine, device, self.state, self.checkpointer,
                              None if self.train_ds is None else len(self.train_ds),
                              signals=signals, watchdog=watchdog, inprocess=inprocess)
        self.checkpointer.prepare_saves(self.reporter.writer, saving=self.guard.saving)

    def log(self, message: str) -> None:
        """One line of the training log, printed by the last rank (see app.utils.rank_logging)."""
        self.reporter.log(message)

    # ------------------------------------------------------------------ one iteration

    def _forward_backward(self, iterator, forward_only: bool) -> List[torch.Tensor]:
        """Run all micro-batches of one iteration (training: the schedule's count for this
        iteration; evaluation: --global-batch-size's) through the pipeline schedule; losses
        (last stage)."""
        schedule = get_forward_backward_func(self.ps)
        model, m = self.engine.module, self.cfg.model
        # stages pass [b, s/C, h] (context parallelism), [b, s/(C tp), h] with sequence parallelism
        seq = m.seq_length // self.ps.context_parallel_size // (
            self.ps.tensor_model_parallel_size if m.sequence_parallel else 1)
        phase = "evaluation" if forward_only else "forward-backward"

        def next_batch():
            self.guard.beat(phase)
            return self.batches.next(iterator)

        if not forward_only:  # per-token loss: N counted before the passes
            next_batch = self.objective.prefetch(next_batch, self.num_micro)
        forward_step = lambda batch: self.objective.forward_step(model, batch)  # noqa: E731
        loss_func = self.objective.loss_func
        if not forward_only:  # --log-straggler times training's forward steps and batch waits
            next_batch, forward_step = self.reporter.stragglers.timed(next_batch, forward_step)
            loss_func = self.objective.training_loss_func(self.state.consumed_train_samples)
            self.objective.begin_training_iteration(model, self.engine.loss_scale,
                                                    self.num_micro)
        return schedule(forward_step_func=forward_step, batch_func=next_batch, model=model,
                        num_microbatches=self.eval_micro if forward_only else self.num_micro,
                        loss_func=loss_func, backward_func=self.engine.backward,
                        output_backward_func=self.engine.backward_output,
                        parallel_state=self.ps, forward_only=forward_only,
                        tensor_shape=(self.cfg.training.micro_batch_size, seq, m.hidden_size))

    def set_batch(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` (the
        batch-size schedule), told to the engine; returns it. Logs a change of batch size."""
        t, ps = self.cfg.training, self.ps
        batch = self.cfg.batch_schedule.batch_at(consumed_samples)
        num_micro = micro_batches(batch, t.micro_batch_size, ps.data_parallel_size)
        if batch != self.global_batch:
            self.log(f"batch size {self.global_batch} -> {batch} at consumed samples "
                     f"{consumed_samples} ({num_micro} micro-batches of {t.micro_batch_size} "
                     f"per data-parallel rank)")
        self.global_batch, self.num_micro = batch, num_micro
        self.engine.set_global_batch(batch, num_micro)
        return batch

    def train_step(self, iterator) -> StepOutput:
        """One iteration: zero grads, accumulate all micro-batches, step. Returns its numbers."""
        timers = self.reporter.timers
        self.engine.train()
        self.engine.zero_grad()
        timers("forward-backward").start()
        losses = self._forward_backward(iterator, forward_only=False)
        self.runtime.after_forward_backward()
        timers("forward-backward").stop()
        self.guard.beat("optimizer")
        timers("optimizer").start()
        result = self.engine.step()
        timers("optimizer").stop()
        metrics, logits = self.objective.take()
        return StepOutput(loss=self.objective.reported_loss(losses),
                          metrics=self.reporter.step_metrics(metrics, self.num_micro),
                          logits=logits if self.objective.return_logits else None,
                          grad_norm=result.grad_norm, skipped=result.skipped, lr=result.lr,
                          loss_scale=result.loss_scale, nonfinite=result.nonfinite,
                          nonfinite_loss=result.nonfinite_loss)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def eval_step(self, iterator) -> StepOutput:
        """Forward only over one global batch: its mean loss (last stage; None elsewhere) and
        metrics, plus the micro-batches' logits with `return_logits`."""
        self.engine.eval()
        losses = self._forward_backward(iterator, forward_only=True)
        self.engine.train()
        metrics, logits = self.objective.take()
        return StepOutput(loss=self.objective.reported_loss(losses),
                          metrics=self.reporter.step_metrics(metrics),
                          logits=logits if self.objective.return_logits else None)

    @torch.no_grad()
    def evaluate(self, iterator, num_iters: int) -> Optional[float]:
        """Mean loss over `num_iters` iterations of the global batch (forward only)."""
        self.engine.eval()
        losses: List[torch.Tensor] = []
        with self.runtime.evaluation():
            for _ in range(num_iters):
                losses.extend(self._forward_backward(iterator, forward_only=True))
                self.runtime.after_forward_backward()
        self.engine.train()
        self.objective.take()  # evaluation reports the loss only
        return self.objective.reported_loss(losses)

    def _validate(self, valid_iter) -> None:
        """One validation run (--eval-iters iterations) reported; its samples counted."""
        t, s = self.cfg.training, self.state
        self.reporter.evaluation("valid", s.iteration, s.consumed_train_samples,
                                 self.evaluate(valid_iter, t.eval_iters))
        s.consumed_valid_samples += t.eval_iters * t.global_batch_size

    # ------------------------------------------------------------------ the loop

    def train(self) -> RunState:
        """Train to `train_iters` (or an exit condition); evaluate and save as configured.

        A collective that fails because another rank died or timed out raises PeerFailure
        (when a watchdog is attached)."""
        try:
            return self._train()
        except RuntimeError as exc:
            failure = self.guard.failure(exc)
            if failure is not None:
                raise failure from exc
            raise
        finally:
            self.guard.idle()

    def _train(self) -> RunState:
        """The loop: one iteration, then what follows it (observe, account, log, evaluate,
        agree on stopping, save), then the end: the last save committed, the final evaluation
        and save, or the exit message."""
        t, s = self.cfg.training, self.state
        if s.iteration >= t.train_iters:
            self.log(f"nothing to train: the run is at iteration {s.iteration} and --train-iters "
                     f"is {t.train_iters}; raise --train-iters to continue")
            self.reporter.close()
            return s
        check_run_data(self.cfg, s.iteration, s.consumed_train_samples,
                       s.consumed_valid_samples, self.ps, self.train_ds, self.valid_ds)
        loop = _Loop(*self._data_iterators())
        ended = False
        try:
            with self.runtime.training():
                self._iterate(loop)
                self._end(loop)
            ended = True
        finally:  # every exit path: no data-loader worker or background writer outlives this
            if not ended:
                self.checkpointer.abandon()
            loop.close()
            self.reporter.close()
        return s

    def _iterate(self, loop: "_Loop") -> None:
        """Iterations until --train-iters or an agreed exit."""
        t, s, guard = self.cfg.training, self.state, self.guard
        self.global_batch = self.cfg.batch_schedule.batch_at(s.consumed_train_samples)
        guard.snapshot()
        while s.iteration < t.train_iters and not loop.exiting:
            batch = self.set_batch(s.consumed_train_samples)
            t0 = time.time()
            with self.runtime.iteration(s.iteration):
                step = self.train_step(loop.train_iter)
            self.reporter.add_iteration(time.time() - t0, batch)
            s.iteration += 1
            s.consumed_train_samples += batch
            if guard.observe(step):  # rolled back: new position, fresh iterators and sums
                loop.close()
                loop.train_iter, loop.valid_iter = self._data_iterators()
                self.reporter.reset_interval()
                continue
            self.reporter.account(step, s)
            self.reporter.after_iteration(s, step, self.global_batch, self.engine)
            if t.eval_iters and self.valid_ds is not None and s.iteration % t.eval_interval == 0:
                self._validate(loop.valid_iter)
            loop.exiting = guard.should_exit()
            self.checkpointer.maybe_save(s, exiting=loop.exiting, nonfinite=guard.in_streak)
            guard.snapshot()

    def _end(self, loop: "_Loop") -> None:
        """After the last iteration: the last save committed (its failure stops the run), then
        the exit message, or the final evaluation, save and test."""
        t, s = self.cfg.training, self.state
        self.checkpointer.finish_last(s)
        if self.guard.stop_signal:
            self.log(self.checkpointer.signal_exit_note(s, self.guard.stop_signal_name))
            return
        if loop.exiting:
            self.log(f"exiting at iteration {s.iteration} (exit condition reached)")
            return
        if t.eval_iters and self.valid_ds is not None and s.iteration % t.eval_interval != 0:
            self._validate(loop.valid_iter)
        self.checkpointer.save_final(s, nonfinite=self.guard.in_streak)
        if t.eval_iters and self.test_ds is not None:
            test_iter = build_data_iterator(self.test_ds, 0, t.micro_batch_size, self.ps, 0)
            self.reporter.evaluation("test", s.iteration, s.consumed_train_samples,
                                     self.evaluate(test_iter, t.eval_iters))

    def _data_iterators(self) -> Tuple[Any, Any]:
        """Training and validation iterators from the run's consumed-sample positions."""
        t, s = self.cfg.training, self.state
        return (build_data_iterator(self.train_ds, s.consumed_train_samples, t.micro_batch_size,
                                    self.ps, self.cfg.data.num_workers),
                build_data_iterator(self.valid_ds, s.consumed_valid_samples, t.micro_batch_size,
                                    self.ps, 0))


@dataclass
class _Loop:
    """The training loop's own state: its iterators, and whether the ranks agreed to exit after
    this iteration."""

    train_iter: Any
    valid_iter: Any
    exiting: bool = False

    def close(self) -> None:
        """Stop the iterators' data-loader workers (app.training.data_loading)."""
        close_data_iterator(self.train_iter)
        close_data_iterator(self.valid_iter)
