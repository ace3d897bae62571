"""Checkpoint conversion: Megatron layout (any TP/PP) <-> torch_dist <-> Hugging Face GPT-2, and
DeepSpeed (read) -> any of them.

Every reader returns a layout-free `ModelCheckpoint` (full tensors under our names); every
writer takes one. `convert()` is what tools/convert_checkpoint.py runs. See docs/conversion.md.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import List, Optional

from app.convert.state import ModelCheckpoint, OptimizerState, describe, staged_directory
from app.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)

INPUT_FORMATS = ("megatron", "torch_dist", "deepspeed", "hf")
OUTPUT_FORMATS = ("megatron", "torch_dist", "hf")
DTYPES = ("fp32", "fp16", "bf16")

__all__ = ["ConvertOptions", "ModelCheckpoint", "OptimizerState", "convert", "read_checkpoint",
           "print_structure"]


@dataclass
class ConvertOptions:
    """What tools/convert_checkpoint.py was asked to do (its flags, validated)."""

    load: str
    input_format: Optional[str] = None
    """megatron, deepspeed or hf; None: detected from the files in `load` (app.convert.detect)."""
    output_format: str = "megatron"
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
        if self.input_format not in (None, *INPUT_FORMATS):
            raise ValueError(f"--input-format {self.input_format!r}: use one of {', '.join(INPUT_FORMATS)}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format {self.output_format!r}: use one of {', '.join(OUTPUT_FORMATS)}")
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
        if self.include_optimizer and "hf" in (self.input_format, self.output_format):
            raise ValueError("--include-optimizer needs a megatron, torch_dist or deepspeed input "
                             "and a megatron or torch_dist output (Hugging Face directories hold "
                             "no optimizer state)")
        if self.metrics_file is not None and not os.path.isfile(self.metrics_file):
            raise FileNotFoundError(f"--metrics-file {self.metrics_file} does not exist (the JSONL "
                                    "that pretrain_gpt2.py --metrics-file wrote)")


def _checked_input_format(load: str, given: Optional[str], iteration: Optional[object]) -> str:
    """The format of the checkpoint in `load` (app.convert.detect); ValueError when --input-format
    `given` says otherwise."""
    from app.convert.detect import detect_format
    found = detect_format(load, iteration)
    if given is not None and given != found:
        raise ValueError(f"--input-format {given}, but --load {load} holds a {found} checkpoint: "
                         f"drop --input-format (the converter detects the format) or pass "
                         f"--input-format {found}")
    if given is None:
        logger.info("--load %s: a %s checkpoint (detected from its files)", load, found)
    return found


def read_checkpoint(opts: ConvertOptions) -> ModelCheckpoint:
    """The source checkpoint as a ModelCheckpoint."""
    if opts.input_format == "megatron":
        from app.convert.megatron import read_megatron
        return read_megatron(opts.load, opts.iteration, opts.include_optimizer)
    if opts.input_format == "torch_dist":
        from app.convert.torch_dist import read_torch_dist
        return read_torch_dist(opts.load, opts.iteration, opts.include_optimizer)
    if opts.input_format == "deepspeed":
        from app.convert.deepspeed import read_deepspeed
        return read_deepspeed(opts.load, opts.iteration, opts.include_optimizer)
    from app.convert.hf_gpt2 import read_hf_dir
    return read_hf_dir(opts.load, opts.make_vocab_size_divisible_by)


def print_structure(opts: ConvertOptions) -> List[str]:
    """Lines describing the source files: every key, tensor shape and dtype, and the args."""
    import glob
    lines: List[str] = []
    if opts.input_format == "hf":
        source = read_checkpoint(opts)
        lines += [f"Hugging Face directory {opts.load}", *describe(vars(source.args))]
        from app.convert.hf_gpt2 import read_hf_tensors
        lines += describe(dict(read_hf_tensors(opts.load)))
        return lines
    if opts.input_format == "torch_dist":
        from app.convert.torch_dist import describe_torch_dist
        return describe_torch_dist(opts.load, opts.iteration)
    if opts.input_format == "megatron":
        from app.convert.megatron import read_rank_files, resolve_iteration
        iteration = resolve_iteration(opts.load, opts.iteration)
        (tp, pp), files = read_rank_files(opts.load, iteration)
        lines.append(f"Megatron checkpoint {opts.load}, iteration {iteration}: TP {tp}, PP {pp}")
        for (tp_rank, pp_rank), state in sorted(files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(f"rank file (tp {tp_rank}, pp {pp_rank}):")
            lines += describe(state, 1)
        return lines
    from app.convert.deepspeed import load_file, resolve_tag
    tag = resolve_tag(opts.load, opts.iteration)
    for path in sorted(glob.glob(os.path.join(opts.load, tag, "*.pt"))):
        lines.append(f"{os.path.relpath(path, opts.load)}:")
        lines += describe(load_file(path), 1)
    return lines


def convert(opts: ConvertOptions) -> str:
    """Read `opts.load`, write `opts.save` in the output format (staged, renamed at the end);
    returns a one-line summary."""
    start = time.perf_counter()
    source = read_checkpoint(opts)
    tp, pp = opts.target_tensor_model_parallel_size, opts.target_pipeline_model_parallel_size
    dtype = torch_dtype(opts.target_params_dtype) if opts.target_params_dtype else None
    with staged_directory(opts.save) as tmp:
        if opts.output_format == "hf":
            if tp != 1 or pp != 1:
                logger.warning("--target-*-parallel-size is ignored for --output-format hf")
            from app.convert.hf_gpt2 import write_hf_dir
            write_hf_dir(source, tmp, dtype, opts.max_shard_size, opts.vocab_file, opts.merge_file,
                         opts.metrics_file, os.path.abspath(opts.save))
            if not (opts.vocab_file or source.tokenizer_files):
                logger.warning("no tokenizer files written: pass --vocab-file and --merge-file so "
                               "AutoTokenizer.from_pretrained works")
            what = "Hugging Face GPT-2 directory"
        elif opts.output_format == "torch_dist":
            from app.convert.torch_dist import write_torch_dist
            iteration = opts.iteration
            if opts.include_optimizer and iteration is None:
                iteration = source.iteration
            written = write_torch_dist(source, tmp, opts.target_params_dtype, iteration,
                                       opts.include_optimizer)
            if tp != 1 or pp != 1:
                logger.warning("--target-*-parallel-size is ignored for --output-format "
                               "torch_dist: it loads at any layout")
            what = f"torch_dist checkpoint (iteration {written}; loads at any TP x PP x DP)"
        else:
            from app.convert.megatron import write_megatron
            iteration = opts.iteration
            if opts.include_optimizer and iteration is None:
                iteration = source.iteration
            written = write_megatron(source, tmp, tp, pp, opts.target_params_dtype,
                                     iteration, opts.include_optimizer)
            if opts.include_optimizer:
                logger.info("wrote iteration %s with the optimizer state: --load resumes it with "
                            "its Adam moments and LR schedule", written)
            else:
                logger.info("wrote %s weights only: load it with --load (a release checkpoint) or "
                            "--finetune; training starts at iteration 0 with a fresh optimizer",
                            "a release checkpoint of" if written == "release" else f"iteration {written},")
            what = f"Megatron checkpoint (iteration {written}, TP {tp}, PP {pp})"
    n = sum(t.numel() for t in source.weights.values())
    return (f"converted {opts.input_format} {opts.load} -> {what} {opts.save}: "
            f"{n / 1e6:.1f}M parameters in {time.perf_counter() - start:.1f} s")
