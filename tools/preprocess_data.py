#!/usr/bin/env python
"""Tokenize loose JSON (one object per line) into Megatron mmap `.bin`/`.idx` pairs.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/corpus \\
        --json-keys content --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \\
        --merge-file merges.txt --append-eod --workers 2

One output pair per JSON key: `{prefix}_{key}_document.bin/.idx` (`_sentence` with
--split-sentences, where each sentence is one sequence of the document). The output is the same
byte for byte whatever --workers is. Output files are written under temporary names and renamed
into place only when complete. Bad lines stop the run with the file, line number and key (or are
counted and skipped with --skip-bad-lines); documents with no tokens are skipped and counted.
Progress (rate, ETA) goes to stderr; temporary files a killed run left for the same output
prefix are removed at start. No network access: Punkt sentence splitting is trained on the input.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import multiprocessing
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, List, Optional, Tuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers N means N cores


import numpy as np

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.data.indexed_dataset import (MMapIndexedDatasetBuilder, best_fitting_dtype,
                                      data_file_path, index_file_path)
from app.data.sentences import (SentenceSplitter, load_punkt_params,
                                save_punkt_params, train_punkt)
from app.data.tokenizer import SUPPORTED_TOKENIZERS, build_tokenizer
from app.utils.fileio import remove_temporaries
from app.utils.progress import progress

Line = Tuple[int, bytes]  # (1-based line number, raw line)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Megatron's preprocess_data.py flags, plus --skip-bad-lines and the Punkt options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="loose JSON file: .json/.jsonl or .jsonl.gz")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; one output pair per key")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (Punkt)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences, keep the whitespace/newlines between sentences")
    g.add_argument("--punkt-model", default=None,
                   help="directory of Punkt parameters (nltk punkt_tab format); default: train "
                        "Punkt on the first --punkt-train-bytes of the input")
    g.add_argument("--punkt-train-bytes", type=int, default=4 << 20)
    g.add_argument("--save-punkt-model", default=None,
                   help="directory to save the Punkt parameters trained on the input")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="count and skip malformed lines instead of stopping")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=SUPPORTED_TOKENIZERS)
    g.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--append-eod", action="store_true", help="append <|endoftext|> to each document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", help="only 'mmap' is supported")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes")
    g.add_argument("--chunk-size", type=int, default=64, help="lines per task sent to a worker")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = p.parse_args(argv)
    if args.dataset_impl != "mmap":
        p.error(f"--dataset-impl {args.dataset_impl!r} is not supported: only 'mmap' (Megatron's "
                f"memory-mapped .bin/.idx) is written; drop the flag or pass --dataset-impl mmap")
    for name in ("workers", "chunk_size", "log_interval"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.keep_newlines and not args.split_sentences:
        p.error("--keep-newlines only applies with --split-sentences")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input!r} does not exist")
    return args


# ----------------------------------------------------------------------------- input


def open_input(path: str):
    """(line iterator over raw bytes, raw file object for progress) of a .jsonl or .jsonl.gz."""
    raw = open(path, "rb")
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
    return stream, raw


def read_chunks(stream, chunk_size: int) -> Iterator[List[Line]]:
    """Lists of up to chunk_size (line number, line) pairs, in file order."""
    chunk: List[Line] = []
    for lineno, line in enumerate(stream, start=1):
        chunk.append((lineno, line))
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def sample_text(path: str, key: str, max_bytes: int) -> str:
    """Concatenated values of `key` from the first documents of the input, up to max_bytes."""
    stream, raw = open_input(path)
    parts, total = [], 0
    with raw, stream:
        for line in stream:
            try:
                value = json.loads(line).get(key)
            except (ValueError, AttributeError):
                continue
            if isinstance(value, str):
                parts.append(value)
                total += len(value)
                if total >= max_bytes:
                    break
    return "\n\n".join(parts)


def build_punkt_params(args: argparse.Namespace):
    """Punkt parameters: loaded from --punkt-model, or trained on a sample of the input."""
    if args.punkt_model:
        return load_punkt_params(args.punkt_model)
    text = sample_text(args.input, args.json_keys[0], args.punkt_train_bytes)
    params = train_punkt(text)
    print(f"trained Punkt on {len(text)} characters of the input", file=sys.stderr)
    if args.save_punkt_model:
        save_punkt_params(params, args.save_punkt_model)
    return params


# ----------------------------------------------------------------------------- encoding


@dataclass
class KeyOutput:
    """Tokens of one JSON key for one chunk, ready for MMapIndexedDatasetBuilder.add_documents."""

    tokens: List[int] = field(default_factory=list)
    sequence_lengths: List[int] = field(default_factory=list)
    sequences_per_document: List[int] = field(default_factory=list)
    empty_documents: int = 0


@dataclass
class ChunkResult:
    """What a worker returns for one chunk (numpy arrays per key, errors, counters)."""

    outputs: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray, int]]
    errors: List[Tuple[int, str]]
    documents: int
    blank_lines: int
    input_bytes: int
    tokens: int


class Encoder:
    """Turns raw JSON lines into token sequences; built once per worker process."""

    def __init__(self, args: argparse.Namespace, punkt_params=None) -> None:
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        self.dtype = best_fitting_dtype(self.tokenizer.vocab_size)
        self.splitter = (SentenceSplitter(punkt_params, args.keep_newlines)
                         if args.split_sentences else None)

    def split(self, text: str) -> List[str]:
        """The document's sequences: one, or its sentences with --split-sentences."""
        return [text] if self.splitter is None else self.splitter.split(text)

    def parse(self, line: bytes) -> Tuple[Optional[List[str]], Optional[str]]:
        """(text of each key, None) or (None, error message) for one line."""
        try:
            obj = json.loads(line)
        except ValueError as err:
            return None, f"malformed JSON ({err})"
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {type(obj).__name__}"
        texts = []
        for key in self.keys:
            if key not in obj:
                return None, (f"missing key {key!r} (the line has keys {sorted(obj)[:10]}); "
                              f"choose the keys with --json-keys")
            if not isinstance(obj[key], str):
                return None, f"key {key!r} holds {type(obj[key]).__name__}, expected a string"
            texts.append(obj[key])
        return texts, None

    def encode_chunk(self, chunk: List[Line]) -> ChunkResult:
        """Tokenize every good line of the chunk; bad lines become (line number, message)."""
        errors, docs, blank, nbytes = [], [], 0, 0
        for lineno, line in chunk:
            nbytes += len(line)
            if not line.strip():
                blank += 1
                continue
            texts, err = self.parse(line)
            if err is not None:
                errors.append((lineno, err))
            else:
                docs.append(texts)
        outputs, total_tokens = {}, 0
        for k, key in enumerate(self.keys):
            out = self._encode_key([d[k] for d in docs])
            total_tokens += len(out.tokens)
            outputs[key] = (np.asarray(out.tokens, dtype=self.dtype),
                            np.asarray(out.sequence_lengths, dtype=np.int32),
                            np.asarray(out.sequences_per_document, dtype=np.int64),
                            out.empty_documents)
        return ChunkResult(outputs, errors, len(docs), blank, nbytes, total_tokens)

    def _encode_key(self, texts: List[str]) -> KeyOutput:
        pieces = [self.split(t) for t in texts]
        flat = [s for p in pieces for s in p]
        ids = self.tokenizer.tokenize_batch(flat) if flat else []
        out, pos = KeyOutput(), 0
        for p in pieces:
            seqs = [s for s in ids[pos:pos + len(p)] if s]
            pos += len(p)
            if not seqs:
                out.empty_documents += 1
                continue
            if self.append_eod:
                seqs[-1] = seqs[-1] + [self.tokenizer.eod]
            for s in seqs:
                out.tokens.extend(s)
                out.sequence_lengths.append(len(s))
            out.sequences_per_document.append(len(seqs))
        return out


