"""Shared checks of the config dataclasses, and the --split parser (pure, no torch)."""
from __future__ import annotations

import math
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
    """'969,30,1' -> normalised (train, valid, test) fractions; '90/5/5' also accepted."""
    sep = "," if "," in splits else "/"
    try:
        parts = [float(x) for x in splits.split(sep) if x.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(x < 0 for x in parts) or not math.isfinite(sum(parts)):
        raise ValueError(f"--split {splits!r} is invalid: give up to three non-negative "
                         "weights, e.g. 969,30,1")
    while len(parts) < 3:
        parts.append(0.0)
    total = sum(parts)
    if total <= 0:
        raise ValueError(f"--split {splits!r} sums to zero; give at least one positive weight")
    return tuple(x / total for x in parts)  # type: ignore[return-value]
