#!/usr/bin/env python
"""Train a GPT-2-format byte-level BPE (vocab.json + merges.txt) from loose JSON or text files.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys content \\
        --vocab-size 8192 --output-dir tokenizer/

Inputs ending in .jsonl / .json (optionally .gz) are read as one JSON object per line and the
values of --json-keys are used; any other file is read as plain UTF-8 text. No network access.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Iterator, List, Optional


# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.data.tokenizer import build_tokenizer, train_gpt2_bpe


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


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl[.gz] or text files")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=int, default=50257,
                   help="upper bound on entries, including 256 bytes and <|endoftext|>")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--output-dir", required=True, help="writes vocab.json and merges.txt here")
    args = p.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input {path!r} does not exist")
    vocab, merges = train_gpt2_bpe(iter_texts(args.input, args.json_keys), args.vocab_size,
                                   args.output_dir, args.min_frequency)
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    print(f"wrote {vocab} and {merges}: vocab size {tok.vocab_size}, eod id {tok.eod}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
