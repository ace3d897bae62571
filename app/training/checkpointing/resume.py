"""The resume policy, shared by both engines: what a checkpoint restores and how ranks agree.

Format and policy are apart. `app.checkpoint.legacy` reads and writes Megatron's files; each
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
  loaded the same iteration;
- weights that are not finite are refused (a checkpoint of a diverged or damaged run).

Before anything is loaded, `decide_start` says whether the run resumes, starts fresh or must
be refused, so that a directory holding checkpoints is never trained into from scratch by
accident:

- `--load` that does not exist is an error, unless it equals `--save`: then the run starts
  from iteration 0 (resume-or-start: the same command line resumes once checkpoints exist);
- `--load` that exists but holds no tracker: an error when it holds checkpoints (iter_*
  directories, DeepSpeed's `latest`: the tracker was lost, and the message says how to write
  it); with `--load` = `--save` and no checkpoints at all, a fresh start (logged);
- `--save` that holds checkpoints while the run does not resume from it (no `--load`, another
  `--load`, or `--finetune` / a release checkpoint, which start at iteration 0): an error
  unless `--overwrite-checkpoints` is given (then a warning in the decision).

When it resumes, `check_resume` then judges the checkpoint from its tracker and file names
alone (no checkpoint file is opened): the tracker's iteration, the plan, and whether this
run's engine and tensor/pipeline/data-parallel sizes can load the saved layout (or, with
`--universal-checkpoint`, the tag `latest_universal` names).

These decisions only read the file system. `app.training.pretrain` calls them at start-up and
`--dry-run` (app.training.planning.preflight) calls the same functions in the same order, so the
two cannot disagree.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from app.config import CheckpointConfig, RunConfig
from app.config.deepspeed import zero_stage
from app.mpu import collectives
from app.mpu.random import load_rng_state_dict
from app.checkpoint import saved_layout
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import model_args, names
from app.launch.distributed import world_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """What to restore from the checkpoint of `iteration` (an int or "release")."""

    iteration: names.Iteration
    weights_only: bool
    """--finetune or a release checkpoint: weights only, then start at iteration 0."""
    load_optimizer: bool
    """Restore optimizer and LR-scheduler states (False with --no-load-optim or weights_only)."""
    load_rng: bool
    """Restore the RNG states (False with --no-load-rng or weights_only)."""
    reason: str = ""
    """Why weights only ("--finetune" / "a release checkpoint"), for the log."""
    layout: Optional[saved_layout.SavedLayout] = None
    """What the iteration's files are (app.checkpoint.saved_layout.inspect_directory),
    detected once by `resume_from_checkpoint` and read by the engine; None: no known files."""


@dataclass
class CheckpointContents:
    """What an engine read from its checkpoint files, whatever their format."""

    path: str
    iteration: names.Iteration
    args: Optional[argparse.Namespace]
    client_state: Dict[str, Any]
    """iteration / consumed_train_samples / consumed_valid_samples when the format stores them."""
    rng_state: Any = None
    scheduler_state: Optional[Dict[str, Any]] = None
    """The saved LR scheduler's state (its step count continues a --no-load-optim resume)."""
    rng_note: str = ""
    """Why the saved RNG states do not apply to this run (a torch_dist checkpoint saved at
    another TP x PP): then they are not restored, and this says so in the log."""


@dataclass
class LoadResult:
    """State recovered from a checkpoint: where training resumes and the run's client state."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    path: str
    data_order: Optional[Dict[str, Any]] = None
    """The checkpoint's data-order record (app.data.plan.order_record), None when it has none."""
    writer: model_args.CheckpointWriter = model_args.CheckpointWriter(False)
    """Who wrote the checkpoint (model_args.checkpoint_writer)."""


@dataclass(frozen=True)
class StartDecision:
    """Where the run starts: `load` is the directory to resume from, None for a fresh start;
    `note` says why, for the log; `warning` what --overwrite-checkpoints lets it write over."""

    load: Optional[str]
    note: str = ""
    warning: str = ""


@dataclass(frozen=True)
class ResumeTarget:
    """What a resume will read: the plan for the tracker's iteration and the saved layout
    (None with --universal-checkpoint, where `universal_tag` names the tag)."""

    plan: ResumePlan
    layout: Optional[saved_layout.SavedLayout]
    universal_tag: str = ""


