"""The data section of the preflight report (--dry-run) and of tools/prepare_cache.py: where
the data comes from, every dataset's files, and each split's datasets, weights and samples as
the run's data plan (app.data.plan) builds them."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from app.config import DataConfig
from app.data.gpt_dataset import cache_dir_of, check_token_ids, token_id_range
from app.data.indexed_dataset import MMapIndexedDataset
from app.data.plan import DataPlan, SplitPlan, plan_datasets


def _check_files(report, prefix: str, vocab_size: Optional[int],
                 cache_path: Optional[str]) -> bool:
    """One dataset opens and validates, holds documents and (with a vocabulary) token ids
    below its size. False after an error."""
    try:
        indexed = MMapIndexedDataset(prefix)
    except (ValueError, OSError) as exc:  # DatasetFormatError is a ValueError
        report.error(f"{prefix}: {exc}")
        return False
    lengths = indexed.document_token_ranges()[:, 1]
    report.ok(f"{prefix}: {indexed.num_documents:,} documents, {int(lengths.sum()):,} tokens "
              f"({indexed.dtype.name})")
    if indexed.num_documents == 0:
        report.error(f"{prefix} holds no documents; re-run tools/preprocess_data.py on a "
                     "non-empty input or leave it out of the data flags")
        return False
    if vocab_size is not None:
        cache = cache_dir_of(prefix, cache_path)
        lo, hi = token_id_range(indexed, cache)
        if lo >= 0 and hi < vocab_size:
            report.ok(f"{prefix}: token ids in [{lo}, {hi}], below the vocabulary size "
                      f"{vocab_size}")
        else:
            try:
                check_token_ids(indexed, vocab_size, cache)
            except ValueError as exc:
                report.error(str(exc))
                return False
    return True


def describe_split(report, plan: SplitPlan, seq_length: int) -> None:
    """One line for the split, one per dataset: weight, documents, tokens, samples, epochs."""
    if plan.blended:
        how = "by dataset size" if plan.by_size else "by weight"
        report.ok(f"{plan.name}: {plan.size:,} samples, a blend of {len(plan.parts)} "
                  f"dataset(s) {how}")
    else:
        report.ok(f"{plan.name}: {plan.size:,} samples from one dataset")
    weights = plan.blend_weights() if plan.blended else [1.0]
    for part, weight in zip(plan.parts, weights):
        epochs = part.epochs(seq_length)
        text = (f"  {part.prefix}: weight {weight:.4f}, {plan.name} documents "
                f"[{part.documents[0]:,}, {part.documents[1]:,}), {part.tokens:,} tokens -> "
                f"{part.num_samples:,} samples, {epochs} epoch(s)")
        repeats = plan.name == "train" and epochs > 1
        (report.warn if repeats else report.ok)(text + (" (the training data repeats)"
                                                        if repeats else ""))
    for prefix in plan.left_out:
        report.warn(f"  {plan.name}: {prefix} has no documents or no weight in this split; it "
                    "is left out of the blend")


def check_data(report, data: Optional[DataConfig], num_samples: Optional[Sequence[int]],
               seq_length: int, vocab_size: Optional[int]) -> Optional[DataPlan]:
    """Every dataset opens and validates, its token ids fit the vocabulary, and (with
    `num_samples`, the configuration having been built) each split's plan: its datasets,
    weights, documents, tokens, samples and epochs. Returns the plan (None after an error or
    without `num_samples`)."""
    report.section("data")
    if data is None:
        return None
    blends = data.blends
    if blends is None:
        report.error("no training data: give --data-path (or --data-args-path, "
                     "--train-data-path, --per-split-data-args-path)")
        return None
    report.ok(f"data from {blends.source}" + (f", divided by --split {data.split}"
                                              if blends.per_split is None else
                                              ", each split's datasets used whole"))
    cache = data.data_cache_path
    report.ok(f"sample-index cache: {cache or 'beside each dataset'}"
              + ("" if cache is None or os.path.isdir(cache) else " (created by the run)"))
    if not all([_check_files(report, p, vocab_size, cache) for p in blends.prefixes()]):
        return None
    if num_samples is None:
        return None
    try:
        plan = plan_datasets(blends, data.split, num_samples, seq_length)
    except ValueError as exc:
        report.error(str(exc))
        return None
    for name, split_plan, needed in zip(("train", "valid", "test"), plan.splits, num_samples):
        if split_plan is not None:
            describe_split(report, split_plan, seq_length)
        elif needed > 0:
            level = report.error if name == "train" else report.warn
            level(f"{name}: {needed:,} samples are needed but no documents are there"
                  + ("; give the first weight of --split a positive value" if name == "train"
                     else f"; {name} evaluation is skipped"))
    return plan if plan.splits[0] is not None else None
