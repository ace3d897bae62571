"""Synthetic training data for --mock-data (Megatron-LM's flag): no files, no tokenizer file;
exactly Megatron Core's mock samples (`MockGPTDataset` over `MockGPTLowLevelDataset`).

The documents (`MockDocuments`) are Megatron's: always 100,000 of them, whatever the run's
seed, their lengths drawn once by `numpy.random.default_rng(0).integers(1, 4096)` (int32);
document d of length L holds the ids `(1, 2, ..., L - 1) % vocab_size` then the
end-of-document id. The splits are Megatron's too: whatever --split says, Megatron's
GPTDatasetConfig divides mock documents by the split "1,1,1" (thirds: [0, 33333),
[33333, 66667), [66667, 100000), app.data.index_builder.split_document_ranges), and each
split's samples are the GPT dataset's (doc/sample/shuffle indices drawn from --seed,
`build_indices`) for exactly the samples the run reads, so sample i of a split is Megatron's
sample i for the same --seed, --seq-length and sample counts. The indices are built in memory (as Megatron, which
caches nothing for mock data): about a second for the 97k training documents.

Vocabulary: the ids count up and wrap at `vocab_size`; with our NullTokenizer (--vocab-size V:
V ids, end of document V - 1) that is Megatron's sample for a tokenizer of `vocab_size` V and
`eod` V - 1. Megatron-LM's own NullTokenizer reports `vocab_size` = --vocab-size + 1 with the
end of document at --vocab-size, so our --vocab-size V matches Megatron-LM's --vocab-size V - 1.

The samples have the shape the GPT datasets give (`{"text": int64 [seq_length + 1]}`), so the
sampler, the batch builder and every layout work on them unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from app.data.gpt_dataset import sample_tokens
from app.data.index_builder import (build_indices, compute_num_epochs, separate_last_epoch,
                                    split_document_ranges)

SPLITS = ("train", "valid", "test")
NUM_DOCUMENTS = 100_000
"""Megatron's MockGPTLowLevelDataset.size."""
MAX_DOCUMENT_LENGTH = 4096
"""Megatron's MockGPTLowLevelDataset.max_sequence_length (lengths are drawn in [1, 4096))."""
LENGTH_SEED = 0
"""Megatron's MockGPTLowLevelDataset.seed: the document lengths never depend on --seed."""
MOCK_SPLIT = "1,1,1"
"""The split Megatron's GPTDatasetConfig imposes on mock data (it replaces --split)."""


class MockDocuments:
    """Megatron's mock documents: `sizes` int32 [100000]; document d is the ids
    `(1 .. sizes[d] - 1) % vocab_size` followed by `eod`."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        if vocab_size <= 0:
            raise ValueError(f"mock data: vocab_size must be positive, got {vocab_size}")
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        rng = np.random.default_rng(seed=LENGTH_SEED)
        self.sizes = rng.integers(1, MAX_DOCUMENT_LENGTH, size=NUM_DOCUMENTS, dtype=np.int32)

    def __len__(self) -> int:
        return NUM_DOCUMENTS

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of document `doc` (int64)."""
        positions = np.arange(lo, hi, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == int(self.sizes[doc]) - 1] = self.eod
        return tokens


class MockGPTDataset:
    """Split `split` of the mock documents: documents `documents` [start, end), `num_samples`
    samples of `seq_length + 1` ids in Megatron's GPT-dataset order for `seed`."""

    def __init__(self, source: MockDocuments, documents: Tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, split: str = "train") -> None:
        for name, value in (("num_samples", num_samples), ("seq_length", seq_length)):
            if value <= 0:
                raise ValueError(f"mock data: {name} must be positive, got {value}")
        if split not in SPLITS:
            raise ValueError(f"mock data: split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.source, self.documents, self.num_samples = source, documents, num_samples
        self.seq_length, self.seed, self.split = seq_length, seed, split
        self._seq_length = source.sizes
        self.doc_idx, self.sample_idx, self.shuffle_idx = build_indices(
            source.sizes, np.arange(*documents, dtype=np.int32), num_samples, seq_length, seed)

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"mock {self.split} sample {index} out of range [0, {len(self)})")
        return {"text": sample_tokens(self, index, self.source.read)}

    def order_entry(self) -> Dict[str, Any]:
        """This split in a data-order record (app.data.plan.order_record's shape): its
        documents, tokens, epochs and whether the last epoch is shuffled apart."""
        start, end = self.documents
        tokens = int(self.source.sizes[start:end].sum(dtype=np.int64))
        epochs = compute_num_epochs(tokens, self.seq_length, self.num_samples)
        apart = separate_last_epoch(tokens, self.seq_length, self.num_samples, epochs)
        return {"samples": self.num_samples, "blended": False, "parts": [
            {"prefix": "mock", "weight": None, "documents": [start, end], "tokens": tokens,
             "epochs": epochs, "separate_last_epoch": bool(apart)}]}

    def describe(self) -> str:
        """One line for the log and the --dry-run report."""
        start, end = self.documents
        return (f"{self.num_samples:,} {self.split} samples of {self.seq_length + 1} token ids "
                f"from Megatron's mock documents [{start}, {end}) (ids counting up modulo "
                f"{self.source.vocab_size}) in the order of seed {self.seed}")


def build_mock_datasets(num_samples: Sequence[int], seq_length: int, vocab_size: int,
                        seed: int, eod: Optional[int] = None
                        ) -> Tuple[Optional[MockGPTDataset], ...]:
    """(train, valid, test) mock datasets of `num_samples` samples each over Megatron's thirds
    of the mock documents (`MOCK_SPLIT`); None for a split that needs no sample. `eod`: the
    end-of-document id (default vocab_size - 1, NullTokenizer's)."""
    source = MockDocuments(vocab_size, vocab_size - 1 if eod is None else eod)
    ranges = split_document_ranges(len(source), MOCK_SPLIT)
    return tuple(MockGPTDataset(source, docs, n, seq_length, seed, name) if n > 0 else None
                 for name, n, docs in zip(SPLITS, num_samples, ranges))


def _size(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 / 10 else f"{n / 2 ** 20:.2f} MiB"


def describe_mock_plan(num_samples: Sequence[int], seq_length: int, vocab_size: int,
                       seed: int) -> List[str]:
    """One line per split of `build_mock_datasets(num_samples, ...)` without building its
    indices (a plan of billions of samples is counted, not materialised): the samples, the
    documents, the epochs and the host memory the indices will take when the run builds them
    (document index int32 per epoch, sample index and shuffle index per sample)."""
    sizes = MockDocuments(vocab_size, vocab_size - 1).sizes
    lines = []
    for name, n, docs in zip(SPLITS, num_samples, split_document_ranges(NUM_DOCUMENTS,
                                                                         MOCK_SPLIT)):
        if n <= 0 or docs is None:
            continue
        tokens = int(sizes[docs[0]:docs[1]].sum(dtype=np.int64))
        epochs = compute_num_epochs(tokens, seq_length, n)
        index_bytes = (4 * epochs * (docs[1] - docs[0]) + 16 * (n + 1)
                       + (4 if n < np.iinfo(np.uint32).max - 1 else 8) * n)
        lines.append(f"{n:,} {name} samples of {seq_length + 1} token ids from Megatron's mock "
                     f"documents [{docs[0]}, {docs[1]}) ({epochs:,} epoch(s), ids counting up "
                     f"modulo {vocab_size}) in the order of seed {seed}; its indices take "
                     f"{_size(index_bytes)} of host memory when the run builds them")
    return lines
