"""GPT pretraining datasets over Megatron .bin/.idx data: split, cached sample indices, blending.

`build_train_valid_test_datasets` is the entry point used by the trainer. For every data prefix
it divides the documents into train/valid/test by `--split`, and for every split builds (once)
the doc/sample/shuffle indices of `app.data.index_builder`, saves them as `.npy` files beside the
data or in `cache_path`, under a name that hashes every input they depend on, and memory-maps
them in every later run. In a distributed run the caller passes `is_builder=True` on one rank
and a `barrier` callable; the others wait at the barrier and then load. This module never
imports torch.distributed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from app.utils.fileio import atomic_write

from app.config import split_weights
from app.data.blendable_dataset import BlendableDataset
from app.data.index_builder import INDEX_VERSION, build_indices, split_document_ranges
from app.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[float], List[str]]:
    """`[prefix]` -> ([1.0], [prefix]); `[w1, p1, w2, p2, ...]` -> (normalised weights, prefixes)."""
    data_path = list(data_path)
    if not data_path:
        raise ValueError("--data-path is empty; give a prefix of a .bin/.idx pair "
                         "(made by tools/preprocess_data.py) or a list 'w1 prefix1 w2 prefix2 "
                         "...', or train on synthetic tokens with --mock-data")
    if len(data_path) == 1:
        return [1.0], data_path
    if len(data_path) % 2:
        raise ValueError(f"--data-path {' '.join(data_path)!r}: a blend needs weight/prefix pairs "
                         f"'w1 prefix1 w2 prefix2 ...' (got an odd number of items)")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError as err:
        raise ValueError(f"--data-path {' '.join(data_path)!r}: weights must be numbers "
                         f"('w1 prefix1 w2 prefix2 ...'): {err}") from None
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights {weights} must be non-negative with a positive sum")
    total = sum(weights)
    return [w / total for w in weights], data_path[1::2]


def samples_per_prefix(data_path: Sequence[str], num_samples: Sequence[int]
                       ) -> List[Tuple[float, str, List[int]]]:
    """(weight, prefix, samples per split) of each dataset of --data-path: all of num_samples
    for a single prefix; for a blend, its share plus 0.5% (so rounding never runs one short)."""
    weights, prefixes = parse_data_path(data_path)
    if len(prefixes) == 1:
        return [(1.0, prefixes[0], list(num_samples))]
    return [(w, p, [int(math.ceil(w * n * 1.005)) for n in num_samples])
            for w, p in zip(weights, prefixes)]


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=10)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def first_token_outside(indexed: MMapIndexedDataset, vocab_size: int,
                        chunk_tokens: int = 1 << 24) -> Optional[Tuple[int, int, int]]:
    """(document, token position in the .bin, token id) of the first id outside
    [0, vocab_size), or None; scans in chunks and stops at the first hit."""
    tokens = indexed.tokens
    for start in range(0, tokens.size, chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        bad = chunk >= vocab_size
        if np.issubdtype(chunk.dtype, np.signedinteger):
            bad |= chunk < 0
        if bad.any():
            position = start + int(np.argmax(bad))
            starts = indexed.document_token_ranges()[:, 0]
            document = int(np.searchsorted(starts, position, side="right")) - 1
            return document, position, int(tokens[position])
    return None


def token_id_range(indexed: MMapIndexedDataset, cache_dir: str) -> Tuple[int, int]:
    """(min, max) token id of `indexed`, cached in `cache_dir` keyed on the files' sizes and
    mtimes, so later runs pay nothing. A cache that cannot be written costs only a rescan."""
    stats = [os.stat(p) for p in (data_file_path(indexed.prefix), index_file_path(indexed.prefix))]
    key = _digest(repr([(s.st_size, s.st_mtime_ns) for s in stats]).encode())
    cache_file = os.path.join(cache_dir, f"{os.path.basename(indexed.prefix)}_{key}_token_range.json")
    if os.path.isfile(cache_file):
        try:
            with open(cache_file) as f:
                lo, hi = json.load(f)
            return int(lo), int(hi)
        except (OSError, ValueError, TypeError):
            pass  # unreadable cache: scan again and replace it
    lo, hi = indexed.token_id_range()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write(cache_file, lambda f: f.write(json.dumps([lo, hi]).encode()))
    except OSError as err:
        logger.warning("could not cache the token range of %s in %s (%s); it is rescanned next "
                       "time", indexed.prefix, cache_dir, err)
    return lo, hi


def check_token_ids(indexed: MMapIndexedDataset, vocab_size: int, cache_dir: str) -> None:
    """Raise ValueError if any token id of `indexed` is < 0 or >= vocab_size, naming the file,
    the first offending document and the fix. The (min, max) scan is cached (token_id_range);
    the search for the first offending document runs only when there is one."""
    lo, hi = token_id_range(indexed, cache_dir)
    if hi < vocab_size and lo >= 0:
        return
    bin_path = data_file_path(indexed.prefix)
    first = first_token_outside(indexed, vocab_size)
    where = ""
    if first is not None:
        document, position, token = first
        where = (f"; the first is id {token} in document {document} (0-based, token {position} "
                 f"of the file)")
    raise ValueError(
        f"{bin_path} holds token ids in [{lo}, {hi}] but the tokenizer's vocabulary has "
        f"{vocab_size} entries (ids must be in [0, {vocab_size - 1}]){where}; the data was "
        f"tokenized with another vocabulary: re-run tools/preprocess_data.py with the "
        f"--vocab-file/--merge-file used for training, or train with the data's tokenizer")


class GPTDataset:
    """Samples of seq_length + 1 tokens from documents [start, end) of an indexed dataset.

    `ds[i]` -> {"text": np.int64 [seq_length + 1]}; `len(ds)` >= the num_samples requested (whole
    epochs are indexed). Indices are built by the builder rank and cached (see module doc).
    """

    def __init__(self, name: str, indexed: MMapIndexedDataset, documents: Tuple[int, int],
                 num_samples: int, seq_length: int, seed: int, cache_dir: str,
                 is_builder: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
        start, end = documents
        if not 0 <= start < end <= indexed.num_documents:
            raise ValueError(f"{name} split of {indexed.prefix}: document range [{start}, {end}) "
                             f"is empty or outside [0, {indexed.num_documents})")
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        ranges = indexed.document_token_ranges()[start:end]
        self._doc_start, self._doc_length = ranges[:, 0].copy(), ranges[:, 1].copy()
        desc = {"version": INDEX_VERSION, "dataset": os.path.basename(indexed.prefix),
                "split": name, "documents": [start, end], "num_samples": int(num_samples),
                "seq_length": int(seq_length), "seed": int(seed),
                "total_documents": indexed.num_documents,
                "tokens": int(self._doc_length.sum())}
        key = _digest(json.dumps(desc, sort_keys=True).encode(), self._doc_length.tobytes())
        stem = os.path.join(cache_dir, f"{desc['dataset']}_{name}_{key}")
        self.cache_files = {kind: f"{stem}_{kind}.npy" for kind in INDEX_KINDS}
        self.description_file = f"{stem}_description.json"
        if is_builder and not self._cache_complete():
            self._build_and_save(desc)
        barrier()
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load()

    def _build_and_save(self, desc: Dict) -> None:
        cache_dir = os.path.dirname(self.description_file) or "."
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as err:
            raise OSError(f"cannot create the sample-index cache directory {cache_dir} ({err}); "
                          f"pass a writable --data-cache-path") from None
        if not os.access(cache_dir, os.W_OK):
            raise PermissionError(f"cannot write sample-index caches to {cache_dir}; "
                                  f"pass a writable --data-cache-path")
        t0 = time.perf_counter()
        arrays = build_indices(self._doc_length, desc["num_samples"], desc["seq_length"],
                               desc["seed"])
        elapsed = time.perf_counter() - t0
        for kind, arr in zip(INDEX_KINDS, arrays):
            atomic_write(self.cache_files[kind], lambda f, a=arr: np.save(f, a, allow_pickle=False))
        desc = dict(desc, build_seconds=round(elapsed, 3), samples=int(arrays[2].size))
        atomic_write(self.description_file,  # written last: marks the set complete
                      lambda f: f.write(json.dumps(desc, indent=1, sort_keys=True).encode()))
        logger.info("built %s indices for %s: %d samples in %.2f s -> %s", self.name,
                    desc["dataset"], arrays[2].size, elapsed, self.description_file)

    def _cache_complete(self) -> bool:
        return all(os.path.isfile(p) for p in [self.description_file, *self.cache_files.values()])

    def _load(self) -> Tuple[np.ndarray, ...]:
        if not self._cache_complete():
            raise FileNotFoundError(
                f"sample-index cache {self.description_file} is missing after the builder rank "
                f"finished; all ranks must see the same --data-cache-path (a shared filesystem)")
        return tuple(np.load(self.cache_files[k], mmap_mode="r", allow_pickle=False)
                     for k in INDEX_KINDS)

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        i = int(self.shuffle_idx[idx])
        (p0, o0), (p1, o1) = self.sample_idx[i:i + 2].tolist()
        docs = self.doc_idx[p0:p1 + 1]
        starts, lengths = self._doc_start[docs].tolist(), self._doc_length[docs].tolist()
        tokens = self.indexed.tokens
        text = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        for k, (base, length) in enumerate(zip(starts, lengths)):
            lo = o0 if k == 0 else 0
            hi = o1 + 1 if k == len(starts) - 1 else length
            text[filled:filled + hi - lo] = tokens[base + lo:base + hi]
            filled += hi - lo
        assert filled == self.seq_length + 1, (filled, self.seq_length)
        return {"text": text}


def _build_split_datasets(prefix: str, weights: Tuple[float, float, float],
                          num_samples: Sequence[int], seq_length: int, seed: int,
                          cache_path: Optional[str], vocab_size: Optional[int], is_builder: bool,
                          barrier: Callable[[], None]) -> List[Optional[GPTDataset]]:
    """The three split datasets of one prefix (None where the split or its sample count is empty)."""
    indexed = MMapIndexedDataset(prefix)
    if indexed.num_documents == 0:
        raise ValueError(f"{data_file_path(prefix)} holds no documents (an empty input was "
                         "preprocessed?); re-run tools/preprocess_data.py on a non-empty input "
                         "or leave this prefix out of --data-path")
    cache_dir = cache_path or os.path.dirname(os.path.abspath(prefix))
    if vocab_size is not None:
        check_token_ids(indexed, vocab_size, cache_dir)
    ranges = split_document_ranges(indexed.num_documents, weights)
    logger.info("%s: %d documents; split %s -> %s", prefix, indexed.num_documents, weights, ranges)
    out: List[Optional[GPTDataset]] = []
    for name, (start, end), n in zip(SPLIT_NAMES, ranges, num_samples):
        if end <= start or n <= 0:
            out.append(None)
            continue
        out.append(GPTDataset(name, indexed, (start, end), n, seq_length, seed, cache_dir,
                              is_builder, barrier))
    return out


def build_train_valid_test_datasets(
        data_path: List[str], split: str, num_samples: Tuple[int, int, int], seq_length: int,
        seed: int, cache_path: Optional[str] = None, vocab_size: Optional[int] = None,
        is_builder: bool = True, barrier: Callable[[], None] = lambda: None):
    """(train, valid, test): datasets (or None) of {"text": np.int64 [seq_length + 1]} items.

    data_path: one prefix or [w1, p1, w2, p2, ...] (Megatron's --data-path). split: "969,30,1".
    num_samples: samples needed per split (train_iters x global batch, eval samples x2).
    cache_path: where index .npy files go (default: beside each prefix). vocab_size: if given,
    token ids are checked against it at start-up. is_builder/barrier: only the builder writes
    the caches; every rank calls barrier() once per dataset, then loads.
    A split is None when it has no documents or no samples are requested for it.
    """
    weights, prefixes = parse_data_path(data_path)
    fractions = split_weights(split)
    if len(prefixes) == 1:
        return tuple(_build_split_datasets(prefixes[0], fractions, num_samples, seq_length, seed,
                                           cache_path, vocab_size, is_builder, barrier))
    per_prefix = []
    for _, prefix, needed in samples_per_prefix(data_path, num_samples):
        per_prefix.append(_build_split_datasets(prefix, fractions, needed, seq_length, seed,
                                                cache_path, vocab_size, is_builder, barrier))
    result = []
    for split_i, name in enumerate(SPLIT_NAMES):
        parts = [(w, ds[split_i], p) for w, ds, p in zip(weights, per_prefix, prefixes)]
        present = [(w, ds) for w, ds, p in parts if ds is not None and w > 0]
        for w, ds, p in parts:
            if ds is None and w > 0 and num_samples[split_i] > 0:
                logger.warning("%s split of %s is empty; it is left out of the blend", name, p)
        if not present or num_samples[split_i] <= 0:
            result.append(None)
            continue
        result.append(BlendableDataset([ds for _, ds in present], [w for w, _ in present],
                                       num_samples[split_i]))
    return tuple(result)
