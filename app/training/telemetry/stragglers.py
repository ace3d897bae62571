"""Slow ranks named: with --log-straggler, every --log-interval the ranks compare their own time
per iteration, and a rank slower than the median by more than --straggler-margin is named, with
its host, in one log line (by the logging rank) and in the metrics (kind "straggler").

In synchronous training one slow GPU or host makes every rank wait in the next collective, so
the wall time per iteration is the same everywhere and names nobody. What each rank measures
is its own work instead, as Megatron's straggler detector does (`--log-straggler`; its
`StragglerDetector` times the forward step and the batch fetch, `Rtt` and `DRtt` in its line):

- forward: the forward steps of its training micro-batches (CUDA events on a GPU, the wall
  clock on CPU). Pipeline sends and receives and the gradient reduction lie outside it, so on
  data- and pipeline-parallel layouts it is the rank's own compute. A forward with tensor
  parallelism holds its group's all-reduces: a slow rank slows its whole tensor-parallel group,
  and the line names that group's ranks (Megatron's detector has the same reach);
- data wait: the time in the batch function (reading the micro-batch, or receiving it from
  tensor-parallel rank 0, and building the model inputs).

A rank's time is forward + data wait per iteration over the interval. The reference is the
lower median over all ranks (with two ranks, the faster one: each is compared with the other),
so fewer than half the ranks being slow never moves it. A rank is a straggler when its time
exceeds (1 + margin) x that median. The arithmetic is the pure `find_stragglers`; the
communication is one all-gather over the world of a two-float vector per interval
(`StragglerDetector.report`), plus one all-gather of the host names the first time. Off by
default: without --log-straggler nothing is timed and nothing is gathered.
"""
from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from app.mpu import collectives
from app.utils.rank_logging import LAST_RANK

logger = logging.getLogger(__name__)

HOST_BYTES = 256
"""Bytes of a host name carried by the one-time host gather (a DNS name has at most 253)."""
LISTED_STRAGGLERS = 16
"""Stragglers named in the log line; the metrics record lists them all."""


@dataclass(frozen=True)
class RankTime:
    """One rank's mean milliseconds per iteration over a logging interval."""

    rank: int
    forward_ms: float
    data_wait_ms: float

    @property
    def ms(self) -> float:
        """The rank's own time per iteration: forward + data wait."""
        return self.forward_ms + self.data_wait_ms


@dataclass(frozen=True)
class StragglerReport:
    """What one interval's comparison found: the lower median of the ranks' times, the ranks
    above (1 + margin) x median (slowest first), and the `minmax_count` slowest (slowest first)
    and fastest (fastest first) ranks."""

    median_ms: float
    margin: float
    ranks: int
    stragglers: Tuple[RankTime, ...]
    slowest: Tuple[RankTime, ...]
    fastest: Tuple[RankTime, ...]


def find_stragglers(times: Sequence[Tuple[float, float]], margin: float,
                    minmax_count: int = 1) -> StragglerReport:
    """The ranks whose forward + data-wait time exceeds (1 + margin) x the lower median.

    `times[r]` is rank r's (forward ms, data-wait ms) per iteration; `margin` and
    `minmax_count` are validated by TrainingConfig. Ties keep rank order.
    """
    if not times:
        raise ValueError("find_stragglers needs the times of at least one rank")
    ranks = [RankTime(rank, float(fwd), float(wait)) for rank, (fwd, wait) in enumerate(times)]
    median = statistics.median_low([r.ms for r in ranks])
    by_speed = sorted(ranks, key=lambda r: (r.ms, r.rank))  # fastest first
    slow_first = sorted(ranks, key=lambda r: (-r.ms, r.rank))
    stragglers = tuple(r for r in slow_first if r.ms > (1.0 + margin) * median)
    count = max(1, min(minmax_count, len(ranks)))
    return StragglerReport(median_ms=median, margin=margin, ranks=len(ranks),
                           stragglers=stragglers, slowest=tuple(slow_first[:count]),
                           fastest=tuple(by_speed[:count]))


def _named(rank: RankTime, hosts: Sequence[str]) -> str:
    return f"rank {rank.rank} (host {hosts[rank.rank]}) {rank.ms:.1f} ms"


def format_report(iteration: int, report: StragglerReport, hosts: Sequence[str]) -> str:
    """The one log line of an interval: the median, the stragglers (each with its host, how much
    slower and its forward / data-wait split) or that there are none, the slowest and fastest."""
    head = (f"straggler check at iteration {iteration}: median {report.median_ms:.1f} ms per "
            f"iteration (forward + data wait) over {report.ranks} ranks; ")
    limit = f"more than {100.0 * report.margin:g}% slower than the median"
    if not report.stragglers:
        body = f"no rank is {limit}"
    else:
        shown = [f"{_named(r, hosts)} (+{_percent_over(r.ms, report.median_ms)}: forward "
                 f"{r.forward_ms:.1f} ms, data wait {r.data_wait_ms:.1f} ms)"
                 for r in report.stragglers[:LISTED_STRAGGLERS]]
        more = len(report.stragglers) - len(shown)
        body = (f"{len(report.stragglers)} rank{'s' if len(report.stragglers) > 1 else ''} "
                f"{limit}: " + ", ".join(shown) + (f", and {more} more" if more > 0 else ""))
    return (head + body + " | slowest: " + ", ".join(_named(r, hosts) for r in report.slowest)
            + " | fastest: " + ", ".join(_named(r, hosts) for r in report.fastest))


