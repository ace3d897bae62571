"""Fused-op wrappers with plain-PyTorch implementations: bias+GeLU and scale+mask+softmax.

Each public function has one reference implementation here, written with ordinary PyTorch ops
(autograd gives the backward). A CUDA kernel can be registered later with `register_kernel`;
the wrappers then route to it when the inputs are on CUDA, and tests compare it with the
reference. Numerics of the fused and unfused paths are the same by contract.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

_KERNELS: Dict[str, Callable] = {}


def register_kernel(name: str, fn: Callable) -> None:
    """Install a kernel for `name` ("bias_gelu" or "scale_mask_softmax"); used for CUDA inputs."""
    if name not in ("bias_gelu", "scale_mask_softmax"):
        raise ValueError(f"unknown fused op {name!r}; expected bias_gelu or scale_mask_softmax")
    _KERNELS[name] = fn


def has_kernel(name: str) -> bool:
    """True when a device kernel is registered for `name`."""
    return name in _KERNELS


def gelu(x: torch.Tensor, openai_gelu: bool = False) -> torch.Tensor:
    """GeLU: exact `x * Phi(x)` (erf), or GPT-2's tanh approximation when `openai_gelu`."""
    return F.gelu(x, approximate="tanh" if openai_gelu else "none")


def bias_gelu(bias: Optional[torch.Tensor], x: torch.Tensor, openai_gelu: bool = False,
              use_kernel: bool = True) -> torch.Tensor:
    """gelu(x + bias), `bias` broadcast over the last dimension (None means no bias). Shape of x.

    `use_kernel` (--bias-gelu-fusion) allows a registered CUDA kernel for CUDA inputs.
    """
    kernel = _KERNELS.get("bias_gelu") if use_kernel else None
    if kernel is not None and x.is_cuda:
        return kernel(bias, x, openai_gelu)
    if bias is not None:
        x = x + bias
    return gelu(x, openai_gelu)


def scale_mask_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                       softmax_in_fp32: bool = True, use_kernel: bool = True) -> torch.Tensor:
    """softmax(scale * scores with masked positions removed) over the last dim; dtype of scores.

    scores: [b, heads, s_q, s_k]; mask: bool, broadcastable to scores, True = masked out (Megatron's
    convention), or None for no mask. Masked positions get the dtype's lowest value before the
    softmax, so they receive probability 0 exactly and a fully masked row gives a uniform row
    instead of NaN. With `softmax_in_fp32` half-precision scores are upcast for the softmax.
    `use_kernel` (--masked-softmax-fusion) allows a registered CUDA kernel for CUDA inputs.
    """
    kernel = _KERNELS.get("scale_mask_softmax") if use_kernel else None
    if kernel is not None and scores.is_cuda:
        return kernel(scores, mask, scale)
    out_dtype = scores.dtype
    if softmax_in_fp32 and scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).to(out_dtype)
