"""Shared checks of the config dataclasses, and the --split parser (pure, no torch)."""
from __future__ import annotations

import math
import re
from typing import Any, Tuple


def positive(config: Any, fields: Tuple[Tuple[str, str], ...], allow_none: bool = False) -> None:
    """Raise naming the flag when a field is not positive (None passes when allow_none)."""
    for name, flag in fields:
        value = getattr(config, name)
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")


def divisible(what: str, value: int, by: str, divisor: int) -> None:
    if value % divisor:
        raise ValueError(f"{what} ({value}) is not divisible by {by} ({divisor})")


def split_weights(splits: str) -> Tuple[float, float, float]:
    """--split as Megatron Core reads it (parse_and_normalize_split): the numbers in the text,
    whatever separates them ('969,30,1', '90/5/5', "'99,1,0'" with the quotes of a word-split
    shell string), up to three, padded with zeros, normalised. Exponents and signs are refused
    (Megatron's pattern would read '1e-3' as the two numbers 1 and 3)."""
    bad = re.search(r"[-+]|\d[eE]", splits)
    try:
        parts = [float(x) for x in re.findall(r"[.0-9]+", splits)]
    except ValueError:  # a lone '.'
        parts = []
    if bad or not parts or len(parts) > 3 or not math.isfinite(sum(parts)):
        raise ValueError(f"--split {splits!r} is invalid: give up to three non-negative "
                         "weights without exponents, e.g. 969,30,1")
    while len(parts) < 3:
        parts.append(0.0)
    total = sum(parts)
    if total <= 0:
        raise ValueError(f"--split {splits!r} sums to zero; give at least one positive weight")
    return tuple(x / total for x in parts)  # type: ignore[return-value]
