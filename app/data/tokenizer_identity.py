"""Tokenizers compared by what they do, not by their class name.

A checkpoint names its tokenizer the way the run that saved it did (`--tokenizer-type` and the
files it read); a run loading it may name the same tokenizer another way: GPT-2's byte-level
BPE as `--vocab-file vocab.json --merge-file merges.txt` (GPT2BPETokenizer), or as the
`tokenizer.json` of a Hugging Face directory (`--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR`, what transformers' GPT-2 `save_pretrained` writes). Both give the same
ids for the same text (the one exception: the literal text `<|endoftext|>`, which only a
Hugging Face tokenizer turns into the end-of-document id; docs/data.md), so both may load the
other's checkpoint.

`TokenizerSpec` is a tokenizer as flags (or a checkpoint's args) name it; `identity(spec)`
reads what decides its ids from its files (None when they are not here):

- a GPT-2 byte-level BPE: its vocabulary (token -> id), its merges in order and its
  end-of-document id, whether from vocab.json + merges.txt or from a tokenizer.json whose
  model is that BPE and nothing else (`gpt2_bpe_in_directory`: no normalizer, GPT-2's byte-level
  pre-tokenizer without a prefix space, no tokens added around the text, no added token
  outside the vocabulary);
- any other Hugging Face tokenizer: a digest of its tokenizer.json (or tokenizer.model) and of
  the special tokens its tokenizer_config.json names;
- a SentencePiece model: a digest of the .model file and the type (SentencePieceTokenizer adds
  Megatron's special tokens after its pieces);
- NullTokenizer: its vocabulary size.

`compare_tokenizers(saved, current)` says whether two specs are the same tokenizer, not the
same, or cannot be told apart from here (a file that is not on this machine), with the
difference in words. Reads files only; imports neither transformers nor torch.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from app.data.tokenizer import EOD_TOKEN, TOKENIZER_MODEL_TYPES

HF_FILES = ("tokenizer.json", "tokenizer.model")
"""The files that hold a Hugging Face tokenizer's model, first found wins."""
_CONFIG_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token",
                    "add_eos_token")


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as flags name it: --tokenizer-type and the files (or size) that type reads."""

    tokenizer_type: str
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    """NullTokenizer's number of ids."""

    @classmethod
    def from_args(cls, args: Any) -> Optional["TokenizerSpec"]:
        """The spec a checkpoint's (or a run's) args Namespace names, with Megatron's field
        names; None when it records no tokenizer_type."""
        kind = getattr(args, "tokenizer_type", None)
        if not kind:
            return None
        size = getattr(args, "vocab_size", None)
        return cls(kind, getattr(args, "vocab_file", None), getattr(args, "merge_file", None),
                   getattr(args, "tokenizer_model", None), int(size) if size else None)

    def flags(self) -> str:
        """The command-line flags that name this tokenizer."""
        if self.tokenizer_type == "GPT2BPETokenizer":
            return (f"--tokenizer-type GPT2BPETokenizer --vocab-file "
                    f"{self.vocab_file or 'VOCAB.json'} --merge-file "
                    f"{self.merge_file or 'MERGES.txt'}")
        if self.tokenizer_type == "NullTokenizer":
            return f"--tokenizer-type NullTokenizer --vocab-size {self.vocab_size or 'N'}"
        return (f"--tokenizer-type {self.tokenizer_type} --tokenizer-model "
                f"{self.tokenizer_model or 'MODEL'}")

    def files(self) -> List[str]:
        """The local files (or directory) this spec reads."""
        if self.tokenizer_type == "GPT2BPETokenizer":
            return [p for p in (self.vocab_file, self.merge_file) if p]
        if self.tokenizer_type in TOKENIZER_MODEL_TYPES and self.tokenizer_model:
            return [self.tokenizer_model]
        return []


@dataclass(frozen=True)
class TokenizerIdentity:
    """What decides a tokenizer's ids. `kind` is "gpt2-bpe" (then `vocab`, `merges`, `eod`),
    "huggingface", "sentencepiece" or "null" (then `digest`: a sha256, or the size)."""

    kind: str
    vocab: Optional[Mapping[str, int]] = None
    merges: Optional[Tuple[Tuple[str, str], ...]] = None
    eod: Optional[int] = None
    digest: Optional[str] = None

    def describe(self) -> str:
        """A few words for messages: what kind of tokenizer, and its size."""
        if self.kind == "gpt2-bpe":
            return (f"a GPT-2 byte-level BPE of {len(self.vocab)} tokens and "
                    f"{len(self.merges)} merges, end of document {self.eod}")
        return {"huggingface": "a Hugging Face tokenizer that is not GPT-2's BPE",
                "sentencepiece": "a SentencePiece model",
                "null": f"NullTokenizer of {self.digest} ids"}[self.kind]


