"""Checkpoint saving and loading (`CheckpointConfig`). Part of `app.config`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import option
from app.config.rules import positive

CKPT_FORMATS = ("torch", "torch_dist")
"""--ckpt-format values: Megatron-LM's legacy files, or its PyTorch distributed checkpoint."""

NON_PERSISTENT_CKPT_TYPES = ("global", "local", "in_memory")
"""--non-persistent-ckpt-type values, Megatron-LM's: `global` (a checkpoint in the run's format
in --non-persistent-global-ckpt-dir, only the newest kept), `local` (each rank on its own
disk); `in_memory` is refused, as Megatron-LM refuses it (validate_args)."""

NON_PERSISTENT_SUBDIR = "non_persistent"
"""Megatron-LM's global non-persistent folder under --save (and --load) when
--non-persistent-global-ckpt-dir is not given."""


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
    non_persistent_save_interval: Optional[int] = option(
        "--non-persistent-save-interval", default=None,
        help="save a non-persistent checkpoint every N iterations, between the --save-interval "
             "ones (needs --non-persistent-ckpt-type global or local; docs/reliability.md)")
    non_persistent_ckpt_type: Optional[str] = option(
        "--non-persistent-ckpt-type", default=None, choices=NON_PERSISTENT_CKPT_TYPES,
        help="global: a checkpoint in the run's format into --non-persistent-global-ckpt-dir, "
             "only the newest kept; local: every rank writes its own state under "
             "--non-persistent-local-ckpt-dir/rank_<r>/ in the background. A resume with "
             "--load (and a rollback) takes the newest non-persistent checkpoint if it is at "
             "least as new as the persistent one; in_memory is refused (use local with a "
             "tmpfs directory such as /dev/shm)")
    non_persistent_global_ckpt_dir: Optional[str] = option(
        "--non-persistent-global-ckpt-dir", default=None,
        help="directory of the global non-persistent checkpoints (default: "
             f"<--save>/{NON_PERSISTENT_SUBDIR} when saving, <--load>/{NON_PERSISTENT_SUBDIR} "
             "when resuming, as Megatron-LM)")
    non_persistent_local_ckpt_dir: Optional[str] = option(
        "--non-persistent-local-ckpt-dir", default=None,
        help="directory of the local checkpoints (a disk of each node's own)")
    replication: bool = option(
        "--replication", default=False,
        help="keep each rank's local checkpoint also on --replication-factor - 1 other ranks "
             "(needs --replication-jump and --non-persistent-ckpt-type local)")
    replication_jump: Optional[int] = option(
        "--replication-jump", default=None,
        help="J, the spacing between the ranks that hold replicas of one another: rank n's "
             "replicas are on ranks n+J, n+2J, ... of its group of J x K ranks (give the number "
             "of ranks per node to put them on other nodes); only with --replication")
    replication_factor: Optional[int] = option(
        "--replication-factor", default=None,
        help="K, how many ranks hold each rank's local checkpoint (itself included); only "
             "with --replication (default then 2)")
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
        self._check_local_checkpoints()
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise ValueError(f"--keep-last-n-checkpoints must be at least 1, got "
                             f"{self.keep_last_n_checkpoints} (leave it out to keep every checkpoint)")


    def _check_local_checkpoints(self) -> None:
        """The local-checkpoint flags' rules (Megatron-LM's validate_args, same messages' sense)."""
        positive(self, (("non_persistent_save_interval", "--non-persistent-save-interval"),
                        ("replication_jump", "--replication-jump")), allow_none=True)
        if self.non_persistent_save_interval and self.non_persistent_ckpt_type is None:
            raise ValueError(f"--non-persistent-save-interval {self.non_persistent_save_interval}"
                             " needs --non-persistent-ckpt-type global (with "
                             "--non-persistent-global-ckpt-dir DIR or --save) or local (with "
                             "--non-persistent-local-ckpt-dir DIR)")
        self._check_global_flags()
        if self.non_persistent_ckpt_type == "local" and not self.non_persistent_local_ckpt_dir:
            raise ValueError("--non-persistent-ckpt-type local needs "
                             "--non-persistent-local-ckpt-dir DIR (a disk of each node's own)")
        self._check_replication_flags()
        if self.replication and self.replication_jump is None:
            raise ValueError("--replication needs --replication-jump J (the spacing between "
                             "the ranks holding each other's replicas, e.g. the ranks per node)")
        if self.replication and self.non_persistent_ckpt_type != "local":
            raise ValueError(f"--replication needs --non-persistent-ckpt-type local, got "
                             f"{self.non_persistent_ckpt_type}")
        if self.replication and self.replication_factor < 2:
            raise ValueError(f"--replication-factor must be at least 2 with --replication, got "
                             f"{self.replication_factor}")

    def _check_global_flags(self) -> None:
        """--non-persistent-ckpt-type global/in_memory and --non-persistent-global-ckpt-dir."""
        kind = self.non_persistent_ckpt_type
        if kind == "in_memory":
            raise ValueError("--non-persistent-ckpt-type in_memory is not implemented (Megatron-LM "
                             "refuses it too): use --non-persistent-ckpt-type local with "
                             "--non-persistent-local-ckpt-dir on a tmpfs such as /dev/shm, or "
                             "global")
        if self.non_persistent_global_ckpt_dir and kind != "global":
            raise ValueError("--non-persistent-global-ckpt-dir "
                             f"{self.non_persistent_global_ckpt_dir} is only used with --non-persistent-ckpt-type global, got {kind}: "
                             "add --non-persistent-ckpt-type global or drop the directory")
        if (kind == "global" and self.non_persistent_save_interval
                and not (self.non_persistent_global_ckpt_dir or self.save)):
            raise ValueError("--non-persistent-ckpt-type global needs "
                             "--non-persistent-global-ckpt-dir DIR or --save (its default is "
                             f"<--save>/{NON_PERSISTENT_SUBDIR})")

    def _check_replication_flags(self) -> None:
        """--replication-jump / --replication-factor without --replication is an error (Megatron
        warns and ignores the jump: a run its user believes replicated would keep no replica);
        with --replication the factor defaults to 2."""
        settings = (("--replication-jump", self.replication_jump),
                    ("--replication-factor", self.replication_factor))
        given = [f"{flag} {value}" for flag, value in settings if value is not None]
        if given and not self.replication:
            raise ValueError(
                f"{' and '.join(given)} given without --replication, which they only configure: "
                "no replica would be kept. Add --replication (with --non-persistent-ckpt-type "
                "local) to keep each rank's local checkpoint on other ranks too, or drop "
                f"{' and '.join(g.split()[0] for g in given)}")
        if self.replication and self.replication_factor is None:
            self.replication_factor = 2

    @property
    def local_checkpoints(self) -> bool:
        """Whether this run writes or reads local (non-persistent) checkpoints."""
        return self.non_persistent_ckpt_type == "local"

    def global_non_persistent_dir(self, base: Optional[str]) -> Optional[str]:
        """The global non-persistent checkpoints' directory: --non-persistent-global-ckpt-dir,
        else `base` (--save when saving, --load when resuming)/non_persistent as Megatron-LM;
        None without --non-persistent-ckpt-type global (or without either directory)."""
        if self.non_persistent_ckpt_type != "global":
            return None
        if self.non_persistent_global_ckpt_dir:
            return self.non_persistent_global_ckpt_dir
        return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None
