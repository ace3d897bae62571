"""Which data each split reads, from Megatron-LM's data flags (pure, plus reading the two data
files). Part of `app.config`.

Megatron-LM's rules (`get_blend_from_list`, `get_blend_and_blend_per_split`):

- a *blend* is a list of words: one prefix; weight/prefix pairs `w1 p1 w2 p2 ...` (the weights
  are normalised to sum to 1); or several prefixes `p1 p2 ...` (an odd count, or an even count
  whose every other word is not a number), whose weights are then the sizes of the datasets
  they build (decided when the datasets are built, `Blend.weights` None);
- `--data-path BLEND` or `--data-args-path FILE` (the same words in a file, separated by any
  whitespace): one blend whose documents `--split` divides into train/valid/test;
- weights are normalised as Megatron's builder normalises them (`normalize`, float64);
- `--train-data-path BLEND --valid-data-path BLEND --test-data-path BLEND` or
  `--per-split-data-args-path FILE` (JSON with the keys `train`, `valid`, `test`, each a blend
  as one string or a list of words, or null): one blend per split, each dataset used whole, and
  `--split` does not apply.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"
"""--split's default (Megatron's legacy default with --data-path)."""


@dataclass(frozen=True)
class Blend:
    """One blend: dataset prefixes and their normalised weights (None: weighted by the sizes
    of the datasets they build)."""

    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]] = None
    given_weights: Optional[Tuple[float, ...]] = field(default=None, compare=False)
    """The weights as written, before normalising (the order of this trainer's releases before
    0.5.0 normalised them its own way: app.data.legacy_order)."""

    def describe(self) -> str:
        """'0.3 a 0.7 b' or 'a b' (the words of an equivalent command line)."""
        if self.weights is None:
            return " ".join(self.prefixes)
        return " ".join(f"{w:g} {p}" for w, p in zip(self.weights, self.prefixes))


@dataclass(frozen=True)
class DataBlends:
    """The data of a run: `blend` divided by --split (with `per_split` None), or one blend per
    split in `per_split` (train, valid, test; None where a split has none). `source` names the
    flags or file they came from, for messages."""

    blend: Optional[Blend]
    per_split: Optional[Tuple[Optional[Blend], Optional[Blend], Optional[Blend]]]
    source: str

    def prefixes(self) -> List[str]:
        """Every prefix the run reads, in order, without repeats."""
        blends = [self.blend] if self.per_split is None else list(self.per_split)
        out: List[str] = []
        for blend in blends:
            for prefix in (blend.prefixes if blend is not None else ()):
                if prefix not in out:
                    out.append(prefix)
        return out


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum in float64, as Megatron normalises blend and split weights
    (numpy's sum, so that the sample counts derived from them are Megatron's to the sample)."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def _weight(word: Any) -> Optional[float]:
    try:
        return float(word)
    except (TypeError, ValueError):
        return None


def parse_blend(words: Sequence[Any], where: str) -> Blend:
    """A blend from its words by Megatron's rules (module docstring); `where` names the flag or
    file in errors."""
    words = [str(w).strip() if not isinstance(w, str) else w.strip() for w in words]
    words = [w for w in words if w]
    if not words:
        raise ValueError(f"{where} is empty; give a prefix of a .bin/.idx pair (made by "
                         "tools/preprocess_data.py), weight/prefix pairs 'w1 p1 w2 p2 ...' or "
                         "prefixes 'p1 p2 ...' (or train on synthetic tokens with --mock-data)")
    if len(words) % 2:
        if len(words) > 1 and all(_weight(w) is not None for w in words[0::2]):
            raise ValueError(f"{where} {' '.join(words)!r}: looks like weight/prefix pairs "
                             "'w1 p1 w2 p2 ...' with a word missing (an odd number of words)")
        return Blend(tuple(words))
    weights = [_weight(w) for w in words[0::2]]
    if all(w is None for w in weights):
        return Blend(tuple(words))
    if any(w is None for w in weights):
        raise ValueError(f"{where} {' '.join(words)!r}: mixes weight/prefix pairs with bare "
                         "prefixes; give 'w1 p1 w2 p2 ...' or 'p1 p2 ...'")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{where} weights {weights} must be finite and non-negative with a "
                         "positive sum")
    return Blend(tuple(words[1::2]), tuple(normalize(weights)), tuple(weights))


def read_data_args(path: str) -> Blend:
    """--data-args-path: the blend's words in a file, separated by any whitespace."""
    try:
        with open(path, encoding="utf-8") as f:
            words = f.read().split()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--data-args-path {path}: cannot read it ({exc})") from None
    return parse_blend(words, f"--data-args-path {path}")


