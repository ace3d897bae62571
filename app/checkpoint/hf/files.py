"""The files of a Hugging Face `save_pretrained` directory, whatever the architecture: config.json,
the weights (model.safetensors, sharded safetensors with model.safetensors.index.json, or
pytorch_model.bin), generation_config.json, the model card and the tokenizer files.

The families' adapters (app.checkpoint.hf.families: GPT-2, Llama/Qwen3) map names, layouts and
config.json; reading and writing the directory is here, once, for all of them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from app.checkpoint.hf.model_card import model_card
from app.checkpoint.model_args import ROPE_FACTOR_APPLIED
from app.checkpoint.hf.sentencepiece import SENTENCEPIECE_TYPES, write_sentencepiece_tokenizer
from app.checkpoint.state import Progress
from app.data.tokenizer import TOKENIZER_MODEL_TYPES, HuggingFaceTokenizer, build_tokenizer

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
GPT2_SPECIAL = "<|endoftext|>"


class HFConversionError(ValueError):
    """A Hugging Face file or key that cannot be mapped; the message names it."""


def read_config(path: str) -> Dict:
    """The config.json of the Hugging Face directory `path` (HFConversionError when absent)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise HFConversionError(f"--load {path} has no config.json: not a Hugging Face model "
                                "directory")
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""A directory holding one of these has a tokenizer AutoTokenizer loads."""


def directory_tokenizer(path: str) -> Optional[str]:
    """The --tokenizer-model an import names in its args (--tokenizer-type
    HuggingFaceTokenizer): the absolute `path` when the directory holds a tokenizer
    AutoTokenizer loads (TOKENIZER_FILES: a tokenizer.json, or the tokenizer.model +
    tokenizer.json of a SentencePiece export), else None."""
    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return os.path.abspath(path)
    return None


def import_args(**model: object) -> argparse.Namespace:
    """The Megatron args of a model read from a Hugging Face directory: its `model` fields plus
    what every import shares (one process, fp32 parameters until the weights say otherwise, no
    training position)."""
    shared = dict(bias_gelu_fusion=True, masked_softmax_fusion=True, params_dtype=torch.float32,
                  fp16=False, bf16=False, apply_residual_connection_post_layernorm=False,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  data_parallel_size=1, world_size=1, consumed_train_samples=0,
                  consumed_valid_samples=0, iteration=0, **{ROPE_FACTOR_APPLIED: True})
    return argparse.Namespace(**{**shared, **model})


def decoder_import_args(config: Dict, positions: int, make_vocab_size_divisible_by: int,
                        tokenizer_model: Optional[str], **family: object) -> argparse.Namespace:
    """`import_args` of a decoder-only config.json's shared fields (layers, widths, heads and
    key/value heads, head_dim, positions (`positions` when it names none), vocabulary, dropout,
    init std, tying, the tokenizer directory), plus the `family`'s own model args."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    positions = int(config.get("max_position_embeddings", positions))
    vocab = int(config["vocab_size"])
    return import_args(
        num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        num_attention_heads=heads, ffn_hidden_size=int(config["intermediate_size"]),
        kv_channels=int(config.get("head_dim") or hidden // heads),
        max_position_embeddings=positions, seq_length=positions, vocab_size=vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, padded_vocab_size=vocab,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model,
        hidden_dropout=0.0, attention_dropout=float(config.get("attention_dropout", 0.0)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        position_embedding_type="rope", use_rotary_position_embeddings=True,
        add_position_embedding=False, **family)


def read_hf_tensors(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the directory's weights, by its Hugging Face name."""
    from safetensors.torch import load_file
    progress = Progress("reading Hugging Face weights")
    if os.path.isfile(os.path.join(path, SAFE_INDEX)):
        with open(os.path.join(path, SAFE_INDEX), encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, SAFE_WEIGHTS)):
        files = [SAFE_WEIGHTS]
    elif os.path.isfile(os.path.join(path, BIN_WEIGHTS)):
        state = torch.load(os.path.join(path, BIN_WEIGHTS), map_location="cpu", weights_only=True)
        for t in state.values():
            progress.add(t)
        progress.report(final=True)
        return state
    else:
        raise HFConversionError(f"--load {path} has neither {SAFE_WEIGHTS}, {SAFE_INDEX} nor "
                                f"{BIN_WEIGHTS}")
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        if not os.path.isfile(os.path.join(path, name)):
            raise HFConversionError(f"{os.path.join(path, SAFE_INDEX)} names {name}, which "
                                    f"{path} does not hold: copy the whole directory")
        shard = load_file(os.path.join(path, name))
        for t in shard.values():
            progress.add(t)
        tensors.update(shard)
    progress.report(final=True)
    return tensors


def parse_size(text: str) -> int:
    """'2GB' -> 2e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000 (HF's units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 10GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def shard_plan(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[List[str]]:
    """Names grouped into shards of at most `max_bytes` (a larger tensor gets its own shard)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(tensors: Dict[str, torch.Tensor], out_dir: str, max_shard_size: str
                  ) -> Dict[str, str]:
    """`tensors` as model.safetensors, or shards of at most `max_shard_size` with
    model.safetensors.index.json; returns the files written, {name: path}."""
    from safetensors.torch import save_file
    written: Dict[str, str] = {}
    plan = shard_plan(tensors, parse_size(max_shard_size))
    progress = Progress("writing Hugging Face weights", total=len(tensors))
    weight_map: Dict[str, str] = {}
    for i, names in enumerate(plan):
        file = (SAFE_WEIGHTS if len(plan) == 1
                else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, file),
                  metadata={"format": "pt"})
        for n in names:
            weight_map[n] = file
            progress.add(tensors[n])
        written[file] = os.path.join(out_dir, file)
    if len(plan) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json(os.path.join(out_dir, SAFE_INDEX),
                   {"metadata": {"total_size": total}, "weight_map": weight_map})
        written[SAFE_INDEX] = os.path.join(out_dir, SAFE_INDEX)
    progress.report(final=True)
    return written


@dataclass
class ExportTokenizer:
    """Where the exported model's tokenizer comes from, and its special ids."""

    vocab_file: Optional[str] = None
    """GPT-2 BPE vocab.json (with merge_file)."""
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    """A Hugging Face tokenizer (a directory with tokenizer.json, or a cached Hub name), or a
    SentencePiece .model file (tokenizer_type says which)."""
    tokenizer_type: Optional[str] = None
    """Our tokenizer type of tokenizer_model: HuggingFaceTokenizer, SentencePieceTokenizer or
    GPTSentencePieceTokenizer."""
    bos: Optional[int] = None
    eos: Optional[int] = None
    pad: Optional[int] = None
    size: Optional[int] = None
    """Tokens the tokenizer has (None: not known)."""
    written: Dict[str, str] = field(default_factory=dict)


def pick_tokenizer(args: argparse.Namespace, tokenizer_files: Dict[str, str],
                   vocab_file: Optional[str], merge_file: Optional[str],
                   tokenizer_model: Optional[str]) -> ExportTokenizer:
    """The tokenizer an export carries: --tokenizer-model (a Hugging Face tokenizer, or a
    SentencePiece .model read as the checkpoint's SentencePiece type, else as
    GPTSentencePieceTokenizer), else --vocab-file/--merge-file, else the source directory's GPT-2
    files, else the --tokenizer-model the checkpoint's args name (--tokenizer-type
    HuggingFaceTokenizer, SentencePieceTokenizer or GPTSentencePieceTokenizer); its special ids
    read from it. An empty ExportTokenizer when none is known."""
    saved_type = getattr(args, "tokenizer_type", None)
    sentencepiece_type = (saved_type if saved_type in SENTENCEPIECE_TYPES
                          else "GPTSentencePieceTokenizer")
    if tokenizer_model is None and not vocab_file:
        vocab_file = tokenizer_files.get("vocab.json")
        merge_file = tokenizer_files.get("merges.txt")
        if not vocab_file and saved_type in TOKENIZER_MODEL_TYPES:
            tokenizer_model = getattr(args, "tokenizer_model", None)
            if tokenizer_model and saved_type in SENTENCEPIECE_TYPES:
                return _sentencepiece_export(tokenizer_model, saved_type,
                                             "the checkpoint's args name ")
    if tokenizer_model and os.path.isfile(tokenizer_model):
        return _sentencepiece_export(tokenizer_model, sentencepiece_type)
    if tokenizer_model:
        tok = HuggingFaceTokenizer(tokenizer_model)
        return ExportTokenizer(tokenizer_model=tokenizer_model,
                               tokenizer_type="HuggingFaceTokenizer", bos=tok.bos, eos=tok.eod,
                               pad=tok.pad, size=tok.vocab_size)
    if vocab_file and merge_file:
        eod = gpt2_eod_id(vocab_file)
        return ExportTokenizer(vocab_file=vocab_file, merge_file=merge_file, bos=eod, eos=eod,
                               pad=eod)
    return ExportTokenizer()


def _sentencepiece_export(model_file: str, tokenizer_type: str, named_by: str = ""
                          ) -> ExportTokenizer:
    """The ExportTokenizer of a SentencePiece .model read as `tokenizer_type`: our tokenizer's
    bos, end of document (the export's eos) and pad ids (None where it has none)."""
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"{named_by}--tokenizer-model {model_file} ({tokenizer_type}), "
                                "which does not exist here: pass --tokenizer-model FILE, the "
                                ".model the run trained with")
    tok = build_tokenizer(tokenizer_type, None, None, tokenizer_model=model_file)
    return ExportTokenizer(tokenizer_model=model_file, tokenizer_type=tokenizer_type,
                           bos=tok.bos, eos=tok.eod, pad=tok.pad, size=tok.vocab_size)


