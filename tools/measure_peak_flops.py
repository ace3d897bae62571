"""Measure (or show) the matmul peak FLOP/s that MFU is computed against on this machine.

    python tools/measure_peak_flops.py                       # show the peak for fp32, this many threads
    python tools/measure_peak_flops.py --dtype bf16 --threads 2 --force   # re-measure and cache it

On a CPU the peak is the best n x n matmul throughput at the run's dtype and thread count,
measured once and cached per machine (CPU model, threads, dtype, torch version) in
$GPT2_PEAK_FLOPS_CACHE or ~/.cache/gpt2-megatron/peak_flops.json, so every run and every rank
uses the same number. `--force` re-measures on an idle machine; the cache keeps the best
measurement (a busy machine only lowers it), `--reset` forgets the cached value first. On a GPU the peak is the
datasheet's dense peak for the dtype (see docs/metrics.md); nothing is measured.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

import torch

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config
from app.config.options import option
from app.training.telemetry import flops
from app.utils.dtypes import torch_dtype


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(kw_only=True)
class PeakFlopsOptions:
    """tools/measure_peak_flops.py's command line: the dtype, the threads, the device."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("peak FLOP/s", "what to measure (or show)")

    dtype: str = option("--dtype", default="fp32", help="fp32, bf16 or fp16 (the run's weights)")
    threads: Optional[int] = option(
        "--threads", default=None, help="torch threads per rank (default: torch's current setting)")
    force: bool = option("--force", default=False,
                         help="re-measure even if a value is cached (the cache keeps the best)")
    reset: bool = option("--reset", default=False,
                         help="forget the cached value, then measure (after a hardware change)")
    device: str = option("--device", default_factory=_default_device)

    def __post_init__(self) -> None:
        try:
            torch_dtype(self.dtype)
        except ValueError as exc:
            raise ValueError(f"--dtype: {exc}") from None


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_config(PeakFlopsOptions, argv, __doc__.split("\n\n")[0])
    dtype = torch_dtype(a.dtype)
    device = torch.device(a.device)
    if device.type == "cuda":
        value, desc = flops.peak_flops(device, dtype)
    else:
        value, desc = flops.cached_cpu_peak(dtype, a.threads, remeasure=a.force, reset=a.reset)
    print(f"{value / 1e12:.4f} TFLOP/s  ({desc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
