"""A SentencePiece `.model` (--tokenizer-type SentencePieceTokenizer or GPTSentencePieceTokenizer,
Megatron's) as the tokenizer of a Hugging Face export: tokenizer.model as it is, and a
tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads (a fast tokenizer,
tokenizer_class PreTrainedTokenizerFast) and that encodes text to the ids our tokenizer of that
type gives.

How the ids are kept equal:
- the `.model` is converted by transformers (its SentencePiece normalizer, dummy prefix and
  whitespace rules: the same ids as `SentencePieceProcessor.encode` for plain text);
- no BOS or EOS is added (neither of Megatron's two types adds one);
- GPTSentencePieceTokenizer encodes literal "<s>", "</s>", "<unk>" text as text, as SentencePiece
  does: split_special_tokens, and a Unigram model's control, unknown, byte and unused pieces
  scored out of reach (SentencePiece never emits them for text);
- SentencePieceTokenizer's <CLS> <SEP> <EOD> <MASK> (and <PAD>/<BOS>/<EOS> where the model has no
  such piece) are added after the pieces in Megatron's order, and the text is split at them and at
  the model's pad/bos/eos pieces (NeMo's rule); its eos_token is <EOD>, the end of document;
- the written tokenizer is loaded back and must encode PROBES as ours (check_same_ids), so a
  transformers version that converts otherwise is refused rather than exported.

What still differs (docs/conversion.md): with SentencePieceTokenizer, literal "<unk>" text is
the unk id in the export (pieces in ours); with a Unigram model, the text of a control piece
whose characters the model does not know gives that piece in the export (unk ids in ours);
decoding an unknown id gives "<unk>" where SentencePiece gives " ⁇ ".
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Dict, List, Optional

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
OUT_OF_REACH = -1e9
"""The Unigram score given to pieces SentencePiece never emits for text."""
PROBES = ("Hello  world,\n\ttabs ", " ＨÉllo ☃ 日本 ﬁ", "a<EOD>b <CLS>c  d<MASK>")
"""Text the written tokenizer must encode as ours (whitespace, NFKC, unicode, special tokens)."""


def _piece(sp, index: int, fallback: Optional[str]) -> Optional[str]:
    """The piece of id `index`, or `fallback` where the model has none (id -1)."""
    return sp.id_to_piece(index) if 0 <= index < len(sp) else fallback


def _backend(model_file: str, sp):
    """transformers' conversion of the `.model` to a `tokenizers.Tokenizer`, without added
    tokens, and with a Unigram model's non-text pieces scored out of reach."""
    import tokenizers
    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(model_file, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"unk_token": _piece(sp, sp.unk_id(), None)}, f)
        try:
            converted = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
            state = json.loads(converted.backend_tokenizer.to_str())
        except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"--tokenizer-model {model_file}: transformers "
                             f"{transformers.__version__} cannot convert this SentencePiece "
                             f"model to a tokenizer.json ({str(exc).strip()[:200]}); use "
                             "transformers 5 (with protobuf), or pass --tokenizer-model DIR, a "
                             "Hugging Face tokenizer of it") from None
    state["added_tokens"] = []
    if state["model"]["type"] == "Unigram":
        for i, entry in enumerate(state["model"]["vocab"][:len(sp)]):
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i):
                entry[1] = OUT_OF_REACH
    return tokenizers.Tokenizer.from_str(json.dumps(state))


def write_sentencepiece_tokenizer(out_dir: str, model_file: str, tokenizer_type: str,
                                  model_max_length: int) -> Dict[str, str]:
    """tokenizer.model, tokenizer.json and tokenizer_config.json of `model_file` read as
    `tokenizer_type` (SENTENCEPIECE_TYPES) in `out_dir`; returns the files written."""
    import sentencepiece
    import transformers
    from tokenizers import AddedToken
    from app.data.tokenizer import build_tokenizer
    ours = build_tokenizer(tokenizer_type, None, None, tokenizer_model=model_file)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    backend = _backend(model_file, sp)
    special = {name: _piece(sp, get(), None) for name, get in (
        ("bos_token", sp.bos_id), ("eos_token", sp.eos_id), ("unk_token", sp.unk_id),
        ("pad_token", sp.pad_id))}
    extra: List[str] = []
    full = tokenizer_type == "SentencePieceTokenizer"
    if full:  # Megatron's tokens after the pieces, at our ids; eos = <EOD>, the end of document
        added = ours.special_tokens
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in added])
        token = {i: t for t, i in added.items()}
        special.update(pad_token=token[ours.pad], bos_token=token[ours.bos],
                       eos_token=token[ours.eod])
        extra = [t for t in added if t not in special.values()]
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, split_special_tokens=not full, model_max_length=model_max_length,
        clean_up_tokenization_spaces=False, add_bos_token=False, add_eos_token=False,
        additional_special_tokens=extra, **{k: v for k, v in special.items() if v is not None})
    written = {os.path.basename(n): n for n in tokenizer.save_pretrained(out_dir)
               if os.path.isfile(n)}
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 knows this name too
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    written["tokenizer.model"] = os.path.join(out_dir, "tokenizer.model")
    check_same_ids(out_dir, model_file, tokenizer_type, ours)
    return written


def check_same_ids(out_dir: str, model_file: str, tokenizer_type: str, ours) -> None:
    """ValueError unless the tokenizer in `out_dir` encodes PROBES as `ours` (our
    `tokenizer_type` of `model_file`): a transformers whose conversion differs is refused."""
    import transformers
    exported = transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    for text in PROBES:
        got, want = list(exported(text).input_ids), ours.tokenize(text)
        if got != want:
            raise ValueError(f"--tokenizer-model {model_file}: the tokenizer.json that "
                             f"transformers {transformers.__version__} makes of it encodes "
                             f"{text!r} as {got}, our {tokenizer_type} as {want}; use "
                             "transformers 5, or pass --tokenizer-model DIR, a Hugging Face "
                             "tokenizer of it")
