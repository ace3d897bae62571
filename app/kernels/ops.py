"""Autograd wrappers over torch.ops.app_kernels.* and the shape rules that say when they apply.

Callers (app/model/fused.py) check `*_unsupported(...)` first: None means the kernel takes these
inputs; otherwise a short reason for the start-up line. The wrappers assume the library is
loaded (`app.kernels.library.status().available`). Outputs have the input's dtype; arithmetic
inside the kernels is fp32.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

MAX_SOFTMAX_LENGTH = 16384  # kMaxSoftmaxLength in csrc/kernels.h (a test keeps them equal)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ops():
    return torch.ops.app_kernels


def _dtype_unsupported(t: torch.Tensor) -> Optional[str]:
    if t.dtype not in KERNEL_DTYPES:
        return f"dtype {t.dtype} (kernels take float32/float16/bfloat16)"
    return None


def causal_softmax_unsupported(scores: torch.Tensor) -> Optional[str]:
    """None when the causal softmax kernel takes scores [..., s_q, s_k]; else why not."""
    s_q, s_k = scores.shape[-2], scores.shape[-1]
    if s_k > MAX_SOFTMAX_LENGTH:
        return f"s_k {s_k} over the kernel limit {MAX_SOFTMAX_LENGTH}"
    if s_q > s_k:
        return f"s_q {s_q} > s_k {s_k}"
    return _dtype_unsupported(scores)


def masked_softmax_unsupported(scores: torch.Tensor, mask: torch.Tensor) -> Optional[str]:
    """None when the masked softmax kernel takes scores [b, n, s_q, s_k] with this mask."""
    if scores.dim() != 4:
        return f"scores of rank {scores.dim()} (kernel takes [b, heads, s_q, s_k])"
    b, _, s_q, s_k = scores.shape
    if s_k > MAX_SOFTMAX_LENGTH:
        return f"s_k {s_k} over the kernel limit {MAX_SOFTMAX_LENGTH}"
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
            or mask.shape[0] not in (1, b) or tuple(mask.shape[2:]) != (s_q, s_k):
        return f"mask {tuple(mask.shape)} {mask.dtype} (kernel takes bool [b|1, 1, s_q, s_k])"
    return _dtype_unsupported(scores)


def layer_norm_unsupported(x: torch.Tensor, weight: Optional[torch.Tensor],
                           bias: Optional[torch.Tensor]) -> Optional[str]:
    """None when the LayerNorm kernel takes x [..., h] with this weight and bias."""
    if weight is None or bias is None:
        return "LayerNorm without weight or bias"
    if weight.dtype != bias.dtype or weight.dtype not in (x.dtype, torch.float32):
        return f"params {weight.dtype}/{bias.dtype} for input {x.dtype}"
    return _dtype_unsupported(x)


def rms_norm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """None when the RMSNorm kernel takes x [..., h] with this weight."""
    if weight.dtype not in (x.dtype, torch.float32):
        return f"weight {weight.dtype} for input {x.dtype}"
    return _dtype_unsupported(x)


def cross_entropy_unsupported(logits: torch.Tensor) -> Optional[str]:
    """None when the cross-entropy kernels take logits [..., V]."""
    if logits.shape[-1] >= 2 ** 31:
        return f"vocab slice {logits.shape[-1]} too large"
    return _dtype_unsupported(logits)


class _CausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, scale: float) -> torch.Tensor:
        probs = _ops().causal_softmax_forward(scores.contiguous(), scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        grad = _ops().softmax_backward(grad_probs.contiguous(), probs, None, ctx.scale, True)
        return grad, None


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        mask = mask.contiguous()
        probs = _ops().masked_softmax_forward(scores.contiguous(), mask, scale)
        ctx.save_for_backward(probs, mask)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        probs, mask = ctx.saved_tensors
        grad = _ops().softmax_backward(grad_probs.contiguous(), probs, mask, ctx.scale, False)
        return grad, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, mean, rstd = _ops().layer_norm_forward(x, weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _ops().layer_norm_backward(grad_y.contiguous(), x,
                                                        weight.contiguous(), mean, rstd)
        return dx, dweight, dbias, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, rstd = _ops().rms_norm_forward(x, weight.contiguous(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _ops().rms_norm_backward(grad_y.contiguous(), x, weight.contiguous(), rstd)
        return dx, dweight, None


def causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * scores) with column c > row + s_k - s_q masked; [..., s_q, s_k], CUDA."""
    return _CausalSoftmax.apply(scores, scale)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * scores) with mask (True = masked) [b|1, 1, s_q, s_k]; fully masked rows
    are uniform, and get zero gradient. scores [b, n, s_q, s_k], CUDA."""
    return _MaskedSoftmax.apply(scores, mask, scale)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics; y in x's dtype, params fp32 or x's."""
    return _LayerNorm.apply(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 statistics; y in x's dtype, weight fp32 or x's."""
    return _RMSNorm.apply(x, weight, eps)


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [..., v]: (max, sum exp(z - max), z[target - vocab_start] or 0), fp32."""
    return _ops().cross_entropy_stats(logits.contiguous(), target.contiguous(), vocab_start)


def cross_entropy_grad(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                       logsumexp: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """(softmax(z) - onehot(target - vocab_start)) * grad_loss, in the logits' dtype."""
    return _ops().cross_entropy_backward(grad_loss.float().contiguous(), logits, target,
                                         logsumexp, vocab_start)
