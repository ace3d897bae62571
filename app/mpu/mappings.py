"""Autograd mappings into and out of the tensor-parallel region, in conjugate pairs.

    copy_to    : forward identity          backward all-reduce (sum)
    reduce_from: forward all-reduce (sum)  backward identity
    scatter_to : forward split last dim    backward all-gather last dim
    gather_from: forward all-gather last   backward split last dim

and, for sequence parallelism (activations [b, s, h] split along s, `SEQUENCE_DIM`):

    scatter_to_sequence_parallel       : forward split s           backward all-gather s
    reduce_scatter_to_sequence_parallel: forward reduce-scatter s  backward all-gather s

and, for the MoE token dispatchers, on an explicit group along the token (first) dim:

    gather_rows        : forward all-gather rows   backward reduce-scatter rows
    reduce_scatter_rows: forward reduce-scatter    backward all-gather rows
    all_to_all_rows    : forward all-to-all        backward the reverse all-to-all

The tensor-parallel ones take the tensor and either a ParallelState (its tensor-parallel group
is used) or a process group; None means the current default state
(`parallel_state.get_parallel_state()`).

`sum_gradient_over_tensor_parallel(param, ...)` is the gradient-side mapping for parameters
that are replicated over TP ranks but see different data on each (LayerNorm weights in the
sequence-parallel region, key/value rows shared by several ranks under grouped-query attention):
their gradient is summed over the ranks that share them, inside backward.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

SEQUENCE_DIM = 1
"""The sequence dimension of batch-first activations [b, s, h]."""

import torch

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState, get_parallel_state


def tensor_parallel_group(parallel_state: Optional[ParallelState] = None) -> Optional[object]:
    """The tensor-parallel group of a ParallelState, a process group as is, or the default's."""
    if parallel_state is None:
        return get_parallel_state().tensor_model_parallel_group
    if hasattr(parallel_state, "tensor_model_parallel_group"):
        return parallel_state.tensor_model_parallel_group
    return parallel_state


class _ConjugateMapping(torch.autograd.Function):
    """forward_op(input, group) in forward, backward_op(grad, group) in backward."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any, forward_op: Callable,
                backward_op: Callable) -> torch.Tensor:
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(input_, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _map(input_: torch.Tensor, parallel_state: ParallelState, forward_op: Callable,
         backward_op: Callable) -> torch.Tensor:
    """input_ itself on one TP rank, else the conjugate pair applied over the TP group."""
    group = tensor_parallel_group(parallel_state)
    if collectives.group_size(group) == 1:
        return input_
    return _ConjugateMapping.apply(input_, group, forward_op, backward_op)


def _identity(t: torch.Tensor, group: Any) -> torch.Tensor:
    return t.view_as(t)  # a new tensor object, as autograd wants from forward


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.all_reduce(t.clone(), group)


def _split_sequence(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.split_dim(t, group, SEQUENCE_DIM)


def _gather_sequence(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.all_gather_dim(t, group, SEQUENCE_DIM)


def _reduce_scatter_sequence(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.reduce_scatter(t, group, dim=SEQUENCE_DIM)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor,
                                         parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over TP in backward. [*] -> [*]."""
    return _map(input_, parallel_state, _identity, _all_reduce)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """All-reduce (sum) over TP forward; identity backward. [*] -> [*]."""
    return _map(input_, parallel_state, _all_reduce, _identity)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor,
                                            parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; all-gather in backward. [*, n] -> [*, n/tp]."""
    return _map(input_, parallel_state, collectives.split_last_dim,
                collectives.all_gather_last_dim)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """All-gather the last dim over TP; split in backward. [*, n/tp] -> [*, n]."""
    return _map(input_, parallel_state, collectives.all_gather_last_dim,
                collectives.split_last_dim)


def scatter_to_sequence_parallel_region(input_: torch.Tensor,
                                        parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """Keep this rank's slice of the sequence; all-gather in backward. [b, s, h] -> [b, s/tp, h]."""
    return _map(input_, parallel_state, _split_sequence, _gather_sequence)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor,
                                               parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of the sequence; all-gather in backward.
    [b, s, h] partial sums -> [b, s/tp, h]."""
    return _map(input_, parallel_state, _reduce_scatter_sequence, _gather_sequence)


# ---- token exchanges over an explicit group (the MoE token dispatchers) ------------------------
def _gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.all_gather_dim(t, group, 0)


def _reduce_scatter_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    return collectives.reduce_scatter(t.contiguous(), group, dim=0)


def _on_group(input_: torch.Tensor, group: Any, forward_op: Callable,
              backward_op: Callable) -> torch.Tensor:
    if collectives.group_size(group) == 1:
        return input_
    return _ConjugateMapping.apply(input_, group, forward_op, backward_op)


def gather_rows(input_: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's rows concatenated in group-rank order; reduce-scatter of the gradient in
    backward. [n, *] -> [n * group_size, *] (no communication for None / one rank)."""
    return _on_group(input_, group, _gather_rows, _reduce_scatter_rows)


