"""The resume policy, shared by both engines: what a checkpoint restores and how ranks agree.

Format and policy are apart. `app.training.checkpoint` reads and writes Megatron's files; each
engine implements only `read_checkpoint(load_dir, plan)`, which reads its own files and applies
what the plan asks for (weights always, optimizer and LR-schedule state when
`plan.load_optimizer`). Everything else is decided here, once:

- `--finetune` or a `release` checkpoint: weights only, the run starts at iteration 0 with a
  fresh optimizer (said in the log);
- `--no-load-optim`: fresh optimizer states, but the LR schedule continues where the saved run
  was (its scheduler's step count, which skipped iterations did not advance);
- `--no-load-rng`: keep this run's seeds; otherwise the saved RNG states must be present;
- a checkpoint without `args` can only be loaded weights-only (its shape cannot be checked);
- every rank loads, then all agree: one rank's failure fails them all, and all must have
  loaded the same iteration.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from app.config import CheckpointConfig, RunConfig
from app.mpu import collectives
from app.mpu.random import load_rng_state_dict
from app.training import checkpoint as ckpt
from app.training.distributed import world_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """What to restore from the checkpoint of `iteration` (an int or "release")."""

    iteration: ckpt.Iteration
    weights_only: bool
    """--finetune or a release checkpoint: weights only, then start at iteration 0."""
    load_optimizer: bool
    """Restore optimizer and LR-scheduler states (False with --no-load-optim or weights_only)."""
    load_rng: bool
    """Restore the RNG states (False with --no-load-rng or weights_only)."""
    reason: str = ""
    """Why weights only ("--finetune" / "a release checkpoint"), for the log."""


@dataclass
class CheckpointContents:
    """What an engine read from its checkpoint files, whatever their format."""

    path: str
    iteration: ckpt.Iteration
    args: Optional[argparse.Namespace]
    client_state: Dict[str, Any]
    """iteration / consumed_train_samples / consumed_valid_samples when the format stores them."""
    rng_state: Any = None
    scheduler_state: Optional[Dict[str, Any]] = None
    """The saved LR scheduler's state (its step count continues a --no-load-optim resume)."""


@dataclass
class LoadResult:
    """State recovered from a checkpoint: where training resumes and the run's client state."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    path: str


def plan_resume(c: CheckpointConfig, iteration: ckpt.Iteration) -> ResumePlan:
    """The plan for loading `iteration` under --finetune / --no-load-optim / --no-load-rng."""
    release = iteration == "release"
    weights_only = c.finetune or release
    return ResumePlan(iteration=iteration, weights_only=weights_only,
                      load_optimizer=not (weights_only or c.no_load_optim),
                      load_rng=not (weights_only or c.no_load_rng),
                      reason="a release checkpoint" if release else "--finetune" if c.finetune else "")


def check_saved_args(plan: ResumePlan, saved: Optional[argparse.Namespace], cfg: RunConfig,
                     where: str) -> None:
    """Refuse a checkpoint whose model shape or layout differs from this run's.

    A checkpoint without `args` (not written by us or by Megatron) is accepted weights-only.
    """
    if saved is None:
        if not plan.weights_only:
            raise ckpt.CheckpointError(f"{where} has no 'args', so its model shape cannot be "
                                       "checked; pass --finetune to load its weights only")
        return
    ckpt.check_checkpoint_args(saved, ckpt.checkpoint_args_namespace(cfg, 0, 0, 0))


def scheduler_steps(saved_scheduler: Optional[Dict[str, Any]], iteration: int) -> int:
    """LR-schedule steps taken by a saved run: its scheduler's count when saved (skipped
    iterations do not advance it), else the iteration."""
    if saved_scheduler:
        for key in ("num_steps", "num_iters"):
            if saved_scheduler.get(key) is not None:
                return int(saved_scheduler[key])
    return iteration


def resume_from_checkpoint(engine: Any, c: CheckpointConfig, load_dir: str
                           ) -> Optional[LoadResult]:
    """Load the latest checkpoint under `load_dir` into `engine` following the plan; None when
    the directory holds none (no tracker)."""
    iteration = ckpt.read_tracker(load_dir)
    if iteration is None:
        return None
    plan = plan_resume(c, iteration)
    contents: CheckpointContents = engine.read_checkpoint(load_dir, plan)
    if plan.weights_only:
        logger.info("loaded weights from %s (%s): starting at iteration 0 with a fresh optimizer",
                    contents.path, plan.reason)
        return LoadResult(0, 0, 0, contents.path)
    saved_iteration = int(contents.client_state.get("iteration", iteration))
    if not plan.load_optimizer:  # fresh optimizer states, the LR continues where the run was
        engine.lr_scheduler.step(scheduler_steps(contents.scheduler_state, saved_iteration))
        logger.info("--no-load-optim: optimizer states start fresh; the LR schedule continues")
    if plan.load_rng:
        if contents.rng_state is None:
            raise ckpt.CheckpointError(
                f"checkpoint {contents.path} has no RNG state (saved with --no-save-rng); pass "
                "--no-load-rng to resume without it")
        ckpt.apply_rng_state(contents.rng_state, load_rng_state_dict)
    position = contents.client_state
    return LoadResult(saved_iteration, int(position.get("consumed_train_samples", 0)),
                      int(position.get("consumed_valid_samples", 0)), contents.path)


def load_on_all_ranks(engine: Any, load_dir: str, device: torch.device,
                      checkpoint: Optional[CheckpointConfig] = None) -> Optional[LoadResult]:
    """engine.load_checkpoint on every rank, then agree: if any rank failed every rank raises,
    and every rank must have loaded the same iteration (none left waiting in a collective for
    a rank that exited, none starting at another iteration). `checkpoint` replaces the run's
    --finetune/--no-load-* settings (a rollback restores everything)."""
    error: Optional[BaseException] = None
    loaded = None
    try:
        loaded = (engine.load_checkpoint(load_dir) if checkpoint is None else
                  resume_from_checkpoint(engine, checkpoint, load_dir))
    except Exception as exc:  # noqa: BLE001  re-raised below, after the other ranks know
        error = exc
    iteration = -1.0 if loaded is None else float(loaded.iteration)
    flags = torch.tensor([1.0 if error else 0.0, iteration, -iteration], device=device)
    collectives.all_reduce(flags, world_group(), op="max")  # NCCL needs a device tensor
    if error is not None:
        raise error
    if flags[0].item() > 0:
        raise ckpt.CheckpointError(f"another rank could not load the checkpoint in {load_dir}; "
                                   "its message says why")
    if flags[1].item() != -flags[2].item():
        raise ckpt.CheckpointError(
            f"ranks loaded different iterations from {load_dir} (from {-flags[2].item():.0f} "
            f"to {flags[1].item():.0f}; -1 = none): is --load on a disk every node sees?")
    return loaded
