"""What this machine has for features that need special hardware: the CUDA device's compute
capability and whether NVIDIA Transformer Engine is installed (without importing it)."""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from app.config import Fp8Config


def cuda_capability() -> Optional[Tuple[int, int]]:
    """The first CUDA device's compute capability, or None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return int(major), int(minor)


def transformer_engine_installed() -> bool:
    """Whether `transformer_engine.pytorch` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):  # transformer_engine itself missing or broken
        return False


def fp8_problem(fp8: Fp8Config) -> Optional[str]:
    """Why this machine cannot run `fp8` (an app.config.Fp8Config), or None."""
    return fp8.requirement(cuda_capability(), transformer_engine_installed())
