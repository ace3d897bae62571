#!/usr/bin/env python
"""Train a GPT-2-format byte-level BPE (vocab.json + merges.txt) from loose JSON or text files,
or with --tokenizer-type HuggingFaceTokenizer a Llama-3-style Hugging Face tokenizer
(tokenizer.json: the same byte-level BPE, <|begin_of_text|> before every text,
<|end_of_text|> its end of document; app.data.tokenizer.train_hf_bpe).

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys content \\
        --vocab-size 8192 --output-dir tokenizer/
    python tools/train_tokenizer.py --input corpus.jsonl --json-keys content \\
        --vocab-size 8192 --output-dir llama_tokenizer/ --tokenizer-type HuggingFaceTokenizer

Inputs ending in .jsonl / .json (optionally .gz) are read as one JSON object per line and the
values of --json-keys are used; any other file is read as plain UTF-8 text. No network access.
"""
from __future__ import annotations

import gzip
import json
import os
import sys
from dataclasses import dataclass
from typing import ClassVar, Iterator, List, Optional, Tuple


# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config
from app.config.options import PathOption, option
from app.data.tokenizer import build_tokenizer, train_gpt2_bpe, train_hf_bpe


def iter_texts(paths: List[str], json_keys: List[str]) -> Iterator[str]:
    """Texts of every input: the --json-keys values of JSON lines, or whole text files."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        base = path[:-3] if path.endswith(".gz") else path
        if base.endswith((".jsonl", ".json")):
            with opener(path, "rt", encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as err:
                        raise SystemExit(f"{path}: line {lineno}: malformed JSON ({err})") from None
                    for key in json_keys:
                        if isinstance(obj, dict) and isinstance(obj.get(key), str):
                            yield obj[key]
        else:
            with opener(path, "rt", encoding="utf-8") as f:
                yield f.read()


@dataclass(kw_only=True)
class TrainTokenizerOptions:
    """tools/train_tokenizer.py's command line: the corpus, the vocabulary size, the output."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("tokenizer training",
                                             "what to train on and where to write")

    input: List[str] = option("--input", nargs="+", required=True,
                              path=PathOption("file", "text or JSONL files of the corpus"),
                              help=".jsonl[.gz] or text files")
    json_keys: List[str] = option("--json-keys", nargs="+", default_factory=lambda: ["text"],
                                  help="keys of .jsonl/.json inputs whose text trains the BPE")
    vocab_size: int = option("--vocab-size", default=50257,
                             help="upper bound on entries, including 256 bytes and <|endoftext|>")
    min_frequency: int = option("--min-frequency", default=2)
    output_dir: str = option("--output-dir", required=True,
                             help="writes vocab.json and merges.txt here")
    tokenizer_type: str = option(
        "--tokenizer-type", default="GPT2BPETokenizer",
        choices=("GPT2BPETokenizer", "HuggingFaceTokenizer"),
        help="what to write: GPT-2's files (--vocab-file/--merge-file), or a Hugging Face "
             "tokenizer directory (--tokenizer-model: tokenizer.json and tokenizer_config.json "
             "in --output-dir) that adds a BOS, as Llama's does")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_config(TrainTokenizerOptions, argv, __doc__.splitlines()[0])
    texts = iter_texts(args.input, args.json_keys)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        directory = train_hf_bpe(texts, args.vocab_size, args.output_dir, args.min_frequency)
        tok = build_tokenizer("HuggingFaceTokenizer", None, None, tokenizer_model=directory)
        print(f"wrote {directory}/tokenizer.json: vocab size {tok.vocab_size}, bos id {tok.bos}, "
              f"eod id {tok.eod}", file=sys.stderr)
        return
    vocab, merges = train_gpt2_bpe(texts, args.vocab_size, args.output_dir, args.min_frequency)
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    print(f"wrote {vocab} and {merges}: vocab size {tok.vocab_size}, eod id {tok.eod}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
