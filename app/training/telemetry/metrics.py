"""Training metrics: timers, the Megatron-style log line, TensorBoard + JSONL, memory, MFU.

The trainer computes the numbers; this module formats and writes them. `MetricsWriter` writes
`--metrics-file` (one JSON object per line with "kind", "iteration" and the values, our
names); TensorBoard (`--tensorboard-dir`) and W&B get the training and evaluation scalars under
Megatron-LM's tags (`MetricsWriter.scalars`, app.training.telemetry.scalars) and every other
kind of record (stragglers, state bytes, ...) as `{kind}/{name}`.
MFU = achieved model FLOP/s per rank / peak FLOP/s per rank, with the FLOP formulas and the
peaks of `app.training.telemetry.flops`.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, TextIO, Tuple

import numpy as np
import torch

from app.training.telemetry import scalars as scalars_lib


# ---------------------------------------------------------------------------- timers

class Timer:
    """One named wall-clock timer accumulating seconds between start() and stop()."""

    def __init__(self, name: str, barrier: Optional[Callable[[], None]] = None,
                 synchronize: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self._barrier, self._synchronize = barrier, synchronize
        self._elapsed = 0.0
        self._started_at: Optional[float] = None

    def _sync(self, barrier: bool) -> None:
        if barrier and self._barrier is not None:
            self._barrier()
        if self._synchronize is not None:
            self._synchronize()

    def start(self, barrier: bool = False) -> None:
        """Start timing (after the barrier hook when `barrier`); error if already started."""
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already started")
        self._sync(barrier)
        self._started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the total; error if not started."""
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._sync(barrier)
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        """Zero the total (a running timer keeps running from now)."""
        self._elapsed = 0.0
        if self._started_at is not None:
            self._started_at = time.perf_counter()

    def elapsed(self, reset: bool = True) -> float:
        """Total seconds so far, including a running interval; optionally reset afterwards."""
        total = self._elapsed
        if self._started_at is not None:
            total += time.perf_counter() - self._started_at
        if reset:
            self.reset()
        return total


