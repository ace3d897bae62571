"""Which checkpoint a resume or a rollback loads: the one choice, made alike by both.

With non-persistent checkpoints (--non-persistent-save-interval) the newest of them competes
with the persistent checkpoint (Megatron's rule: the non-persistent one when it is at least as
new): local ones (app.training.checkpointing.local: complete over all ranks, a lost copy taken
from a replica) or global ones (the run's own checkpoint under --non-persistent-global-ckpt-dir,
by default <--save>/non_persistent, whose tracker names the newest). `newest_checkpoint`
chooses, `load_newest` loads the choice on every rank (the persistent one through
app.training.checkpointing.resume). The run's checkpointer (app.training.checkpointing
.checkpointer) asks both, for a resume at start-up and for a --rollback-on-spike.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from app.checkpoint import CheckpointError, names
from app.config.checkpoint import CheckpointConfig
from app.training.checkpointing.local import LocalPick, load_pick, persistent_words, pick_newest
from app.training.checkpointing.resume import LoadResult, load_on_all_ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewestCheckpoint:
    """The checkpoint a load takes (`newest_checkpoint`): `local` when the newest local
    checkpoint wins, `global_iteration` (under `global_dir`) when the newest global
    non-persistent one does, else the persistent one under `directory`, whose tracker named
    `persistent` (None: no tracker)."""

    directory: Optional[str]
    persistent: Optional[names.Iteration]
    local: Optional[LocalPick] = None
    local_dir: str = ""
    global_iteration: Optional[int] = None
    global_dir: str = ""

    @property
    def iteration(self) -> Optional[names.Iteration]:
        """The iteration the load goes back to (None: there is no checkpoint)."""
        if self.local is not None:
            return self.local.iteration
        return self.global_iteration if self.global_iteration is not None else self.persistent

    def describe(self) -> str:
        """'the local checkpoint of iteration 16 in DIR', 'the global non-persistent
        checkpoint of ...', or the persistent one's words."""
        if self.local is not None:
            return f"the local checkpoint of iteration {self.local.iteration} in {self.local_dir}"
        if self.global_iteration is not None:
            return (f"the global non-persistent checkpoint of iteration {self.global_iteration} "
                    f"in {self.global_dir}")
        return persistent_words(self.persistent, self.directory)


def _pick_global(global_dir: Optional[str], persistent: Optional[int], persistent_dir: str,
                 at_most: Optional[int]) -> Optional[int]:
    """The iteration the global non-persistent tracker names when it is at least as new as
    `persistent` (Megatron's rule) and not after `at_most`, else None (and why is logged)."""
    committed = names.read_tracker(global_dir) if global_dir and os.path.isdir(global_dir) else None
    if committed == names.RELEASE:
        raise CheckpointError(f"{global_dir} names a 'release' checkpoint: a non-persistent "
                              "checkpoint cannot be one (Megatron-LM refuses it too); remove "
                              "its tracker or point --non-persistent-global-ckpt-dir elsewhere")
    if not isinstance(committed, int):
        return None
    if (persistent is not None and committed < persistent) or (at_most is not None
                                                              and committed > at_most):
        logger.info("the global non-persistent checkpoint of iteration %d in %s not used "
                    "(older than the persistent one, or after the run's iteration): loading %s",
                    committed, global_dir, persistent_words(persistent, persistent_dir))
        return None
    return committed


def newest_checkpoint(cfg: CheckpointConfig, directory: Optional[str], non_persistent: bool,
                      at_most: Optional[int] = None) -> NewestCheckpoint:
    """The one choice between non-persistent and persistent checkpoints, made alike by a resume
    (from --load) and a rollback (to --save; the checkpointer's `load_latest` and
    `rollback_target`): with `non_persistent`, the newest non-persistent
    checkpoint of --non-persistent-ckpt-type (local: complete over all ranks; global: the one
    its tracker names, under --non-persistent-global-ckpt-dir or `directory` (else
    --load)/non_persistent)
    when it is at least as new as the persistent checkpoint under `directory` (a tracker naming
    'release' counts as none), else that persistent one. `at_most` (a rollback: the run's
    iteration) leaves out non-persistent checkpoints after it, which another run left. Every
    rank calls it (a collective for local checkpoints)."""
    persistent = names.read_tracker(directory) if directory else None
    numbered = persistent if isinstance(persistent, int) else None
    if non_persistent and cfg.non_persistent_ckpt_type == "global":
        global_dir = cfg.global_non_persistent_dir(directory or cfg.load) or ""
        return NewestCheckpoint(directory, persistent, global_dir=global_dir,
                                global_iteration=_pick_global(global_dir, numbered,
                                                              directory or "", at_most))
    pick = (pick_newest(cfg, numbered, directory or "", at_most)
            if non_persistent and cfg.local_checkpoints else None)
    return NewestCheckpoint(directory, persistent, pick, cfg.non_persistent_local_ckpt_dir or "")


def load_newest(engine: Any, chosen: NewestCheckpoint, cfg: CheckpointConfig, device: Any,
                doing: str = "resuming from") -> Optional[LoadResult]:
    """Load `chosen` on every rank under `cfg`'s --finetune/--no-load-* settings; None when
    it is persistent and its directory holds no checkpoint (any more)."""
    if chosen.local is not None:
        return load_pick(engine, cfg, device, chosen.local,
                         persistent_words(chosen.persistent, chosen.directory), doing)
    if chosen.global_iteration is not None:
        logger.info("%s %s, not from %s", doing, chosen.describe(),
                    persistent_words(chosen.persistent, chosen.directory))
        return load_on_all_ranks(engine, chosen.global_dir, device, checkpoint=cfg)
    if not chosen.directory:
        return None
    return load_on_all_ranks(engine, chosen.directory, device, checkpoint=cfg)


__all__ = ["NewestCheckpoint", "load_newest", "newest_checkpoint"]
