"""Pure builders of the GPT sample indices and of blend interleavings, in Megatron Core's order.

Given the same flags and files, every array here equals the one megatron-core (0.16) builds, so
sample i of a split is Megatron's sample i (tests/unit/test_data_megatron_order.py compares
them token for token). Definitions, for one split whose documents are the ids `documents` of
an indexed dataset (Megatron splits a GPT dataset by *sequence*: an entry of the .idx), with
token counts `sequence_lengths[documents]` summing to T per epoch:

- epochs E: the smallest E with `E * T >= num_samples * seq_length + 1` (1 when the number of
  samples is not given); samples of `seq_length + 1` tokens, consecutive samples sharing one
  token, give `S = (E * T - 1) // seq_length` samples in all.
- last epoch kept apart: when E > 1 and the last epoch supplies fewer than
  `int(0.8 * ((T - 1) // seq_length))` of the samples, i.e. `num_samples -
  ((E - 1) * T - 1) // seq_length`.
- one `numpy.random.RandomState(seed)` draws everything, in this order: the document index
  `[E * D]` int32 (the document ids repeated E times, shuffled as one array; with the last
  epoch apart, the first E - 1 epochs shuffled together, then the last one alone), then the
  shuffle index `[S]` (a permutation of the samples; with the last epoch apart, samples
  `[0, ((E - 1) * T - 1) // seq_length)` and the rest permuted separately, in that order).
- sample index `[S + 1, 2]`: row i is (position in the document index, token offset in that
  document) of global token `i * seq_length` of the concatenated documents; sample i runs to row
  i + 1 inclusive. Documents without tokens are never a sample's start or end.
- split of a dataset by `--split`: Megatron's split matrix (`split_bounds`), each split the
  documents `[round(lo * N), round(hi * N))`.
- blends: `blend_indices` (a size and weights) and `exhaustive_blend_indices` (a number of
  samples per dataset) give (dataset index int16, sample within that dataset int64) per blend
  sample by Megatron's greedy rule: each sample goes to the dataset whose count lags its share
  most (`weight * max(i, 1) - count`, the first such dataset on a tie), computed in doubles
  exactly as Megatron's C++ helper does.

Everything is deterministic given its arguments; only the blends loop in Python per sample.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from app.config.blends import Blend, normalize

INDEX_VERSION = "gpt-index-v2-megatron-core"
"""Bumped whenever the algorithm changes, so that cached indices of older versions are not reused
(v1, before Megatron Core's order: one PCG64 permutation per epoch)."""
BLEND_VERSION = "blend-v2-megatron-core"
"""The same for blend interleavings."""

Indices = Tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class SampleOrder:
    """The rules that decide which sample is where: how documents are counted and split, how
    weights are normalised, and the index and blend builders. `MEGATRON_ORDER` (this module)
    is every new run's; app.data.legacy_order reads the order of this trainer's releases
    before 0.5.0, for the checkpoints they wrote."""

    name: str
    """Named in the log and in --dry-run."""
    version: int
    """The data-order record's version (app.data.plan.order_record)."""
    index_version: str
    blend_version: str
    documents: Callable[[Any], Tuple[np.ndarray, np.ndarray]]
    """An indexed dataset -> (first token, token count) of each of its documents."""
    split_ranges: Callable[[int, str], Tuple[Optional[Tuple[int, int]], ...]]
    """(number of documents, --split) -> [start, end) of train/valid/test (None: no document)."""
    blend_weights: Callable[[Blend], Optional[Tuple[float, ...]]]
    """A blend's normalised weights (None: weighted by size)."""
    normalize: Callable[[Sequence[float]], List[float]]
    build_indices: Callable[[np.ndarray, int, int, Optional[int], int, int], Indices]
    """(document lengths, start, end, num_samples, seq_length, seed) -> (doc_idx of document
    ids, sample_idx, shuffle_idx) of the documents [start, end)."""
    blend: Callable[[Sequence[float], Optional[int]], Tuple[np.ndarray, np.ndarray]]
    """(weights or, with size None, sample counts; size) -> (dataset_index,
    dataset_sample_index)."""

LAST_EPOCH_THRESHOLD = 0.80
"""The share of an epoch's samples under which Megatron shuffles the last epoch apart."""


def compute_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Smallest number of epochs that yields at least num_samples samples (1 when None)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; use more data or a different --split")
    if num_samples is None:
        return 1
    if seq_length <= 0 or num_samples < 0:
        raise ValueError(f"seq_length ({seq_length}) must be positive and num_samples "
                         f"({num_samples}) non-negative")
    # E * T >= n * s + 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def samples_before_last_epoch(tokens_per_epoch: int, seq_length: int, num_epochs: int) -> int:
    """Samples the first num_epochs - 1 epochs hold: ((E - 1) * T - 1) // s."""
    return ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int],
                        num_epochs: int) -> bool:
    """True when the last epoch supplies < 80% of an epoch's samples (Megatron's rule)."""
    if num_epochs == 1 or num_samples is None:
        return False
    from_last = num_samples - samples_before_last_epoch(tokens_per_epoch, seq_length, num_epochs)
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_last < int(LAST_EPOCH_THRESHOLD * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int,
                         random_state: np.random.RandomState, separate_last: bool) -> np.ndarray:
    """int32 [num_epochs * D]: `documents` repeated num_epochs times, shuffled in place by
    `random_state` as one array, or (separate_last) the first epochs and the last apart."""
    if separate_last and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, random_state, False)
        last = build_document_index(documents, 1, random_state, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    random_state.shuffle(document_index)
    return document_index


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """[S + 1, 2] (document-index position, offset) of each sample start (module doc), int32
    when the positions and offsets fit, else int64. Vectorised: no loop per sample."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(lengths)  # ends[k]: global token position just past document_index[k]
    total = int(ends[-1]) if ends.size else 0
    num_samples = (total - 1) // seq_length if total > 0 else 0
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # the document holding the token
    offset = starts - (ends[position] - lengths[position])
    out_dtype = np.int32 if max(document_index.size, int(lengths.max(initial=0))) < 2 ** 31 \
        else np.int64
    sample_index = np.empty((num_samples + 1, 2), dtype=out_dtype)
    sample_index[:, 0] = position
    sample_index[:, 1] = offset
    return sample_index


def build_shuffle_index(num_samples_first: int, total_samples: int,
                        random_state: np.random.RandomState) -> np.ndarray:
    """Permutation of range(total): [0, first) shuffled, then [first, total) shuffled, by
    `random_state`; uint32 unless total needs int64."""
    dtype = np.uint32 if total_samples < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples_first, dtype=dtype)
    random_state.shuffle(first)
    if num_samples_first == total_samples:
        return first
    last = np.arange(num_samples_first, total_samples, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sequence_lengths: np.ndarray, documents: np.ndarray,
                  num_samples: Optional[int], seq_length: int, seed: int
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) of a split over the ids `documents` of a
    dataset whose sequences have `sequence_lengths` tokens (module doc); num_samples None:
    one epoch."""
    sequence_lengths = np.asarray(sequence_lengths)
    documents = np.asarray(documents, dtype=np.int32)
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    num_epochs = compute_num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    random_state = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, random_state, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    total = sample_index.shape[0] - 1
    first = (samples_before_last_epoch(tokens_per_epoch, seq_length, num_epochs)
             if separate else total)
    return document_index, sample_index, build_shuffle_index(first, total, random_state)


def split_bounds(split: str) -> List[Optional[Tuple[float, float]]]:
    """Megatron's split matrix of `--split` ('969,30,1'): (lo, hi) fractions of each of
    train/valid/test, None for a split of weight 0. The numbers are found as Megatron finds
    them (digits and dots), normalised in float64 and summed from 0 in order."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} is invalid: give up to three non-negative "
                         "weights with a positive sum, e.g. 969,30,1")
    fractions = normalize(parts + [0.0] * (3 - len(parts)))
    bounds: List[float] = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + fraction)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_document_ranges(num_documents: int, split: str
                          ) -> Tuple[Optional[Tuple[int, int]], ...]:
    """[start, end) document ranges of train/valid/test by `split_bounds` (None: weight 0)."""
    return tuple(None if b is None else (int(round(b[0] * float(num_documents))),
                                         int(round(b[1] * float(num_documents))))
                 for b in split_bounds(split))


def _greedy_blend(weights: Sequence[float], size: int, capacity: Optional[Sequence[int]]
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy interleaving of `size` samples (module doc); with `capacity`, dataset d
    stops being a candidate once it has given capacity[d] samples."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    candidates = [d for d in range(len(w)) if capacity is None or capacity[d] > 0]
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        x = float(i) if i > 1 else 1.0  # Megatron's max(i, 1)
        best, best_error = -1, -np.inf
        for d in candidates:
            error = w[d] * x - counts[d]  # in doubles, as the C++ helper computes it
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
        if capacity is not None and counts[best] == capacity[best]:
            candidates.remove(best)
    return dataset_index, dataset_sample_index


def blend_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of `size` blend samples drawn by
    Megatron's greedy rule (module doc) from datasets of normalised `weights`."""
    return _greedy_blend(weights, size, None)


def exhaustive_blend_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) taking exactly sizes[d] samples of dataset d, in
    Megatron's greedy order with weights sizes / sum(sizes); a dataset leaves once spent."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    return _greedy_blend([s / float(total) for s in sizes], total, sizes)


def _megatron_blend(weights: Sequence[float], size: Optional[int]
                    ) -> Tuple[np.ndarray, np.ndarray]:
    if size is None:
        return exhaustive_blend_indices([int(w) for w in weights])
    return blend_indices(normalize(weights), size)


MEGATRON_ORDER = SampleOrder(
    name="Megatron Core's order", version=2, index_version=INDEX_VERSION,
    blend_version=BLEND_VERSION,
    documents=lambda indexed: (indexed.sequence_starts(), indexed.sizes),
    split_ranges=split_document_ranges, blend_weights=lambda blend: blend.weights,
    normalize=normalize,
    build_indices=lambda lengths, start, end, num_samples, seq_length, seed: build_indices(
        lengths, np.arange(start, end, dtype=np.int32), num_samples, seq_length, seed),
    blend=_megatron_blend)
"""Megatron Core's GPTDataset and BlendedDataset (a document is a sequence of the .idx)."""
