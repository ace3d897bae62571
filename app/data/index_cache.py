"""The on-disk cache of index arrays (GPT sample indices, blend indices).

A cache entry is `{stem}_{kind}.npy` for each of its arrays plus `{stem}_description.json`,
written last (each file to a temporary name, then renamed), so a description marks a complete
set. The stem ends in a hash of the entry's `description` (every input the arrays depend on)
and of `content` (e.g. the document lengths), so other inputs find other files. The
description file repeats those inputs and records each array's length; an entry whose
description or array lengths disagree with what is expected is never used: the builder
rebuilds it when it may write there, and otherwise the run stops naming the file and the fix.

Nothing here knows about ranks: `load_or_build` takes `is_builder` and a `barrier`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from app.utils.fileio import atomic_write

logger = logging.getLogger(__name__)

PREPARE_HINT = ("build it ahead with tools/prepare_cache.py and this run's flags, or pass a "
                "writable --data-cache-path")


def digest(*parts: bytes) -> str:
    """20 hex digits of BLAKE2b over `parts` (the key in cache file names)."""
    h = hashlib.blake2b(digest_size=10)
    for part in parts:
        h.update(part)
    return h.hexdigest()


class IndexCache:
    """One cache entry: arrays `kinds` of `name` under `directory` for `description`."""

    def __init__(self, directory: str, name: str, description: Dict[str, Any],
                 kinds: Sequence[str], content: bytes = b"") -> None:
        key = digest(json.dumps(description, sort_keys=True).encode(), content)
        stem = os.path.join(directory, f"{name}_{key}")
        self.directory, self.description, self.kinds = directory, description, tuple(kinds)
        self.files = {kind: f"{stem}_{kind}.npy" for kind in self.kinds}
        self.description_file = f"{stem}_description.json"

    def complete(self) -> bool:
        """All files of the entry exist (the description is written last)."""
        return all(os.path.isfile(p) for p in [self.description_file, *self.files.values()])

    def _saved_description(self) -> Dict[str, Any]:
        with open(self.description_file, encoding="utf-8") as f:
            return json.load(f)

    def problem(self) -> Optional[str]:
        """None when the entry is complete, its description matches and every array has the
        length the description records (read from the .npy headers); else why not."""
        if not self.complete():
            return f"{self.description_file} is missing"
        try:
            saved = self._saved_description()
        except (OSError, ValueError) as exc:
            return f"{self.description_file} is unreadable ({exc})"
        changed = sorted(k for k, v in self.description.items() if saved.get(k) != v)
        if changed:
            return (f"{self.description_file} describes other inputs ({', '.join(changed)} "
                    "differ)")
        lengths = saved.get("lengths", {})  # absent in caches written before it was recorded
        for kind in self.kinds:
            try:
                rows = int(np.load(self.files[kind], mmap_mode="r", allow_pickle=False).shape[0])
            except (OSError, ValueError) as exc:
                return f"{self.files[kind]} is unreadable ({exc})"
            if kind in lengths and rows != int(lengths[kind]):
                return (f"{self.files[kind]} holds {rows} rows but its description records "
                        f"{lengths[kind]}")
        return None

    def load(self) -> Tuple[np.ndarray, ...]:
        """The arrays, memory-mapped, in `kinds` order (check `problem()` first)."""
        return tuple(np.load(self.files[kind], mmap_mode="r", allow_pickle=False)
                     for kind in self.kinds)

    def save(self, arrays: Sequence[np.ndarray], extra: Dict[str, Any]) -> None:
        """Write the arrays, then the description (inputs, `extra`, the array lengths)."""
        for kind, arr in zip(self.kinds, arrays):
            atomic_write(self.files[kind], lambda f, a=arr: np.save(f, a, allow_pickle=False))
        desc = dict(self.description, **extra,
                    lengths={k: int(a.shape[0]) for k, a in zip(self.kinds, arrays)})
        atomic_write(self.description_file,
                     lambda f: f.write(json.dumps(desc, indent=1, sort_keys=True).encode()))


def _check_writable(cache: IndexCache, why: str) -> None:
    directory = cache.directory or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"sample-index cache: {why}, and the cache directory {directory} "
                              f"cannot be created ({err}): {PREPARE_HINT}") from None
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"sample-index cache: {why}, and {directory} is not writable: "
                              f"{PREPARE_HINT}")


def load_or_build(cache: IndexCache, build: Callable[[], Sequence[np.ndarray]],
                  is_builder: bool, barrier: Callable[[], None], what: str
                  ) -> Tuple[Tuple[np.ndarray, ...], bool]:
    """(the entry's arrays, whether this call built them). The builder builds and saves the
    entry unless it is complete and matches; every caller then calls `barrier()` once and loads
    it. Raises naming the file when the entry is missing or wrong after the barrier."""
    built = False
    if is_builder:
        problem = cache.problem()
        if problem is not None:
            _check_writable(cache, problem)
            t0 = time.perf_counter()
            arrays = build()
            elapsed = time.perf_counter() - t0
            cache.save(arrays, {"build_seconds": round(elapsed, 3)})
            logger.info("built %s in %.2f s -> %s", what, elapsed, cache.description_file)
            built = True
    barrier()
    problem = cache.problem()
    if problem is not None:
        raise FileNotFoundError(
            f"sample-index cache: {problem} after the builder rank finished; all ranks must see "
            "the same --data-cache-path (a shared filesystem), where the builder (rank 0) "
            "writes or tools/prepare_cache.py wrote it")
    return cache.load(), built
