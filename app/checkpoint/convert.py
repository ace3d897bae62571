"""Checkpoint conversion: read through the format registry, write through it.

Any format of app.checkpoint.formats (legacy Megatron `torch` at any TP/PP, `torch_dist`,
DeepSpeed incl. ZeRO-3, Hugging Face GPT-2) is read into a layout-free `ModelCheckpoint` (full
tensors under our names); any writable one writes it. `convert()` is what
tools/convert_checkpoint.py runs. See docs/conversion.md.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import List, Optional

from app.checkpoint import formats
from app.checkpoint.names import FORMAT_ALIASES, canonical_format
from app.checkpoint.state import ModelCheckpoint, OptimizerState, staged_directory

logger = logging.getLogger(__name__)

INPUT_FORMATS = formats.READABLE
OUTPUT_FORMATS = formats.WRITABLE
INPUT_NAMES = (*INPUT_FORMATS, *FORMAT_ALIASES)
"""What --input-format accepts: the registry's names and their aliases."""
OUTPUT_NAMES = (*OUTPUT_FORMATS, *(a for a, name in FORMAT_ALIASES.items() if name in OUTPUT_FORMATS))
DTYPES = ("fp32", "fp16", "bf16")

__all__ = ["ConvertOptions", "ModelCheckpoint", "OptimizerState", "convert", "read_checkpoint",
           "print_structure"]


@dataclass
class ConvertOptions:
    """What tools/convert_checkpoint.py was asked to do (its flags, validated)."""

    load: str
    input_format: Optional[str] = None
    """A name of app.checkpoint.formats (or an alias: megatron = torch); None: detected from the
    files in `load`."""
    output_format: str = "torch"
    save: Optional[str] = None
    iteration: Optional[object] = None
    """Source iteration to read (int or 'release'); for Megatron output also the one written."""
    target_tensor_model_parallel_size: int = 1
    target_pipeline_model_parallel_size: int = 1
    target_params_dtype: Optional[str] = None
    include_optimizer: bool = False
    max_shard_size: str = "2GB"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    make_vocab_size_divisible_by: int = 128
    print_checkpoint_structure: bool = False
    metrics_file: Optional[str] = None
    """The run's --metrics-file JSONL: the hf output's model card reports its last validation loss."""

    def __post_init__(self) -> None:
        self.output_format = canonical_format(self.output_format, "--output-format")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format {self.output_format!r}: use one of "
                             f"{', '.join(OUTPUT_FORMATS)}")
        if self.target_params_dtype not in (None, *DTYPES):
            raise ValueError(f"--target-params-dtype {self.target_params_dtype!r}: use fp32, fp16 or bf16")
        for flag, value in (("--target-tensor-model-parallel-size", self.target_tensor_model_parallel_size),
                            ("--target-pipeline-model-parallel-size",
                             self.target_pipeline_model_parallel_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if (self.vocab_file is None) != (self.merge_file is None):
            raise ValueError("--vocab-file and --merge-file go together")
        if not self.print_checkpoint_structure and not self.save:
            raise ValueError("--save DIR is required (unless --print-checkpoint-structure)")
        self.input_format = _checked_input_format(self.load, self.input_format, self.iteration)
        if self.include_optimizer and not (formats.lookup(self.input_format).optimizer
                                           and formats.lookup(self.output_format).optimizer):
            raise ValueError("--include-optimizer needs a torch, torch_dist or deepspeed input "
                             "and a torch or torch_dist output (Hugging Face directories hold "
                             "no optimizer state)")
        if self.metrics_file is not None and not os.path.isfile(self.metrics_file):
            raise FileNotFoundError(f"--metrics-file {self.metrics_file} does not exist (the JSONL "
                                    "that pretrain_gpt2.py --metrics-file wrote)")


def _checked_input_format(load: str, given: Optional[str], iteration: Optional[object]) -> str:
    """The format of the checkpoint in `load` (formats.detect_format); ValueError when
    --input-format `given` says otherwise."""
    found = formats.detect_format(load, iteration)
    if given is not None and canonical_format(given, "--input-format") != found:
        raise ValueError(f"--input-format {given}, but --load {load} holds a {found} checkpoint: "
                         f"drop --input-format (the converter detects the format) or pass "
                         f"--input-format {found}")
    if given is None:
        logger.info("--load %s: a %s checkpoint (detected from its files)", load, found)
    return found


def read_checkpoint(opts: ConvertOptions) -> ModelCheckpoint:
    """The source checkpoint as a ModelCheckpoint (the input format's registry reader)."""
    return formats.lookup(opts.input_format).read(opts.load, opts.iteration, opts.include_optimizer,
                                                  opts.make_vocab_size_divisible_by)


def print_structure(opts: ConvertOptions) -> List[str]:
    """Lines describing the source files: every key, tensor shape and dtype, and the args."""
    return formats.lookup(opts.input_format).describe(opts.load, opts.iteration)


def convert(opts: ConvertOptions) -> str:
    """Read `opts.load`, write `opts.save` in the output format (staged, renamed at the end);
    returns a one-line summary."""
    start = time.perf_counter()
    source = read_checkpoint(opts)
    with staged_directory(opts.save) as tmp:
        what = formats.lookup(opts.output_format, "--output-format").write(source, tmp, opts)
    n = sum(t.numel() for t in source.weights.values())
    return (f"converted {opts.input_format} {opts.load} -> {what} {opts.save}: "
            f"{n / 1e6:.1f}M parameters in {time.perf_counter() - start:.1f} s")
