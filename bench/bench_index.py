#!/usr/bin/env python
"""Benchmark index building and sample reads on a synthetic ~1M-document, ~200M-token dataset.

    python bench/bench_index.py [--num-docs 1000000] [--tokens 200000000] [--seq-length 1024]

Prints: mmap open time (anchor ~0.07 s for 13.7M docs), doc/sample/shuffle index build in ns per
entry (anchors: ~35 ns/sample for the sample index, ~90 ns/sample for the shuffle, Megatron PR
#310 with its C++ helper), cached reload time, and random sample reads/s against a bare
np.memmap slice baseline. The .bin is a sparse file (token values do not matter here).
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import time


import numpy as np

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.data import MMapIndexedDataset, build_train_valid_test_datasets
from app.data.index_builder import (build_document_index, build_sample_index,
                                    build_shuffle_index, compute_num_epochs)


def write_synthetic(prefix: str, num_docs: int, tokens: int, seed: int = 0) -> np.ndarray:
    """Index with random document lengths summing to ~tokens; sparse uint16 .bin. Returns lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.exponential(tokens / num_docs, size=num_docs).astype(np.int32) + 1
    pointers = np.zeros(num_docs, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= 2
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, num_docs, num_docs + 1))
        f.write(lengths.tobytes() + pointers.tobytes())
        f.write(np.arange(num_docs + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    return lengths


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--num-docs", type=int, default=1_000_000)
    p.add_argument("--tokens", type=int, default=200_000_000)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--epochs", type=float, default=2.5, help="samples requested, in epochs")
    p.add_argument("--reads", type=int, default=20000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "synthetic")
        lengths = write_synthetic(prefix, args.num_docs, args.tokens)
        total_tokens = int(lengths.sum(dtype=np.int64))
        ds, t_open = timed(MMapIndexedDataset, prefix)
        print(f"data: {args.num_docs} docs, {total_tokens / 1e6:.1f} M tokens, seq {args.seq_length}")
        print(f"mmap open + validation: {t_open * 1e3:.1f} ms (anchor ~70 ms for 13.7 M docs)")
        num_samples = int(args.epochs * (total_tokens - 1) // args.seq_length)
        epochs = compute_num_epochs(total_tokens, args.seq_length, num_samples)
        random_state = np.random.RandomState(1234)
        doc_idx, t_doc = timed(build_document_index, np.arange(args.num_docs), epochs,
                               random_state, False)
        sample_idx, t_sample = timed(build_sample_index, lengths, doc_idx, args.seq_length)
        n = sample_idx.shape[0] - 1
        shuffle_idx, t_shuffle = timed(build_shuffle_index, n, n, random_state)
        print(f"epochs {epochs}, samples {n}")
        print(f"doc-idx:     {t_doc:.3f} s, {t_doc / doc_idx.size * 1e9:.1f} ns/doc entry")
        print(f"sample-idx:  {t_sample:.3f} s, {t_sample / n * 1e9:.1f} ns/sample (anchor ~35), "
              f"{t_sample / doc_idx.size * 1e9:.1f} ns/doc entry, "
              f"{doc_idx.size / n:.1f} doc entries per sample")
        print(f"shuffle-idx: {t_shuffle:.3f} s, {t_shuffle / n * 1e9:.1f} ns/sample (anchor ~90)")
        build = lambda: build_train_valid_test_datasets(  # noqa: E731
            [prefix], "969,30,1", (num_samples, 1000, 100), args.seq_length, 1234)
        (train, _, _), t_first = timed(build)
        (train, _, _), t_cached = timed(build)
        print(f"full build incl. split, check and .npy save: {t_first:.2f} s; "
              f"cached reload: {t_cached * 1e3:.1f} ms")
        rng = np.random.default_rng(1)
        picks = rng.integers(0, len(train), size=args.reads)
        _, t_reads = timed(lambda: [train[int(i)] for i in picks])
        flat = np.memmap(prefix + ".bin", mode="r", dtype=np.uint16)
        offsets = rng.integers(0, flat.size - args.seq_length - 1, size=args.reads)
        _, t_base = timed(lambda: [flat[o:o + args.seq_length + 1].astype(np.int64)
                                   for o in offsets])
        print(f"random sample reads: {args.reads / t_reads:,.0f}/s; bare np.memmap slice baseline "
              f"{args.reads / t_base:,.0f}/s (ratio {t_base / t_reads:.2f})")
        _, t_scan = timed(ds.token_id_range)
        print(f"token-id range scan (vocab check, cached after first run): {t_scan:.2f} s")


if __name__ == "__main__":
    main()
