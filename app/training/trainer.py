"""The training loop: iterations of accumulated micro-batches, evaluation, logging, saving, exits.

The loop talks only to an `Engine` (native or DeepSpeed) and to a forward/backward schedule
(no pipelining, or 1F1B when the pipeline has several stages). It keeps the run's position as
`iteration` and `consumed_train_samples` / `consumed_valid_samples`, which checkpoints carry,
so a resumed run continues exactly where it stopped.

Faults (docs/reliability.md): at the end of every iteration the ranks agree in one all-reduce
whether to stop (a signal recorded by `signals`, the `--exit-duration-in-mins` budget), then all
save and return; the loop reports its phase to `watchdog`, and a collective that fails because
another rank died or timed out becomes a PeerFailure naming this rank and the phase.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from app.config import RunConfig
from app.config.batch_schedule import micro_batches
from app.model.moe import MoEMetrics, begin_iteration as begin_moe_iteration
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState
from app.training.telemetry import metrics as metrics_lib
from app.training.telemetry.reporting import TIMERS, TrainingReporter, interval_values
from app.training.telemetry.runtime_hooks import RuntimeHooks
from app.training.telemetry.stragglers import StragglerDetector
from app.launch.distributed import world_group
from app.training.data_loading import (BatchBuilder, build_data_iterator, check_run_data,
                                       close_data_iterator)
from app.training.engines.base import Engine
from app.checkpoint import CheckpointError
from app.checkpoint.names import checkpoint_dir
from app.pipeline import get_forward_backward_func
from app.training.loss import DEFAULT_LOSS, LossFunction, MicroBatchObjective
from app.training.resilience.inprocess import InProcessRestart
from app.training.resilience.local_checkpoints import non_persistent_saves
from app.training.resilience.nonfinite import NonFinitePolicy, TrainingAborted
from app.training.resilience.rollback import SpikeRollback
from app.training.resilience.saving import CheckpointSaver, SaveFailed, flagged
from app.training.resilience.signals import ExitSignalHandler, signal_name
from app.training.resilience.watchdog import Watchdog, is_peer_failure
from app.training.state import RunState, StepOutput
from app.utils import faults
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)


@dataclass
class _Interval:
    """Sums over one logging interval."""

    losses: List[float] = field(default_factory=list)
    metrics: Dict[str, List[float]] = field(default_factory=dict)
    skipped: int = 0
    nan: int = 0
    iterations: int = 0
    samples: int = 0
    seconds: float = 0.0


class Trainer:
    """Runs training for `cfg.training.train_iters` iterations on the given engine and datasets.

    `loss_function` (app.training.loss) is the objective, Megatron's masked-mean LM loss by
    default; its metrics are averaged and logged. With `return_logits` the results of
    `train_step` and `eval_step` carry the full-vocabulary logits of every micro-batch on the
    last pipeline stage (Accelerate's `return_logits`).
    """

    def __init__(self, cfg: RunConfig, engine: Engine, parallel_state: ParallelState, datasets: tuple,
                 eod: int, device: torch.device, state: Optional[RunState] = None,
                 loss_function: Optional[LossFunction] = None,
                 return_logits: bool = False, *,
                 signals: Optional[ExitSignalHandler] = None,
                 watchdog: Optional[Watchdog] = None,
                 inprocess: Optional[InProcessRestart] = None) -> None:
        self.cfg, self.engine, self.ps = cfg, engine, parallel_state
        self.inprocess = inprocess
        """--inprocess-restart's snapshots, taken before the first iteration and after each."""
        self.objective = MicroBatchObjective(loss_function or DEFAULT_LOSS, parallel_state,
                                             return_logits,
                                             per_token=cfg.training.calculate_per_token_loss)
        self.signals, self.watchdog = signals, watchdog
        self.stop_signal = 0
        """The signal that stopped training (0 when none did)."""
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.device = device
        # Megatron's print_rank_last: the loss lives on the last pipeline stage
        self.is_logging_rank = parallel_state.rank == parallel_state.world_size - 1
        self.state = state or RunState()
        t = cfg.training
        self.eval_micro = t.num_micro_batches(parallel_state.data_parallel_size)
        """Micro-batches of an evaluation iteration: --global-batch-size's."""
        self.num_micro = self.eval_micro
        """Micro-batches of the iteration running (the batch-size schedule's)."""
        self.global_batch = t.global_batch_size
        """The global batch of the iteration running (or of the last one)."""
        self.batches = BatchBuilder(cfg.data, eod, t.micro_batch_size, cfg.model.seq_length,
                                    parallel_state, device)
        self.writer = metrics_lib.MetricsWriter(t.tensorboard_dir, t.metrics_file,
                                                enabled=self.is_logging_rank, wandb=cfg.wandb,
                                                run_config=cfg,
                                                queue_size=cfg.log.tensorboard_queue_size)
        self.runtime = RuntimeHooks(cfg.runtime, parallel_state.rank, device, t.tensorboard_dir,
                                    log=self.log)
        """Manual GC, the CUDA cache and the profiler around the steps (telemetry.runtime_hooks)."""
        self.moe_metrics = MoEMetrics(engine.module, cfg.model, parallel_state, world_group())
        self.reporter = TrainingReporter(cfg, self.writer, device, parallel_state.world_size,
                                         parallel_state.pipeline_model_parallel_size,
                                         self.is_logging_rank, self.log)
        """MFU, the log line and Megatron's TensorBoard scalars (telemetry.reporting)."""
        self._state_bytes_reported = False
        self.nonfinite = NonFinitePolicy(t.max_consecutive_skipped_iterations,
                                         t.check_for_nan_in_loss_and_grad)
        self.saver = CheckpointSaver(cfg.checkpoint, engine, self.writer, self.log,
                                     saving=lambda: flagged(self.signals))
        self.local_saves = non_persistent_saves(
            cfg.checkpoint, engine, self.saver, parallel_state.rank, parallel_state.world_size,
            device, self.writer, self.log)
        """--non-persistent-save-interval's local or global checkpoints (None without it;
        resilience.local_checkpoints)."""
        self.rollback = (SpikeRollback(cfg, engine, device, _length(self.train_ds),
                                       finish_save=lambda: self._finish_save(blocking=True))
                         if cfg.rollback.enabled else None)
        self.start_time = time.time()
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.timers = metrics_lib.Timers(synchronize=sync)
        self.stragglers = StragglerDetector(t.log_straggler, t.straggler_margin,
                                            t.straggler_minmax_count, world_group(), device)

    @staticmethod
    def log(message: str) -> None:
        """One line of the training log, printed by the last rank (see app.utils.rank_logging)."""
        logger.info(message, extra=LAST_RANK)

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
            self._beat(phase)
            return self.batches.next(iterator)

        if self.objective.per_token and not forward_only:  # N counted before the passes
            batches = [next_batch() for _ in range(self.num_micro)]
            self.objective.prepare(batches, self.num_micro)
            next_batch = iter(batches).__next__

        forward_step = lambda batch: self.objective.forward_step(model, batch)  # noqa: E731
        if not forward_only:  # --log-straggler times training's forward steps and batch waits
            begin_moe_iteration(model, self.engine.loss_scale, self.ps.context_parallel_size,
                                self.num_micro, self.objective.aux_loss_scale(self.num_micro))
            next_batch, forward_step = self.stragglers.timed(next_batch, forward_step)
        return schedule(forward_step_func=forward_step,
                        batch_func=next_batch,
                        model=model,
                        num_microbatches=self.eval_micro if forward_only else self.num_micro,
                        loss_func=self._loss_func(forward_only),
                        backward_func=self.engine.backward,
                        output_backward_func=self.engine.backward_output,
                        parallel_state=self.ps, forward_only=forward_only,
                        tensor_shape=(self.cfg.training.micro_batch_size, seq, m.hidden_size))

    def _mean_metrics_across_dp(self, metrics: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
        """{name: mean over the micro-batches and data-parallel ranks} of the loss's metrics."""
        if not metrics:
            return {}
        names = sorted(metrics[0])
        means = torch.stack([torch.stack([m[n] for m in metrics]).mean() for n in names])
        if self.ps.data_parallel_size > 1:
            collectives.all_reduce(means, self.ps.data_parallel_group, op="avg")
        return dict(zip(names, means.tolist()))

    def _beat(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase, self.state.iteration + 1)

    def _loss_func(self, forward_only: bool) -> Callable:
        """The schedule's loss_func: the objective's, in training through the fault-injection
        point `faults.TRAINING_LOSS` when a test armed it."""
        inject = faults.armed(faults.TRAINING_LOSS)
        if inject is None or forward_only:
            return self.objective.loss_func
        first_sample = self.state.consumed_train_samples
        return lambda out, batch: inject(first_sample, self.objective.loss_func(out, batch))

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
        self.engine.train()
        self.engine.zero_grad()
        self.timers("forward-backward").start()
        losses = self._forward_backward(iterator, forward_only=False)
        self.runtime.after_forward_backward()
        self.timers("forward-backward").stop()
        self._beat("optimizer")
        self.timers("optimizer").start()
        result = self.engine.step()
        self.timers("optimizer").stop()
        metrics, logits = self.objective.take()
        return StepOutput(loss=self.objective.reported_loss(losses),
                          metrics={**self._mean_metrics_across_dp(metrics),
                                   **self.moe_metrics.take(self.num_micro)},
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
                          metrics=self._mean_metrics_across_dp(metrics),
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

    def _report_eval(self, kind: str, loss: Optional[float]) -> None:
        self.reporter.evaluation(kind, self.state.iteration, self.state.consumed_train_samples,
                                 loss)

    # ------------------------------------------------------------------ logging

    def _log_interval(self, acc: _Interval, step: StepOutput) -> None:
        t, s = self.cfg.training, self.state
        values = interval_values(acc.losses, step, s.consumed_train_samples, step.lr,
                                 self.global_batch, acc.seconds, acc.iterations, acc.samples,
                                 self.cfg.model.seq_length, t.train_iters - s.iteration)
        values.update(skipped_iterations=acc.skipped, nan_iterations=acc.nan,
                      total_skipped_iterations=s.skipped_iterations)
        self.reporter.interval(s.iteration, values,
                               metrics_lib.interval_means(acc.metrics),  # MoE's lists element-wise
                               acc.iterations, {name: self.timers.elapsed(name)
                                                for name in TIMERS})

    def _report_state_bytes(self) -> None:
        """Bytes of parameters, gradients and optimizer states of every rank, after the first
        step (when optimizer states exist); shows how ZeRO partitions them."""
        self._state_bytes_reported = True
        b = self.engine.state_bytes()  # "host": what ZeRO-3 offloads there
        mine = torch.tensor([float(b[k]) for k in ("params", "grads", "optimizer")]
                            + [float(b.get("host", 0))], dtype=torch.float64, device=self.device)
        every = [x.cpu().tolist() for x in collectives.all_gather(mine, world_group())]
        for rank, (params, grads, optim, host) in enumerate(every):
            self.log(f"state held by rank {rank} ({self.engine.name}): parameters "
                     f"{params / 2**20:.2f} MiB, gradients {grads / 2**20:.2f} MiB, "
                     f"optimizer states {optim / 2**20:.2f} MiB"
                     + (f", offloaded to the host {host / 2**20:.2f} MiB" if host else ""))
        self.writer.write("state_bytes", self.state.iteration,
                          {**b, "per_rank": [[int(v) for v in row] for row in every]})

    # ------------------------------------------------------------------ the loop

    def _save(self, final: bool) -> bool:
        """Save the checkpoint of this iteration (every rank); False when the save failed and
        training goes on (app.training.resilience.saving; SaveFailed when the run stops)."""
        self._beat("checkpoint save")
        return self.saver.save(self.state.iteration, self.state.client_state(), final=final)

    def _finish_save(self, blocking: bool, final: bool = False) -> None:
        """Commit the checkpoint being written in the background (--async-save) once every rank
        has written its files: at once with `blocking` (before exiting), else only if they all
        have (checked every iteration; one agreement while a save is in flight). `final`: it is
        the save that ends the run (its failure stops the run)."""
        if self.engine.save_in_flight is not None:
            self._beat("checkpoint save")
            self.saver.finish(blocking, final)
        if self.local_saves is not None:
            self.local_saves.finish(blocking)

    def _stop_request(self) -> Tuple[bool, int]:
        """(the --exit-duration-in-mins budget is spent, the signal to stop on or 0), the same on
        every rank: one all-reduce (max) of both, so all ranks stop at the same iteration."""
        limit = self.cfg.training.exit_duration_in_mins
        if not limit and self.signals is None:
            return False, 0
        self._beat("stop agreement")
        over = 1.0 if limit and (time.time() - self.start_time) / 60.0 > limit else 0.0
        signum = float(self.signals.pending()) if self.signals is not None else 0.0
        over, signum = collectives.agree([over, signum], world_group(), self.device)
        return over > 0, int(signum)

    def train(self) -> RunState:
        """Train to `train_iters` (or an exit condition); evaluate and save as configured.

        A collective that fails because another rank died or timed out raises PeerFailure
        (when a watchdog is attached)."""
        try:
            return self._train()
        except (TrainingAborted, CheckpointError, SaveFailed):
            raise
        except RuntimeError as exc:
            if self.watchdog is not None and is_peer_failure(exc):
                raise self.watchdog.failure(exc) from exc
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.idle()

    def _train(self) -> RunState:
        """The loop: one iteration, then what follows it (observe, account, log, evaluate,
        agree on stopping, save), each a small method below."""
        t, s = self.cfg.training, self.state
        if s.iteration >= t.train_iters:
            self.log(f"nothing to train: the run is at iteration {s.iteration} and --train-iters "
                     f"is {t.train_iters}; raise --train-iters to continue")
            self.writer.close()
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
                self.saver.abandon()
                if self.local_saves is not None:
                    self.local_saves.abandon()
            loop.close()
            self.writer.close()
        return s

    def _iterate(self, loop: "_Loop") -> None:
        """Iterations until --train-iters or an agreed exit."""
        t, s = self.cfg.training, self.state
        self.global_batch = self.cfg.batch_schedule.batch_at(s.consumed_train_samples)
        self._snapshot()
        while s.iteration < t.train_iters and not loop.exiting:
            batch = self.set_batch(s.consumed_train_samples)
            t0 = time.time()
            with self.runtime.iteration(s.iteration):
                step = self.train_step(loop.train_iter)
            loop.interval.seconds += time.time() - t0
            s.iteration += 1
            s.consumed_train_samples += batch
            loop.interval.iterations += 1
            loop.interval.samples += batch
            if self._observe(step):  # rolled back: new position, fresh iterators and sums
                loop.close()
                loop.train_iter, loop.valid_iter = self._data_iterators()
                loop.interval = _Interval()
                continue
            self._account(loop.interval, step)
            self._maybe_log(loop, step)
            self._maybe_evaluate(loop)
            loop.exiting = self._should_exit()
            self._finish_save(blocking=loop.exiting)
            self._maybe_save(loop)
            if self.local_saves is not None and not self.nonfinite.in_streak:
                self.local_saves.maybe_save(s.iteration, s.client_state(), persistent=(
                    loop.last_saved == s.iteration or s.iteration >= t.train_iters))
            self._snapshot()

    def _snapshot(self) -> None:
        """--inprocess-restart: hand the state after this iteration to its snapshots."""
        if self.inprocess is not None:
            self.inprocess.after_iteration(self.engine, self.state)

    def _end(self, loop: "_Loop") -> None:
        """After the last iteration: the last save committed (its failure stops the run), then
        the exit message, or the final evaluation and save."""
        s = self.state
        self._finish_save(blocking=True, final=self.engine.save_in_flight == s.iteration)
        if self.stop_signal:
            self._log_signal_exit(loop.last_saved)
        elif loop.exiting:
            self.log(f"exiting at iteration {s.iteration} (exit condition reached)")
        else:
            self._finish(loop.valid_iter, loop.last_saved)

    def _data_iterators(self) -> Tuple[Any, Any]:
        """Training and validation iterators from the run's consumed-sample positions."""
        t, s = self.cfg.training, self.state
        return (build_data_iterator(self.train_ds, s.consumed_train_samples, t.micro_batch_size,
                                    self.ps, self.cfg.data.num_workers),
                build_data_iterator(self.valid_ds, s.consumed_valid_samples, t.micro_batch_size,
                                    self.ps, 0))

    def _account(self, acc: _Interval, step: StepOutput) -> None:
        """Add an (un-rolled-back) iteration to the interval's sums and the skip count."""
        acc.nan += int(step.nonfinite or step.nonfinite_loss)
        if step.skipped:
            acc.skipped += 1
            self.state.skipped_iterations += 1
            return
        if step.loss is not None and math.isfinite(step.loss):
            acc.losses.append(step.loss)
        for name, value in step.metrics.items():
            acc.metrics.setdefault(name, []).append(value)

    def _maybe_log(self, loop: "_Loop", step: StepOutput) -> None:
        """The state-bytes report after the first iteration; the straggler check (with
        --log-straggler) and the log line every --log-interval iterations (then a fresh
        interval)."""
        if not self._state_bytes_reported:
            self._report_state_bytes()
        self.reporter.iteration(self.state.iteration, self.state.consumed_train_samples,
                                self.global_batch, step)
        if self.state.iteration % self.cfg.training.log_interval == 0:
            self.stragglers.report(self.state.iteration, loop.interval.iterations, self.writer)
            self._log_interval(loop.interval, step)
            loop.interval = _Interval()

    def _maybe_evaluate(self, loop: "_Loop") -> None:
        """Validation every --eval-interval iterations (when there is validation data)."""
        t, s = self.cfg.training, self.state
        if t.eval_iters and self.valid_ds is not None and s.iteration % t.eval_interval == 0:
            self._report_eval("valid", self.evaluate(loop.valid_iter, t.eval_iters))
            s.consumed_valid_samples += t.eval_iters * t.global_batch_size

    def _should_exit(self) -> bool:
        """Whether every rank stops after this iteration: --exit-interval, the
        --exit-duration-in-mins budget, or an exit signal (agreed by all ranks)."""
        t = self.cfg.training
        out_of_time, self.stop_signal = self._stop_request()
        at_interval = bool(t.exit_interval and self.state.iteration % t.exit_interval == 0)
        return at_interval or out_of_time or bool(self.stop_signal)

    def _maybe_save(self, loop: "_Loop") -> None:
        """A checkpoint every --save-interval iterations and before exiting, except during a
        run of non-finite iterations (the previous checkpoint stays the one to resume from)."""
        c, s = self.cfg.checkpoint, self.state
        if not c.save or not ((c.save_interval and s.iteration % c.save_interval == 0)
                              or loop.exiting):
            return
        if self.nonfinite.in_streak:
            logger.warning("iteration %d: not saving a checkpoint during a run of non-finite "
                           "iterations", s.iteration, extra=LAST_RANK)
            return
        if self._save(final=loop.exiting or s.iteration >= self.cfg.training.train_iters):
            loop.last_saved = s.iteration

    def _log_signal_exit(self, last_saved: Optional[int]) -> None:
        c, s = self.cfg.checkpoint, self.state
        name = signal_name(self.stop_signal)
        if c.save and last_saved != s.iteration:  # a non-finite streak: no checkpoint of it
            self.log(f"exiting after {name} at iteration {s.iteration} without a checkpoint of "
                     "it (its state is not finite); exit status 0. The latest checkpoint in "
                     f"{c.save} is the one to resume from")
        elif c.save:
            self.log(f"exiting after {name}: saved the checkpoint of iteration {s.iteration} to "
                     f"{checkpoint_dir(c.save, s.iteration)}; exit status 0. Relaunch with "
                     f"--load {c.save} to resume")
        else:
            self.log(f"exiting after {name} at iteration {s.iteration} without a checkpoint (no "
                     "--save); exit status 0")

    def _observe(self, step: StepOutput) -> bool:
        """The non-finite policy, then (with --rollback-on-spike) the spike check, which turns
        the policy's stop into a rollback while the budget lasts. True when rolled back."""
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

    def _finish(self, valid_iter, last_saved: Optional[int]) -> None:
        t, s = self.cfg.training, self.state
        if t.eval_iters and self.valid_ds is not None and s.iteration % t.eval_interval != 0:
            self._report_eval("valid", self.evaluate(valid_iter, t.eval_iters))
            s.consumed_valid_samples += t.eval_iters * t.global_batch_size
        if self.cfg.checkpoint.save and last_saved != s.iteration and not self.nonfinite.in_streak:
            self._save(final=True)
        if t.eval_iters and self.test_ds is not None:
            test_iter = build_data_iterator(self.test_ds, 0, t.micro_batch_size, self.ps, 0)
            self._report_eval("test", self.evaluate(test_iter, t.eval_iters))


@dataclass
class _Loop:
    """The training loop's own state: its iterators, the logging interval's sums, the last
    saved iteration, and whether the ranks agreed to exit after this iteration."""

    train_iter: Any
    valid_iter: Any
    interval: _Interval = field(default_factory=_Interval)
    last_saved: Optional[int] = None
    exiting: bool = False

    def close(self) -> None:
        """Stop the iterators' data-loader workers (app.training.data_loading)."""
        close_data_iterator(self.train_iter)
        close_data_iterator(self.valid_iter)


def _length(dataset: Any) -> Optional[int]:
    return None if dataset is None else len(dataset)
