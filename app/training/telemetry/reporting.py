"""Everything the training loop reports, in one object: the step's metrics (the loss
function's, averaged over data-parallel ranks, and MoE's), the interval's sums, MFU and HFU,
Megatron's log line every --log-interval, the TensorBoard / W&B scalars under Megatron's tags
(app.training.telemetry.scalars) every --tensorboard-log-interval iterations and after each
evaluation, the evaluation lines, the state bytes each rank holds, straggler checks, and the
step timers; the metrics file gets the same numbers under our names.

`TrainingReporter` belongs to one Trainer; only the logging rank (Megatron's last rank, where
the loss lives) writes. The loop times its phases with `timers`, hands each iteration to
`add_iteration` and `account`, asks `after_iteration` (the per-iteration scalars, and the log
line when the interval ends) and `evaluation` after each evaluation.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from app.config import RunConfig
from app.launch.distributed import world_group
from app.model.moe import MoEMetrics
from app.mpu import ParallelState, collectives
from app.training.state import RunState, StepOutput
from app.training.telemetry import flops
from app.training.telemetry import metrics as metrics_lib
from app.training.telemetry import scalars as scalars_lib
from app.training.telemetry.stragglers import StragglerDetector
from app.utils.dtypes import torch_dtype
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)

TIMERS = ("forward-backward", "optimizer")
"""The step timers the log line and --log-timers-to-tensorboard report."""


@dataclass
class Interval:
    """Sums over one logging interval."""

    losses: List[float] = field(default_factory=list)
    metrics: Dict[str, List[Any]] = field(default_factory=dict)
    skipped: int = 0
    nan: int = 0
    iterations: int = 0
    samples: int = 0
    seconds: float = 0.0


class TrainingReporter:
    """What one run reports on this rank of `parallel_state` (module docstring), for the
    stage `model` (its MoE layers' metrics)."""

    def __init__(self, cfg: RunConfig, parallel_state: ParallelState, device: torch.device,
                 model: torch.nn.Module) -> None:
        t, ps = cfg.training, parallel_state
        self.cfg, self.ps, self.device = cfg, ps, torch.device(device)
        # Megatron's print_rank_last: the loss lives on the last pipeline stage
        self.enabled = ps.rank == ps.world_size - 1
        self.world_size = ps.world_size
        self.writer = metrics_lib.MetricsWriter(t.tensorboard_dir, t.metrics_file,
                                                enabled=self.enabled, wandb=cfg.wandb,
                                                run_config=cfg,
                                                queue_size=cfg.log.tensorboard_queue_size)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.timers = metrics_lib.Timers(synchronize=sync)
        self.stragglers = StragglerDetector(t.log_straggler, t.straggler_margin,
                                            t.straggler_minmax_count, world_group(), device)
        self.moe_metrics = MoEMetrics(model, cfg.model, ps, world_group())
        self.interval = Interval()
        self._state_bytes_reported = False
        pipeline_size = ps.pipeline_model_parallel_size
        self.recompute = cfg.model.recompute
        self.flops_per_token = flops.model_flops_per_token(cfg.model)
        self.hardware_flops_per_token = flops.hardware_flops_per_token(
            cfg.model, self.recompute, recomputed_layers=cfg.model.recomputed_layers(
                pipeline_size, cfg.virtual_pipeline_model_parallel_size))
        self.peak_flops = float("nan")
        self._warned_over_peak = False
        if self.enabled:  # only the logging rank reports MFU; measuring takes a moment
            dtype = torch_dtype(cfg.model.params_dtype)
            self.peak_flops, desc = flops.peak_flops(self.device, dtype,
                                                     override=cfg.training.peak_flops)
            fp8 = (" (FP8 runs are measured against the bf16 peak)" if cfg.fp8.enabled else "")
            self.log(f"MFU peak: {self.peak_flops / 1e12:.3f} TFLOP/s per rank ({desc}){fp8}; "
                     f"model FLOPs per token {self.flops_per_token / 1e6:.2f} MFLOP "
                     f"(Megatron's count), hardware {self.hardware_flops_per_token / 1e6:.2f} "
                     f"MFLOP (recompute: {self.recompute})")

    @staticmethod
    def log(message: str) -> None:
        """One line of the training log, printed by the last rank (see app.utils.rank_logging)."""
        logger.info(message, extra=LAST_RANK)

    def close(self) -> None:
        """Flush and close the metrics outputs."""
        self.writer.close()

    # ------------------------------------------------------------------ per iteration

    def step_metrics(self, metrics: List[Dict[str, torch.Tensor]],
                     num_micro_batches: Optional[int] = None) -> Dict[str, Any]:
        """{name: mean over the micro-batches and data-parallel ranks} of the loss function's
        `metrics`; of a training step (`num_micro_batches` given) also MoE's values
        (app.model.moe.MoEMetrics.take: every rank calls it, one all-reduce)."""
        out: Dict[str, Any] = {}
        if metrics:
            names = sorted(metrics[0])
            means = torch.stack([torch.stack([m[n] for m in metrics]).mean() for n in names])
            if self.ps.data_parallel_size > 1:
                collectives.all_reduce(means, self.ps.data_parallel_group, op="avg")
            out = dict(zip(names, means.tolist()))
        if num_micro_batches is not None:
            out.update(self.moe_metrics.take(num_micro_batches))
        return out

    def reset_interval(self) -> None:
        """Start the logging interval afresh (after a rollback: its sums are of the window
        that was undone)."""
        self.interval = Interval()

    def add_iteration(self, seconds: float, samples: int) -> None:
        """Count one iteration of `samples` that took `seconds` in the interval's throughput."""
        self.interval.seconds += seconds
        self.interval.iterations += 1
        self.interval.samples += samples

    def account(self, step: StepOutput, state: RunState) -> None:
        """Add an (un-rolled-back) iteration's loss, metrics and skip to the interval's sums
        and a skip to the run's count."""
        acc = self.interval
        acc.nan += int(step.nonfinite or step.nonfinite_loss)
        if step.skipped:
            acc.skipped += 1
            state.skipped_iterations += 1
            return
        if step.loss is not None and math.isfinite(step.loss):
            acc.losses.append(step.loss)
        for name, value in step.metrics.items():
            acc.metrics.setdefault(name, []).append(value)

    def after_iteration(self, state: RunState, step: StepOutput, global_batch: int,
                        engine: Any) -> None:
        """The state-bytes report after the first iteration; the per-iteration scalars; the
        straggler check (with --log-straggler) and the log line every --log-interval
        iterations (then a fresh interval)."""
        if not self._state_bytes_reported:
            self._report_state_bytes(engine, state.iteration)
        self.iteration(state.iteration, state.consumed_train_samples, global_batch, step)
        if state.iteration % self.cfg.training.log_interval == 0:
            self.stragglers.report(state.iteration, self.interval.iterations, self.writer)
            acc, t = self.interval, self.cfg.training
            values = interval_values(acc.losses, step, state.consumed_train_samples, step.lr,
                                     global_batch, acc.seconds, acc.iterations, acc.samples,
                                     self.cfg.model.seq_length, t.train_iters - state.iteration)
            values.update(skipped_iterations=acc.skipped, nan_iterations=acc.nan,
                          total_skipped_iterations=state.skipped_iterations)
            self.interval_line(state.iteration, values,
                               metrics_lib.interval_means(acc.metrics),  # MoE's lists element-wise
                               acc.iterations, {name: self.timers.elapsed(name)
                                                for name in TIMERS})
            self.reset_interval()

    # ------------------------------------------------------------------ the numbers

    def utilization(self, tokens_per_s: float) -> Dict[str, float]:
        """MFU (and HFU with recompute) at `tokens_per_s`, with the model TFLOP/s per rank
        (Megatron's 'throughput per GPU'); warns once if FLOP/s exceed the peak."""
        model = metrics_lib.achieved_flops_per_rank(tokens_per_s, self.flops_per_token,
                                                    self.world_size)
        hardware = metrics_lib.achieved_flops_per_rank(tokens_per_s,
                                                       self.hardware_flops_per_token,
                                                       self.world_size)
        out = {"tflops_per_rank": model / 1e12,
               "mfu": metrics_lib.model_flops_utilization(model, self.peak_flops)}
        if self.recompute != "none":
            out["hfu"] = metrics_lib.model_flops_utilization(hardware, self.peak_flops)
        if hardware > self.peak_flops and not self._warned_over_peak:
            self._warned_over_peak = True
            logger.warning("achieved %.3f TFLOP/s per rank exceeds the peak used for MFU "
                           "(%.3f TFLOP/s), so that peak is wrong: pass --peak-flops, or "
                           "re-measure the CPU peak with tools/measure_peak_flops.py --force",
                           hardware / 1e12, self.peak_flops / 1e12, extra=LAST_RANK)
        return out

    def iteration(self, iteration: int, consumed_samples: int, batch_size: int, step: Any
                  ) -> None:
        """Megatron's per-iteration scalars of `step` (a StepOutput) every
        --tensorboard-log-interval iterations."""
        if not self.enabled or iteration % self.cfg.log.tensorboard_log_interval:
            return
        memory = (torch.cuda.memory_stats(self.device) if self.device.type == "cuda"
                  and self.cfg.log.log_memory_to_tensorboard else None)
        losses = {scalars_lib.LM_LOSS: step.loss, **{  # the loss function's and MoE's scalars
            name: value for name, value in step.metrics.items() if not isinstance(value, list)}}
        self.writer.scalars(iteration, scalars_lib.iteration_scalars(
            self.cfg.log, lr=step.lr, batch_size=batch_size, losses=losses,
            loss_scale=step.loss_scale, grad_norm=step.grad_norm, world_size=self.world_size,
            cuda_memory=memory), consumed_samples,
            no_twin=[name for name in losses if scalars_lib.is_moe_metric(name, self.cfg.model)])

    def interval_line(self, iteration: int, values: Dict[str, Any],
                      loss_metrics: Mapping[str, float], iterations: int,
                      timer_seconds: Mapping[str, float]) -> None:
        """The log line and the metrics-file row of one --log-interval: `values` (our names:
        consumed_samples, lm_loss, ms_per_iteration, tokens_per_s, ...) completed here with
        MFU, memory, the timers and, with --log-throughput, Megatron's throughput field."""
        util = self.utilization(values["tokens_per_s"])
        values.update(util)
        if self.cfg.log.log_throughput:
            values["throughput"] = util["tflops_per_rank"]
        values.update(loss_metrics)
        values.update(metrics_lib.memory_stats(self.device))
        per_iter = {name: seconds / max(iterations, 1) for name, seconds in timer_seconds.items()}
        values.update({f"ms_{name.replace('-', '_')}": s * 1e3 for name, s in per_iter.items()})
        if not self.enabled:
            return
        t = self.cfg.training
        self.log(metrics_lib.format_train_log(iteration, t.train_iters, values)
                 + metrics_lib.format_loss_metrics(loss_metrics)
                 + " time per iteration (ms) | " + " | ".join(
                     f"{name}: {s * 1e3:.1f}" for name, s in per_iter.items()))
        self.writer.write("train", iteration, values)
        self.writer.scalars(iteration, scalars_lib.interval_scalars(
            self.cfg.log, values, values["ms_per_iteration"] / 1e3,
            util["tflops_per_rank"], per_iter))

    def evaluation(self, kind: str, iteration: int, consumed_samples: int,
                   loss: Optional[float]) -> None:
        """One evaluation's log line, metrics-file row and Megatron's validation scalars (the
        test set under the same tags, as Megatron)."""
        if loss is None or not self.enabled:
            return
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        self.log(f" {kind} loss at iteration {iteration} | lm loss: {loss:.6E} | "
                 f"lm loss PPL: {ppl:.6E}")
        self.writer.write(kind, iteration, {"lm_loss": loss, "ppl": ppl,
                                            "consumed_train_samples": consumed_samples})
        self.writer.scalars(iteration, scalars_lib.validation_scalars(
            self.cfg.log, {scalars_lib.LM_LOSS: loss}), consumed_samples)

    def _report_state_bytes(self, engine: Any, iteration: int) -> None:
        """Bytes of parameters, gradients and optimizer states of every rank, after the first
        step (when optimizer states exist); shows how ZeRO partitions them."""
        self._state_bytes_reported = True
        b = engine.state_bytes()  # "host": what ZeRO-3 offloads there
        mine = torch.tensor([float(b[k]) for k in ("params", "grads", "optimizer")]
                            + [float(b.get("host", 0))], dtype=torch.float64, device=self.device)
        every = [x.cpu().tolist() for x in collectives.all_gather(mine, world_group())]
        for rank, (params, grads, optim, host) in enumerate(every):
            self.log(f"state held by rank {rank} ({engine.name}): parameters "
                     f"{params / 2**20:.2f} MiB, gradients {grads / 2**20:.2f} MiB, "
                     f"optimizer states {optim / 2**20:.2f} MiB"
                     + (f", offloaded to the host {host / 2**20:.2f} MiB" if host else ""))
        self.writer.write("state_bytes", iteration,
                          {**b, "per_rank": [[int(v) for v in row] for row in every]})


def interval_values(losses: Sequence[float], step: Any, consumed_samples: int, lr: float,
                    global_batch: int, seconds: float, iterations: int, samples: int,
                    seq_length: int, iterations_left: int) -> Dict[str, Any]:
    """Our names for one log interval's numbers (the log line's fields before MFU)."""
    per_iter = seconds / max(iterations, 1)
    tokens_per_s = metrics_lib.tokens_per_second(samples / max(iterations, 1), seq_length,
                                                  per_iter)
    return {"consumed_samples": consumed_samples, "lr": lr, "global_batch_size": global_batch,
            "eta_s": per_iter * max(0, iterations_left),
            "lm_loss": sum(losses) / len(losses) if losses else float("nan"),
            # Megatron logs the last iteration's norm (None when that step was skipped)
            "grad_norm": step.grad_norm if step.grad_norm is not None else float("nan"),
            "loss_scale": step.loss_scale, "ms_per_iteration": per_iter * 1e3,
            "tokens_per_s": tokens_per_s}
