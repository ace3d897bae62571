"""Synthetic training data for --mock-data (Megatron-LM's flag): no files, no tokenizer.

Megatron's MockGPTDataset serves the ids 1, 2, 3, ... of documents whose lengths a fixed seed
draws; ours serves token ids drawn uniformly from the vocabulary by the run's --seed, so that
the loss behaves like a model's on unseen text (it starts near ln V and stays there) rather
than learning a counter. Either way the content does not matter: it is for throughput runs,
benchmarks and checks that must not build a corpus (scripts/gpu_check.sh).

Each sample is a pure function of (seed, split, index): any rank, worker or resumed run reads
the same tokens for the same sample, whatever the layout, with nothing stored. Samples have
the shape the GPT datasets give (`{"text": int64 [seq_length + 1]}`), so the sampler, the batch
builder and every layout work on them unchanged.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

SPLITS = ("train", "valid", "test")


class MockGPTDataset:
    """`num_samples` samples of `seq_length + 1` token ids drawn uniformly from
    [0, vocab_size); sample i of `split` is drawn by numpy's PCG64 seeded with
    (seed, split number, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 split: str = "train") -> None:
        for name, value in (("num_samples", num_samples), ("seq_length", seq_length),
                            ("vocab_size", vocab_size)):
            if value <= 0:
                raise ValueError(f"mock data: {name} must be positive, got {value}")
        if split not in SPLITS:
            raise ValueError(f"mock data: split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split = seed, split
        self._entropy = (seed % 2 ** 64, SPLITS.index(split))  # SeedSequence takes naturals

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock {self.split} sample {index} out of range "
                             f"[0, {self.num_samples})")
        rng = np.random.default_rng((*self._entropy, index))
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}

    def describe(self) -> str:
        """One line for the log and the --dry-run report."""
        return (f"{self.num_samples:,} {self.split} samples of {self.seq_length + 1} token ids "
                f"drawn uniformly from [0, {self.vocab_size}) by seed {self.seed}")


def build_mock_datasets(num_samples: Sequence[int], seq_length: int, vocab_size: int,
                        seed: int) -> Tuple[Optional[MockGPTDataset], ...]:
    """(train, valid, test) mock datasets holding `num_samples` samples each; None for a split
    that needs none (as `build_train_valid_test_datasets` gives)."""
    return tuple(MockGPTDataset(n, seq_length, vocab_size, seed, split) if n > 0 else None
                 for split, n in zip(SPLITS, num_samples))
