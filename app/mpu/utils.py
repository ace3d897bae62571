"""Pure arithmetic shared by the parallel layers: divisions with named checks, vocab ranges."""
from __future__ import annotations

from typing import Tuple


def divide(numerator: int, denominator: int, what: str = "value", by: str = "divisor") -> int:
    """numerator // denominator, raising ValueError naming both values if it is not exact."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[start, end) of the vocabulary rows owned by `rank` when split evenly over `world_size`."""
    per_rank = divide(global_vocab_size, world_size, "vocab size", "tensor_model_parallel_size")
    start = rank * per_rank
    return start, start + per_rank


def shard_range(full_size: int, rank: int, world_size: int, what: str = "size") -> Tuple[int, int]:
    """[start, end) of the contiguous slice of a dimension of `full_size` kept by `rank`."""
    per_rank = divide(full_size, world_size, what, "tensor_model_parallel_size")
    return rank * per_rank, (rank + 1) * per_rank
