"""The registry's `hf` format (app.checkpoint.formats): a Hugging Face `save_pretrained`
directory of one of the model families in app/checkpoint/hf/families/ (GPT-2; Llama and Qwen3),
each an adapter of its own (app.checkpoint.hf.adapter).

Reading picks the family by config.json's model_type; writing by what the model is: the first
family in export order that expresses it (`export_architecture`). The directory's files
(config, safetensors, generation config, tokenizer, model card) are app.checkpoint.hf.files'.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from app.checkpoint.hf.adapter import FamilyAdapter
from app.checkpoint.hf.families import ADAPTERS
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, pick_tokenizer,
                                     read_config, read_hf_tensors)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.request import WriteRequest
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.state import ModelCheckpoint, describe
from app.config import ModelConfig
from app.utils.dtypes import torch_dtype

READERS: Dict[Optional[str], FamilyAdapter] = {
    model_type: adapter for adapter in ADAPTERS for model_type in adapter.model_types}
"""config.json model_type -> the family that reads it (None: an old GPT-2 config)."""


def _family(config: Dict, path: str) -> FamilyAdapter:
    kind = config.get("model_type")
    if kind not in READERS:
        known = ", ".join(sorted(t for t in READERS if t is not None))
        raise HFConversionError(f"{path}/config.json: model_type {kind!r} is not one this "
                                f"converter reads ({known})")
    return READERS[kind]


def read_directory(path: str, make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """The Hugging Face directory `path`, whole, read by the family its config.json names."""
    config = read_config(path)
    return _family(config, path).read_directory(path, config, make_vocab_size_divisible_by)


def read_hf(saved: SavedCheckpoint, include_optimizer: bool = False,
            make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """The registry's read (`saved`: what app.checkpoint.saved_layout.detect found): the
    directory, whole; a Hugging Face directory has one version and no optimizer state
    (`include_optimizer` refused by app.checkpoint.convert before this is called)."""
    return read_directory(saved.folder, make_vocab_size_divisible_by)


def describe_hf(saved: SavedCheckpoint) -> List[str]:
    """Lines describing a Hugging Face directory: the args it implies, then every tensor."""
    path = saved.folder
    source = read_directory(path)
    lines = [f"Hugging Face directory {path} (model_type {read_config(path).get('model_type')})",
             *describe(vars(source.args))]
    return lines + describe(dict(read_hf_tensors(path)))


def export_family(config: ModelConfig) -> FamilyAdapter:
    """The family `config` is written as: the first in export order that expresses it; a
    ValueError naming, for every family, each option it cannot express when none does."""
    refusals = []
    for adapter in ADAPTERS:
        blockers = adapter.export_blockers(config)
        if not blockers:
            return adapter
        refusals.append(f"a Hugging Face {adapter.family} model (it uses {'; '.join(blockers)})")
    raise ValueError("the model is neither " + " nor ".join(refusals))


def export_architecture(config: ModelConfig) -> str:
    """The Hugging Face architecture (config.json "architectures") `config` exports as:
    GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, ... (`export_family`)."""
    return export_family(config).export_architecture(config)


def write_hf(source: ModelCheckpoint, out_dir: str, request: WriteRequest) -> str:
    """The registry's write: `write_model` in the request's dtype and shard size, with the
    tokenizer the request or the source name (app.checkpoint.hf.files.pick_tokenizer) and the
    model card's metrics; returns what was written, in words."""
    dtype = torch_dtype(request.params_dtype) if request.params_dtype else None
    t = request.tokenizer
    tokenizer = pick_tokenizer(source.args, source.tokenizer_files, t.vocab_file, t.merge_file,
                               t.tokenizer_model)
    architecture = write_model(source, out_dir, tokenizer, dtype, request.max_shard_size,
                               request.metrics_file, request.model_path)
    return f"Hugging Face {architecture} directory"


def write_model(source: ModelCheckpoint, out_dir: str, tokenizer: Optional[ExportTokenizer] = None,
                dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                metrics_file: Optional[str] = None, model_path: Optional[str] = None) -> str:
    """`source` as the Hugging Face architecture its model is (`export_family`) in `out_dir`;
    returns that architecture's name."""
    config = model_config_from_args(source.args, for_inference=True)
    family = export_family(config)
    family.write_directory(source, out_dir, tokenizer or ExportTokenizer(), dtype, max_shard_size,
                           metrics_file, model_path)
    return family.export_architecture(config)
