"""GPT pretraining datasets over Megatron .bin/.idx data: the splits' datasets, cached sample
indices, blending.

`build_datasets(plan, ...)` builds what an `app.data.plan.DataPlan` says (Megatron-LM's rules
for --data-path/--split and the per-split blends): for every dataset of every split the
doc/sample/shuffle indices of `app.data.index_builder`, and for every blend its interleaving,
each built once and cached as `.npy` files beside the data or in `cache_path`
(app.data.index_cache), then memory-mapped in every later run. In a distributed run the caller
passes `is_builder=True` on one rank and a `barrier` callable; the others wait at the barrier
and then load. This module never imports torch.distributed.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from app.utils.fileio import atomic_write

from app.config.blends import DataBlends, parse_blend
from app.data.blendable_dataset import BlendableDataset
from app.data.index_builder import MEGATRON_ORDER, SampleOrder
from app.data.index_cache import IndexCache, digest, load_or_build
from app.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path
from app.data.plan import DataPlan, SplitPlan, plan_datasets

logger = logging.getLogger(__name__)

INDEX_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")


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
    key = digest(repr([(s.st_size, s.st_mtime_ns) for s in stats]).encode())
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
    """Samples of seq_length + 1 tokens from documents [start, end) of an indexed dataset, in
    `order`: Megatron Core's (app.data.index_builder; a document is a sequence of the .idx, as
    in Megatron's GPTDataset), or this trainer's before 0.5.0 (app.data.legacy_order).

    `ds[i]` -> {"text": np.int64 [seq_length + 1]}; `len(ds)` >= the num_samples requested (whole
    epochs are indexed; num_samples None: one epoch). Indices are built by the builder rank and
    cached (app.data.index_cache); `built` says whether this instance built them or loaded them
    from `cache_dir`.
    """

    def __init__(self, name: str, indexed: MMapIndexedDataset, documents: Tuple[int, int],
                 num_samples: Optional[int], seq_length: int, seed: int, cache_dir: str,
                 is_builder: bool = True, barrier: Callable[[], None] = lambda: None,
                 order: SampleOrder = MEGATRON_ORDER) -> None:
        start, end = documents
        self._seq_start, self._seq_length = order.documents(indexed)
        count = int(self._seq_length.size)
        if not 0 <= start < end <= count:
            raise ValueError(f"{name} split of {indexed.prefix}: document range [{start}, {end}) "
                             f"is empty or outside [0, {count})")
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        split_lengths = np.asarray(self._seq_length[start:end], dtype=np.int32)
        desc = {"version": order.index_version, "dataset": os.path.basename(indexed.prefix),
                "split": name, "documents": [start, end],
                "num_samples": None if num_samples is None else int(num_samples),
                "seq_length": int(seq_length), "seed": int(seed), "total_documents": count,
                "tokens": int(split_lengths.sum(dtype=np.int64))}
        self.cache = IndexCache(cache_dir, f"{desc['dataset']}_{name}", desc, INDEX_KINDS,
                                content=split_lengths.tobytes())
        self.cache_files, self.description_file = self.cache.files, self.cache.description_file
        build = lambda: order.build_indices(self._seq_length, start, end,  # noqa: E731
                                            num_samples, seq_length, seed)
        arrays, self.built = load_or_build(
            self.cache, build, is_builder, barrier,
            f"{name} indices of {desc['dataset']} ({num_samples} samples)")
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        tokens, starts = self.indexed.tokens, self._seq_start
        return {"text": sample_tokens(
            self, idx, lambda doc, lo, hi: tokens[starts[doc] + lo:starts[doc] + hi])}


def sample_tokens(indices, idx: int, read: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
    """Sample `idx` (int64 [seq_length + 1]) of `indices`, which has Megatron's `doc_idx`,
    `sample_idx`, `shuffle_idx` (app.data.index_builder), `seq_length` and the documents'
    lengths `_seq_length`; `read(doc, lo, hi)` gives tokens [lo, hi) of document `doc`."""
    i = int(indices.shuffle_idx[idx])
    (p0, o0), (p1, o1) = indices.sample_idx[i:i + 2].tolist()
    docs = indices.doc_idx[p0:p1 + 1].tolist()
    text = np.empty(indices.seq_length + 1, dtype=np.int64)  # [seq_length + 1]
    filled = 0
    for k, doc in enumerate(docs):
        lo = o0 if k == 0 else 0
        hi = o1 + 1 if k == len(docs) - 1 else int(indices._seq_length[doc])
        text[filled:filled + hi - lo] = read(doc, lo, hi)
        filled += hi - lo
    assert filled == indices.seq_length + 1, (filled, indices.seq_length)
    return text


def _split_dataset(plan: SplitPlan, data: DataPlan, seed: int, cache_path: Optional[str],
                   is_builder: bool, barrier: Callable[[], None]):
    """One split's dataset: its single GPTDataset, or the blend of its parts."""
    parts = [GPTDataset(plan.name, data.datasets[p.prefix], p.documents, p.num_samples,
                        data.seq_length, seed, cache_dir_of(p.prefix, cache_path), is_builder,
                        barrier, plan.order) for p in plan.parts]
    if not plan.blended:
        return parts[0]
    for prefix in plan.left_out:
        logger.warning("%s split of %s is empty; it is left out of the blend", plan.name, prefix)
    return BlendableDataset(
        parts, plan.blend_inputs(), plan.size, name=plan.name,
        cache_dir=cache_dir_of(plan.parts[0].prefix, cache_path), is_builder=is_builder,
        barrier=barrier, order=plan.order)


