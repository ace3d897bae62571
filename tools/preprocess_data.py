#!/usr/bin/env python
"""Tokenize loose JSON (.jsonl, .jsonl.gz) or Parquet into Megatron mmap `.bin`/`.idx` pairs.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/corpus \\
        --json-keys content --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \\
        --merge-file merges.txt --append-eod --workers 2
    python tools/preprocess_data.py --input shard-00000.parquet --json-keys text ...

One output pair per JSON key (for Parquet: per column): `{prefix}_{key}_document.bin/.idx`
(`_sentence` with --split-sentences, where each sentence is one sequence of the document). The
output is the same byte for byte whatever --workers is, and the same as Megatron-LM's
tools/preprocess_data.py and preprocess_data_fast.py write for documents that have text and no
literal `<|endoftext|>` (docs/data.md says how the three differ on those). Output files are
written under temporary names and renamed into place only when complete. Bad lines (rows) stop
the run with the file, line (row) number and key, or are counted and skipped with
--skip-bad-lines; documents with no tokens are skipped and counted. Progress (rate, ETA) goes to
stderr; temporary files a killed run left for the same output prefix are removed at start.

Speed: with gigatoken installed (requirements.txt), this process tokenizes blocks of the input
with its Rust BPE on --workers threads (the same ids as `tokenizers`); with --split-sentences
(Punkt is Python) or without gigatoken, --workers processes each tokenize chunks of
--chunk-size lines. No network access: Punkt sentence splitting is trained on the input.
"""
from __future__ import annotations

import collections
import gzip
import json
import multiprocessing
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Deque, Dict, Iterator, List, Optional, Tuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers N means N cores


import numpy as np

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config
from app.config.data import tokenizer_flags_not_read
from app.config.inference import MERGES, TOKENIZER_MODEL, VOCAB
from app.config.options import PathOption, option
from app.data.indexed_dataset import (MMapIndexedDatasetBuilder, best_fitting_dtype,
                                      data_file_path, index_file_path)
from app.data.sentences import (SentenceSplitter, load_punkt_params,
                                save_punkt_params, train_punkt)
from app.data.tokenizer import SUPPORTED_TOKENIZERS, build_tokenizer
from app.utils.fileio import remove_temporaries
from app.utils.progress import progress

Record = Tuple[int, Any]
"""(1-based line or row number, raw JSON line bytes or a Parquet row's {column: value})."""
BLOCK_BYTES = 8 << 20
"""Input read per block when this process tokenizes on gigatoken's threads."""
BLOCK_ROWS = 8192
"""Parquet rows per block on that path."""