def _same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def held_checkpoints(directory: str) -> str:
    """A short description of the checkpoints `directory` holds ("" when none): the tracker's
    iteration, iter_* directories, DeepSpeed's `latest`, a release checkpoint."""
    if not directory or not os.path.isdir(directory):
        return ""
    parts = []
    interrupted = set(names.interrupted_saves(directory))
    tracker = names.read_tracker_text(directory)
    if tracker is not None:
        parts.append(f"tracker naming {tracker[:40]!r}")
    iterations = [i for i in names.list_checkpoint_iterations(directory) if i not in interrupted]
    if iterations:
        shown = ", ".join(os.path.basename(names.checkpoint_dir(directory, i))
                          for i in iterations[-3:])
        parts.append(f"{len(iterations)} iteration director{'y' if len(iterations) == 1 else 'ies'}"
                     f" ({'..., ' if len(iterations) > 3 else ''}{shown})")
    latest = names.read_latest_tag(directory)
    if latest is not None:
        parts.append(f"DeepSpeed 'latest' naming {latest[:40]!r}")
    if os.path.isdir(names.checkpoint_dir(directory, names.RELEASE)):
        parts.append("a release checkpoint")
    return "; ".join(parts)


def _lost_tracker_error(directory: str, held: str, overwrite_hint: bool) -> ckpt.CheckpointError:
    interrupted = set(names.interrupted_saves(directory))
    iterations = [i for i in names.list_checkpoint_iterations(directory) if i not in interrupted]
    fix = (f"to resume, write the iteration into it (e.g. `echo {iterations[-1]} > "
           f"{names.tracker_path(directory)}`, after checking that iteration is complete)"
           if iterations
           else f"to resume, write the iteration into {names.tracker_path(directory)}")
    also = ("; to train from scratch over them, pass --overwrite-checkpoints"
            if overwrite_hint else "")
    return ckpt.CheckpointError(f"{directory} holds checkpoints ({held}) but no "
                                f"{names.TRACKER_FILENAME}, so which one is the latest is not "
                                f"known: {fix}{also}")


def decide_start(c: CheckpointConfig) -> StartDecision:
    """Resume, start fresh, or refuse (CheckpointError), per the rules in the module doc."""
    same = _same_dir(c.load, c.save)
    if c.load:
        if not os.path.exists(c.load):
            if not same:
                raise ckpt.CheckpointError(
                    f"--load {c.load} does not exist; check the path (drop --load to start "
                    "from scratch)")
            return StartDecision(None, f"--load {c.load} does not exist yet: starting from "
                                       "iteration 0 (it equals --save, so a relaunch resumes)")
        if not os.path.isdir(c.load):
            raise ckpt.CheckpointError(f"--load {c.load} is a file, not a checkpoint directory")
        tracker = names.read_tracker(c.load)
        if tracker is None:
            held = held_checkpoints(c.load)
            if held and not (same and c.overwrite_checkpoints):
                raise _lost_tracker_error(c.load, held, overwrite_hint=same)
            if not same:
                raise ckpt.CheckpointError(
                    f"--load {c.load} holds no checkpoint (no {names.TRACKER_FILENAME}); check "
                    "the path (drop --load to start from scratch)")
            note = (f"--load {c.load} holds no checkpoint yet: starting from iteration 0 (it "
                    "equals --save, so a relaunch resumes)")
            if held:
                note = (f"--overwrite-checkpoints: training from scratch into {c.save}, over "
                        f"the checkpoints it holds ({held})")
            return StartDecision(None, note)
        restart = c.finetune or tracker == "release"
        warning = ""
        if c.save and (restart or not same):
            warning = _refuse_overwrite(
                c, "this run starts at iteration 0 (--finetune or a release checkpoint)"
                if restart else f"it loads from --load {c.load}")
        return StartDecision(c.load, "", warning)
    return StartDecision(None, "", _refuse_overwrite(c, "there is no --load") if c.save else "")


