"""TensorBoard and W&B scalars under Megatron-LM's tag names, at Megatron's cadence, so a
user's dashboards and comparison scripts read our runs as they read Megatron's (Megatron-LM
main, megatron/training/training.py training_log and evaluate_and_print_results).

Every --tensorboard-log-interval iterations (default every iteration, with that iteration's
values): `learning-rate`, `batch-size`, each loss (`lm loss`, the loss function's own
metrics by their names, MoE's `load_balancing_loss`, ... without "vs samples" twins, as
Megatron's MoE logging), `loss-scale` (unless --no-log-loss-scale-to-tensorboard),
`world-size` (--log-world-size-to-tensorboard), `grad-norm` (when the step has one), and the
CUDA allocator's `mem-*` (--log-memory-to-tensorboard, CUDA only); TensorBoard also gets each
as "<tag> vs samples" over consumed samples; W&B gets `samples vs steps` instead.
Every --log-interval: `iteration-time` (seconds, --log-timers-to-tensorboard), `throughput`
(TFLOP/s per GPU, --log-throughput with --log-timers-to-tensorboard), the step timers as
`<timer>-time` (--log-timers-to-tensorboard), and our own extras, which Megatron does not write,
under names of their own: `tokens-per-second`, `mfu`, `hfu`.
Each evaluation: `<loss> validation` (and "... vs samples"; the test set is written under the
same tag, as Megatron does), with --log-validation-ppl-to-tensorboard `<loss> validation ppl`.

Pure mapping from values to {tag: value}; `MetricsWriter.scalars` writes them.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

from app.config import LogConfig

LM_LOSS = "lm loss"
"""Megatron's name of the language-model loss."""
OUR_EXTRAS = {"tokens_per_s": "tokens-per-second", "mfu": "mfu", "hfu": "hfu"}
"""Our interval values that Megatron has no tag for -> their tag."""
VS_SAMPLES = " vs samples"
NO_TWIN = ("mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
           "mem-allocated-count")
"""Iteration tags Megatron writes without a "vs samples" twin."""


MOE_SCALARS = ("expert_load_imbalance", "dropped_tokens")
"""MoE's values besides its tracked losses (app.model.moe.metrics)."""


def is_moe_metric(name: str, model: Any) -> bool:
    """Whether `name` is one of MoE's logged values (its tracked losses, the load imbalance,
    dropped tokens, the per-layer `moe/...`), which Megatron writes without a "vs samples"
    twin (megatron/core/transformer/moe/moe_logging.py)."""
    return (name in model.moe.tracked_losses or name in MOE_SCALARS
            or name.startswith("moe/"))


def iteration_scalars(log: LogConfig, *, lr: Optional[float], batch_size: int,
                      losses: Mapping[str, Optional[float]], loss_scale: Optional[float],
                      grad_norm: Optional[float], world_size: int,
                      cuda_memory: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
    """{tag: value} of one iteration (module docstring); `losses` {Megatron name: value},
    `cuda_memory` torch.cuda.memory_stats() when --log-memory-to-tensorboard on CUDA."""
    out: Dict[str, float] = {}
    if lr is not None:
        out["learning-rate"] = lr
    out["batch-size"] = batch_size
    out.update({name: value for name, value in losses.items() if value is not None})
    if log.log_loss_scale_to_tensorboard and loss_scale is not None:
        out["loss-scale"] = loss_scale
    if log.log_world_size_to_tensorboard:
        out["world-size"] = world_size
    if grad_norm is not None and math.isfinite(grad_norm):
        out["grad-norm"] = grad_norm
    if log.log_memory_to_tensorboard and cuda_memory:
        out.update({"mem-reserved-bytes": cuda_memory["reserved_bytes.all.current"],
                    "mem-allocated-bytes": cuda_memory["allocated_bytes.all.current"],
                    "mem-max-allocated-bytes": cuda_memory["allocated_bytes.all.peak"],
                    "mem-allocated-count": cuda_memory["allocation.all.current"]})
    return out


def interval_scalars(log: LogConfig, values: Mapping[str, Optional[float]],
                     seconds_per_iteration: float, throughput: float,
                     timer_seconds: Mapping[str, float]) -> Dict[str, float]:
    """{tag: value} of one --log-interval: Megatron's timer tags (with
    --log-timers-to-tensorboard), its `throughput` (TFLOP/s per GPU) and our extras of
    `values` (OUR_EXTRAS)."""
    out: Dict[str, float] = {}
    if log.log_timers_to_tensorboard:
        out["iteration-time"] = seconds_per_iteration
        out.update({f"{name}-time": seconds for name, seconds in timer_seconds.items()})
        if log.log_throughput:
            out["throughput"] = throughput
    out.update({tag: values[key] for key, tag in OUR_EXTRAS.items()
                if values.get(key) is not None})
    return out


def validation_scalars(log: LogConfig, losses: Mapping[str, float]) -> Dict[str, float]:
    """{tag: value} of one evaluation: `<loss> validation` and, with
    --log-validation-ppl-to-tensorboard, `<loss> validation ppl` (exp(min(20, loss)))."""
    out: Dict[str, float] = {}
    for name, value in losses.items():
        out[f"{name} validation"] = value
        if log.log_validation_ppl_to_tensorboard:
            out[f"{name} validation ppl"] = math.exp(min(20.0, value))
    return out
