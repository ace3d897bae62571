"""Rank-aware logging on the standard library's `logging`: every module logs through
`logging.getLogger(__name__)`; `setup_logging` decides which rank prints.

By default a record is printed by global rank 0 only. Pass `extra=LAST_RANK` for what lives on
the last rank (Megatron's `print_rank_last`: the training log line, whose loss is on the last
pipeline stage) and `extra=ALL_RANKS` for per-rank facts (printed with a `[rank N]` prefix).
Records go to the *current* `sys.stdout` at emit time, so test harnesses that swap stdout see
them. Without `setup_logging` (library use, tests) the standard library's defaults apply.
"""
from __future__ import annotations

import logging
import sys
from typing import Dict

LAST_RANK: Dict[str, str] = {"ranks": "last"}
ALL_RANKS: Dict[str, str] = {"ranks": "all"}
ROOT_LOGGER = "app"


class RankFilter(logging.Filter):
    """Pass a record on the ranks its `ranks` attribute names ("first" by default)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def filter(self, record: logging.LogRecord) -> bool:
        which = getattr(record, "ranks", "first")
        if which == "all":
            record.rank_prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
            return True
        record.rank_prefix = ""
        if which == "last":
            return self.rank == self.world_size - 1
        return self.rank == 0


class _StdoutHandler(logging.Handler):
    """Writes each record as one line to whatever `sys.stdout` is now, and flushes."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def setup_logging(rank: int = 0, world_size: int = 1, level: int = logging.INFO) -> logging.Logger:
    """Route the `app` loggers to stdout through a RankFilter for this rank; idempotent.

    Warnings and errors get a `WARNING: ` / `ERROR: ` prefix; info lines are printed as is
    (the log-line format users grep for stays Megatron's).
    """
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler, _StdoutHandler):
            logger.removeHandler(handler)
    handler = _StdoutHandler()
    handler.addFilter(RankFilter(rank, world_size))
    handler.setFormatter(_Formatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    # records still propagate: the root logger normally has no handler (so nothing prints
    # twice), and test harnesses or an embedding application can capture them there
    return logger


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return getattr(record, "rank_prefix", "") + text
