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
import argparse
from typing import ClassVar, Dict, List, Optional

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.files import ExportTokenizer, HFConversionError, write_directory
from app.checkpoint.model_args import model_config_from_args
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


class DecoderAdapter(FamilyAdapter):
    """A family written as Hugging Face's decoder layout (`model.embed_tokens.weight`, ...):
    its tensors (`hf_tensors`) and config.json (`hf_config_json`) are the family's, the steps
    of an export this class's `write_directory`."""

    @abc.abstractmethod
    def hf_tensors(self, weights: Dict[str, torch.Tensor], config: ModelConfig,
                   vocab_size: int) -> Dict[str, torch.Tensor]:
        """Our full tensors -> the family's names and layouts, `vocab_size` rows kept."""

    @abc.abstractmethod
    def hf_config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                       vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        """The config.json of `config` (the model of checkpoint args `args`)."""

    def write_directory(self, source: ModelCheckpoint, out_dir: str, tokenizer: ExportTokenizer,
                        dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                        metrics_file: Optional[str] = None, model_path: Optional[str] = None
                        ) -> Dict[str, str]:
        """`source` as this family's directory: refused naming `export_blockers`; the
        vocabulary trimmed to the tokenizer's size (args.vocab_size); every tensor in `dtype`
        (default: the embedding's)."""
        args = source.args
        config = model_config_from_args(args, for_inference=True)
        blockers = self.export_blockers(config)
        if blockers:
            raise HFConversionError(f"the model is not a Hugging Face {self.family} model: "
                                    + "; ".join(blockers))
        vocab_size = int(getattr(args, "vocab_size", None) or
                         source.weights[layout.WORD_EMBEDDINGS].shape[0])
        tensors = self.hf_tensors(source.weights, config, vocab_size)
        dtype = dtype or tensors["model.embed_tokens.weight"].dtype
        tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
        return write_directory(out_dir, tensors,
                               self.hf_config_json(args, config, dtype, vocab_size, tokenizer),
                               args, source.iteration, tokenizer, max_shard_size, vocab_size,
                               metrics_file, model_path)


def shift_norm_weights(weights: Dict[str, torch.Tensor], delta: float) -> Dict[str, torch.Tensor]:
    """`weights` with `delta` added (in fp32, then back to each tensor's dtype) to every norm's
    weight (input, post-attention, final and query/key norms): +1 turns the zero-centred gamma
    of --apply-layernorm-1p into a plain norm weight, -1 the reverse. Other tensors are the
    same objects."""
    if delta == 0.0:
        return weights
    return {name: (t.float() + delta).to(t.dtype)
            if name.endswith("layernorm.weight") else t for name, t in weights.items()}
