"""A reader of the sample order of this trainer's releases before 0.5.0 (0.1.0 to 0.4.0, and the
code up to the change to Megatron Core's order): what their checkpoints need to resume on the
samples they would have read. New runs never use it; a checkpoint chooses it
(app.training.checkpointing.data_order: its data-order record of version 1, or, recording none,
the marks of this trainer's args before 0.4.0).

The order, for one split whose documents (entries of the .idx's document index, not its
sequences) `[start, end)` hold `doc_lengths` tokens and `T` in all:

- split: `--split`'s weights normalised in Python (`app.config.rules.split_weights`), the
  boundaries at `round(cumulative weight x D)` (`split_document_ranges`);
- epochs E and whether the last one is shuffled apart: as Megatron's rules
  (app.data.index_builder.compute_num_epochs, separate_last_epoch);
- document index `[E x D]`: one permutation of the split's documents per epoch, drawn one epoch
  after the other by numpy's PCG64 seeded with `[seed, 1]` (`build_doc_idx`);
- sample index: as Megatron's (app.data.index_builder.build_sample_index);
- shuffle index: PCG64 `[seed, 2]` permutes the samples of the first E - 1 epochs, then (always
  drawn, empty unless the last epoch is apart) those of the last;
- blend weights normalised in Python from the weights given; a blend's sample i goes to the
  dataset whose j-th sample is due first at time `(j + 0.5) / w_d` (ties: the lower dataset),
  with the weights normalised twice more in float64 as the code did (`blend_indices`).

Checked against the checkpoints those releases wrote and the losses they logged
(tests/integration/test_old_checkpoints.py) and against the arrays of that code
(tests/unit/test_data_legacy_order.py).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from app.config.blends import Blend
from app.config.rules import split_weights
from app.data.index_builder import (MEGATRON_ORDER, Indices, SampleOrder, build_sample_index,
                                    compute_num_epochs, samples_before_last_epoch,
                                    separate_last_epoch)


def _rng(seed: int, purpose: int) -> np.random.Generator:
    """The stream of (seed, purpose): 1 the document index, 2 the shuffle index."""
    return np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, purpose]))


def build_doc_idx(num_documents: int, num_epochs: int, seed: int) -> np.ndarray:
    """int32 [num_epochs * num_documents]: one permutation of range(D) per epoch."""
    rng = _rng(seed, 1)
    doc_idx = np.empty((num_epochs, num_documents), dtype=np.int32)
    for epoch in doc_idx:
        epoch[:] = np.arange(num_documents, dtype=np.int32)
        rng.shuffle(epoch)
    return doc_idx.reshape(-1)


def build_shuffle_idx(num_samples_first: int, total_samples: int, seed: int) -> np.ndarray:
    """Permutation of range(total): [0, first) and [first, total) permuted separately."""
    dtype = np.uint32 if total_samples < 2 ** 32 - 1 else np.int64
    rng = _rng(seed, 2)
    first = rng.permutation(np.arange(num_samples_first, dtype=dtype))
    last = rng.permutation(np.arange(num_samples_first, total_samples, dtype=dtype))
    return np.concatenate([first, last])


def build_indices(doc_lengths: np.ndarray, start: int, end: int, num_samples: Optional[int],
                  seq_length: int, seed: int) -> Indices:
    """(doc_idx of document ids, sample_idx, shuffle_idx) of the documents [start, end) whose
    token counts are `doc_lengths[start:end]` (module doc)."""
    if num_samples is None:
        raise ValueError("the order before 0.5.0 always built a split for a number of samples")
    lengths = np.asarray(doc_lengths[start:end], dtype=np.int64)
    tokens_per_epoch = int(lengths.sum())
    num_epochs = compute_num_epochs(tokens_per_epoch, seq_length, num_samples)
    doc_idx = build_doc_idx(lengths.size, num_epochs, seed)
    sample_idx = build_sample_index(lengths, doc_idx, seq_length)
    total = sample_idx.shape[0] - 1
    first = (samples_before_last_epoch(tokens_per_epoch, seq_length, num_epochs)
             if separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
             else total)
    return doc_idx + np.int32(start), sample_idx, build_shuffle_idx(first, total, seed)


def split_document_ranges(num_documents: int, split: str) -> Tuple[Tuple[int, int], ...]:
    """[start, end) document ranges of train/valid/test: boundaries at round(cumulative
    weight x D), the weights of `split_weights`."""
    bounds = [0]
    acc = 0.0
    for w in split_weights(split):
        acc += w
        bounds.append(min(num_documents, int(round(acc * num_documents))))
    bounds[-1] = num_documents
    return tuple((bounds[i], bounds[i + 1]) for i in range(3))


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their Python sum."""
    total = sum(float(w) for w in weights)
    return [float(w) / total for w in weights]


def blend_weights(blend: Blend) -> Optional[Tuple[float, ...]]:
    """The blend's weights as given, normalised in Python (None: weighted by size)."""
    if blend.weights is None:
        return None
    return tuple(normalize(blend.given_weights or blend.weights))


def blend_indices(weights: Sequence[float], size: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of `size` samples of datasets weighted `weights`
    (module doc): dataset d's j-th sample is due at (j + 0.5) / w_d, merged by time."""
    if size is None:
        raise ValueError("the order before 0.5.0 always blended a number of samples")
    weights = np.asarray(normalize(weights), dtype=np.float64)  # the plan's
    weights = weights / float(np.sum(weights))  # the blended dataset's
    weights = weights / weights.sum()  # the builder's
    times, which, ordinal = [], [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        count = int(np.ceil(w * size)) + 1
        j = np.arange(count, dtype=np.int64)
        times.append((j + 0.5) / w)
        which.append(np.full(count, d, dtype=np.int16))
        ordinal.append(j)
    t, d_all, j_all = np.concatenate(times), np.concatenate(which), np.concatenate(ordinal)
    order = np.lexsort((d_all, t))[:size]
    return d_all[order], j_all[order]


def _documents(indexed) -> Tuple[np.ndarray, np.ndarray]:
    ranges = indexed.document_token_ranges()
    return ranges[:, 0], ranges[:, 1]


LEGACY_ORDER = SampleOrder(
    # not the old code's "gpt-index-v1": its cached doc_idx held ids relative to the split
    name="this trainer's order before 0.5.0", version=1, index_version="gpt-index-v1-absolute",
    blend_version="blend-v1", documents=_documents, split_ranges=split_document_ranges,
    blend_weights=blend_weights, normalize=normalize, build_indices=build_indices,
    blend=blend_indices)
"""The order of the releases before 0.5.0 (data-order record version 1)."""


def sample_order(version: int) -> SampleOrder:
    """The order a data-order record's `version` names (1: LEGACY_ORDER, 2: Megatron Core's)."""
    orders = {LEGACY_ORDER.version: LEGACY_ORDER, MEGATRON_ORDER.version: MEGATRON_ORDER}
    if version not in orders:
        raise ValueError(f"data-order version {version} is not one this code reads ("
                         f"{sorted(orders)}): a checkpoint of a newer release? Resume it with "
                         "that release, or pass --allow-data-order-change to continue in "
                         "Megatron Core's order")
    return orders[version]
