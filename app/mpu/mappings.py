"""Autograd mappings into and out of the tensor-parallel region, in conjugate pairs.

    copy_to    : forward identity          backward all-reduce (sum)
    reduce_from: forward all-reduce (sum)  backward identity
    scatter_to : forward split last dim    backward all-gather last dim
    gather_from: forward all-gather last   backward split last dim

Each takes the tensor and either a ParallelState (its tensor-parallel group is used) or a
process group; None means the current default state (`parallel_state.get_parallel_state()`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from app.mpu import collectives
from app.mpu.parallel_state import get_parallel_state


def tensor_parallel_group(parallel_state: Any = None) -> Optional[object]:
    """The tensor-parallel group of a ParallelState, a process group as is, or the default's."""
    if parallel_state is None:
        return get_parallel_state().tensor_model_parallel_group
    if hasattr(parallel_state, "tensor_model_parallel_group"):
        return parallel_state.tensor_model_parallel_group
    return parallel_state


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any) -> torch.Tensor:
        return collectives.all_reduce(input_.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return collectives.split_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.all_gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return collectives.all_gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.split_last_dim(grad, ctx.group), None


def _trivial(group: Any) -> bool:
    return collectives.group_size(group) == 1


def copy_to_tensor_model_parallel_region(input_: torch.Tensor,
                                         parallel_state: Any = None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over TP in backward. [*] -> [*]."""
    group = tensor_parallel_group(parallel_state)
    return input_ if _trivial(group) else _CopyToRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             parallel_state: Any = None) -> torch.Tensor:
    """All-reduce (sum) over TP forward; identity backward. [*] -> [*]."""
    group = tensor_parallel_group(parallel_state)
    return input_ if _trivial(group) else _ReduceFromRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor,
                                            parallel_state: Any = None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; all-gather in backward. [*, n] -> [*, n/tp]."""
    group = tensor_parallel_group(parallel_state)
    return input_ if _trivial(group) else _ScatterToRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             parallel_state: Any = None) -> torch.Tensor:
    """All-gather the last dim over TP; split in backward. [*, n/tp] -> [*, n]."""
    group = tensor_parallel_group(parallel_state)
    return input_ if _trivial(group) else _GatherFromRegion.apply(input_, group)
