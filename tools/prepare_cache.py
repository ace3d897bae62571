#!/usr/bin/env python
"""Build a run's sample-index caches ahead of time, on a CPU machine, without a process group.

    python tools/prepare_cache.py <the flags of pretrain_gpt2.py> [--prepare-cache-world-size N]

Takes the training run's own flags (data, --split, --seq-length, --seed, batch sizes and
schedule, --train-iters or --train-samples, --eval-*, --tensor/--pipeline-model-parallel-size,
--data-cache-path, the tokenizer) and the world size the run will have, and builds exactly what
the run's start-up would build: every split's datasets and blends (app.data.plan, Megatron-LM's
rules), their doc/sample/shuffle and blend indices, and each dataset's token-id range. They go
to --data-cache-path (default: beside each dataset), where the run looks for them. The run then
builds and writes nothing: it logs how many index sets it loaded from the cache, and where, and
its data and cache folders may be read-only. A cache made for other flags is never used: its
file names hash every input, and a damaged or mismatching entry is rebuilt here (or refused by
a run that cannot write there).

Prints the effective world size, data-parallel size and batches, each split's datasets,
weights and samples, then what was built and what was already there. Exit status 2 with one
line on bad flags or data.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import arguments  # noqa: E402
from app.config import PrepareCacheConfig  # noqa: E402
from app.config.options import from_flags  # noqa: E402
from app.data.tokenizer import build_tokenizer_from  # noqa: E402
from app.data.gpt_dataset import build_datasets, cache_entries  # noqa: E402
from app.launch.distributed import discover_world  # noqa: E402
from app.training.planning.data_check import describe_split  # noqa: E402
from app.training.planning.preflight import Report  # noqa: E402
from app.training.pretrain import data_plan  # noqa: E402


def prepare(argv: List[str]) -> Report:
    """Build the caches of the run `argv` describes; the report of what it did."""
    args = arguments.parse_args(argv, roots=arguments.ROOTS + (PrepareCacheConfig,))
    own = from_flags(PrepareCacheConfig, vars(args))
    world_size = own.world_size or discover_world(args.deepspeed_mpi).world_size
    tokenizer = build_tokenizer_from(args)
    cfg = arguments.build_run_config(args, world_size, tokenizer.vocab_size)
    report = Report(name="prepare_cache", title="prepare_cache")
    report.section("run")
    t, p = cfg.training, cfg.parallel
    schedule = cfg.batch_schedule
    report.ok(f"world size {p.world_size}: tensor {p.tensor_model_parallel_size} x pipeline "
              f"{p.pipeline_model_parallel_size} x data {p.data_parallel_size}")
    report.ok(f"{t.train_iters} iterations, global batch "
              + (" -> ".join(map(str, schedule.sizes_from(0, t.train_iters)))
                 if schedule.varies else str(t.global_batch_size))
              + f", seq length {cfg.model.seq_length}, seed {t.seed}")
    report.ok(f"cache: {cfg.data.data_cache_path or 'beside each dataset'}")
    plan = data_plan(cfg)
    report.section("datasets")
    report.ok(f"data from {plan.blends.source}")
    for split in plan.splits:
        if split is not None:
            describe_split(report, split, cfg.model.seq_length)
    started = time.perf_counter()
    datasets = build_datasets(plan, t.seed, cfg.data.data_cache_path,
                              vocab_size=tokenizer.vocab_size)
    entries = cache_entries(datasets)
    built = sum(1 for e in entries if e.built)
    report.section("cache")
    report.ok(f"{built} index set(s) built, {len(entries) - built} already there, in "
              f"{time.perf_counter() - started:.2f} s")
    for where in sorted({os.path.dirname(e.cache.description_file) for e in entries}):
        report.ok(f"written to {where}")
    return report


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry: 0 when the caches are ready, 2 with one line on an error."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        report = prepare(list(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(report.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
