"""Shared benchmark helpers: the machine's measured matmul peak, timing statistics, formatting.

MFU in our benchmarks is always "model FLOPs per second / measured peak of the same dtype on
this machine" (performance-anchors.md section 8.1: MFU_measured), with model FLOPs per token
from `app.training.telemetry.flops.model_flops_per_token`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

from app.launch.distributed import keep_freed_memory  # noqa: F401  (re-exported for the benches)
from app.training.telemetry.flops import matmul_flops_by_size


@dataclass
class PeakResult:
    """Best matmul throughput found and the throughput of every size tried (FLOP/s)."""

    flops: float
    best_n: int
    by_n: Dict[int, float]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on the CPU) so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(sizes: Sequence[int] = (512, 1024, 1536, 2048), repeats: int = 10,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device = torch.device("cpu")) -> PeakResult:
    """max over n of 2 n^3 / t for an n x n @ n x n matmul, best of `repeats` timings per n
    (app.training.telemetry.flops.matmul_flops_by_size, the measurement training uses too)."""
    by_n = matmul_flops_by_size(device, dtype, sizes, repeats)
    best_n = max(by_n, key=by_n.get)
    return PeakResult(flops=by_n[best_n], best_n=best_n, by_n=by_n)


def time_call(fn: Callable[[], object], device: torch.device = torch.device("cpu")) -> float:
    """Seconds one call of `fn` takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def summarize(times: List[float]) -> Dict[str, float]:
    """Median, p90, min and mean of a list of step times (seconds)."""
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median": statistics.median(ordered), "p90": p90, "min": ordered[0],
            "mean": statistics.fmean(ordered)}


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width text table (first column left-aligned, the others right-aligned)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
