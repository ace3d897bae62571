"""Pretrain GPT-2 with Megatron-LM's flags, on the native path or through DeepSpeed.

    python pretrain_gpt2.py --num-layers 4 --hidden-size 256 ... --data-path data/corpus_content_document
    torchrun --nproc-per-node 2 pretrain_gpt2.py --tensor-model-parallel-size 2 ...
    deepspeed pretrain_gpt2.py --deepspeed --deepspeed_config ds_configs/zero2.json ...
    python pretrain_gpt2.py ... --dry-run [--dry-run-world-size 8 --dry-run-device-memory 80]
    srun --ntasks-per-node 8 python pretrain_gpt2.py ...  (ranks from Slurm; scripts/sbatch_*)

The composition root: flags parsed and the world discovered once -> RunConfig (arguments.py) -> app.training.pretrain.pretrain,
or with --dry-run the preflight report (app.training.planning.preflight) instead of training.
See README.md and docs/ for every flag.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List, Optional, Tuple

import arguments
from app.data import build_tokenizer
from app.training.planning import preflight as preflight_lib
from app.training import pretrain as pretrain_lib
from app.launch.distributed import WorldInfo, discover_world
from app.launch.threads import choose_threads
from app.launch.slurm import SlurmLaunchError
from app.training.loss import LossFunction


def _tokenizer(args: argparse.Namespace) -> Any:
    """--tokenizer-type's tokenizer (NullTokenizer of --vocab-size ids needs no file)."""
    return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size,
                           args.tokenizer_model)


def _train(args: argparse.Namespace, world: WorldInfo,
           loss_function: Optional[LossFunction] = None) -> Any:
    tokenizer = _tokenizer(args)
    cfg = arguments.build_run_config(args, world.world_size, tokenizer.vocab_size,
                                     world_source=world.source)
    return pretrain_lib.pretrain(cfg, tokenizer, arguments.format_args(args), loss_function,
                                 world=world)


def preflight(args: argparse.Namespace, world: WorldInfo) -> preflight_lib.Report:
    """--dry-run: the tokenizer, the RunConfig the run would build (for --dry-run-world-size
    ranks, else the launcher's world) and every check of app.training.planning.preflight,
    gathered in one report; nothing trains and no process group starts."""
    report = preflight_lib.Report()
    report.section("world")
    report.ok(world.describe())
    report.ok(choose_threads(os.environ, world.local_world_size or world.world_size).describe())
    if world.warning:
        report.warn(world.warning)
    report.section("tokenizer")
    vocab: Optional[int] = None
    try:
        tokenizer = _tokenizer(args)
        vocab = tokenizer.vocab_size
        report.ok(f"{type(tokenizer).__name__}: vocabulary {vocab}, end-of-document id "
                  f"{tokenizer.eod}")
    except (ValueError, OSError) as exc:
        report.error(str(exc))
    cfg, data = None, None
    try:  # with no tokenizer, a placeholder vocabulary still checks the flags and the JSON
        dry = arguments.dry_run_config(args)
        cfg = arguments.build_run_config(
            args, dry.world_size or world.world_size, vocab or args.make_vocab_size_divisible_by,
            world_source="--dry-run-world-size" if dry.world_size else world.source)
        data = cfg.data
    except ValueError as exc:
        report.section("configuration")
        report.error(str(exc))
        data = arguments.data_config(args)  # the data files are checked all the same
    return preflight_lib.run_checks(
        report, cfg if vocab is not None else None, data=data, vocab_size=vocab,
        device_memory_gib=args.dry_run_device_memory)


def _start(argv: Optional[List[str]]) -> Tuple[argparse.Namespace, WorldInfo]:
    """The command line parsed and the world discovered, once per process. A launch that
    cannot make the world the run needs raises app.launch.slurm.SlurmLaunchError."""
    args = arguments.parse_args(argv)
    return args, discover_world(args.deepspeed_mpi)


def _report(args: argparse.Namespace, world: WorldInfo) -> preflight_lib.Report:
    report = preflight(args, world)
    if world.rank == 0:
        print(report.render(), flush=True)
    return report


def run(argv: Optional[List[str]] = None, loss_function: Optional[LossFunction] = None) -> Any:
    """Parse `argv`, build the RunConfig and train; returns the Trainer (with --dry-run: the
    preflight Report, printed). `loss_function` (app.training.loss.LossFunction) replaces
    Megatron's LM loss; see examples/custom_loss.py."""
    args, world = _start(argv)
    if args.dry_run:
        return _report(args, world)
    return _train(args, world, loss_function)


def main(argv: Optional[List[str]] = None, loss_function: Optional[LossFunction] = None) -> int:
    """Command-line entry: exit code 0, or 2 with one clear line for bad flags, data or
    checkpoints (with --dry-run: 2 when the report has an error)."""
    try:
        args, world = _start(argv)
    except SlurmLaunchError as exc:  # before anything is written
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        return 2 if _report(args, world).errors else 0
    return pretrain_lib.main(lambda: _train(args, world, loss_function))


if __name__ == "__main__":
    sys.exit(main())
