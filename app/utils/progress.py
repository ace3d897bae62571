"""Progress with rate and ETA for the long tools (preprocessing, conversion, evaluation).

    from app.utils.progress import progress

    for item in progress(items, total=len(items), desc="converting"):
        ...
    with progress(total=os.path.getsize(path), desc="tokenizing", unit="B") as bar:
        bar.update(nbytes)
        bar.set_postfix_str("1234 docs/s")

Built on tqdm and written to stderr, so stdout stays clean for results. On a terminal the bar
redraws in place; elsewhere (a log file, a CI job, a test capturing stderr) each update is one
complete line, at most every `min_interval_s` seconds, so logs stay readable. Every line shows
the count, the rate and an explicit `ETA` (when the total is known).
"""
from __future__ import annotations

import sys
from typing import IO, Any, Iterable, Optional

from tqdm import tqdm

_TIMES = "[{elapsed}, ETA {remaining}, {rate_fmt}{postfix}]"
_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " + _TIMES
_LINE = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} " + _TIMES
_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class _LineStream:
    """A text stream for tqdm that turns each in-place redraw into one finished line."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable: Optional[Iterable[Any]] = None, total: Optional[float] = None,
             desc: str = "", *, unit: str = "it", min_interval_s: Optional[float] = None,
             stream: Optional[IO[str]] = None, disable: bool = False) -> tqdm:
    """A tqdm progress bar over `iterable` (or updated by hand) reporting rate and ETA on stderr.

    `total` None takes len(iterable) when it has one; without a total the line shows the count
    and the rate only. `unit="B"` scales to kB/MB/GB. `min_interval_s` is the least time between
    two updates: 0.5 s on a terminal, 30 s otherwise by default. Use it as an iterator or as a
    context manager (`update(n)`, `set_postfix_str(text)`); closing it prints the final line.
    """
    out = stream if stream is not None else sys.stderr
    interactive = bool(getattr(out, "isatty", lambda: False)())
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if min_interval_s is None:
        min_interval_s = 0.5 if interactive else 30.0
    fmt = _NO_TOTAL if not total else _BAR if interactive else _LINE
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000,
                file=out if interactive else _LineStream(out), mininterval=min_interval_s,
                maxinterval=max(min_interval_s, 10.0), bar_format=fmt, dynamic_ncols=interactive,
                disable=disable, leave=True)


__all__ = ["progress"]
