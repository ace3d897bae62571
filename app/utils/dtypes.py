"""The one place where dtype names ("float32", "fp16", ...) become torch dtypes.

torch is imported on first use, so that configs (app.config) import without it: a tool that
never builds a model (tools/preprocess_data.py) starts without loading torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_BY_NAME = {
    "float32": "float32", "fp32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
"""Every accepted name -> its canonical name (the torch attribute)."""
DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""Canonical names used in configs and checkpoints."""


def torch_dtype(name: str) -> "torch.dtype":
    """torch dtype for a name (float32/float16/bfloat16, or fp32/fp16/bf16/half)."""
    import torch
    try:
        return getattr(torch, _BY_NAME[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)} "
                         "(or fp32, fp16, bf16)") from None


def dtype_name(dtype: "torch.dtype") -> str:
    """Canonical name of a torch floating dtype: float32, float16 or bfloat16."""
    import torch
    for name in DTYPE_NAMES:
        if getattr(torch, name) == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPE_NAMES)}")