@dataclass(frozen=True)
class TokenizerMatch:
    """The verdict of compare_tokenizers: `same` True, False, or None (cannot be told from
    here); `detail` says why."""

    same: Optional[bool]
    detail: str = ""


def read_merges(merge_file: str) -> Tuple[Tuple[str, str], ...]:
    """The merges of a GPT-2 merges.txt, in order (the '#version' header skipped)."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if line and not (lineno == 1 and line.startswith("#version")):
                first, _, second = line.partition(" ")
                merges.append((first, second))
    return tuple(merges)


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def _read_json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> Any:
    """A special token of tokenizer_config.json: its text (an AddedToken dict gives its
    content)."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_config(directory: str) -> Dict[str, Any]:
    """The special tokens (and add_bos/eos_token) a Hugging Face directory's
    tokenizer_config.json names, special_tokens_map.json filling in."""
    config = {**_read_json(os.path.join(directory, "special_tokens_map.json")),
              **_read_json(os.path.join(directory, "tokenizer_config.json"))}
    return {key: _token_text(config.get(key)) for key in _CONFIG_SPECIALS}


def _adds_tokens(post_processor: Optional[Dict[str, Any]]) -> bool:
    """Whether a tokenizer.json post-processor puts tokens around the text (a BOS, ...)."""
    if not post_processor or post_processor.get("type") == "ByteLevel":
        return False
    if post_processor.get("type") == "Sequence":
        return any(_adds_tokens(p) for p in post_processor.get("processors", []))
    if post_processor.get("type") == "TemplateProcessing":
        return any("SpecialToken" in piece for piece in post_processor.get("single", []))
    return True  # RobertaProcessing, BertProcessing: <s>/</s>, [CLS]/[SEP]


def _byte_level_without_prefix(pre_tokenizer: Optional[Dict[str, Any]]) -> bool:
    """Whether a tokenizer.json pre-tokenizer is GPT-2's: byte-level, its regex, no prefix
    space (GPT2BPETokenizer's ByteLevel(add_prefix_space=False, use_regex=True))."""
    if pre_tokenizer and pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer.get("pretokenizers", [])
        return len(steps) == 1 and _byte_level_without_prefix(steps[0])
    return bool(pre_tokenizer) and pre_tokenizer.get("type") == "ByteLevel" and \
        not pre_tokenizer.get("add_prefix_space", True) and pre_tokenizer.get("use_regex", True)


def gpt2_bpe_in_directory(directory: str) -> Optional[TokenizerIdentity]:
    """The GPT-2 byte-level BPE a Hugging Face directory's tokenizer.json holds, or None when
    it holds something else (module docstring: the conditions) or no tokenizer.json."""
    tokenizer = _read_json(os.path.join(directory, "tokenizer.json"))
    model = tokenizer.get("model") or {}
    plain_bpe = (model.get("type") == "BPE" and not model.get("dropout")
                 and not model.get("continuing_subword_prefix")
                 and not model.get("end_of_word_suffix") and not model.get("byte_fallback")
                 and not model.get("ignore_merges"))
    if not plain_bpe or tokenizer.get("normalizer") or \
            not _byte_level_without_prefix(tokenizer.get("pre_tokenizer")) or \
            _adds_tokens(tokenizer.get("post_processor")):
        return None
    config = _hf_config(directory)
    vocab = {str(k): int(v) for k, v in model.get("vocab", {}).items()}
    if config["add_bos_token"] or config["add_eos_token"] or any(
            vocab.get(t.get("content")) != t.get("id") for t in tokenizer.get("added_tokens", [])):
        return None
    eos = config["eos_token"] or EOD_TOKEN
    if eos not in vocab:
        return None
    merges = tuple(tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                   for m in model.get("merges", []))
    return TokenizerIdentity("gpt2-bpe", vocab=vocab, merges=merges, eod=vocab[eos])


def _gpt2_files(vocab_file: str, merge_file: str) -> Optional[TokenizerIdentity]:
    with open(vocab_file, encoding="utf-8") as f:
        vocab = {str(k): int(v) for k, v in json.load(f).items()}
    if EOD_TOKEN not in vocab:
        return None
    return TokenizerIdentity("gpt2-bpe", vocab=vocab, merges=read_merges(merge_file),
                             eod=vocab[EOD_TOKEN])


