"""Pretrain from a RunConfig: distributed start-up, the run's parts, checkpoint, data, training.

`pretrain_gpt2.py` is the composition root: it parses the flags into a RunConfig once (with
`arguments.py`) and calls `pretrain(cfg, tokenizer)`. Order here: process group -> logging ->
parts of the run (app.training.run) -> checkpoint load (all ranks agree) -> datasets sized for
the run -> Trainer. `main` turns configuration, data and checkpoint errors into exit code 2 and a run stopped by
the non-finite policy (app.training.nonfinite) into 3.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional, Sequence

from app.config import RunConfig, samples_per_split
from app.data import build_train_valid_test_datasets
from app.mpu import collectives
from app.training.checkpoint import CheckpointError
from app.training.distributed import init_distributed, shutdown_distributed, world_group
from app.training.loss import LossFunction
from app.training.nonfinite import TrainingAborted
from app.training.resume import load_on_all_ranks
from app.training.run import build_run
from app.training.trainer import RunState, Trainer
from app.utils.rank_logging import setup_logging

logger = logging.getLogger(__name__)


def _datasets(cfg: RunConfig, rank: int) -> tuple:
    t = cfg.training
    num_samples = samples_per_split(cfg)
    logger.info("building train/valid/test datasets for %s samples from %s", num_samples,
                cfg.data.data_path)
    datasets = build_train_valid_test_datasets(
        cfg.data.data_path, cfg.data.split, num_samples, cfg.model.seq_length, t.seed,
        cache_path=cfg.data.data_cache_path, vocab_size=cfg.raw_vocab_size,
        is_builder=rank == 0, barrier=lambda: collectives.barrier(world_group()))
    if datasets[0] is None:
        raise ValueError(f"--split {cfg.data.split} leaves no training documents in --data-path "
                         f"{' '.join(cfg.data.data_path)}; give the first (training) weight a "
                         "positive value, e.g. --split 969,30,1")
    if datasets[1] is None and t.eval_iters > 0:
        logger.warning("--split %s leaves no validation documents: evaluation is skipped "
                       "(--eval-iters 0 silences this)", cfg.data.split)
    return datasets


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


def pretrain(cfg: RunConfig, tokenizer: Any, arguments_listing: Sequence[str] = (),
             loss_function: Optional[LossFunction] = None) -> Trainer:
    """Build everything for `cfg` and train; returns the Trainer (for tests and tools).

    `tokenizer` gives the end-of-document id; `arguments_listing` (Megatron's "arguments" block)
    is printed at start; `loss_function` replaces Megatron's LM loss (app.training.loss).
    """
    info = init_distributed(cfg.parallel.distributed_backend, cfg.deepspeed.mpi)
    setup_logging(info.rank, info.world_size)
    if arguments_listing:
        logger.info("------------------------ arguments ------------------------\n%s\n"
                    "-------------------- end of arguments ---------------------",
                    "\n".join(arguments_listing))
    logger.info("> padded vocab (size: %d) with %d dummy tokens (new size: %d)",
                cfg.raw_vocab_size, cfg.model.padded_vocab_size - cfg.raw_vocab_size,
                cfg.model.padded_vocab_size)
    _log_precision(cfg)
    run = build_run(cfg, info.world_size, info.device)
    state = RunState()
    if cfg.checkpoint.load:
        loaded = load_on_all_ranks(run.engine, cfg.checkpoint.load, info.device)
        if loaded is None:
            logger.warning("--load %s holds no checkpoint (no latest_checkpointed_iteration.txt); "
                           "starting from iteration 0", cfg.checkpoint.load)
        else:
            state = RunState(loaded.iteration, loaded.consumed_train_samples,
                             loaded.consumed_valid_samples)
            logger.info("loaded checkpoint %s: resuming at iteration %d, consumed samples %d",
                        loaded.path, loaded.iteration, loaded.consumed_train_samples)
    trainer = run.attach_trainer(_datasets(cfg, info.rank), tokenizer.eod, state,
                                 loss_function=loss_function)
    trainer.train()
    return trainer


def main(run: Callable[[], Any]) -> int:
    """Call `run()` (which builds the config and trains) and return the process exit code:
    configuration, data and checkpoint errors print one clear line and give 2; the process
    group is torn down either way."""
    try:
        run()
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return 2
    except TrainingAborted as exc:
        print(f"error: training stopped: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return 3
    shutdown_distributed(graceful=True)
    return 0


__all__ = ["pretrain", "main"]