def read_per_split_data_args(path: str) -> Tuple[Optional[Blend], ...]:
    """--per-split-data-args-path: Megatron's JSON {"train": ..., "valid": ..., "test": ...},
    each value a blend as a string or a list of words, or null (a missing key is null too)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--per-split-data-args-path {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--per-split-data-args-path {path}: not JSON ({exc}); write "
                         '{"train": "w1 p1 w2 p2", "valid": "p3", "test": null}') from None
    if not isinstance(doc, dict) or set(doc) - set(SPLIT_NAMES):
        found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"--per-split-data-args-path {path}: expected an object with the keys "
                         f"'train', 'valid' and 'test', found {found}")
    out: List[Optional[Blend]] = []
    for name in SPLIT_NAMES:
        value = doc.get(name)
        where = f"--per-split-data-args-path {path} ({name!r})"
        if value is None:
            out.append(None)
        elif isinstance(value, str):
            out.append(parse_blend(value.split(), where))
        elif isinstance(value, list):
            out.append(parse_blend(value, where))
        else:
            raise ValueError(f"{where}: expected a string or a list of words, found "
                             f"{type(value).__name__}")
    return tuple(out)


def resolve_blends(data_path: Sequence[str], data_args_path: Optional[str],
                   per_split_paths: Sequence[Sequence[str]],
                   per_split_data_args_path: Optional[str]) -> Optional[DataBlends]:
    """The run's DataBlends from its flags (one way in only), or None when no data flag is
    given. `per_split_paths` are --train/--valid/--test-data-path (empty lists when absent)."""
    shared = [name for name, given in (("--data-path", bool(data_path)),
                                       ("--data-args-path", data_args_path is not None)) if given]
    split_flags = [f"--{n}-data-path" for n, p in zip(SPLIT_NAMES, per_split_paths) if p]
    if per_split_data_args_path is not None:
        split_flags.append("--per-split-data-args-path")
    given = shared + split_flags
    if len(shared) > 1 or (shared and split_flags) or (
            per_split_data_args_path is not None and len(split_flags) > 1):
        raise ValueError(f"{' and '.join(given)} were given together; describe the data one "
                         "way: --data-path or --data-args-path (divided by --split), or "
                         "--train/--valid/--test-data-path or --per-split-data-args-path")
    if data_args_path is not None:
        return DataBlends(read_data_args(data_args_path), None,
                          f"--data-args-path {data_args_path}")
    if data_path:
        return DataBlends(parse_blend(data_path, "--data-path"), None, "--data-path")
    if per_split_data_args_path is not None:
        per_split = read_per_split_data_args(per_split_data_args_path)
        source = f"--per-split-data-args-path {per_split_data_args_path}"
    elif split_flags:
        per_split = tuple(parse_blend(p, f"--{n}-data-path") if p else None
                          for n, p in zip(SPLIT_NAMES, per_split_paths))
        source = " ".join(split_flags)
    else:
        return None
    if per_split[0] is None:
        raise ValueError(f"{source} gives no training data; add --train-data-path (or a "
                         "'train' entry to the JSON)")
    return DataBlends(None, per_split, source)  # type: ignore[arg-type]
