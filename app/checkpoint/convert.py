"""Checkpoint conversion: read through the format registry, write through it.

Any format of app.checkpoint.formats (legacy Megatron `torch` at any TP/PP, `torch_dist`,
DeepSpeed incl. ZeRO-3, Hugging Face GPT-2, Llama and Qwen3) is read into a layout-free
`ModelCheckpoint` (full tensors under our names); any writable one writes it. `convert()` is what
tools/convert_checkpoint.py runs: its flags are `ConvertOptions`, which detects the source once
(`source`) and turns the flags into the writer's typed request (`write_request`). See
docs/conversion.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional, Tuple

from app.checkpoint import formats
from app.checkpoint.names import FORMAT_ALIASES, canonical_format
from app.checkpoint.request import TokenizerSource, WriteRequest
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.state import ModelCheckpoint, OptimizerState, staged_directory
from app.config.inference import LOAD, MERGES, TOKENIZER_MODEL, VOCAB
from app.config.options import PathOption, option

logger = logging.getLogger(__name__)

INPUT_FORMATS = formats.READABLE
OUTPUT_FORMATS = formats.WRITABLE
INPUT_NAMES = (*INPUT_FORMATS, *FORMAT_ALIASES)
"""What --input-format accepts: the registry's names and their aliases."""
OUTPUT_NAMES = (*OUTPUT_FORMATS, *(a for a, name in FORMAT_ALIASES.items() if name in OUTPUT_FORMATS))
DTYPES = ("fp32", "fp16", "bf16")

__all__ = ["ConvertOptions", "ModelCheckpoint", "OptimizerState", "convert", "read_checkpoint",
           "print_structure"]


def _iteration(text: str) -> object:
    """--iteration's value: a number >= 0 or 'release' (argparse's type for the flag)."""
    if text == "release":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--iteration {text!r}: expected a number or 'release'")
    if value < 0:
        raise argparse.ArgumentTypeError(f"--iteration must be >= 0, got {value}")
    return value