@dataclass(kw_only=True)
class PreprocessOptions:
    """Megatron's preprocess_data.py flags, plus --skip-bad-lines and the Punkt options."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("input", "the corpus and what to take from it")

    input: str = option("--input", required=True,
                        path=PathOption("file", "the corpus file (.jsonl, .jsonl.gz or .parquet)"),
                        help="loose JSON (.json/.jsonl, or .jsonl.gz) or a Parquet file (.parquet)")
    json_keys: List[str] = option(
        "--json-keys", nargs="+", default_factory=lambda: ["text"],
        help="keys (Parquet: columns) to extract; one output pair per key")
    split_sentences: bool = option("--split-sentences", default=False,
                                   help="one sequence per sentence (Punkt)")
    keep_newlines: bool = option(
        "--keep-newlines", default=False,
        help="with --split-sentences, keep the whitespace/newlines between sentences")
    punkt_model: Optional[str] = option(
        "--punkt-model", default=None,
        path=PathOption("dir", "a directory that --save-punkt-model wrote (or nltk's punkt_tab)"),
        help="directory of Punkt parameters (nltk punkt_tab format); default: train Punkt on "
             "the first --punkt-train-bytes of the input")
    punkt_train_bytes: int = option("--punkt-train-bytes", default=4 << 20)
    save_punkt_model: Optional[str] = option(
        "--save-punkt-model", default=None,
        help="directory to save the Punkt parameters trained on the input")
    skip_bad_lines: bool = option("--skip-bad-lines", default=False,
                                  help="count and skip malformed lines (rows) instead of stopping")
    tokenizer_type: str = option("--tokenizer-type", default="GPT2BPETokenizer",
                                 choices=SUPPORTED_TOKENIZERS, group="tokenizer")
    vocab_file: Optional[str] = option("--vocab-file", "--vocab", default=None, group="tokenizer",
                                       path=VOCAB)
    merge_file: Optional[str] = option("--merge-file", default=None, group="tokenizer",
                                       path=MERGES)
    tokenizer_model: Optional[str] = option(
        "--tokenizer-model", default=None, group="tokenizer", path=TOKENIZER_MODEL,
        help="HuggingFaceTokenizer: a directory with tokenizer.json or a Hub name in the local "
             "cache (offline); (GPT)SentencePieceTokenizer: a .model")
    append_eod: bool = option("--append-eod", default=False, group="tokenizer",
                              help="append <|endoftext|> to each document")
    output_prefix: str = option("--output-prefix", required=True, group="output")
    dataset_impl: str = option("--dataset-impl", default="mmap", group="output",
                               help="only 'mmap' is supported")
    workers: int = option("--workers", default=1, group="runtime",
                          help="cores: gigatoken threads in this process, else worker processes")
    chunk_size: int = option("--chunk-size", default=64, group="runtime",
                             help="lines per task sent to a worker process")
    log_interval: int = option("--log-interval", default=10000, group="runtime",
                               help="documents between progress lines")

    def __post_init__(self) -> None:
        if self.dataset_impl != "mmap":
            raise ValueError(f"--dataset-impl {self.dataset_impl!r} is not supported: only 'mmap' "
                             "(Megatron's memory-mapped .bin/.idx) is written; drop the flag or "
                             "pass --dataset-impl mmap")
        for name in ("workers", "chunk_size", "log_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.keep_newlines and not self.split_sentences:
            raise ValueError("--keep-newlines only applies with --split-sentences")


def get_args(argv: Optional[List[str]] = None) -> PreprocessOptions:
    """PreprocessOptions from the command line (exit status 2 on a bad one)."""
    return parse_config(PreprocessOptions, argv, __doc__.splitlines()[0])


# ----------------------------------------------------------------------------- input


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


def open_input(path: str):
    """(line iterator over raw bytes, raw file object for progress) of a .jsonl or .jsonl.gz."""
    raw = open(path, "rb")
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
    return stream, raw


def read_chunks(stream, chunk_size: int) -> Iterator[List[Record]]:
    """Lists of up to chunk_size (line number, line) pairs, in file order."""
    chunk: List[Record] = []
    for lineno, line in enumerate(stream, start=1):
        chunk.append((lineno, line))
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def read_blocks(stream, block_bytes: int) -> Iterator[List[Record]]:
    """Lists of whole lines of about `block_bytes` (at least one line), in file order."""
    lineno = 0
    while True:
        lines = stream.readlines(block_bytes)
        if not lines:
            return
        yield list(enumerate(lines, start=lineno + 1))
        lineno += len(lines)


def parquet_chunks(path: str, keys: List[str], rows: int) -> Iterator[List[Record]]:
    """Lists of up to `rows` (row number, {column: value}) of the Parquet file's `keys`
    columns; SystemExit naming the file when it is not Parquet or lacks a string column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        table = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise SystemExit(f"{path} is not a readable Parquet file ({exc})") from None
    schema = table.schema_arrow
    for key in keys:
        if key not in schema.names:
            raise SystemExit(f"{path} has no column {key!r} (columns: {schema.names[:20]}); "
                             "choose the columns with --json-keys")
        kind = schema.field(key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SystemExit(f"{path}: column {key!r} holds {kind}, not strings; choose a text "
                             "column with --json-keys")
    first = 1
    for batch in table.iter_batches(batch_size=rows, columns=keys):
        columns = [batch.column(key).to_pylist() for key in keys]
        yield [(first + i, dict(zip(keys, values))) for i, values in enumerate(zip(*columns))]
        first += batch.num_rows


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


def build_punkt_params(args: PreprocessOptions):
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
class ChunkResult:
    """What a worker returns for one chunk (numpy arrays per key, errors, counters)."""

    outputs: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray, int]]
    errors: List[Tuple[int, str]]
    documents: int
    blank_lines: int
    input_bytes: int
    tokens: int


