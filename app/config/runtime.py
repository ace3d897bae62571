"""Garbage collection, the CUDA caching allocator and profiling during training
(`RuntimeConfig`): Megatron-LM's flags with Megatron's defaults and meaning. Part of
`app.config`; the loop's side is app.training.telemetry.runtime_hooks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Tuple

from app.config.options import option

EMPTY_CACHE_LEVELS = (0, 1, 2)
"""--empty-unused-memory-level values."""


@dataclass(kw_only=True)
class RuntimeConfig:
    """What runs around the training steps: Python's garbage collector, the CUDA cache and the
    profiler (Megatron-LM's flags and iteration windows)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "runtime", "garbage collection, the CUDA cache and profiling (Megatron-LM's flags; "
                   "docs/performance.md)")

    manual_gc: bool = option(
        "--manual-gc", default=False,
        help="disable Python's automatic garbage collector for training and collect at fixed "
             "points instead (before training, every --manual-gc-interval iterations, around "
             "each evaluation), so every rank collects at the same time")
    manual_gc_interval: int = option(
        "--manual-gc-interval", default=0,
        help="with --manual-gc: collect after every this many iterations (0: never during "
             "training)")
    manual_gc_eval: bool = option(
        "--no-manual-gc-eval", "--disable-manual-gc-eval", default=True, action="store_false",
        dest="manual_gc_eval",
        help="with --manual-gc: do not collect before and after each evaluation")
    empty_unused_memory_level: int = option(
        "--empty-unused-memory-level", default=0, choices=EMPTY_CACHE_LEVELS,
        help="release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 1 "
             "after each training step's forward-backward and each evaluation step, 2 also "
             "after the optimizer step; no effect on the CPU")
    profile: bool = option(
        "--profile", default=False,
        help="profile iterations --profile-step-start..--profile-step-end: on CUDA, "
             "cudaProfilerStart/Stop for nsys (run under `nsys profile --capture-range="
             "cudaProfilerApi`), or with --use-pytorch-profiler (and always on the CPU, which "
             "has no nsys) a torch.profiler trace in {--tensorboard-dir}/../torch_profile/")
    profile_step_start: int = option(
        "--profile-step-start", default=10,
        help="the completed iterations at which profiling starts")
    profile_step_end: int = option(
        "--profile-step-end", default=12,
        help="the completed iterations at which profiling stops")
    profile_ranks: List[int] = option(
        "--profile-ranks", default_factory=list, nargs="+",
        help="global ranks that profile (default: every rank)")
    use_pytorch_profiler: bool = option(
        "--use-pytorch-profiler", default=False,
        help="with --profile: torch.profiler instead of nsys, a gzipped Chrome trace per rank "
             "at {--tensorboard-dir}/../torch_profile/rank-N.json.gz")
    pytorch_profiler_collect_shapes: bool = option(
        "--pytorch-profiler-collect-shapes", default=False,
        help="torch.profiler records tensor shapes")
    pytorch_profiler_collect_callstack: bool = option(
        "--pytorch-profiler-collect-callstack", default=False,
        help="torch.profiler records Python call stacks")
    record_shapes: bool = option(
        "--record-shapes", default=False,
        help="nsys mode: record tensor shapes in the NVTX ranges (emit_nvtx)")

    def __post_init__(self) -> None:
        if self.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0 (0: no collection during "
                             f"training), got {self.manual_gc_interval}")
        if self.empty_unused_memory_level not in EMPTY_CACHE_LEVELS:
            raise ValueError(f"--empty-unused-memory-level must be 0, 1 or 2, got "
                             f"{self.empty_unused_memory_level}")

    def profiles(self, rank: int) -> bool:
        """Whether `rank` profiles (--profile and, when given, in --profile-ranks)."""
        return self.profile and (not self.profile_ranks or rank in self.profile_ranks)