def _refuse_overwrite(c: CheckpointConfig, why: str) -> str:
    """CheckpointError when --save holds checkpoints this run would write over; the warning
    to log when --overwrite-checkpoints allows it; an empty string when it holds none."""
    held = held_checkpoints(c.save)
    if not held:
        return ""
    if c.overwrite_checkpoints:
        return (f"--overwrite-checkpoints: --save {c.save} holds checkpoints ({held}); this run "
                "writes its own over them")
    resume = f"pass --load {c.save} to resume from them, " if why == "there is no --load" else ""
    raise ckpt.CheckpointError(
        f"--save {c.save} already holds checkpoints ({held}) and {why}, so they would be "
        f"overwritten: {resume}choose another --save, or pass --overwrite-checkpoints to "
        "write over them")


def check_resume(cfg: RunConfig, load_dir: str) -> ResumeTarget:
    """The checkpoint a resume from `load_dir` reads, judged from its tracker and file names:
    CheckpointError, naming the directory and the fix, when the tracker's iteration holds no
    checkpoint files, is incomplete, or has a format or tensor/pipeline/data-parallel layout
    this run's engine cannot load (`saved_layout.loadable_problem`); with --universal-checkpoint,
    when `latest_universal` is missing."""
    c, p = cfg.checkpoint, cfg.parallel
    iteration = names.read_tracker(load_dir)
    if iteration is None:
        raise ckpt.CheckpointError(f"--load {load_dir} holds no {names.TRACKER_FILENAME}; check "
                                   "the path (drop --load to start from scratch)")
    plan = plan_resume(c, iteration)
    if cfg.deepspeed.universal_checkpoint:  # DeepSpeed re-slices it for any layout
        return ResumeTarget(plan, None, saved_layout.universal_tag(load_dir))
    layout = saved_layout.check_loadable(
        load_dir, iteration, deepspeed=cfg.deepspeed.enabled,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        data_parallel_size=p.data_parallel_size, load_optimizer=False,
        expert_model_parallel_size=p.expert_model_parallel_size)
    if layout is None:
        raise ckpt.CheckpointError(
            f"{names.checkpoint_dir(load_dir, iteration)} (named by "
            f"{names.tracker_path(load_dir)}) holds no Megatron or DeepSpeed checkpoint files; "
            "restore them, or write an earlier complete iteration into the tracker")
    partitioned = cfg.deepspeed.enabled and zero_stage(cfg.deepspeed.config) == 3
    if deepspeed_problem(layout, None, cfg, partitioned, plan):
        # the model shape is the more basic mismatch: named first, as the engine does
        saved = saved_layout.read_saved_state(layout).get("args")
        if saved is not None:
            check_saved_args(plan, saved, cfg, layout.directory)
        raise ckpt.CheckpointError(deepspeed_problem(layout, saved, cfg, partitioned, plan))
    return ResumeTarget(plan, layout)


def deepspeed_problem(layout: Optional[saved_layout.SavedLayout],
                      saved_args: Optional[argparse.Namespace], cfg: RunConfig,
                      partitioned: bool, plan: ResumePlan) -> Optional[str]:
    """Why this DeepSpeed run (at ZeRO-3 when `partitioned`) cannot load `layout`: its ZeRO
    stage (saved_layout.stage_problem), or, when the plan loads the optimizer states, ZeRO
    partitions over another number of data x context ranks (saved_layout.partition_problem; the
    saved context size from `saved_args`, 1 when unknown); None if it can."""
    p = cfg.parallel
    saved_cp = int(getattr(saved_args, "context_parallel_size", 1) or 1)
    return saved_layout.stage_problem(layout, partitioned, plan.load_optimizer) or (
        saved_layout.partition_problem(layout, p.data_parallel_size * p.context_parallel_size,
                                  (saved_cp, p.context_parallel_size))
        if layout is not None and plan.load_optimizer else None)


def require_rng_state(plan: ResumePlan, rng_state: Any, where: str) -> None:
    """CheckpointError when the plan restores RNG states and the checkpoint has none."""
    if plan.load_rng and rng_state is None:
        raise ckpt.CheckpointError(
            f"checkpoint {where} has no RNG state (saved with --no-save-rng); pass "
            "--no-load-rng to resume without it")


