"""What the training loop reports, in one object: the log line every --log-interval iterations
(loss, LR, grad norm, tokens/s, TFLOP/s, MFU/HFU, memory, timers), validation and test losses,
the state bytes each rank holds, straggler checks, and the same values to TensorBoard, the
JSONL metrics file and W&B (app.training.telemetry.metrics.MetricsWriter).

The trainer holds one `TrainingReport`, times its phases with `timers`, hands each iteration to
`add_iteration` and asks `after_iteration` to log when the interval ends. The numbers are
computed where they are known (the loss and metrics by the trainer, the FLOP formulas and
peaks by app.training.telemetry.flops); this module only sums, formats and writes them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from app.config import RunConfig
from app.launch.distributed import world_group
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState
from app.training.state import RunState, StepOutput
from app.training.telemetry import flops
from app.training.telemetry import metrics as metrics_lib
from app.training.telemetry.stragglers import StragglerDetector
from app.utils.dtypes import torch_dtype
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)


@dataclass
class Interval:
    """Sums over one logging interval."""

    losses: List[float] = field(default_factory=list)
    metrics: Dict[str, List[float]] = field(default_factory=dict)
    skipped: int = 0
    nan: int = 0
    iterations: int = 0
    samples: int = 0
    seconds: float = 0.0


class TrainingReport:
    """The log, metrics and timers of one training run on this rank of `parallel_state`."""

    def __init__(self, cfg: RunConfig, parallel_state: ParallelState,
                 device: torch.device) -> None:
        t = cfg.training
        self.cfg, self.ps, self.device = cfg, parallel_state, device
        # Megatron's print_rank_last: the loss lives on the last pipeline stage
        self.is_logging_rank = parallel_state.rank == parallel_state.world_size - 1
        self.writer = metrics_lib.MetricsWriter(t.tensorboard_dir, t.metrics_file,
                                                enabled=self.is_logging_rank, wandb=cfg.wandb,
                                                run_config=cfg)
        self.interval = Interval()
        self.recompute = cfg.model.recompute
        self.flops_per_token = flops.model_flops_per_token(cfg.model)
        self.hardware_flops_per_token = flops.hardware_flops_per_token(
            cfg.model, self.recompute,
            recomputed_layers=cfg.model.recomputed_layers(
                parallel_state.pipeline_model_parallel_size,
                cfg.virtual_pipeline_model_parallel_size))
        self.peak_flops = float("nan")
        self._warned_over_peak = False
        self._state_bytes_reported = False
        if self.is_logging_rank:  # only the logging rank reports MFU; measuring takes a moment
            self.peak_flops, peak_desc = flops.peak_flops(
                device, torch_dtype(cfg.model.params_dtype), override=t.peak_flops)
            self.log(f"MFU peak: {self.peak_flops / 1e12:.3f} TFLOP/s per rank ({peak_desc}); "
                     f"model FLOPs per token {self.flops_per_token / 1e6:.2f} MFLOP, hardware "
                     f"{self.hardware_flops_per_token / 1e6:.2f} MFLOP (recompute: "
                     f"{self.recompute})")
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.timers = metrics_lib.Timers(synchronize=sync)
        self.stragglers = StragglerDetector(t.log_straggler, t.straggler_margin,
                                            t.straggler_minmax_count, world_group(), device)

    @staticmethod
    def log(message: str) -> None:
        """One line of the training log, printed by the last rank (see app.utils.rank_logging)."""
        logger.info(message, extra=LAST_RANK)

    def close(self) -> None:
        """Flush and close the metrics outputs."""
        self.writer.close()

    # ------------------------------------------------------------------ per iteration

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
        """The state-bytes report after the first iteration; the straggler check (with
        --log-straggler) and the log line every --log-interval iterations (then a fresh
        interval)."""
        if not self._state_bytes_reported:
            self._report_state_bytes(engine, state.iteration)
        if state.iteration % self.cfg.training.log_interval == 0:
            self.stragglers.report(state.iteration, self.interval.iterations, self.writer)
            self._log_interval(state, step, global_batch)
            self.reset_interval()

    def eval_loss(self, kind: str, loss: Optional[float], state: RunState) -> None:
        """The validation or test (`kind`) loss and perplexity at `state.iteration`."""
        if loss is None or not self.is_logging_rank:
            return
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        self.log(f" {kind} loss at iteration {state.iteration} | lm loss: {loss:.6E} | "
                 f"lm loss PPL: {ppl:.6E}")
        self.writer.write(kind, state.iteration,
                          {"lm_loss": loss, "ppl": ppl,
                           "consumed_train_samples": state.consumed_train_samples})

    # ------------------------------------------------------------------ the numbers

    def utilization(self, tokens_per_s: float) -> Dict[str, float]:
        """MFU (and HFU with recompute) of this interval; warns once if FLOP/s exceed the peak."""
        world = self.ps.world_size
        model = metrics_lib.achieved_flops_per_rank(tokens_per_s, self.flops_per_token, world)
        hardware = metrics_lib.achieved_flops_per_rank(tokens_per_s,
                                                       self.hardware_flops_per_token, world)
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

    def _log_interval(self, state: RunState, step: StepOutput, global_batch: int) -> None:
        t, s, acc = self.cfg.training, state, self.interval
        per_iter = acc.seconds / max(acc.iterations, 1)
        samples_per_iter = acc.samples / max(acc.iterations, 1)
        tokens_per_s = metrics_lib.tokens_per_second(samples_per_iter,
                                                      self.cfg.model.seq_length, per_iter)
        values = {
            "consumed_samples": s.consumed_train_samples, "lr": step.lr,
            "global_batch_size": global_batch,
            "eta_s": per_iter * max(0, t.train_iters - s.iteration),
            "lm_loss": sum(acc.losses) / len(acc.losses) if acc.losses else float("nan"),
            # Megatron logs the last iteration's norm (None when that step was skipped)
            "grad_norm": step.grad_norm if step.grad_norm is not None else float("nan"),
            "loss_scale": step.loss_scale, "skipped_iterations": acc.skipped,
            "nan_iterations": acc.nan,
            "total_skipped_iterations": s.skipped_iterations,
            "ms_per_iteration": per_iter * 1e3, "tokens_per_s": tokens_per_s,
            **self.utilization(tokens_per_s),
        }
        loss_metrics = {name: sum(v) / len(v) for name, v in acc.metrics.items()}
        values.update(loss_metrics)
        values.update(metrics_lib.memory_stats(self.device))
        timing = {f"ms_{name.replace('-', '_')}": self.timers.elapsed(name) * 1e3 / max(acc.iterations, 1)
                  for name in ("forward-backward", "optimizer")}
        values.update(timing)
        if self.is_logging_rank:
            self.log(metrics_lib.format_train_log(s.iteration, t.train_iters, values)
                     + "".join(f" {name}: {value:.6E} |" for name, value in loss_metrics.items())
                     + " time per iteration (ms) | forward-backward: "
                     f"{timing['ms_forward_backward']:.1f} | optimizer: {timing['ms_optimizer']:.1f}")
            self.writer.write("train", s.iteration, values)

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
