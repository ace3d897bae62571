#!/usr/bin/env python
"""Benchmark the data start-up of a run on a 1 GB dataset: building the sample indices at
start-up (what rank 0 does without a prepared cache) against loading the indices
tools/prepare_cache.py built ahead.

    python bench/bench_cache_startup.py [--gigabytes 1] [--prefixes 4] [--seq-length 2048]

The dataset is `--prefixes` uint16 .bin/.idx pairs of `--gigabytes` in all (sparse files:
token values do not matter here), blended with equal weights and divided by --split 969,30,1;
the training split is asked for one epoch of samples. Timed, each in a fresh cache folder or
the prepared one:

- start-up without a prepared cache: the run's data step with an empty cache folder (plan,
  token-id range scan, doc / sample / shuffle indices and the blend, written to the cache),
  which is also the work tools/prepare_cache.py does ahead; median of 2 fresh folders;
- cached start-up: the run's data step after it (plan, cached token ranges, indices loaded
  by memory map; nothing built, nothing written), median of --repeats.
The first start-up reads the freshly written files; every later timing finds them in the page
cache.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_index import write_synthetic  # noqa: E402  (bench/ is this script's folder)

from app.config import DataConfig  # noqa: E402
from app.data.gpt_dataset import build_datasets, cache_entries  # noqa: E402
from app.data.plan import plan_datasets  # noqa: E402

VOCAB = 50257


def data_startup(prefixes, samples, seq_length, cache):
    """The run's data step (app.training.pretrain.data_plan + build_datasets, one rank):
    (seconds, index sets built, index sets in all)."""
    t0 = time.perf_counter()
    words = [w for p in prefixes for w in ("1", p)]
    blends = DataConfig(data_path=words).blends
    plan = plan_datasets(blends, "969,30,1", samples, seq_length)
    datasets = build_datasets(plan, 1234, cache, vocab_size=VOCAB)
    entries = cache_entries(datasets)
    return time.perf_counter() - t0, sum(e.built for e in entries), len(entries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--gigabytes", type=float, default=1.0)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--tokens-per-doc", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tokens = int(args.gigabytes * 1e9 / 2 / args.prefixes)  # uint16
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = []
        for i in range(args.prefixes):
            prefixes.append(os.path.join(tmp, f"part{i}"))
            write_synthetic(prefixes[-1], tokens // args.tokens_per_doc, tokens, seed=i)
        size = sum(os.path.getsize(q + ".bin") for q in prefixes)
        train = int(0.969 * size / 2) // args.seq_length  # about one epoch of the train split
        samples = (train, train // 100, train // 1000)
        print(f"data: {args.prefixes} prefixes, {size / 1e9:.2f} GB, "
              f"{size // 2 / 1e6:.0f} M tokens, {args.prefixes * (tokens // args.tokens_per_doc):,}"
              f" documents; seq {args.seq_length}; samples {samples}")
        first, _, _ = data_startup(prefixes, samples, args.seq_length,
                                   os.path.join(tmp, "first"))
        print(f"first start-up, data files not yet in the page cache: {first:.2f} s")
        cold = []  # the data files are in the page cache from here on, for every timing
        for k in range(2):
            seconds, built, total = data_startup(prefixes, samples, args.seq_length,
                                                 os.path.join(tmp, f"cold{k}"))
            cold.append(seconds)
        print(f"start-up without a prepared cache (rank 0 builds {built} of {total} index sets "
              f"and the token ranges; tools/prepare_cache.py does the same work ahead): "
              f"{statistics.median(cold):.2f} s median of 2")
        prepared = os.path.join(tmp, "cold0")
        warm = []
        for _ in range(args.repeats):
            seconds, built, total = data_startup(prefixes, samples, args.seq_length, prepared)
            assert built == 0, "the prepared cache was not used"
            warm.append(seconds)
        print(f"cached start-up (after prepare_cache): {statistics.median(warm) * 1e3:.1f} ms "
              f"median of {args.repeats} ({total} index sets loaded, 0 built); "
              f"{statistics.median(cold) / statistics.median(warm):.0f}x faster")


if __name__ == "__main__":
    main()
