"""The Weights & Biases sink of MetricsWriter: the same scalars as TensorBoard, under the same
names (Megatron-LM's tags for training and evaluation, `{kind}/{name}` for our other records;
step = iteration), and the run configuration as the run's config.

`wandb` is imported only here and only when --wandb-project is set (it is optional; WandbConfig
refuses the flags without it). WANDB_MODE=offline keeps everything in --wandb-save-dir.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from app.config.wandb import WandbConfig


class WandbWriter:
    """One W&B run: `write(kind, iteration, values)` logs the finite numbers among `values`."""

    def __init__(self, config: WandbConfig, run_config: Any = None) -> None:
        """Start the run; `run_config` (a dataclass such as RunConfig, or a mapping) becomes its
        config."""
        import wandb  # optional dependency: WandbConfig checked that it is installed
        if config.save_dir:
            os.makedirs(config.save_dir, exist_ok=True)
        if dataclasses.is_dataclass(run_config):
            run_config = dataclasses.asdict(run_config)
        self._run = wandb.init(project=config.project, name=config.exp_name,
                               entity=config.entity or None, dir=config.save_dir or None,
                               config=dict(run_config or {}))

    def write(self, kind: str, iteration: int, values: Mapping[str, Any]) -> None:
        """Log `values` as `{kind}/{name}` (numbers only; NaN/inf and non-numbers are left
        out) at step `iteration`."""
        self.log(iteration, {f"{kind}/{name}": value for name, value in values.items()})

    def log(self, iteration: int, tags: Mapping[str, Any]) -> None:
        """Log {tag: value} (numbers only; NaN/inf and non-numbers are left out) at step
        `iteration`."""
        scalars = {tag: float(value) for tag, value in tags.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value)}
        if scalars:
            self._run.log(scalars, step=int(iteration))

    def close(self) -> None:
        """Finish the run (flushes its files; idempotent)."""
        if self._run is not None:
            self._run.finish()
            self._run = None
