"""The process's one copy of the csrc/ kernel library: built or found on first use, loaded once.

`status()` answers "can the fused kernels run here, and if not, why": no CUDA device, no CUDA
toolkit (nvcc), the build failed (its first error line), the build timed out, or the library did
not load. The first answer is kept for the life of the process, so every op reports the same
reason. A failure is logged once as a warning naming the fix; with `configure(required=True)`
(the --require-fused-kernels switch) it raises instead, unless there is no CUDA device at all
(then no kernel could ever apply, and a CPU run should not die for that).

`agree_across_ranks(group, device)` then makes the answer the same on every rank: if any rank
lacks the kernels, every rank falls back. Ranks must not mix implementations: tensor-parallel
ranks exchange per-row statistics in the cross entropy, and the two paths round differently.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from app.kernels import build
from app.mpu import collectives
from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)

DEFAULT_BUILD_TIMEOUT_S = 300.0  # below the 10-minute process-group timeout
REQUIRED_FLAG = "--require-fused-kernels"
NO_CUDA = "no CUDA device"


@dataclasses.dataclass(frozen=True)
class Status:
    """Whether the kernels are loaded; `reason` says why not, or what was loaded."""

    available: bool
    reason: str
    library: Optional[str] = None


@dataclasses.dataclass
class _Settings:
    required: bool = False
    build_root: Optional[str] = None
    timeout_s: float = DEFAULT_BUILD_TIMEOUT_S
    local_rank: Optional[int] = None


_SETTINGS = _Settings()
_STATUS: Optional[Status] = None
_LOCK = threading.Lock()


def configure(*, required: bool = False, build_root: Optional[str] = None,
              timeout_s: float = DEFAULT_BUILD_TIMEOUT_S, local_rank: Optional[int] = None) -> None:
    """Set how the library is obtained; call before the first kernel use (the run's start-up).

    required: a build or load failure on a CUDA machine raises instead of falling back.
    build_root: cache directory (default `build.default_build_root()`).
    timeout_s: longest a build (or the wait for another rank's build) may take.
    local_rank: this process's rank on its node (default $LOCAL_RANK, else 0); only 0 builds.
    """
    if timeout_s <= 0:
        raise ValueError(f"kernel build timeout must be positive, got {timeout_s}")
    global _SETTINGS
    _SETTINGS = _Settings(required, build_root, timeout_s, local_rank)
    if _STATUS is not None and not _STATUS.available:
        _raise_if_required(_STATUS)


def reset() -> None:
    """Forget the cached status (tests); a loaded library stays loaded in the process."""
    global _STATUS
    with _LOCK:
        _STATUS = None


def status() -> Status:
    """The library's status, building/loading it on the first call (may take minutes)."""
    global _STATUS
    with _LOCK:
        if _STATUS is None:
            _STATUS = _obtain()
            if _STATUS.available:
                logger.info("fused kernels: %s", _STATUS.reason)
            else:
                _raise_if_required(_STATUS)
                logger.warning("fused kernels unavailable (%s); using the PyTorch implementations"
                               " (pass %s to make this an error)", _STATUS.reason, REQUIRED_FLAG)
        return _STATUS


def agree_across_ranks(group: object, device: torch.device) -> Status:
    """Kernels on every rank of `group` or on none; returns the status now in effect here.

    One agreement (min) over a [group size] vector holding each rank's availability (on
    `device`: the CUDA device under NCCL). If some ranks lack the kernels,
    each of them logs its reason (printed whatever its rank), rank 0 logs which ranks they are,
    and the ranks that have them switch to the PyTorch implementations for good.
    """
    global _STATUS
    mine = status()
    size, rank = collectives.group_size(group), collectives.group_rank(group)
    mine_only = [1.0] * size  # [size], 1 = has the kernels; each rank fills in its own slot
    mine_only[rank] = float(mine.available)
    flags = collectives.agree(mine_only, group, device, op="min")
    lacking = [r for r, have in enumerate(flags) if not have]
    if not lacking or len(lacking) == size:  # all agree already
        return mine
    if not mine.available:
        logger.warning("fused kernels unavailable on this rank: %s", mine.reason,
                       extra=ALL_RANKS)
    logger.warning("fused kernels unavailable on rank(s) %s of %d; every rank uses the PyTorch "
                   "implementations, so that ranks compute alike", lacking, size)
    if mine.available:
        with _LOCK:
            _STATUS = Status(False, f"off on every rank: rank(s) {lacking} lack them")
    return status()


def available() -> bool:
    """True when the fused kernels are loaded (or could be loaded now)."""
    return status().available


def _raise_if_required(result: Status) -> None:
    if _SETTINGS.required and result.reason != NO_CUDA:
        raise RuntimeError(f"fused kernels are required ({REQUIRED_FLAG}) but unavailable: "
                           f"{result.reason}")


def _local_rank() -> int:
    if _SETTINGS.local_rank is not None:
        return _SETTINGS.local_rank
    return int(os.environ.get("LOCAL_RANK", "0"))


def _obtain() -> Status:
    if not torch.cuda.is_available():
        return Status(False, NO_CUDA)
    cuda_home = build.find_cuda_home()
    if cuda_home is None:
        return Status(False, "no CUDA toolkit: nvcc not found (set CUDA_HOME)")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    root = Path(_SETTINGS.build_root) if _SETTINGS.build_root else build.default_build_root()
    try:
        library = build.ensure_built(build.kernel_spec(arch), root, local_rank=_local_rank(),
                                     timeout_s=_SETTINGS.timeout_s, cuda_home=cuda_home)
    except build.BuildError as err:
        return Status(False, f"build failed: {err}")
    except OSError as err:  # an unwritable cache directory and the like
        return Status(False, f"build failed: {err}")
    try:
        torch.ops.load_library(library)
    except Exception as err:  # noqa: BLE001 - any loader error means "fall back", with its text
        return Status(False, f"load of {library} failed: {str(err).splitlines()[0]}")
    return Status(True, f"loaded {library} (sm_{major}{minor}, nvcc "
                        f"{build.nvcc_version(cuda_home)})", library)