def assemble(tokens: np.ndarray, seq_lengths: np.ndarray, seq_docs: np.ndarray, documents: int,
             eod: Optional[int], dtype: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(tokens, sequence lengths int32, sequences per document int64, empty documents) for
    MMapIndexedDatasetBuilder.add_documents, from the tokens of every sequence back to back
    (`seq_lengths[s]` of them for sequence s of document `seq_docs[s]`, documents numbered
    0..documents-1 in order): sequences without tokens are dropped, a document left with none
    is skipped and counted, and `eod` (if not None) ends each kept document's last sequence."""
    keep = seq_lengths > 0
    lengths, docs = seq_lengths[keep], seq_docs[keep]
    per_document = np.bincount(docs, minlength=documents)
    empty = int(np.count_nonzero(per_document == 0))
    per_document = per_document[per_document > 0].astype(np.int64)
    if eod is None or lengths.size == 0:
        return tokens.astype(dtype), lengths.astype(np.int32), per_document, empty
    last = np.cumsum(per_document) - 1  # each document's last sequence, among those kept
    lengths = lengths.copy()
    lengths[last] += 1
    eod_at = np.cumsum(lengths)[last] - 1  # [kept documents]
    out = np.empty(int(lengths.sum()), dtype=dtype)
    text = np.ones(out.size, dtype=bool)
    text[eod_at] = False
    out[text] = tokens
    out[eod_at] = eod
    return out, lengths.astype(np.int32), per_document, empty


class Encoder:
    """Turns raw JSON lines (or Parquet rows) into token sequences; built once per process.
    `parallel`: tokenize on gigatoken's thread pool (this process tokenizes the whole input)."""

    def __init__(self, args: PreprocessOptions, punkt_params=None,
                 parallel: Optional[bool] = None, tokenizer: Any = None) -> None:
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.parallel = parallel
        self.tokenizer = tokenizer or build_tokenizer(args.tokenizer_type, args.vocab_file,
                                                      args.merge_file,
                                                      tokenizer_model=args.tokenizer_model)
        self.dtype = best_fitting_dtype(self.tokenizer.vocab_size)
        self.splitter = (SentenceSplitter(punkt_params, args.keep_newlines)
                         if args.split_sentences else None)

    def parse(self, record: Any) -> Tuple[Optional[List[str]], Optional[str]]:
        """(text of each key, None) or (None, error message) for one JSON line or Parquet row."""
        if isinstance(record, dict):
            obj = record
        else:
            try:
                obj = json.loads(record)
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

    def encode_chunk(self, chunk: List[Record]) -> ChunkResult:
        """Tokenize every good record of the chunk; bad ones become (number, message)."""
        errors, docs, blank, nbytes = [], [], 0, 0
        for number, record in chunk:
            if not isinstance(record, dict):
                nbytes += len(record)
                if not record.strip():
                    blank += 1
                    continue
            texts, err = self.parse(record)
            if err is not None:
                errors.append((number, err))
            else:
                docs.append(texts)
                if isinstance(record, dict):
                    nbytes += sum(len(t) for t in texts)
        outputs, total_tokens = {}, 0
        for k, key in enumerate(self.keys):
            outputs[key] = self._encode_key([d[k] for d in docs])
            total_tokens += outputs[key][0].size
        return ChunkResult(outputs, errors, len(docs), blank, nbytes, total_tokens)

    def _encode_key(self, texts: List[str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        if self.splitter is None:
            sequences, seq_docs = texts, np.arange(len(texts))
        else:
            pieces = [self.splitter.split(t) for t in texts]
            sequences = [s for p in pieces for s in p]
            seq_docs = np.repeat(np.arange(len(texts)), [len(p) for p in pieces])
        tokens, lengths = self.tokenizer.encode_flat(sequences, parallel=self.parallel)
        return assemble(tokens, lengths, seq_docs, len(texts),
                        self.tokenizer.eod if self.append_eod else None, self.dtype)


_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(args: PreprocessOptions, punkt_params) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(args, punkt_params)


def _encode_in_worker(chunk: List[Record]) -> ChunkResult:
    return _WORKER_ENCODER.encode_chunk(chunk)


# ----------------------------------------------------------------------------- driver


class Progress:
    """Progress on stderr through app.utils.progress: input bytes read with rate and ETA, plus
    docs/s, MB/s and tokens/s; a line at least every `interval` documents."""

    def __init__(self, interval: int, total_bytes: Optional[int], raw: Any = None) -> None:
        self.interval, self.raw = interval, raw
        self.start = time.perf_counter()
        self.docs = self.bytes = self.tokens = 0
        self.next_report = interval
        self.bar = progress(total=total_bytes or None, desc="tokenizing", unit="B")

    def update(self, result: ChunkResult) -> None:
        self.docs += result.documents
        self.bytes += result.input_bytes
        self.tokens += result.tokens
        position = (self.raw.tell() if self.raw is not None and not self.raw.closed
                    else self.bar.n + result.input_bytes)
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


def output_prefix_for(args: PreprocessOptions, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


def in_process(args: PreprocessOptions, tokenizer: Any) -> bool:
    """Whether this process tokenizes everything, on gigatoken's --workers threads (else
    --workers processes do, or this one alone with --workers 1)."""
    return tokenizer.fast_backend == "gigatoken" and not args.split_sentences


def _results(args: PreprocessOptions, chunks: Iterator[List[Record]], punkt_params,
             tokenizer: Any):
    """ChunkResults in input order: from this process (on gigatoken's threads, or alone with
    --workers 1) or from a pool of --workers processes.

    At most 4 chunks per worker are in flight, so memory stays bounded on inputs of any size
    (Pool.imap would read the whole input ahead)."""
    if args.workers == 1 or in_process(args, tokenizer):
        encoder = Encoder(args, punkt_params, parallel=args.workers > 1, tokenizer=tokenizer)
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


def _chunks(args: PreprocessOptions, stream, tokenizer: Any) -> Iterator[List[Record]]:
    """The input in pieces: blocks of about BLOCK_BYTES (BLOCK_ROWS rows) when this process
    tokenizes them on threads, else --chunk-size lines (rows) per worker task."""
    whole = in_process(args, tokenizer)
    if is_parquet(args.input):
        return parquet_chunks(args.input, args.json_keys, BLOCK_ROWS if whole else args.chunk_size)
    return read_blocks(stream, BLOCK_BYTES) if whole else read_chunks(stream, args.chunk_size)


def _read_input(args: PreprocessOptions, stream, punkt_params, counts: Dict[str, int],
                tokenizer: Any):
    """_results over the input's chunks; a truncated or corrupt .gz stops with the file named."""
    try:
        yield from _results(args, _chunks(args, stream, tokenizer), punkt_params, tokenizer)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        lines = counts["documents"] + counts["bad_lines"] + counts["blank_lines"]
        raise SystemExit(f"{args.input} is truncated or corrupt after about {lines} lines "
                         f"({type(exc).__name__}: {exc}); re-create or re-copy the file "
                         "(nothing was written)") from None


def _check_not_empty(args: PreprocessOptions, counts: Dict[str, int]) -> None:
    """Stop (nothing written) when the input gave no document, or a key none with text."""
    if counts["documents"] == 0:
        raise SystemExit(f"{args.input} holds no documents ({counts['blank_lines']} blank and "
                         f"{counts['bad_lines']} skipped lines); nothing was written: check "
                         "--input")
    for key in args.json_keys:
        if counts[f"empty_{key}"] == counts["documents"]:
            raise SystemExit(f"{args.input}: the {counts['documents']} documents have no text "
                             f"under key {key!r}; nothing was written: check --json-keys")


def run(args: PreprocessOptions) -> Dict[str, int]:
    """Preprocess per `args`; returns the counters printed at the end. Raises SystemExit on bad input."""
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                                    tokenizer_model=args.tokenizer_model)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    for note in tokenizer_flags_not_read(args.tokenizer_type, args.vocab_file, args.merge_file,
                                         args.tokenizer_model, None):
        print(f"warning: {note}", file=sys.stderr)
    punkt_params = build_punkt_params(args) if args.split_sentences else None
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    for stale in remove_temporaries(out_dir, prefix=os.path.basename(args.output_prefix)):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    builders = {k: MMapIndexedDatasetBuilder(data_file_path(output_prefix_for(args, k)), dtype)
                for k in args.json_keys}
    threads = os.environ.get("RAYON_NUM_THREADS")
    if in_process(args, tokenizer):  # the size of gigatoken's pool, made on its first use
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    parquet = is_parquet(args.input)
    stream, raw = (None, None) if parquet else open_input(args.input)
    meter = Progress(args.log_interval, None if parquet else os.path.getsize(args.input), raw)
    unit = "row" if parquet else "line"
    counts = {"documents": 0, "bad_lines": 0, "blank_lines": 0,
              **{f"empty_{k}": 0 for k in args.json_keys}}
    try:
        for result in _read_input(args, stream, punkt_params, counts, tokenizer):
            if result.errors and not args.skip_bad_lines:
                number, message = result.errors[0]
                raise SystemExit(f"{args.input}: {unit} {number}: {message}. Fix the {unit} or "
                                 f"pass --skip-bad-lines to count and skip such {unit}s")
            for number, message in result.errors[:max(0, 10 - counts["bad_lines"])]:
                print(f"skipped {args.input}: {unit} {number}: {message}", file=sys.stderr)
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
        if stream is not None:
            stream.close()
            raw.close()
        if threads is None:  # as it was (the tool may run inside another program)
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = threads
    meter.close()
    print("done: " + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr)
    return counts


def main(argv: Optional[List[str]] = None) -> Dict[str, int]:
    return run(get_args(argv))


if __name__ == "__main__":
    main()