def _huggingface(directory: str) -> Optional[TokenizerIdentity]:
    found = gpt2_bpe_in_directory(directory)
    if found is not None:
        return found
    for name in HF_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                model = f.read()
            if name == "tokenizer.json":  # the parts that decide ids, key order aside
                data = json.loads(model)
                for key in ("version", "truncation", "padding"):
                    data.pop(key, None)
                model = json.dumps(data, sort_keys=True).encode()
            specials = json.dumps(_hf_config(directory), sort_keys=True).encode()
            return TokenizerIdentity("huggingface", digest=_sha256(model, specials))
    return None


def identity(spec: TokenizerSpec) -> Optional[TokenizerIdentity]:
    """What decides `spec`'s ids, read from its files; None when a file it names is not on
    this machine (or it names none, or a Hub name instead of a directory)."""
    kind = spec.tokenizer_type
    try:
        if kind == "NullTokenizer":
            return TokenizerIdentity("null", digest=str(spec.vocab_size)) if spec.vocab_size \
                else None
        if kind == "GPT2BPETokenizer":
            if spec.vocab_file and spec.merge_file and os.path.isfile(spec.vocab_file) \
                    and os.path.isfile(spec.merge_file):
                return _gpt2_files(spec.vocab_file, spec.merge_file)
            return None
        model = spec.tokenizer_model
        if kind == "HuggingFaceTokenizer" and model and os.path.isdir(model):
            return _huggingface(model)
        if kind in TOKENIZER_MODEL_TYPES and model and os.path.isfile(model):
            with open(model, "rb") as f:
                return TokenizerIdentity("sentencepiece", digest=_sha256(kind.encode(), f.read()))
    except (OSError, ValueError, AttributeError, TypeError):
        return None  # an unreadable file: not known here (the tokenizer build names it)
    return None


def _bpe_difference(saved: TokenizerIdentity, current: TokenizerIdentity) -> str:
    """The first difference between two GPT-2 BPEs, in words ("" when they are the same)."""
    if saved.vocab != current.vocab:
        if len(saved.vocab) != len(current.vocab):
            return f"a vocabulary of {len(saved.vocab)} tokens there, {len(current.vocab)} here"
        token = next(t for t in saved.vocab if current.vocab.get(t) != saved.vocab[t])
        return (f"token {token!r} is id {saved.vocab[token]} there, "
                f"{current.vocab.get(token, 'absent')} here")
    if saved.merges != current.merges:
        if len(saved.merges) != len(current.merges):
            return f"{len(saved.merges)} merges there, {len(current.merges)} here"
        at = next(i for i, (a, b) in enumerate(zip(saved.merges, current.merges)) if a != b)
        return (f"merge {at + 1} is {' '.join(saved.merges[at])!r} there, "
                f"{' '.join(current.merges[at])!r} here")
    if saved.eod != current.eod:
        return f"the end of document is id {saved.eod} there, {current.eod} here"
    return ""


def _unknown(spec: TokenizerSpec, whose: str) -> str:
    """Why `spec`'s ids cannot be read here, in words."""
    if not spec.files():
        return f"{whose} {spec.tokenizer_type} names no file"
    missing = [f for f in spec.files() if not os.path.exists(f)]
    if missing:
        return f"{whose} {', '.join(missing)} not found here"
    return f"{whose} {', '.join(spec.files())} cannot be read as its tokenizer's files"


def compare_tokenizers(saved: TokenizerSpec, current: TokenizerSpec) -> TokenizerMatch:
    """Whether `current` is the same tokenizer as `saved` (module docstring: what counts).

    The same spec is the same tokenizer without reading anything. Otherwise both are read
    (`identity`): same ids -> same; different -> not the same, `detail` naming the first
    difference; a file not here -> None (`detail` names it)."""
    if saved == current:
        return TokenizerMatch(True)
    ours, theirs = identity(current), identity(saved)
    if ours is None or theirs is None:
        why = [_unknown(spec, whose) for spec, found, whose in
               ((saved, theirs, "the checkpoint's"), (current, ours, "this run's"))
               if found is None]
        return TokenizerMatch(None, "; ".join(why))
    if ours.kind == theirs.kind == "gpt2-bpe":
        difference = _bpe_difference(theirs, ours)
        return TokenizerMatch(not difference, difference or
                              "the same vocabulary, merges and end-of-document token")
    if ours == theirs:
        return TokenizerMatch(True, "the same tokenizer files")
    return TokenizerMatch(False, f"{theirs.describe()} there, {ours.describe()} here")