_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(args: argparse.Namespace, punkt_params) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(args, punkt_params)


def _encode_in_worker(chunk: List[Line]) -> ChunkResult:
    return _WORKER_ENCODER.encode_chunk(chunk)


# ----------------------------------------------------------------------------- driver


class Progress:
    """Progress on stderr through app.utils.progress: input bytes read with rate and ETA, plus
    docs/s, MB/s and tokens/s; a line at least every `interval` documents."""

    def __init__(self, interval: int, total_bytes: Optional[int], raw) -> None:
        self.interval, self.raw = interval, raw
        self.start = time.perf_counter()
        self.docs = self.bytes = self.tokens = 0
        self.next_report = interval
        self.bar = progress(total=total_bytes or None, desc="tokenizing", unit="B")

    def update(self, result: ChunkResult) -> None:
        self.docs += result.documents
        self.bytes += result.input_bytes
        self.tokens += result.tokens
        position = self.raw.tell() if not self.raw.closed else self.bar.n
        self.bar.set_postfix_str(self.rates(), refresh=False)
        self.bar.update(max(0, position - self.bar.n))
        if self.docs >= self.next_report:
            self.next_report = (self.docs // self.interval + 1) * self.interval
            self.bar.refresh()

    def rates(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (f"{self.docs} documents, {self.docs / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s, {self.tokens / elapsed:.0f} tokens/s")

    def close(self) -> None:
        self.bar.set_postfix_str(self.rates(), refresh=False)
        self.bar.close()


def output_prefix_for(args: argparse.Namespace, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


def _results(args: argparse.Namespace, chunks: Iterator[List[Line]], punkt_params):
    """ChunkResults in input order, from this process (--workers 1) or a pool.

    At most 4 chunks per worker are in flight, so memory stays bounded on inputs of any size
    (Pool.imap would read the whole input ahead)."""
    if args.workers == 1:
        encoder = Encoder(args, punkt_params)
        for chunk in chunks:
            yield encoder.encode_chunk(chunk)
        return
    pending: Deque = collections.deque()
    with multiprocessing.Pool(args.workers, initializer=_init_worker,
                              initargs=(args, punkt_params)) as pool:
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 4 * args.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _read_input(args: argparse.Namespace, stream, punkt_params, counts: Dict[str, int]):
    """_results over the input's chunks; a truncated or corrupt .gz stops with the file named."""
    try:
        yield from _results(args, read_chunks(stream, args.chunk_size), punkt_params)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        lines = counts["documents"] + counts["bad_lines"] + counts["blank_lines"]
        raise SystemExit(f"{args.input} is truncated or corrupt after about {lines} lines "
                         f"({type(exc).__name__}: {exc}); re-create or re-copy the file "
                         "(nothing was written)") from None


def _check_not_empty(args: argparse.Namespace, counts: Dict[str, int]) -> None:
    """Stop (nothing written) when the input gave no document, or a key none with text."""
    if counts["documents"] == 0:
        raise SystemExit(f"{args.input} holds no documents ({counts['blank_lines']} blank and "
                         f"{counts['bad_lines']} skipped lines); nothing was written: check "
                         "--input")
    for key in args.json_keys:
        if counts[f"empty_{key}"] == counts["documents"]:
            raise SystemExit(f"{args.input}: the {counts['documents']} documents have no text "
                             f"under key {key!r}; nothing was written: check --json-keys")


def run(args: argparse.Namespace) -> Dict[str, int]:
    """Preprocess per `args`; returns the counters printed at the end. Raises SystemExit on bad input."""
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    punkt_params = build_punkt_params(args) if args.split_sentences else None
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    for stale in remove_temporaries(out_dir, prefix=os.path.basename(args.output_prefix)):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    builders = {k: MMapIndexedDatasetBuilder(data_file_path(output_prefix_for(args, k)), dtype)
                for k in args.json_keys}
    stream, raw = open_input(args.input)
    meter = Progress(args.log_interval, os.path.getsize(args.input), raw)
    counts = {"documents": 0, "bad_lines": 0, "blank_lines": 0,
              **{f"empty_{k}": 0 for k in args.json_keys}}
    try:
        for result in _read_input(args, stream, punkt_params, counts):
            if result.errors and not args.skip_bad_lines:
                lineno, message = result.errors[0]
                raise SystemExit(f"{args.input}: line {lineno}: {message}. Fix the line or pass "
                                 f"--skip-bad-lines to count and skip such lines")
            for lineno, message in result.errors[:max(0, 10 - counts["bad_lines"])]:
                print(f"skipped {args.input}: line {lineno}: {message}", file=sys.stderr)
            counts["bad_lines"] += len(result.errors)
            counts["documents"] += result.documents
            counts["blank_lines"] += result.blank_lines
            for key, (tokens, lengths, per_doc, empty) in result.outputs.items():
                builders[key].add_documents(tokens, lengths, per_doc)
                counts[f"empty_{key}"] += empty
            meter.update(result)
        _check_not_empty(args, counts)
        for key, builder in builders.items():
            builder.finalize(index_file_path(output_prefix_for(args, key)))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        stream.close()
        raw.close()
    meter.close()
    print("done: " + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr)
    return counts


def main(argv: Optional[List[str]] = None) -> Dict[str, int]:
    return run(get_args(argv))


if __name__ == "__main__":
    main()
