"""Batch samplers that resume from `consumed_samples` and shard every global step over DP ranks."""
from __future__ import annotations

from typing import Iterator, List


class MegatronPretrainingSampler:
    """Yields, for this data-parallel rank, the index list of each of its micro-batches.

    Global sample order is 0, 1, 2, ... starting at `consumed_samples`. Each micro step takes the
    next micro_batch_size x data_parallel_size samples; rank r gets the slice
    [r * micro_batch_size, (r + 1) * micro_batch_size) of them. An incomplete last step is
    dropped, so every rank yields the same number of micro-batches.

    Over all ranks, a global batch of G samples read from `consumed_samples` c is the range
    [c, c + G) whatever the micro-batch and data-parallel sizes: a run resumed from a checkpoint's
    consumed-sample count at another layout or global batch size reads on from the next unread
    sample (tests/unit/test_data_position.py).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank ({data_parallel_rank}) must be in "
                             f"[0, data_parallel_size ({data_parallel_size}))")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) must be in [0, total_samples "
                             f"({total_samples})): the run has used up its dataset")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        step = self.micro_batch_size * self.data_parallel_size
        return (self.total_samples - self.consumed_samples) // step

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + lo, start + lo + self.micro_batch_size))
