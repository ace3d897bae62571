"""What one Hugging Face model family provides (its adapter): the config.json `model_type`s it
reads, the architectures it writes, what of our model it cannot express, and its weights and
config.json both ways.

One module per family under app/checkpoint/hf/families/ defines `ADAPTER`, a `FamilyAdapter`
of its own functions (as torchtitan keeps each model's Hugging Face names in its own
state_dict_adapter.py, and Megatron-Bridge one mapping per family). app.checkpoint.hf finds
the families there and picks one by config.json's model_type when it reads, by
`export_blockers` when it writes, so adding a family is adding one module; the directory's
files (weights, config.json, tokenizer, model card) are app.checkpoint.hf.files' for every
family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig


@dataclass(frozen=True)
class FamilyAdapter:
    """One Hugging Face model family, both ways."""

    family: str
    """The family's name in messages ("GPT-2", "Llama")."""
    model_types: Mapping[Optional[str], str]
    """config.json `model_type` -> the architecture (config.json "architectures") of that type;
    the reader picks the family by it (None: a config without model_type)."""
    export_order: int
    """Families are tried in this order (lowest first) when a model is exported: the first
    whose `export_blockers` are empty writes it."""
    export_blockers: Callable[[ModelConfig], List[str]]
    """export_blockers(config) -> reasons, one per option (naming the flag), why `config`
    cannot be written as this family; empty when it can."""
    export_architecture: Callable[[ModelConfig], str]
    """export_architecture(config) -> the architecture `config` (which this family
    expresses) is written as."""
    read_directory: Callable[..., ModelCheckpoint]
    """read_directory(path, config_json, make_vocab_size_divisible_by=128) -> the
    `save_pretrained` directory `path` whose config.json is `config_json`, under our names
    (the vocabulary keeps the file's rows; the args record Megatron's padding multiple)."""
    write_directory: Callable[..., Dict[str, str]]
    """write_directory(source, out_dir, tokenizer, dtype=None, max_shard_size="2GB",
    metrics_file=None, model_path=None) -> `source` as this family's directory in `out_dir`
    (app.checkpoint.hf.files.write_directory), the vocabulary trimmed to the tokenizer's
    size; the files written, {name: path}."""