def write_tokenizer(out_dir: str, tokenizer: ExportTokenizer, model_max_length: int
                    ) -> Dict[str, str]:
    """The files of `tokenizer` (pick_tokenizer) that AutoTokenizer reads offline, in `out_dir`."""
    if tokenizer.tokenizer_type in SENTENCEPIECE_TYPES:
        return write_sentencepiece_tokenizer(out_dir, tokenizer.tokenizer_model,
                                             tokenizer.tokenizer_type, model_max_length)
    if tokenizer.tokenizer_model:
        import transformers
        auto = transformers.AutoTokenizer.from_pretrained(tokenizer.tokenizer_model,
                                                          local_files_only=True)
        names = auto.save_pretrained(out_dir)
        return {os.path.basename(n): n for n in names if os.path.isfile(n)}
    if tokenizer.vocab_file and tokenizer.merge_file:
        return write_gpt2_tokenizer(out_dir, tokenizer.vocab_file, tokenizer.merge_file,
                                    model_max_length)
    return {}


def gpt2_eod_id(vocab_file: str) -> int:
    """The id of GPT-2's <|endoftext|> in `vocab_file` (HFConversionError when absent)."""
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if GPT2_SPECIAL not in vocab:
        raise HFConversionError(f"--vocab-file {vocab_file} has no {GPT2_SPECIAL!r} token")
    return int(vocab[GPT2_SPECIAL])


