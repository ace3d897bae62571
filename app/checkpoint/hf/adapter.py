"""What one Hugging Face model family provides (its adapter): the config.json `model_type`s it
reads, the architectures it writes, what of our model it cannot express, and its weights and
config.json both ways.

One module per family under app/checkpoint/hf/families/ defines `ADAPTER`, an instance of a
`FamilyAdapter` subclass (as torchtitan keeps each model's Hugging Face names in its own
state_dict_adapter.py, and Megatron-Bridge one mapping per family). app.checkpoint.hf finds
the families there and picks one by config.json's model_type when it reads, by
`export_blockers` when it writes, so adding a family is adding one module; the directory's
files (weights, config.json, tokenizer, model card) are app.checkpoint.hf.files' for every
family.
"""
from __future__ import annotations

import abc
from typing import ClassVar, Dict, List, Optional

import torch

from app.checkpoint.hf.files import ExportTokenizer
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig


class FamilyAdapter(abc.ABC):
    """One Hugging Face model family, both ways."""

    family: ClassVar[str]
    """The family's name in messages ("GPT-2", "Llama")."""
    model_types: ClassVar[Dict[Optional[str], str]]
    """config.json `model_type` -> the architecture (config.json "architectures") of that type;
    the reader picks the family by it (None: a config without model_type)."""
    export_order: ClassVar[int]
    """Families are tried in this order (lowest first) when a model is exported: the first
    whose `export_blockers` are empty writes it."""

    @abc.abstractmethod
    def export_blockers(self, config: ModelConfig) -> List[str]:
        """Reasons, one per option (naming the flag), why `config` cannot be written as this
        family; empty when it can."""

    @abc.abstractmethod
    def export_architecture(self, config: ModelConfig) -> str:
        """The architecture `config` (which this family expresses) is written as."""

    @abc.abstractmethod
    def read_directory(self, path: str, config: Dict,
                       make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
        """The `save_pretrained` directory `path` whose config.json is `config`, under our
        names (the vocabulary keeps the file's rows; the args record Megatron's padding
        multiple)."""

    @abc.abstractmethod
    def write_directory(self, source: ModelCheckpoint, out_dir: str, tokenizer: ExportTokenizer,
                        dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                        metrics_file: Optional[str] = None, model_path: Optional[str] = None
                        ) -> Dict[str, str]:
        """`source` as this family's directory in `out_dir` (app.checkpoint.hf.files
        .write_directory), the vocabulary trimmed to the tokenizer's size; the files written,
        {name: path}."""
