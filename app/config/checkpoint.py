"""Checkpoint saving and loading (`CheckpointConfig`). Part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import option
from app.config.rules import positive

CKPT_FORMATS = ("torch", "torch_dist")
"""--ckpt-format values: Megatron-LM's legacy files, or its PyTorch distributed checkpoint."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Megatron-layout (or DeepSpeed) checkpoint saving and loading."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("checkpointing", "Megatron-layout checkpoints")

    save: Optional[str] = option("--save", default=None)
    save_interval: Optional[int] = option("--save-interval", default=None)
    load: Optional[str] = option("--load", default=None)
    no_save_optim: bool = option("--no-save-optim", default=False)
    no_save_rng: bool = option("--no-save-rng", default=False)
    no_load_optim: bool = option("--no-load-optim", default=False)
    no_load_rng: bool = option("--no-load-rng", default=False)
    finetune: bool = option(
        "--finetune", default=False,
        help="load weights only and start at iteration 0")
    keep_last_n_checkpoints: Optional[int] = option(
        "--keep-last-n-checkpoints", default=None,
        help="after each save, delete all but the newest N iter_ directories")
    overwrite_checkpoints: bool = option(
        "--overwrite-checkpoints", default=False,
        help="allow training from scratch (or from another --load) into a --save directory that "
             "already holds checkpoints")
    allow_data_order_change: bool = option(
        "--allow-data-order-change", default=False,
        help="resume even though the data paths, blend weights, --split, --seed, --seq-length "
             "or sample counts differ from the checkpoint's in a way that reorders the samples "
             "(refused otherwise, naming what changed)")
    async_save: bool = option(
        "--async-save", default=False,
        help="write checkpoint files in the background while training goes on; the checkpoint "
             "becomes the latest once every rank's files are durable (docs/reliability.md)")
    max_failed_saves: int = option(
        "--max-failed-saves", default=3,
        help="stop the run (exit code 5) after this many checkpoint saves in a row failed (a "
             "full disk, an I/O error); until then a failed save is undone, logged and retried "
             "at the next --save-interval while training goes on (docs/reliability.md)")
    ckpt_format: str = option(
        "--ckpt-format", default="torch", choices=CKPT_FORMATS,
        help="format of the checkpoints this run saves: torch (Megatron-LM's legacy "
             "mp_rank_XX/model_optim_rng.pt, one file per model-parallel rank) or torch_dist "
             "(Megatron Core's PyTorch distributed checkpoint: every rank writes its own shards, "
             "and it loads at any TP x PP x DP). Loading reads either, whatever this says "
             "(docs/checkpoints.md)")
    auto_detect_ckpt_format: bool = option(
        "--auto-detect-ckpt-format", default=False,
        help="accepted for Megatron-LM command lines: the checkpoint format is always detected "
             "on load")

    def __post_init__(self) -> None:
        positive(self, (("save_interval", "--save-interval"),), allow_none=True)
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load <checkpoint dir>")
        if self.max_failed_saves < 1:
            raise ValueError(f"--max-failed-saves must be at least 1, got {self.max_failed_saves} "
                             "(1 stops the run at the first failed save)")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise ValueError(f"--keep-last-n-checkpoints must be at least 1, got "
                             f"{self.keep_last_n_checkpoints} (leave it out to keep every checkpoint)")