def _percent_over(ms: float, median: float) -> str:
    return f"{100.0 * (ms / median - 1.0):.0f}%" if median > 0 else "inf%"


def report_values(report: StragglerReport, hosts: Sequence[str]) -> Dict[str, Any]:
    """The metrics record of an interval: scalars (median_ms, slowest_ms, fastest_ms,
    straggler_count, ranks, margin) and the lists `stragglers`, `slowest`, `fastest` of
    {rank, host, ms, forward_ms, data_wait_ms}."""
    def entry(r: RankTime) -> Dict[str, Any]:
        return {"rank": r.rank, "host": hosts[r.rank], "ms": r.ms, "forward_ms": r.forward_ms,
                "data_wait_ms": r.data_wait_ms}
    return {"median_ms": report.median_ms, "slowest_ms": report.slowest[0].ms,
            "fastest_ms": report.fastest[0].ms, "straggler_count": len(report.stragglers),
            "ranks": report.ranks, "margin": report.margin,
            "stragglers": [entry(r) for r in report.stragglers],
            "slowest": [entry(r) for r in report.slowest],
            "fastest": [entry(r) for r in report.fastest]}


class _ForwardClock:
    """Milliseconds spent in timed calls: CUDA events on a GPU (read once, at `take_ms`, so the
    run does not synchronise per call), the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._ms = 0.0
        self._events: List[Tuple[Any, Any]] = []

    def time(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), timed."""
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = fn(*args)
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args)
        self._ms += (time.perf_counter() - t0) * 1e3
        return out

    def take_ms(self) -> float:
        """The milliseconds so far, then zero."""
        for start, end in self._events:
            end.synchronize()
            self._ms += start.elapsed_time(end)
        total, self._ms, self._events = self._ms, 0.0, []
        return total


class StragglerDetector:
    """Times this rank's training forward steps and batch fetches, and every logging interval
    compares all ranks (`report`, called by every rank at the same iteration).

    Disabled (`enabled` False) it times nothing, gathers nothing and reports nothing.
    """

    def __init__(self, enabled: bool, margin: float, minmax_count: int, group: Any,
                 device: torch.device) -> None:
        self.enabled = enabled
        self.margin, self.minmax_count = margin, minmax_count
        self.group, self.device = group, device
        self._forward = _ForwardClock(device)
        self._data_wait_s = 0.0
        self._hosts: Optional[List[str]] = None

    def timed(self, batch_func: Callable[[], Any], forward_step: Callable[[Any], Any]
              ) -> Tuple[Callable[[], Any], Callable[[Any], Any]]:
        """The training schedule's batch function and forward step, timed when enabled (the
        same functions otherwise)."""
        if not self.enabled:
            return batch_func, forward_step

        def timed_batch() -> Any:
            t0 = time.perf_counter()
            try:
                return batch_func()
            finally:
                self._data_wait_s += time.perf_counter() - t0

        return timed_batch, lambda batch: self._forward.time(forward_step, batch)

    def report(self, iteration: int, iterations: int, writer: Any) -> Optional[StragglerReport]:
        """Gather every rank's mean forward and data-wait time per iteration over the last
        `iterations` iterations, log the comparison (logging rank) and write it to `writer`
        (kind "straggler"; a writer that is not enabled writes nothing); start a new interval.
        Every rank must call it at the same iteration. None when disabled."""
        if not self.enabled:
            return None
        per = 1.0 / max(iterations, 1)
        mine = torch.tensor([self._forward.take_ms() * per, self._data_wait_s * 1e3 * per],
                            dtype=torch.float64, device=self.device)  # [2]
        self._data_wait_s = 0.0
        times = [tuple(t.cpu().tolist()) for t in collectives.all_gather(mine, self.group)]
        if self._hosts is None:
            self._hosts = gather_hosts(self.group, self.device)
        found = find_stragglers(times, self.margin, self.minmax_count)
        line = format_report(iteration, found, self._hosts)
        if found.stragglers:
            logger.warning(line, extra=LAST_RANK)
        else:
            logger.info(line, extra=LAST_RANK)
        writer.write("straggler", iteration, report_values(found, self._hosts))
        return found


def gather_hosts(group: Any, device: torch.device) -> List[str]:
    """Every rank's host name in group-rank order: one all-gather of HOST_BYTES bytes."""
    raw = socket.gethostname().encode("utf-8")[:HOST_BYTES]
    mine = torch.zeros(HOST_BYTES, dtype=torch.uint8, device=device)
    if raw:
        mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    return [bytes(part.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
            for part in collectives.all_gather(mine, group)]
