"""Pretrain from a RunConfig: distributed start-up, the run's parts, checkpoint, data, training.

`pretrain_gpt2.py` is the composition root: it parses the flags into a RunConfig once (with
`arguments.py`) and calls `pretrain(cfg, tokenizer)`. Order here: process group -> logging ->
start-up checks of --save/--load (all ranks agree: --save writable, its writer lock, no stale
temporaries; resume or fresh start per app.training.checkpointing.resume.decide_start; the saved
layout loadable per resume.check_resume) -> launcher watch and watchdog -> parts of the run
(app.training.run, the run's checkpointer included) -> the data plan (app.data.plan) ->
checkpoint load (the checkpointer's `load_latest`: all ranks agree; the newest non-persistent
(local or global) checkpoint when it is at least as new as --load's; a resume keeps the
checkpoint's data order) -> datasets built or loaded from the cache -> Trainer, with
the exit-signal handler installed while it trains. `--dry-run` (app.training.planning.preflight)
calls the same decision functions in the same order. With
--inprocess-restart these steps are one attempt, which app.training.resilience.inprocess runs
again in the same process after a rank's error.

`main` maps outcomes to exit codes: 0 for a finished run and for one stopped by a signal after
its checkpoint; 2 for configuration, data and checkpoint errors (one clear line); 3 for a run
stopped by the non-finite policy (app.training.resilience.nonfinite); 4 (EXIT_PEER_FAILURE) when another
rank died, stopped or hung; 5 (EXIT_SAVE_FAILED) when checkpoints could not be saved
(--max-failed-saves in a row, or the run's last save; app.training.checkpointing.saver).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from app.config import RunConfig, samples_per_split
from app.config.unread import unread_flags
from app.data import build_mock_datasets
from app.data.gpt_dataset import build_datasets
from app.data.index_builder import MEGATRON_ORDER, SampleOrder
from app.data.legacy_order import sample_order
from app.data.plan import ORDER_VERSION, DataPlan, order_record, plan_datasets
from app.mpu import collectives
from app.checkpoint import CheckpointError
from app.launch.hardware import fp8_problem
from app.launch.distributed import (DistributedInfo, WorldInfo, all_ranks_ok,
                                    init_distributed, log_launch_notes, nccl_trace_dir,
                                    shutdown_distributed, world_group)
from app.training.loss import LossFunction
from app.training.checkpointing.resume import StartDecision, check_resume, decide_start
from app.training.checkpointing.saver import SaveFailed
from app.training.resilience.inprocess import InProcessRestart
from app.training.resilience.nonfinite import TrainingAborted
from app.training.run import build_run
from app.training.resilience.save_dir import SaveDirError, SaveDirLock, claim_save_dir, ensure_writable_dir
from app.training.resilience.signals import ExitSignalHandler, LauncherWatch, detect_launcher, handler_enabled
from app.training.trainer import Trainer
from app.training.resilience.watchdog import PeerFailure, Watchdog
from app.utils.rank_logging import setup_logging

logger = logging.getLogger(__name__)


def data_plan(cfg: RunConfig, order: SampleOrder = MEGATRON_ORDER) -> DataPlan:
    """The run's data plan in `order` (app.data.plan: which datasets each split builds, for how
    many samples); opens every dataset. Raises ValueError when there is no training data."""
    blends = cfg.data.blends
    if blends is None:
        raise ValueError("no training data: give --data-path (or --data-args-path, "
                         "--train-data-path, --per-split-data-args-path) with the prefix of a "
                         ".bin/.idx pair made by tools/preprocess_data.py")
    plan = plan_datasets(blends, cfg.data.split, samples_per_split(cfg), cfg.model.seq_length,
                         cfg.data.mmap_bin_files, order)
    if plan.splits[0] is None:
        where = (f"--split {cfg.data.split} leaves no training documents in {blends.source}"
                 if blends.per_split is None else f"{blends.source}: the training data holds "
                 "no sample")
        raise ValueError(f"{where}; give the first (training) weight of --split a positive "
                         "value, e.g. --split 969,30,1, or more training data")
    if plan.splits[1] is None and cfg.training.eval_iters > 0:
        logger.warning("%s gives no validation data: evaluation is skipped (--eval-iters 0 "
                       "silences this)", blends.source if blends.per_split is not None
                       else f"--split {cfg.data.split}")
    return plan


def _datasets(cfg: RunConfig, plan: DataPlan, rank: int) -> tuple:
    logger.info("building train/valid/test datasets for %s samples from %s",
                [None if s is None else s.size for s in plan.splits], plan.blends.source)
    return build_datasets(plan, cfg.training.seed, cache_path=cfg.data.data_cache_path,
                          vocab_size=cfg.raw_vocab_size, is_builder=rank == 0,
                          barrier=lambda: collectives.barrier(world_group()))


def _mock_datasets(cfg: RunConfig, eod: int) -> tuple:
    """--mock-data: Megatron's mock (train, valid, test) datasets of the sizes the run reads,
    documents ending in the tokenizer's `eod`."""
    datasets = build_mock_datasets(samples_per_split(cfg), cfg.model.seq_length,
                                   cfg.raw_vocab_size, cfg.training.seed, eod)
    logger.info("--mock-data: %s", "; ".join(d.describe() for d in datasets if d))
    return datasets