def write_gpt2_tokenizer(out_dir: str, vocab_file: str, merge_file: str,
                         model_max_length: int) -> Dict[str, str]:
    """vocab.json, merges.txt and the tokenizer configs AutoTokenizer reads offline (GPT-2's)."""
    written = {}
    for src, name in ((vocab_file, "vocab.json"), (merge_file, "merges.txt")):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"tokenizer file {src} does not exist")
        dst = os.path.join(out_dir, name)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
        written[name] = dst
    special = GPT2_SPECIAL
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
        "bos_token": special, "eos_token": special, "unk_token": special, "pad_token": special,
        "add_prefix_space": False, "add_bos_token": False, "clean_up_tokenization_spaces": False})
    write_json(os.path.join(out_dir, "special_tokens_map.json"),
               {"bos_token": special, "eos_token": special, "unk_token": special,
                "pad_token": special})
    written["tokenizer_config.json"] = os.path.join(out_dir, "tokenizer_config.json")
    return written


def write_directory(out_dir: str, tensors: Dict[str, torch.Tensor], config: Dict,
                    args: argparse.Namespace, iteration: object, tokenizer: ExportTokenizer,
                    max_shard_size: str, rows: int, metrics_file: Optional[str],
                    model_path: Optional[str]) -> Dict[str, str]:
    """The whole `save_pretrained` directory: weights, config.json, generation_config.json, the
    tokenizer's files and the model card README.md (app.checkpoint.hf.model_card; `metrics_file`
    gives its validation loss, `model_path` the path its examples load, default `out_dir`).
    Returns the files written, {name: path}. A tokenizer with more tokens than the model's
    `rows` is refused (HFConversionError) before anything is written."""
    if tokenizer.size is not None and tokenizer.size > rows:
        raise HFConversionError(f"--tokenizer-model {tokenizer.tokenizer_model} has "
                                f"{tokenizer.size} tokens but the checkpoint's vocabulary has "
                                f"{rows} rows: give the tokenizer the run trained with")
    written = write_weights(tensors, out_dir, max_shard_size)
    write_json(os.path.join(out_dir, "config.json"), config)
    written["config.json"] = os.path.join(out_dir, "config.json")
    write_json(os.path.join(out_dir, "generation_config.json"),
               {"bos_token_id": config.get("bos_token_id"),
                "eos_token_id": config.get("eos_token_id"),
                "pad_token_id": tokenizer.pad if tokenizer.pad is not None
                else config.get("pad_token_id")})
    written.update(write_tokenizer(out_dir, tokenizer, int(args.max_position_embeddings)))
    card = model_card(args, iteration, sum(t.numel() for t in tensors.values()),
                      model_path or out_dir, metrics_file, config["architectures"][0])
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    written["README.md"] = os.path.join(out_dir, "README.md")
    if not written.get("tokenizer_config.json"):
        logger.warning("no tokenizer files written: pass --tokenizer-model DIR (a Hugging Face "
                       "tokenizer) or --vocab-file and --merge-file (GPT-2 BPE) so "
                       "AutoTokenizer.from_pretrained works")
    return written


def write_json(path: str, obj: Dict) -> None:
    """`obj` as indented JSON with sorted keys and a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
