"""What the training log and TensorBoard show beyond the loss line (`LogConfig`): Megatron-LM's
logging flags with its defaults. Part of `app.config`; the writers are
app.training.telemetry.metrics and app.training.telemetry.tensorboard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Tuple

from app.config.rules import positive
from app.config.options import option


@dataclass(kw_only=True)
class LogConfig:
    """Megatron-LM's logging switches (throughput field, TensorBoard cadence and extra tags)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "logging", "the log line's fields and the TensorBoard scalars (Megatron-LM's tags; "
                   "docs/monitoring.md)")

    log_throughput: bool = option(
        "--log-throughput", default=False,
        help="add Megatron's 'throughput per GPU (TFLOP/s/GPU)' to the log line (Megatron's "
             "FLOP count per iteration / time / world size); with --log-timers-to-tensorboard "
             "also the TensorBoard scalar 'throughput'")
    log_timers_to_tensorboard: bool = option(
        "--log-timers-to-tensorboard", default=False,
        help="write 'iteration-time', the step timers ('<timer>-time') and, with "
             "--log-throughput, 'throughput' to TensorBoard every --log-interval")
    tensorboard_log_interval: int = option(
        "--tensorboard-log-interval", default=1,
        help="write the per-iteration TensorBoard scalars every this many iterations")
    tensorboard_queue_size: int = option(
        "--tensorboard-queue-size", default=1000,
        help="TensorBoard events held before a write to disk")
    log_loss_scale_to_tensorboard: bool = option(
        "--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
        default=True, action="store_false", dest="log_loss_scale_to_tensorboard",
        help="do not write 'loss-scale' to TensorBoard")
    log_world_size_to_tensorboard: bool = option(
        "--log-world-size-to-tensorboard", default=False,
        help="write 'world-size' to TensorBoard")
    log_validation_ppl_to_tensorboard: bool = option(
        "--log-validation-ppl-to-tensorboard", default=False,
        help="write each validation loss's perplexity ('<loss> validation ppl') to TensorBoard")
    log_memory_to_tensorboard: bool = option(
        "--log-memory-to-tensorboard", default=False,
        help="write the CUDA allocator's 'mem-reserved-bytes', 'mem-allocated-bytes', "
             "'mem-max-allocated-bytes', 'mem-allocated-count' to TensorBoard (CUDA only)")

    def __post_init__(self) -> None:
        positive(self, (("tensorboard_log_interval", "--tensorboard-log-interval"),
                        ("tensorboard_queue_size", "--tensorboard-queue-size")))