def mock_order_record(cfg: RunConfig, datasets: Sequence) -> Dict[str, Any]:
    """The data-order record of a --mock-data run over its (train, valid, test) `datasets`:
    Megatron's mock documents in Megatron Core's order (ORDER_VERSION), decided by the seed,
    the sequence length and each split's epochs (--split does not apply: Megatron divides
    them in thirds; app.data.mock_dataset)."""
    return {"version": ORDER_VERSION, "mock_data": True, "seed": cfg.training.seed,
            "seq_length": cfg.model.seq_length,
            "splits": {d.split: d.order_entry() for d in datasets[:2] if d is not None}}


def _start_checks(cfg: RunConfig, info: DistributedInfo, restarted: bool = False
                  ) -> Tuple[Optional[SaveDirLock], StartDecision]:
    """The --save/--load checks every rank runs before anything is built; all ranks agree.

    Rank 0 claims --save (created, writable, writer lock, stale temporaries removed), every
    other rank checks it can write there too; all apply the resume policy and, when resuming,
    check that the saved layout can be loaded. If any rank fails, every rank raises (the
    failing one with its own message) and the lock is released. `--dry-run` makes the same
    decisions, without writing (app.training.planning.preflight.check_checkpoint). After an
    in-process restart (`restarted`) the checkpoints --save holds are this run's own: they are
    not refused (as --overwrite-checkpoints, without its warning).
    """
    c = dataclasses.replace(cfg.checkpoint, overwrite_checkpoints=True) if restarted \
        else cfg.checkpoint
    lock: Optional[SaveDirLock] = None
    decision, error = StartDecision(None), None
    try:
        if c.save and info.rank == 0:
            lock = claim_save_dir(c.save)
        elif c.save:
            ensure_writable_dir(c.save)
        decision = decide_start(c)
        if decision.warning and not restarted:
            logger.warning(decision.warning)
        if decision.load is not None:
            check_resume(cfg, decision.load)
    except (ValueError, CheckpointError) as exc:
        error = exc
    if not all_ranks_ok(error is None, info.device):
        if lock is not None:
            lock.release()
        raise error or SaveDirError("another rank failed the start-up checks of --save/--load; "
                                    "its message says why")
    return lock, decision


def _signal_handler(cfg: RunConfig) -> Optional[ExitSignalHandler]:
    """The exit-signal handler when --exit-signal-handler is on (by default: with --save)."""
    c, setting = cfg.checkpoint, cfg.training.exit_signal_handler
    if c.save_interval and not c.save:
        logger.warning("--save-interval %d is set but --save is not: no checkpoint will be "
                       "saved; add --save <directory>", c.save_interval)
    enabled = handler_enabled(setting, c.save)
    launcher = detect_launcher()
    how = "--exit-signal-handler" if setting else "on by default with --save"
    if enabled:
        logger.info("exit signal handler (%s%s): SIGTERM, SIGINT and SIGUSR1 stop the run at the "
                    "end of the iteration%s, exit status 0", how,
                    f"; launched by {launcher}" if launcher else "",
                    " with a checkpoint" if c.save else " (no --save: without a checkpoint)")
    return ExitSignalHandler() if enabled else None


def _log_precision(cfg: RunConfig) -> None:
    p = cfg.precision
    detail = ""
    if p.fp16 and not cfg.deepspeed.enabled:
        initial, minimum, window, hysteresis = p.dynamic_scaler_settings()
        detail = (f"; static loss scale {p.loss_scale}" if p.loss_scale else
                  f"; dynamic loss scale from {initial:g} (min {minimum:g}, window {window}, "
                  f"hysteresis {hysteresis})")
    if (p.fp16 or p.bf16) and not cfg.deepspeed.enabled:
        detail += (", gradients accumulated in fp32" if p.grads_accumulate_in_fp32
                   else ", gradients accumulated in fp16") + ", fp32 main weights"
    logger.info("> precision: %s weights (from %s)%s", cfg.model.params_dtype, p.source, detail)


def _log_world(cfg: RunConfig, info: DistributedInfo) -> None:
    """The start-up lines: the layout as Megatron-LM prints it, where the ranks came from, the
    intra-op threads and, when derived, the exit time."""
    logger.info(cfg.parallel.megatron_layout())
    if info.world is not None:
        logger.info("> world: %s", info.world.describe())
        if info.world.warning:
            logger.warning(info.world.warning)
    if info.threads is not None:
        logger.info("> %s", info.threads.describe())
    t = cfg.training
    if t.exit_duration_source:
        logger.info("> --exit-duration-in-mins %.1f (from %s)", t.exit_duration_in_mins,
                    t.exit_duration_source)