@dataclass(kw_only=True)
class ConvertOptions:
    """tools/convert_checkpoint.py's command line (its flags, validated)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("conversion", "the source, the target and what "
                                             "is carried")

    input_format: Optional[str] = option(
        "--input-format", default=None, choices=INPUT_NAMES,
        help="the source's format (default: detected from its files; when given, it must agree "
             "with them). torch (aliases megatron, legacy): the legacy mp_rank_XX files "
             "(--ckpt-format torch); torch_dist: Megatron Core's PyTorch distributed checkpoint "
             "(--ckpt-format torch_dist); deepspeed: a --deepspeed run's checkpoint (ZeRO-0 to "
             "3); hf (alias huggingface): a Hugging Face GPT-2, Llama or Qwen3 directory")
    """A name of app.checkpoint.formats (or an alias: megatron = torch); None: detected from the
    files in `load`."""
    output_format: str = option(
        "--output-format", default="torch", choices=OUTPUT_NAMES,
        help=f"one of {', '.join(OUTPUT_FORMATS)} (aliases: megatron and legacy for torch, "
             "huggingface for hf); hf writes the model's own architecture: GPT2LMHeadModel, "
             "LlamaForCausalLM, or Qwen3ForCausalLM with --qk-layernorm")
    load: str = option("--load", required=True, path=LOAD,
                       help="source: checkpoint directory (--save of the run: ours or "
                            "DeepSpeed's, any TP/PP) or a Hugging Face save_pretrained "
                            "directory")
    save: Optional[str] = option("--save", default=None,
                                 help="target directory (must not exist or be empty)")
    iteration: Optional[object] = option(
        "--iteration", default=None, parse=_iteration,
        help="source iteration (default: the latest); for torch or torch_dist output also "
             "the iteration written (default: release, or with --include-optimizer the "
             "source's)")
    """Source iteration to read (int or 'release'); for Megatron output also the one written."""
    target_tensor_model_parallel_size: int = option("--target-tensor-model-parallel-size",
                                                    default=1)
    target_pipeline_model_parallel_size: int = option("--target-pipeline-model-parallel-size",
                                                      default=1)
    target_expert_model_parallel_size: int = option(
        "--target-expert-model-parallel-size", "--target-expert-parallel-size", default=1,
        help="torch output of a Mixture-of-Experts model: one file per expert-parallel rank too "
             "(mp_rank_XX[_YYY]_ZZZ), each with its rank's experts")
    target_expert_tensor_parallel_size: Optional[int] = option(
        "--target-expert-tensor-parallel-size", default=None,
        help="torch output: the experts' tensor-parallel split (the legacy files hold it equal "
             "to --target-tensor-model-parallel-size, the default)")
    target_params_dtype: Optional[str] = option(
        "--target-params-dtype", default=None, choices=DTYPES,
        help="dtype of the written weights (default: the source's)")
    include_optimizer: bool = option(
        "--include-optimizer", default=False,
        help="also carry the optimizer state, LR schedule and RNG states (a torch, torch_dist "
             "or deepspeed input; a torch or torch_dist output)")
    max_shard_size: str = option("--max-shard-size", default="2GB",
                                 help="largest safetensors file (hf output)")
    vocab_file: Optional[str] = option("--vocab-file", default=None, path=VOCAB,
                                       help="hf output: GPT-2 vocab.json copied into it (with "
                                            "--merge-file)")
    merge_file: Optional[str] = option("--merge-file", default=None, path=MERGES,
                                       help="hf output: GPT-2 merges.txt copied into it (with "
                                            "--vocab-file)")
    tokenizer_model: Optional[str] = option(
        "--tokenizer-model", default=None, path=TOKENIZER_MODEL,
        help="hf output: the tokenizer saved into the output: a Hugging Face tokenizer (a "
             "directory with tokenizer.json, or a Hub name in the local cache) or a SentencePiece "
             ".model file (default: the source directory's tokenizer, or the one the "
             "checkpoint's args name)")
    make_vocab_size_divisible_by: int = option(
        "--make-vocab-size-divisible-by", default=128,
        help="Megatron's vocabulary padding multiple for hf input (default 128)")
    metrics_file: Optional[str] = option(
        "--metrics-file", default=None,
        path=PathOption("file", "the JSONL that pretrain_gpt2.py --metrics-file wrote"),
        help="hf output: the run's --metrics-file JSONL; the model card (README.md) reports its "
             "last validation loss")
    print_checkpoint_structure: bool = option(
        "--print-checkpoint-structure", default=False,
        help="print every key, shape and dtype of the source (and convert too if --save)")
    source: Optional[SavedCheckpoint] = field(default=None, init=False, repr=False,
                                              compare=False)
    """What --load holds, detected once here (app.checkpoint.saved_layout.detect) and read
    through it."""

    def __post_init__(self) -> None:
        self.output_format = canonical_format(self.output_format, "--output-format")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format {self.output_format!r}: use one of "
                             f"{', '.join(OUTPUT_FORMATS)}")
        if self.target_params_dtype not in (None, *DTYPES):
            raise ValueError(f"--target-params-dtype {self.target_params_dtype!r}: use fp32, fp16 or bf16")
        for flag, value in (("--target-tensor-model-parallel-size", self.target_tensor_model_parallel_size),
                            ("--target-pipeline-model-parallel-size",
                             self.target_pipeline_model_parallel_size),
                            ("--target-expert-model-parallel-size",
                             self.target_expert_model_parallel_size),
                            ("--target-expert-tensor-parallel-size",
                             self.target_expert_tensor_parallel_size or 1)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if (self.vocab_file is None) != (self.merge_file is None):
            raise ValueError("--vocab-file and --merge-file go together")
        if self.tokenizer_model and self.vocab_file:
            raise ValueError(f"--tokenizer-model {self.tokenizer_model} and --vocab-file "
                             f"{self.vocab_file} both name the tokenizer: give one of them")
        if not self.print_checkpoint_structure and not self.save:
            raise ValueError("--save DIR is required (unless --print-checkpoint-structure)")
        self.source = formats.detect(self.load, self.iteration)
        self.input_format = _checked_input_format(self.source, self.input_format)
        if self.include_optimizer and not (formats.lookup(self.input_format).optimizer
                                           and formats.lookup(self.output_format).optimizer):
            raise ValueError("--include-optimizer needs a torch, torch_dist or deepspeed input "
                             "and a torch or torch_dist output (Hugging Face directories hold "
                             "no optimizer state)")


    def write_request(self) -> WriteRequest:
        """What the output format's writer is asked to write (app.checkpoint.request), from
        the flags: the target layout and dtype, the iteration, the optimizer, the Hugging Face
        shard size, tokenizer and model card."""
        return WriteRequest(
            tensor_model_parallel_size=self.target_tensor_model_parallel_size,
            pipeline_model_parallel_size=self.target_pipeline_model_parallel_size,
            expert_model_parallel_size=self.target_expert_model_parallel_size,
            expert_tensor_parallel_size=self.target_expert_tensor_parallel_size,
            params_dtype=self.target_params_dtype, iteration=self.iteration,
            include_optimizer=self.include_optimizer, max_shard_size=self.max_shard_size,
            tokenizer=TokenizerSource(self.vocab_file, self.merge_file, self.tokenizer_model),
            metrics_file=self.metrics_file,
            model_path=os.path.abspath(self.save) if self.save else None)


def _checked_input_format(source: SavedCheckpoint, given: Optional[str]) -> str:
    """The format of the checkpoint `source` (what --load holds); ValueError when
    --input-format `given` says otherwise."""
    load, found = source.load, source.format
    if given is not None and canonical_format(given, "--input-format") != found:
        raise ValueError(f"--input-format {given}, but --load {load} holds a {found} checkpoint: "
                         f"drop --input-format (the converter detects the format) or pass "
                         f"--input-format {found}")
    if given is None:
        logger.info("--load %s: a %s checkpoint (detected from its files)", load, found)
    return found


def read_checkpoint(opts: ConvertOptions) -> ModelCheckpoint:
    """The source checkpoint as a ModelCheckpoint (the input format's registry reader, given
    what ConvertOptions detected)."""
    return formats.read(opts.source, opts.include_optimizer, opts.make_vocab_size_divisible_by)


def print_structure(opts: ConvertOptions) -> List[str]:
    """Lines describing the source files: every key, tensor shape and dtype, and the args."""
    return formats.lookup(opts.input_format).describe(opts.source)


def convert(opts: ConvertOptions) -> str:
    """Read `opts.load`, write `opts.save` in the output format (staged, renamed at the end);
    returns a one-line summary."""
    start = time.perf_counter()
    source = read_checkpoint(opts)
    target = formats.lookup(opts.output_format, "--output-format")
    if not target.placed and (opts.target_tensor_model_parallel_size,
                              opts.target_pipeline_model_parallel_size,
                              opts.target_expert_model_parallel_size) != (1, 1, 1):
        logger.warning("--target-*-parallel-size is ignored for --output-format %s: it loads at "
                       "any layout", opts.output_format)
    with staged_directory(opts.save) as tmp:
        what = target.write(source, tmp, opts.write_request())
    n = sum(t.numel() for t in source.weights.values())
    return (f"converted {opts.input_format} {opts.load} -> {what} {opts.save}: "
            f"{n / 1e6:.1f}M parameters in {time.perf_counter() - start:.1f} s")