def reduce_scatter_rows(input_: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group and keep this rank's contiguous rows; all-gather of the gradient in
    backward. [n * group_size, *] -> [n, *]."""
    return _on_group(input_, group, _reduce_scatter_rows, _gather_rows)


class _AllToAllRows(torch.autograd.Function):
    """collectives.all_to_all_single forward; the reverse exchange of the gradient backward."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, output_splits, input_splits, group: Any):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        return collectives.all_to_all_single(input_, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return (collectives.all_to_all_single(grad.contiguous(), input_splits, output_splits,
                                              ctx.group), None, None, None)


def all_to_all_rows(input_: torch.Tensor, output_splits, input_splits, group: Any
                    ) -> torch.Tensor:
    """Rows of `input_` split by `input_splits` go to the group's ranks in order; returns the
    rows received (`output_splits` from each rank). Backward sends the gradients back."""
    if collectives.group_size(group) == 1:
        return input_
    return _AllToAllRows.apply(input_, output_splits, input_splits, group)


def sum_gradient_over_tensor_parallel(param: torch.Tensor, parallel_state: Optional[ParallelState] = None, *,
                                      first_row: int = 0, replica_set: int = 0,
                                      num_replica_sets: int = 1) -> None:
    """Make backward sum `param`'s gradient rows [first_row:] over the TP ranks sharing them.

    For a parameter replicated over the tensor-parallel group whose uses differ per rank
    (LayerNorm and bias in the sequence-parallel region: defaults, the whole gradient summed
    over TP). With `num_replica_sets` > 1 the TP ranks form that many sets (this rank is in
    `replica_set`), each holding its own rows [first_row:] (key/value heads of one query group
    under grouped-query attention), and the rows are summed within a set only. Implemented as a
    gradient hook, so every engine (native, DeepSpeed) sees the summed gradient; the sum happens
    once per backward pass. The parameter is marked `sequence_parallel` (whole tensor) or
    `replicated_rows = (first_row, ranks per set)` for gradient-norm counting (app.mpu.grads).
    """
    group = tensor_parallel_group(parallel_state)
    size = collectives.group_size(group)
    if size == 1:
        return
    if size % num_replica_sets:
        raise ValueError(f"{num_replica_sets} replica sets do not divide the tensor-parallel "
                         f"size ({size})")
    if first_row == 0 and num_replica_sets == 1:
        param.sequence_parallel = True
    else:
        param.replicated_rows = (first_row, size // num_replica_sets)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        rows = grad[first_row:]
        if num_replica_sets == 1:
            summed = collectives.all_reduce(rows.clone(), group)
        else:  # one slot per set; the other sets add zeros to this set's slot
            slots = rows.new_zeros((num_replica_sets,) + tuple(rows.shape))
            slots[replica_set] = rows
            summed = collectives.all_reduce(slots, group)[replica_set]
        return summed if first_row == 0 else torch.cat([grad[:first_row], summed])

    param.register_hook(hook)
