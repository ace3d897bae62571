"""Fault injection: named points where a test, or a chaos drill, makes a run fail on purpose.

The product marks each point once, by name; nothing is armed in a real run, and a point that
is not armed costs one dictionary lookup. A test arms a point with a handler for a block,

    with faults.injected(faults.SAVE_STAGE, crash_at("rank_tmp_written")):
        save(...)

or with `arm(point, handler)` for the rest of the test (tests/conftest.py disarms every point
after each test) or of a process it owns (a wrapper script around `pretrain_gpt2.main`, a forked
child). The points (`POINTS` holds this table):

- `SAVE_STAGE` ("checkpoint.save_stage"), in `app.checkpoint.commit`: the handler is called
  with the name of each stage of a save as it is reached (`commit.SAVE_STAGES`, in order; the
  per-file stages once per file), in the thread doing that stage (the background writer thread
  with --async-save). It returns nothing; to inject a fault it raises, sends a signal or kills
  the process.
- `TRAINING_LOSS` ("training.loss"), in `app.training.loss`: the handler is called with
  (the first training sample of the iteration, one micro-batch's loss tensor) for every training
  micro-batch (not evaluation) and returns the loss to use: a NaN loss for a data window, or a
  SIGKILL in the forward pass of a chosen iteration.

Handlers are process-wide (every thread sees them). docs/reliability.md lists the tests that
use each point.

Ready-made faults: `disk_full(saves)` is a `SAVE_STAGE` handler that makes chosen saves of this
process fail the way torch.save fails on a full disk (`torch_disk_full_error`).
"""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Any, Callable, Collection, Dict, Iterator, Optional

SAVE_STAGE = "checkpoint.save_stage"
TRAINING_LOSS = "training.loss"

POINTS: Dict[str, str] = {
    SAVE_STAGE: "each stage of a checkpoint save (handler(stage name) -> None)",
    TRAINING_LOSS: "each training micro-batch's loss (handler(first sample, loss) -> loss)",
}
"""Every injection point, by name, with what its handler is given and returns."""

_handlers: Dict[str, Callable[..., Any]] = {}


def _check_point(point: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault-injection point {point!r}; the points are "
                         f"{', '.join(sorted(POINTS))} (app/utils/faults.py)")


def arm(point: str, handler: Callable[..., Any]) -> None:
    """From now on, in this process, `point` calls `handler` (replacing any handler it had)."""
    _check_point(point)
    if not callable(handler):
        raise ValueError(f"the handler for fault-injection point {point!r} must be callable, "
                         f"got {handler!r}")
    _handlers[point] = handler


def disarm(point: str) -> None:
    """`point` calls nothing any more (whether or not it was armed)."""
    _check_point(point)
    _handlers.pop(point, None)


def disarm_all() -> None:
    """No point calls anything any more."""
    _handlers.clear()


@contextlib.contextmanager
def injected(point: str, handler: Callable[..., Any]) -> Iterator[None]:
    """`point` calls `handler` inside the block; afterwards (also when the block raises) it
    calls what it called before, or nothing."""
    _check_point(point)
    previous = _handlers.get(point)
    arm(point, handler)
    try:
        yield
    finally:
        if previous is None:
            _handlers.pop(point, None)
        else:
            _handlers[point] = previous


def armed(point: str) -> Optional[Callable[..., Any]]:
    """The handler `point` calls now, or None (for callers that skip work when nothing is
    armed)."""
    return _handlers.get(point)


def fire(point: str, *args: Any) -> Any:
    """Product side: call `point`'s handler with `args` and return what it returns; None when
    the point is not armed."""
    handler = _handlers.get(point)
    return None if handler is None else handler(*args)


# ---------------------------------------------------------------------------- ready-made faults

TORCH_DISK_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos {written} vs {expected}"
"""torch.save's message (torch 2.x) when the file system fills while it writes a checkpoint."""


def torch_disk_full_error(written: int = 704, expected: int = 598) -> RuntimeError:
    """The RuntimeError torch.save raises into a file object on a full disk: TORCH_DISK_FULL,
    raised while handling the file's OSError(ENOSPC), as torch raises it."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        try:
            raise RuntimeError(TORCH_DISK_FULL.format(written=written, expected=expected))
        except RuntimeError as exc:
            return exc


def disk_full(saves: Optional[Collection[int]] = None,
              stage: str = "rank_tmp_written") -> Callable[[str], None]:
    """A `SAVE_STAGE` handler: the saves of this process numbered in `saves` (1, 2, ... in
    the order they start; None: every save) fail at `stage` of each file with
    `torch_disk_full_error`, the error torch.save gives on a full disk."""
    started = [0]

    def handler(name: str) -> None:
        if name == "start":
            started[0] += 1
        if name == stage and (saves is None or started[0] in saves):
            raise torch_disk_full_error()
    return handler