def pretrain(cfg: RunConfig, tokenizer: Any, arguments_listing: Sequence[str] = (),
             loss_function: Optional[LossFunction] = None,
             world: Optional[WorldInfo] = None) -> Trainer:
    """Build everything for `cfg` and train; returns the Trainer (for tests and tools).

    `tokenizer` gives the end-of-document id; `arguments_listing` (Megatron's "arguments" block)
    is printed at start; `loss_function` replaces Megatron's LM loss (app.training.loss);
    `world` is the world pretrain_gpt2.py discovered (None: discovered here). With
    --inprocess-restart a failed attempt is built and run again inside this process
    (app.training.resilience.inprocess).
    """
    if not cfg.inprocess.enabled:
        return _attempt(cfg, tokenizer, arguments_listing, loss_function, world, None)
    restart = InProcessRestart(cfg.inprocess, cfg.parallel.distributed_timeout_minutes)
    return restart.run(lambda r: _attempt(cfg, tokenizer, () if r.restarts else arguments_listing,
                                          loss_function, world, r))


def _attempt(cfg: RunConfig, tokenizer: Any, arguments_listing: Sequence[str],
             loss_function: Optional[LossFunction], world: Optional[WorldInfo],
             restart: Optional[InProcessRestart]) -> Trainer:
    """One attempt of `pretrain`: everything built, the state loaded (after an in-process
    restart: `restart`'s snapshot when it has one) and trained."""
    p = cfg.parallel
    problem = fp8_problem(cfg.fp8)
    if problem:  # before any process group: one line, exit status 2 (main)
        raise ValueError(problem)
    info = init_distributed(p.distributed_backend, cfg.deepspeed.mpi,
                            p.distributed_timeout_minutes, nccl_trace_dir(cfg.checkpoint.save),
                            world=world)
    setup_logging(info.rank, info.world_size)
    _log_world(cfg, info)
    if arguments_listing:
        logger.info("---------- arguments (those not at their --help default) ----------\n%s\n"
                    "----------------------- end of arguments --------------------------",
                    "\n".join(arguments_listing))
    logger.info("> padded vocab (size: %d) with %d dummy tokens (new size: %d)",
                cfg.raw_vocab_size, cfg.model.padded_vocab_size - cfg.raw_vocab_size,
                cfg.model.padded_vocab_size)
    _log_precision(cfg)
    if restart is None or not restart.restarts:
        for note in unread_flags(cfg, info.device.type):  # once per run, not per restart
            logger.warning(note)
    with contextlib.ExitStack() as stack:
        lock, decision = _start_checks(cfg, info, restarted=bool(restart and restart.restarts))
        if lock is not None:
            stack.callback(lock.release)
        stack.enter_context(LauncherWatch())
        timeout_s = p.distributed_timeout_minutes * 60.0
        watchdog = stack.enter_context(Watchdog(
            timeout_s + max(30.0, 0.1 * timeout_s), info.rank, info.world_size,
            on_expire=lock.release if lock is not None else None))
        run = build_run(cfg, info.world_size, info.device)
        plan = None if cfg.data.mock_data else data_plan(cfg)
        mock = _mock_datasets(cfg, tokenizer.eod) if plan is None else None

        def plan_in(version: int) -> Optional[DataPlan]:
            """The run's plan in the order of data-order `version` (--mock-data: None)."""
            if plan is None or version == plan.order.version:
                return plan
            return data_plan(cfg, sample_order(version))  # a checkpoint's older order

        if decision.note:
            logger.info(decision.note)
        state = ((restart.restore(run.engine) if restart is not None else None)
                 or run.checkpointer.load_latest(decision.load, lambda version: (
                     mock_order_record(cfg, mock) if plan is None
                     else order_record(plan_in(version), cfg.training.seed))))
        plan = plan_in((state.data_order or {}).get("version", ORDER_VERSION))
        log_launch_notes(info, state.iteration if decision.load is not None else None)
        handler = _signal_handler(cfg)
        datasets = mock if plan is None else _datasets(cfg, plan, info.rank)
        trainer = run.attach_trainer(datasets, tokenizer.eod, state,
                                     loss_function=loss_function, signals=handler,
                                     watchdog=watchdog, inprocess=restart)
        if handler is not None:
            stack.enter_context(handler)
        trainer.train()
    return trainer


def main(run: Callable[[], Any]) -> int:
    """Call `run()` (which builds the config and trains) and return the process exit code:
    configuration, data and checkpoint errors print one clear line and give 2; the non-finite
    policy stopping the run gives 3; a dead, stopped or hung peer gives 4 (PeerFailure, without
    waiting for the other ranks); checkpoints that could not be saved give 5 (SaveFailed); the
    process group is torn down otherwise."""
    try:
        run()
    except PeerFailure as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return 2
    except TrainingAborted as exc:
        print(f"error: training stopped: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return 3
    except SaveFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return exc.exit_code
    shutdown_distributed(graceful=True)
    return 0


__all__ = ["pretrain", "main"]
