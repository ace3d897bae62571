"""Pure, vectorised builders of the GPT sample indices (Megatron's doc / sample / shuffle index).

Definitions, for one split of `D` documents with token counts `doc_lengths[D]`:

- epochs: the smallest E such that E passes over the split give `num_samples` samples of
  `seq_length + 1` tokens, where consecutive samples share one token (the last input token of a
  sample is the first of the next): `(E * tokens_per_epoch - 1) // seq_length >= num_samples`.
- doc index `[E * D]`: the concatenation of one independent permutation of the documents per epoch.
- sample index `[S + 1, 2]`: row i is (position in the doc index, token offset in that document)
  of the first token of sample i; sample i runs to row i + 1 inclusive. Empty documents are
  skipped. S = `(E * tokens_per_epoch - 1) // seq_length`.
- shuffle index `[S]`: a permutation of the samples. As in Megatron, when the last epoch is needed
  for less than 80% of its samples, the samples of the first E - 1 epochs and those of the last
  epoch are permuted separately (so the partial epoch is not mixed into the earlier ones).

Everything is deterministic given the seed; no Python loop runs per document or per sample.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

INDEX_VERSION = "gpt-index-v1"
"""Bumped whenever the algorithm changes, so that cached indices of older versions are not reused."""


def _rng(seed: int, purpose: int) -> np.random.Generator:
    """Independent deterministic stream for (seed, purpose)."""
    return np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, purpose]))


def compute_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs that yields at least num_samples samples (see module doc)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; use more data or a different --split")
    if seq_length <= 0 or num_samples <= 0:
        raise ValueError(f"seq_length ({seq_length}) and num_samples ({num_samples}) must be positive")
    # (E * T - 1) // s >= n  <=>  E * T >= n * s + 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                        num_epochs: int) -> bool:
    """True when the last epoch contributes < 80% of an epoch's samples (Megatron's rule)."""
    if num_epochs == 1:
        return False
    from_earlier = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return (num_samples - from_earlier) < int(0.80 * per_epoch)


def build_doc_idx(num_documents: int, num_epochs: int, seed: int) -> np.ndarray:
    """int32 [num_epochs * num_documents]: one random permutation of range(D) per epoch."""
    rng = _rng(seed, 1)
    doc_idx = np.empty((num_epochs, num_documents), dtype=np.int32)
    for epoch in doc_idx:  # in-place shuffles of int32 rows: ~2x faster than Generator.permuted
        epoch[:] = np.arange(num_documents, dtype=np.int32)
        rng.shuffle(epoch)
    return doc_idx.reshape(-1)


def build_sample_idx(doc_lengths: np.ndarray, doc_idx: np.ndarray, seq_length: int) -> np.ndarray:
    """[S + 1, 2] (doc-index position, offset) of each sample start; int32 if it fits, else int64."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)[doc_idx]
    ends = np.cumsum(lengths)  # ends[k]: global token position just past doc_idx[k]
    total = int(ends[-1]) if ends.size else 0
    num_samples = (total - 1) // seq_length if total > 0 else 0
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # first doc ending after the token
    offset = starts - (ends[position] - lengths[position])
    out_dtype = np.int32 if max(doc_idx.size, int(lengths.max(initial=0))) < 2 ** 31 else np.int64
    sample_idx = np.empty((num_samples + 1, 2), dtype=out_dtype)
    sample_idx[:, 0] = position
    sample_idx[:, 1] = offset
    return sample_idx


def build_shuffle_idx(num_samples_first: int, total_samples: int, seed: int) -> np.ndarray:
    """Permutation of range(total): [0, first) and [first, total) permuted separately."""
    dtype = np.uint32 if total_samples < 2 ** 32 - 1 else np.int64
    rng = _rng(seed, 2)
    first = rng.permutation(np.arange(num_samples_first, dtype=dtype))
    last = rng.permutation(np.arange(num_samples_first, total_samples, dtype=dtype))
    return np.concatenate([first, last])


def build_indices(doc_lengths: np.ndarray, num_samples: int, seq_length: int,
                  seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for a split whose documents have `doc_lengths` tokens."""
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    tokens_per_epoch = int(doc_lengths.sum())
    num_epochs = compute_num_epochs(tokens_per_epoch, seq_length, num_samples)
    doc_idx = build_doc_idx(doc_lengths.size, num_epochs, seed)
    sample_idx = build_sample_idx(doc_lengths, doc_idx, seq_length)
    total = sample_idx.shape[0] - 1
    if separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs):
        first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    else:
        first = total
    shuffle_idx = build_shuffle_idx(first, total, seed)
    return doc_idx, sample_idx, shuffle_idx


def split_document_ranges(num_documents: int, weights: Tuple[float, float, float]
                          ) -> Tuple[Tuple[int, int], ...]:
    """[start, end) document ranges of train/valid/test: boundaries at round(cumulative weight x D)."""
    bounds = [0]
    acc = 0.0
    for w in weights:
        acc += w
        bounds.append(min(num_documents, int(round(acc * num_documents))))
    bounds[-1] = num_documents
    return tuple((bounds[i], bounds[i + 1]) for i in range(3))


def blend_indices(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` samples drawn in proportion to `weights`.

    Dataset d's j-th sample is placed at time (j + 0.5) / w_d and all datasets are merged by time
    (ties by dataset order), so after any prefix of i samples each dataset has w_d * i samples
    up to rounding (within one). Deterministic, no randomness needed.
    """
    weights = np.asarray(weights, dtype=np.float64)
    weights = weights / weights.sum()
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
