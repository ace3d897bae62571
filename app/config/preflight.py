"""--dry-run: check a run without training (`DryRunConfig`); tools/prepare_cache.py's own
option (`PrepareCacheConfig`). Part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import option
from app.config.rules import positive


@dataclass(kw_only=True)
class DryRunConfig:
    """What the preflight report plans for (app.training.planning.preflight)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "preflight", "check a run without training (docs/reliability.md)")

    enabled: bool = option(
        "--dry-run", default=False,
        help="check the flags, DeepSpeed JSON, data, checkpoint and memory; print one report and "
             "exit (non-zero on any error) without training")
    world_size: Optional[int] = option(
        "--dry-run-world-size", default=None,
        help="plan for this many ranks (default: the launcher's WORLD_SIZE, else 1)")
    device_memory: Optional[float] = option(
        "--dry-run-device-memory", default=None, metavar="GiB",
        help="memory per device to check the estimate against (default: the first CUDA device's)")

    def __post_init__(self) -> None:
        positive(self, (("world_size", "--dry-run-world-size"),
                        ("device_memory", "--dry-run-device-memory")), allow_none=True)


@dataclass(kw_only=True)
class PrepareCacheConfig:
    """tools/prepare_cache.py's own option; every other flag is the run's."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "prepare cache", "build the run's sample-index caches ahead (tools/prepare_cache.py)")

    world_size: Optional[int] = option(
        "--prepare-cache-world-size", default=None,
        help="the world size the run will have, which sets its data-parallel size and so its "
             "sample counts (default: the launcher's WORLD_SIZE, else 1)")

    def __post_init__(self) -> None:
        positive(self, (("world_size", "--prepare-cache-world-size"),), allow_none=True)
