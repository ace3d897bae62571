"""The registry's `hf` format (app.checkpoint.formats): a Hugging Face `save_pretrained`
directory of GPT-2 (app.checkpoint.hf_gpt2) or of the Llama architecture (Llama, Qwen3:
app.checkpoint.hf_llama). Reading picks the module by config.json's model_type; writing by what
the model is (app.model.hf_compat.export_architecture): GPT-2's block exports as GPT-2, the
Llama recipe as Llama. The directory's files are app.checkpoint.hf_files'.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from app.checkpoint import hf_gpt2, hf_llama
from app.checkpoint.hf_files import (ExportTokenizer, HFConversionError, pick_tokenizer,
                                     read_config, read_hf_tensors)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint, describe
from app.model.hf_compat import GPT2, export_architecture
from app.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)

_READERS = {"gpt2": hf_gpt2, None: hf_gpt2, **{t: hf_llama for t in hf_llama.MODEL_TYPES}}
"""config.json model_type -> the module that reads it (None: an old GPT-2 config)."""


def _reader(config: Dict, path: str):
    kind = config.get("model_type")
    if kind not in _READERS:
        raise HFConversionError(f"{path}/config.json: model_type {kind!r} is not one this "
                                f"converter reads (gpt2, {', '.join(hf_llama.MODEL_TYPES)})")
    return _READERS[kind]


def read_converted(path: str, iteration: Optional[object] = None, include_optimizer: bool = False,
                   make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """The registry's read: the GPT-2 or Llama-architecture directory `path`, whole; a Hugging
    Face directory has one version (`iteration` unused) and no optimizer state
    (`include_optimizer` refused by app.checkpoint.convert before this is called)."""
    config = read_config(path)
    return _reader(config, path).read_hf_dir(path, config, make_vocab_size_divisible_by)


def describe_hf(path: str, iteration: Optional[object] = None) -> List[str]:
    """Lines describing a Hugging Face directory: the args it implies, then every tensor."""
    source = read_converted(path)
    lines = [f"Hugging Face directory {path} (model_type {read_config(path).get('model_type')})",
             *describe(vars(source.args))]
    return lines + describe(dict(read_hf_tensors(path)))


def write_converted(source: ModelCheckpoint, out_dir: str, opts: Any) -> str:
    """The converter's write (opts: app.checkpoint.convert.ConvertOptions): `write_model` with
    the tokenizer the flags or the source name (hf_files.pick_tokenizer); returns what was
    written, in words."""
    if (opts.target_tensor_model_parallel_size, opts.target_pipeline_model_parallel_size) != (1, 1):
        logger.warning("--target-*-parallel-size is ignored for --output-format hf")
    dtype = torch_dtype(opts.target_params_dtype) if opts.target_params_dtype else None
    tokenizer = pick_tokenizer(source.args, source.tokenizer_files, opts.vocab_file,
                               opts.merge_file, opts.tokenizer_model)
    architecture = write_model(source, out_dir, tokenizer, dtype, opts.max_shard_size,
                               opts.metrics_file, os.path.abspath(opts.save))
    return f"Hugging Face {architecture} directory"


def write_model(source: ModelCheckpoint, out_dir: str, tokenizer: Optional[ExportTokenizer] = None,
                dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                metrics_file: Optional[str] = None, model_path: Optional[str] = None) -> str:
    """`source` as the Hugging Face architecture its model is (GPT2LMHeadModel, LlamaForCausalLM
    or Qwen3ForCausalLM: app.model.hf_compat.export_architecture) in `out_dir`; returns that
    architecture's name."""
    architecture = export_architecture(model_config_from_args(source.args, for_inference=True))
    module = hf_gpt2 if architecture == GPT2 else hf_llama
    module.write_hf_dir(source, out_dir, tokenizer or ExportTokenizer(), dtype, max_shard_size,
                        metrics_file, model_path)
    return architecture
