"""Where the training data lives and how batches are built from it (`DataConfig`). Part of
`app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

from app.config.options import option
from app.config.rules import split_weights


@dataclass(kw_only=True)
class DataConfig:
    """Where the training data lives and how batches are built from it."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("data", "dataset and tokenizer")

    data_path: List[str] = option(
        "--data-path", default_factory=list, nargs="*",
        help="a dataset prefix, or weight prefix pairs: 0.7 a 0.3 b")
    mock_data: bool = option(
        "--mock-data", default=False,
        help="no data files: token ids drawn uniformly from the vocabulary by --seed, for "
             "throughput runs and checks (Megatron's flag; app.data.mock_dataset); instead of "
             "--data-path")
    split: str = option("--split", default="969,30,1")
    data_cache_path: Optional[str] = option("--data-cache-path", default=None)
    tokenizer_type: str = option("--tokenizer-type", default="GPT2BPETokenizer")
    vocab_file: Optional[str] = option("--vocab-file", default=None)
    merge_file: Optional[str] = option("--merge-file", default=None)
    vocab_size: Optional[int] = option(
        "--vocab-size", default=None,
        help="NullTokenizer's vocabulary (Megatron's): ids 0..N-1, end of document N-1; "
             "without --vocab-file it selects --tokenizer-type NullTokenizer (e.g. "
             "--mock-data --vocab-size 50257)")
    reset_position_ids: bool = option("--reset-position-ids", default=False)
    reset_attention_mask: bool = option("--reset-attention-mask", default=False)
    eod_mask_loss: bool = option("--eod-mask-loss", default=False)
    num_workers: int = option("--num-workers", default=2)

    def __post_init__(self) -> None:
        split_weights(self.split)
        if self.mock_data and self.data_path:
            raise ValueError(f"--mock-data and --data-path {' '.join(self.data_path)} are two "
                             "data sources; give one of them")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2, got {self.vocab_size}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")