def cache_dir_of(prefix: str, cache_path: Optional[str]) -> str:
    """Where a dataset's indices are cached: --data-cache-path, else beside the dataset."""
    return cache_path or os.path.dirname(os.path.abspath(prefix))


def build_datasets(data: DataPlan, seed: int, cache_path: Optional[str] = None,
                   vocab_size: Optional[int] = None, is_builder: bool = True,
                   barrier: Callable[[], None] = lambda: None) -> Tuple:
    """(train, valid, test): the datasets of `data` (app.data.plan), each a dataset of
    {"text": np.int64 [seq_length + 1]} items, or None where the plan builds nothing.

    cache_path: where index .npy files go (default: beside each dataset). vocab_size: if
    given, every dataset's token ids are checked against it first. is_builder/barrier: only
    the builder writes the caches; every rank calls barrier() once per cached entry, then
    loads. Logs how many index sets were loaded from the cache and how many built.
    """
    if vocab_size is not None:
        for prefix, indexed in data.datasets.items():
            check_token_ids(indexed, vocab_size, cache_dir_of(prefix, cache_path))
    out = tuple(None if plan is None else
                _split_dataset(plan, data, seed, cache_path, is_builder, barrier)
                for plan in data.splits)
    entries = cache_entries(out)
    built = [e for e in entries if e.built]
    where = sorted({os.path.dirname(e.cache.description_file) for e in entries})
    logger.info("sample indices: %d of %d index sets loaded from the cache in %s, %d built",
                len(entries) - len(built), len(entries), ", ".join(where), len(built))
    return out


def cache_entries(datasets: Sequence) -> List:
    """Every cached dataset among `datasets` (None skipped): each blend's parts, then the blend;
    each has `cache` (app.data.index_cache.IndexCache) and `built`."""
    out: List = []
    for dataset in datasets:
        if dataset is not None:
            out += list(getattr(dataset, "datasets", [])) + [dataset]
    return out


def build_train_valid_test_datasets(
        data_path: List[str], split: str, num_samples: Tuple[int, int, int], seq_length: int,
        seed: int, cache_path: Optional[str] = None, vocab_size: Optional[int] = None,
        is_builder: bool = True, barrier: Callable[[], None] = lambda: None):
    """`build_datasets` for Megatron's --data-path (one prefix or [w1, p1, w2, p2, ...]) divided
    by --split ("969,30,1") into splits of `num_samples` (train, valid, test) samples."""
    blends = DataBlends(parse_blend(data_path, "--data-path"), None, "--data-path")
    return build_datasets(plan_datasets(blends, split, num_samples, seq_length), seed,
                          cache_path, vocab_size, is_builder, barrier)