class Timers:
    """A registry of named timers: `timers("forward").start()`, `timers.log_line([...])`.

    `barrier` is called by start/stop(barrier=True) (e.g. a process-group barrier);
    `synchronize` is called at every start/stop (e.g. torch.cuda.synchronize on GPU).
    """

    def __init__(self, barrier: Optional[Callable[[], None]] = None,
                 synchronize: Optional[Callable[[], None]] = None) -> None:
        self._barrier, self._synchronize = barrier, synchronize
        self._timers: Dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name, self._barrier, self._synchronize)
        return self._timers[name]

    def names(self) -> Iterable[str]:
        """Names of the timers created so far, in creation order."""
        return list(self._timers)

    def elapsed(self, name: str, reset: bool = True) -> float:
        """Seconds accumulated by `name` (0.0 for a timer never created)."""
        return self._timers[name].elapsed(reset) if name in self._timers else 0.0

    def log_line(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """'time (ms) | forward: 12.34 | backward: ...': milliseconds divided by `normalizer`."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        parts = [f"{n}: {self.elapsed(n, reset) * 1000.0 / normalizer:.2f}"
                 for n in names if n in self._timers]
        return "time (ms) | " + " | ".join(parts)


# ---------------------------------------------------------------------------- throughput

def tokens_per_second(global_batch_size: int, seq_length: int,
                      seconds_per_iteration: float) -> float:
    """Training tokens processed per second by the whole job."""
    if seconds_per_iteration <= 0:
        return float("nan")
    return global_batch_size * seq_length / seconds_per_iteration


def achieved_flops_per_rank(tokens_per_s: float, flops_per_token: float,
                            world_size: int) -> float:
    """Model FLOP/s per rank: tokens/s x model FLOPs per token / number of ranks."""
    return tokens_per_s * flops_per_token / max(world_size, 1)


def model_flops_utilization(achieved_per_rank: float, peak_per_rank: float) -> float:
    """MFU as a fraction: achieved model FLOP/s per rank / peak FLOP/s per rank."""
    if not peak_per_rank or peak_per_rank <= 0:
        return float("nan")
    return achieved_per_rank / peak_per_rank


# ---------------------------------------------------------------------------- memory

def _current_rss_bytes() -> int:
    import psutil  # a requirement; imported here because only the logging rank needs it
    return int(psutil.Process().memory_info().rss)


def memory_stats(device: Optional[torch.device] = None) -> Dict[str, float]:
    """Memory in MB: process RSS and peak RSS; CUDA allocated / max allocated / max reserved.

    Keys: mem_rss_mb, mem_peak_rss_mb, and on a CUDA device mem_cuda_allocated_mb,
    mem_cuda_max_allocated_mb, mem_cuda_max_reserved_mb.
    """
    mb = 1024.0 * 1024.0
    stats: Dict[str, float] = {}
    stats["mem_rss_mb"] = _current_rss_bytes() / mb
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    stats["mem_peak_rss_mb"] = peak_kb / (mb if sys.platform == "darwin" else 1024.0)
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        stats["mem_cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / mb
        stats["mem_cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / mb
        stats["mem_cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved(device) / mb
    return stats


# ---------------------------------------------------------------------------- the log line

_LOG_FIELDS: Tuple[Tuple[str, str, str], ...] = (
    # (key in values, label, format)
    ("consumed_samples", "consumed samples", "{:12d}"),
    ("ms_per_iteration", "elapsed time per iteration (ms)", "{:.1f}"),
    ("throughput", "throughput per GPU (TFLOP/s/GPU)", "{:.1f}"),
    ("eta_s", "ETA", "{hms}"),
    ("lr", "learning rate", "{:.6E}"),
    ("global_batch_size", "global batch size", "{:5d}"),
    ("lm_loss", "lm loss", "{:.6E}"),
    ("loss_scale", "loss scale", "{:.1f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("skipped_iterations", "number of skipped iterations", "{:3d}"),
    ("nan_iterations", "number of nan iterations", "{:3d}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("tflops_per_rank", "TFLOP/s per rank", "{:.3f}"),
)


def format_duration(seconds: float) -> str:
    """3725.2 -> '1:02:05'; days as '2 days, 3:04:05'; '?' when not finite."""
    if not math.isfinite(seconds):
        return "?"
    whole = int(round(max(0.0, seconds)))
    days, rest = divmod(whole, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {text}" if days else text


def _fmt(fmt: str, value: Any) -> str:
    if fmt == "{hms}":
        return format_duration(float(value))
    if "d}" in fmt:
        return fmt.format(int(value))
    return fmt.format(float(value))


def format_train_log(iteration: int, train_iters: int, values: Mapping[str, Any]) -> str:
    """Megatron's one-line training log, extended with throughput, MFU and memory.

    ' iteration       10/     200 | consumed samples:           80 | elapsed time per iteration
    (ms): 123.4 | ETA: 0:00:23 | learning rate: 1.000000E-04 | lm loss: 5.123456E+00 | loss scale: 1.0 |
    grad norm: 1.234 | number of skipped iterations:   0 | tokens/s: 1234 | TFLOP/s per rank:
    0.123 | MFU: 12.34% | mem RSS/peak (MB): 812/900 |'. Keys absent or None are left out;
    `mfu` is a fraction; memory keys are those of memory_stats().
    """
    parts = [f" iteration {iteration:8d}/{train_iters:8d}"]
    for key, label, fmt in _LOG_FIELDS:
        if values.get(key) is not None:
            parts.append(f" {label}: {_fmt(fmt, values[key])}")
    for key, label in (("mfu", "MFU"), ("hfu", "HFU")):
        if values.get(key) is not None:
            parts.append(f" {label}: {100.0 * float(values[key]):.2f}%")
    if values.get("mem_rss_mb") is not None:
        parts.append(f" mem RSS/peak (MB): {values['mem_rss_mb']:.0f}/"
                     f"{values.get('mem_peak_rss_mb', float('nan')):.0f}")
    if values.get("mem_cuda_allocated_mb") is not None:
        parts.append(f" CUDA allocated/max reserved (MB): {values['mem_cuda_allocated_mb']:.0f}/"
                     f"{values.get('mem_cuda_max_reserved_mb', float('nan')):.0f}")
    return " |".join(parts) + " |"


def interval_means(metrics: Mapping[str, Any]) -> Dict[str, Any]:
    """{name: mean of its values over the interval}; list values (MoE's tokens per expert)
    element-wise."""
    means: Dict[str, Any] = {}
    for name, values in metrics.items():
        if values and isinstance(values[0], list):
            means[name] = [sum(column) / len(values) for column in zip(*values)]
        else:
            means[name] = sum(values) / len(values)
    return means


def format_loss_metrics(values: Mapping[str, Any]) -> str:
    """' name: 1.234000E+00 |' for each scalar of the loss function and of the MoE losses, as
    Megatron prints them after the lm loss; lists and per-layer values ('moe/...') are left to
    the metrics file and TensorBoard."""
    return "".join(f" {name}: {float(value):.6E} |" for name, value in values.items()
                   if not isinstance(value, list) and not name.startswith("moe/"))


# ---------------------------------------------------------------------------- writers

def _json_value(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, np.generic)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Infinity
    return value


class MetricsWriter:
    """Writes each set of values to TensorBoard, to Weights & Biases and as one JSON line to the
    metrics file.

    Disabled (a no-op) when `enabled` is False, so every rank can hold one and only the logging
    rank writes. TensorBoard is imported lazily and only when `tensorboard_dir` is set; W&B only
    when `wandb` (a WandbConfig) is enabled; `run_config` (the RunConfig) becomes the run's config.
    """

    MEGATRON_KINDS = ("train", "valid", "test")
    """Kinds whose scalars TensorBoard and W&B get under Megatron's tags (`scalars`), not from
    `write`."""

    def __init__(self, tensorboard_dir: Optional[str], metrics_file: Optional[str],
                 enabled: bool = True, wandb: Optional[Any] = None,
                 run_config: Any = None, queue_size: int = 1000) -> None:
        self.enabled = enabled
        self._tb: Any = None
        self._file: Optional[TextIO] = None
        self._wandb: Any = None
        if not enabled:
            return
        if wandb is not None and wandb.enabled:
            from app.training.telemetry.wandb_writer import WandbWriter  # deferred: imports wandb
            self._wandb = WandbWriter(wandb, run_config)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # lazy: slow import
            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)
        if metrics_file:
            parent = os.path.dirname(os.path.abspath(metrics_file))
            os.makedirs(parent, exist_ok=True)
            self._file = open(metrics_file, "a", encoding="utf-8")

    def write(self, kind: str, iteration: int, values: Mapping[str, Any]) -> None:
        """Record `values` at `iteration` under `kind` ("train", "valid", "test", or another
        record such as "stragglers") in the metrics file; kinds other than MEGATRON_KINDS also
        go to TensorBoard and W&B as `{kind}/{name}`."""
        if not self.enabled:
            return
        if kind not in self.MEGATRON_KINDS:
            self._tensorboard({f"{kind}/{name}": v for name, v in values.items()}, iteration)
            if self._wandb is not None:
                self._wandb.write(kind, iteration,
                                  {k: _json_value(v) for k, v in values.items()})
        if self._file is not None:
            record = {"kind": kind, "iteration": int(iteration), "time": time.time()}
            record.update({k: _json_value(v) for k, v in values.items()})
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def scalars(self, iteration: int, tags: Mapping[str, Any],
                consumed_samples: Optional[int] = None, no_twin: Sequence[str] = ()) -> None:
        """Megatron-LM's scalars (app.training.telemetry.scalars) at `iteration`: TensorBoard
        gets each tag and, with `consumed_samples`, its "<tag> vs samples" twin over the
        samples (not for the CUDA memory tags nor the tags in `no_twin`, as Megatron); W&B gets
        each tag and "samples vs steps"."""
        if not self.enabled:
            return
        self._tensorboard(tags, iteration)
        if consumed_samples is not None:
            self._tensorboard({tag + scalars_lib.VS_SAMPLES: value for tag, value in tags.items()
                               if tag not in scalars_lib.NO_TWIN and tag not in no_twin},
                              consumed_samples)
        if self._wandb is not None:
            logged = dict(tags)
            if consumed_samples is not None:
                logged["samples vs steps"] = consumed_samples
            self._wandb.log(iteration, {k: _json_value(v) for k, v in logged.items()})

    def _tensorboard(self, tags: Mapping[str, Any], step: int) -> None:
        """add_scalar for every number among `tags`, then flush."""
        if self._tb is None:
            return
        for tag, value in tags.items():
            value = _json_value(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close every output (idempotent)."""
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        """Use as a context manager; close() on exit."""
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
