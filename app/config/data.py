"""Where the training data lives and how batches are built from it (`DataConfig`). Part of
`app.config`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

from app.config.blends import DEFAULT_SPLIT, DataBlends, resolve_blends
from app.config.options import option
from app.config.rules import split_weights

TOKENIZER_READS: Dict[str, Tuple[str, ...]] = {
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "NullTokenizer": ("--vocab-size",),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",)}
"""The flags each --tokenizer-type reads (Megatron-LM's types; app.data.tokenizer builds
them)."""

BLEND_HELP = ("a prefix of a .bin/.idx pair, weight/prefix pairs 'w1 p1 w2 p2 ...', or "
              "prefixes 'p1 p2 ...' weighted by their sizes (Megatron's rules)")


@dataclass(kw_only=True)
class DataConfig:
    """Where the training data lives and how batches are built from it. The data flags are
    resolved once into `blends` (app.config.blends: Megatron-LM's rules, the two data files
    read here), which every later step uses."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("data", "dataset and tokenizer")

    # --data-path also takes prefixes without weights (BLEND_HELP); its help is kept as it was
    data_path: List[str] = option(
        "--data-path", default_factory=list, nargs="*",
        help="a dataset prefix, or weight prefix pairs: 0.7 a 0.3 b")
    mock_data: bool = option(
        "--mock-data", default=False,
        help="no data files: Megatron Core's mock documents (ids counting up) in its order for "
             "--seed, for throughput runs and checks (Megatron's flag; app.data.mock_dataset); "
             "instead of --data-path")
    split: str = option("--split", default=DEFAULT_SPLIT)
    train_data_path: List[str] = option(
        "--train-data-path", default_factory=list, nargs="*",
        help=f"the training data, used whole: {BLEND_HELP}")
    valid_data_path: List[str] = option(
        "--valid-data-path", default_factory=list, nargs="*",
        help="the validation data, used whole (as --train-data-path)")
    test_data_path: List[str] = option(
        "--test-data-path", default_factory=list, nargs="*",
        help="the test data, used whole (as --train-data-path)")
    data_args_path: Optional[str] = option(
        "--data-args-path", default=None,
        help="a file holding the words of --data-path (whitespace-separated), for long blends")
    per_split_data_args_path: Optional[str] = option(
        "--per-split-data-args-path", default=None,
        help='a JSON file {"train": BLEND, "valid": BLEND, "test": BLEND} (each a string or a '
             "list of words, or null) instead of --train/--valid/--test-data-path")
    data_cache_path: Optional[str] = option(
        "--data-cache-path", default=None,
        help="where the sample indices are cached (default: beside each dataset); "
             "tools/prepare_cache.py fills it ahead of a run")
    tokenizer_type: str = option("--tokenizer-type", default="GPT2BPETokenizer")
    vocab_file: Optional[str] = option("--vocab-file", default=None)
    tokenizer_model: Optional[str] = option(
        "--tokenizer-model", default=None,
        help="HuggingFaceTokenizer: a directory with tokenizer.json or a Hub name in the local "
             "cache (loaded offline); (GPT)SentencePieceTokenizer: a .model file")
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
    create_attention_mask_in_dataloader: bool = option(
        "--no-create-attention-mask-in-dataloader", default=True, action="store_false",
        dest="create_attention_mask_in_dataloader",
        help="batches carry no attention mask: attention is plain causal, so "
             "--reset-attention-mask has no effect (Megatron's meaning)")
    mmap_bin_files: bool = option(
        "--no-mmap-bin-files", default=True, action="store_false", dest="mmap_bin_files",
        help="read the .bin token files with file reads instead of memory maps (the same "
             "samples)")
    blends: Optional[DataBlends] = field(init=False, default=None)
    """The data each split reads (None when no data flag is given)."""

    def __post_init__(self) -> None:
        if not self.mock_data:  # mock data is divided in thirds whatever --split says (Megatron)
            split_weights(self.split)
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2, got {self.vocab_size}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        self.blends = resolve_blends(
            self.data_path, self.data_args_path,
            (self.train_data_path, self.valid_data_path, self.test_data_path),
            self.per_split_data_args_path)
        if (self.blends is not None and self.blends.per_split is not None
                and split_weights(self.split) != split_weights(DEFAULT_SPLIT)):
            raise ValueError(f"--split {self.split} does not apply to {self.blends.source} "
                             "(each split's data is used whole); drop --split")
        if self.mock_data and self.blends is not None:
            raise ValueError(f"--mock-data and {self.blends.source} are two data sources; give "
                             "one of them")

    @property
    def attention_mask_resets(self) -> bool:
        """Whether batches carry --reset-attention-mask's per-document mask: only when the data
        loader creates masks (not with --no-create-attention-mask-in-dataloader)."""
        return self.reset_attention_mask and self.create_attention_mask_in_dataloader


def tokenizer_type_in_effect(tokenizer_type: str, vocab_file: Optional[str],
                             vocab_size: Optional[int]) -> str:
    """--tokenizer-type, except that --vocab-size without --vocab-file selects NullTokenizer
    (`--mock-data --vocab-size 50257` needs no other flag); --vocab-size with a
    GPT2BPETokenizer's --vocab-file is a contradiction and raises."""
    if vocab_size is None or tokenizer_type != "GPT2BPETokenizer":
        return tokenizer_type
    if vocab_file:
        raise ValueError(f"--vocab-size ({vocab_size}) is NullTokenizer's vocabulary, but "
                         f"--vocab-file {vocab_file} gives a GPT2BPETokenizer its own: drop "
                         "--vocab-size, or drop --vocab-file/--merge-file for NullTokenizer")
    return "NullTokenizer"


def tokenizer_flags_not_read(tokenizer_type: str, vocab_file: Optional[str],
                             merge_file: Optional[str], tokenizer_model: Optional[str],
                             vocab_size: Optional[int]) -> List[str]:
    """One warning per tokenizer flag given that the tokenizer type in effect does not read
    (TOKENIZER_READS), naming the flag, the type and what it reads instead; a path that does
    not exist says so. NullTokenizer's refusal of vocabulary files (app.data.tokenizer) and
    the --vocab-size contradiction above are errors, not warnings."""
    kind = tokenizer_type_in_effect(tokenizer_type, vocab_file, vocab_size)
    reads = TOKENIZER_READS.get(kind)
    if reads is None:
        return []
    given = {"--vocab-file": vocab_file, "--merge-file": merge_file,
             "--tokenizer-model": tokenizer_model, "--vocab-size": vocab_size}
    refused = ("--vocab-file", "--merge-file") if kind == "NullTokenizer" else ()
    notes = []
    for flag, value in given.items():
        if value is None or flag in reads or flag in refused:
            continue
        missing = flag in ("--vocab-file", "--merge-file") and not os.path.exists(value)
        notes.append(f"{flag} {value} is not read: --tokenizer-type {kind} reads "
                     f"{' and '.join(reads)}{' (and that file does not exist)' if missing else ''}"
                     f"; drop {flag}, or choose the tokenizer type that reads it")
    return notes
