"""The training log's numbers: MFU and HFU, Megatron's log line every --log-interval, and the
TensorBoard / W&B scalars under Megatron's tags (app.training.telemetry.scalars) every
--tensorboard-log-interval iterations and after each evaluation; the metrics file gets the
same numbers under our names.

`TrainingReporter` belongs to one Trainer; only the logging rank (Megatron's last rank, where
the loss lives) writes. The loop calls `iteration` after every iteration, `interval` every
--log-interval with the interval's sums, and `evaluation` after each evaluation.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch

from app.config import RunConfig
from app.training.telemetry import flops
from app.training.telemetry import metrics as metrics_lib
from app.training.telemetry import scalars as scalars_lib
from app.utils.dtypes import torch_dtype
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)

TIMERS = ("forward-backward", "optimizer")
"""The step timers the log line and --log-timers-to-tensorboard report."""


class TrainingReporter:
    """MFU/HFU, the log line and the scalars of one run (module docstring). `pipeline_size` and
    `world_size` describe the layout; `enabled` is whether this rank writes."""

    def __init__(self, cfg: RunConfig, writer: metrics_lib.MetricsWriter, device: torch.device,
                 world_size: int, pipeline_size: int, enabled: bool,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.writer, self.device = cfg, writer, torch.device(device)
        self.world_size, self.enabled, self.log = world_size, enabled, log
        self.recompute = cfg.model.recompute
        self.flops_per_token = flops.model_flops_per_token(cfg.model)
        self.hardware_flops_per_token = flops.hardware_flops_per_token(
            cfg.model, self.recompute, recomputed_layers=cfg.model.recomputed_layers(
                pipeline_size, cfg.virtual_pipeline_model_parallel_size))
        self.peak_flops = float("nan")
        self._warned_over_peak = False
        if enabled:  # only the logging rank reports MFU; measuring takes a moment
            dtype = torch_dtype(cfg.model.params_dtype)
            self.peak_flops, desc = flops.peak_flops(self.device, dtype,
                                                     override=cfg.training.peak_flops)
            fp8 = (" (FP8 runs are measured against the bf16 peak)" if cfg.fp8.enabled else "")
            self.log(f"MFU peak: {self.peak_flops / 1e12:.3f} TFLOP/s per rank ({desc}){fp8}; "
                     f"model FLOPs per token {self.flops_per_token / 1e6:.2f} MFLOP "
                     f"(Megatron's count), hardware {self.hardware_flops_per_token / 1e6:.2f} "
                     f"MFLOP (recompute: {self.recompute})")

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

    def interval(self, iteration: int, values: Dict[str, Any], loss_metrics: Mapping[str, float],
                 iterations: int, timer_seconds: Mapping[str, float]) -> None:
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
