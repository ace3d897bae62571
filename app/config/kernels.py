"""How the fused code is obtained: the csrc/ kernels and compiled layers (`KernelConfig`).
Part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import option
from app.config.rules import positive


def default_kernel_build_timeout(distributed_timeout_minutes: float) -> float:
    """Seconds a kernel build may take when --kernel-build-timeout is not given: 300, or half
    the process-group timeout when that is shorter (the other ranks wait for the build)."""
    return min(300.0, distributed_timeout_minutes * 30.0)


@dataclass(kw_only=True)
class KernelConfig:
    """How the fused code is obtained: the csrc/ kernels (built on first use; see
    docs/kernels.md) and, with compile_layers, torch.compile of each transformer layer.
    build_timeout: seconds local rank 0 may spend on the build (waiting for another node's
    build included) before the run falls back to PyTorch; it must stay below the process-group
    timeout, since the other ranks wait for it in the first collective. Without the flag,
    arguments.py gives `default_kernel_build_timeout` of --distributed-timeout-minutes."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "fused kernels", "fusions and the csrc/ kernels (docs/kernels.md); each has a --no- form")

    require_fused_kernels: bool = option(
        "--require-fused-kernels", default=False,
        help="stop if the kernels cannot be built on a CUDA machine (default: warn and use "
             "PyTorch)")
    build_dir: Optional[str] = option(
        "--kernel-build-dir", default=None,
        help="kernel build cache (default $APP_KERNELS_BUILD_DIR or ~/.cache/app_kernels)")
    build_timeout: float = option(
        "--kernel-build-timeout", default=300.0, flag_default=None,
        help="seconds a kernel build may take before falling back to PyTorch (below the "
             "process-group timeout; default 300, or half of --distributed-timeout-minutes when "
             "that is shorter)")

    compile_layers: bool = option(
        "--compile-layers", default=False,
        help="torch.compile each transformer layer (as torchtitan does per block; native path "
             "only): inside a layer the PyTorch paths of the fused ops are compiled, the csrc/ "
             "kernels and fusion flags then apply outside the layers (final LayerNorm, loss); "
             "the first iterations pay for the compilation (docs/kernels.md)")

    gradient_accumulation_fusion: bool = option(
        "--no-gradient-accumulation-fusion", default=True, action="store_false",
        dest="gradient_accumulation_fusion",
        help="Megatron-LM's switch for its fused weight-gradient accumulation (APEX/Transformer "
             "Engine); here autograd accumulates the weight gradients either way")

    def __post_init__(self) -> None:
        positive(self, (("build_timeout", "--kernel-build-timeout"),))

