"""The one place where dtype names ("float32", "fp16", ...) become torch dtypes."""
from __future__ import annotations

import torch

_BY_NAME = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""Canonical names used in configs and checkpoints."""


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a name (float32/float16/bfloat16, or fp32/fp16/bf16/half)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)} "
                         "(or fp32, fp16, bf16)") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a torch floating dtype: float32, float16 or bfloat16."""
    for name in DTYPE_NAMES:
        if _BY_NAME[name] == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPE_NAMES)}")
