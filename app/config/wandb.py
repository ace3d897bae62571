"""Weights & Biases logging (Megatron-LM's --wandb-* flags): the run it logs to, checked once."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import option


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Where the last rank logs the training scalars and the run configuration; off unless
    `project` is set. `wandb` is an optional package, so asking for it without it installed is
    refused here, on every rank, before anything starts."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "Weights & Biases", "log the training scalars and the run configuration from the last "
        "rank (pip install wandb; docs/metrics.md)")

    project: Optional[str] = option(
        "--wandb-project", default=None,
        help="the W&B project; W&B is off without it")
    exp_name: Optional[str] = option(
        "--wandb-exp-name", default=None,
        help="the run's name in W&B")
    save_dir: Optional[str] = option(
        "--wandb-save-dir", default=None,
        help="the run's local W&B files (default: {--save}/wandb)")
    """arguments.py defaults it to {--save}/wandb, as Megatron-LM does; None with neither:
    W&B's default, ./wandb."""
    entity: Optional[str] = option(
        "--wandb-entity", default=None,
        help="the W&B user or team (default: the account's)")

    @property
    def enabled(self) -> bool:
        return bool(self.project)

    def __post_init__(self) -> None:
        if not self.enabled:
            given = [flag for flag, value in (("--wandb-exp-name", self.exp_name),
                                               ("--wandb-save-dir", self.save_dir),
                                               ("--wandb-entity", self.entity)) if value]
            if given:
                raise ValueError(f"{', '.join(given)} given without --wandb-project; add "
                                 "--wandb-project NAME to log to Weights & Biases")
            return
        if not self.exp_name:
            raise ValueError(f"--wandb-project {self.project} needs --wandb-exp-name NAME (the "
                             "run's name in the project)")
        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package, which is not installed: "
                             "pip install wandb (set WANDB_MODE=offline to log without an "
                             "account), or drop the --wandb-* flags")