def check_finite_weights(parameters: Iterable[Tuple[str, torch.Tensor]], where: str) -> None:
    """CheckpointError naming the first of the (name, values) pairs with NaN or Inf values
    after a load (an engine's `local_parameters()`)."""
    for name, param in parameters:
        if not bool(torch.isfinite(param.detach()).all()):
            bad = int((~torch.isfinite(param.detach())).sum())
            raise ckpt.CheckpointError(
                f"checkpoint {where} holds non-finite weights ({bad} NaN/Inf values in {name}): "
                "it was saved from a diverged run or is damaged; load an earlier iteration "
                "(write it into the tracker file)")


def plan_resume(c: CheckpointConfig, iteration: names.Iteration,
                layout: Optional[saved_layout.SavedLayout] = None) -> ResumePlan:
    """The plan for loading `iteration` (whose files are `layout`) under --finetune /
    --no-load-optim / --no-load-rng."""
    release = iteration == "release"
    weights_only = c.finetune or release
    return ResumePlan(iteration=iteration, weights_only=weights_only,
                      load_optimizer=not (weights_only or c.no_load_optim),
                      load_rng=not (weights_only or c.no_load_rng),
                      reason="a release checkpoint" if release else "--finetune" if c.finetune else "",
                      layout=layout)


def check_saved_args(plan: ResumePlan, saved: Optional[argparse.Namespace], cfg: RunConfig,
                     where: str, reshardable: bool = False) -> None:
    """Refuse a checkpoint whose model shape, tokenizer or layout differs from this run's; a
    `reshardable` one (torch_dist) may have any TP x PP and vocabulary padding. A tokenizer
    named another way but the same is logged (model_args.check_checkpoint_args).

    A checkpoint without `args` (not written by us or by Megatron) is accepted weights-only.
    """
    if saved is None:
        if not plan.weights_only:
            raise ckpt.CheckpointError(f"{where} has no 'args', so its model shape cannot be "
                                       "checked; pass --finetune to load its weights only")
        return
    for note in model_args.check_checkpoint_args(
            saved, model_args.checkpoint_args_namespace(cfg, 0, 0, 0), reshardable=reshardable):
        logger.info(note)


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
    iteration = names.read_tracker(load_dir)
    if iteration is None:
        return None
    plan = plan_resume(c, iteration, saved_layout.inspect_directory(  # once per load
        names.checkpoint_dir(load_dir, iteration)))
    contents: CheckpointContents = engine.read_checkpoint(load_dir, plan)
    check_finite_weights(engine.local_parameters(), contents.path)
    if plan.weights_only:
        logger.info("loaded weights from %s (%s): starting at iteration 0 with a fresh optimizer",
                    contents.path, plan.reason)
        return LoadResult(0, 0, 0, contents.path)
    saved_iteration = int(contents.client_state.get("iteration", iteration))
    if not plan.load_optimizer:  # fresh optimizer states, the LR continues where the run was
        engine.lr_scheduler.step(scheduler_steps(contents.scheduler_state, saved_iteration))
        logger.info("--no-load-optim: optimizer states start fresh; the LR schedule continues")
    if plan.load_rng and contents.rng_note:
        logger.info("%s", contents.rng_note)
    elif plan.load_rng:
        require_rng_state(plan, contents.rng_state, contents.path)
        ckpt.apply_rng_state(contents.rng_state, load_rng_state_dict)
    position = contents.client_state
    return LoadResult(saved_iteration, int(position.get("consumed_train_samples", 0)),
                      int(position.get("consumed_valid_samples", 0)), contents.path,
                      position.get("data_order", getattr(contents.args, "data_order", None)),
                      model_args.checkpoint_writer(contents.args, position.get("writer")))


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
    failed, highest, minus_lowest = collectives.agree(
        [error is not None, iteration, -iteration], world_group(), device)
    if error is not None:
        raise error
    if failed > 0:
        raise ckpt.CheckpointError(f"another rank could not load the checkpoint in {load_dir}; "
                                   "its message says why")
    if highest != -minus_lowest:
        raise ckpt.CheckpointError(
            f"ranks loaded different iterations from {load_dir} (from {-minus_lowest:.0f} "
            f"to {highest:.0f}; -1 = none): is --load on a disk every node sees?")
    return loaded
