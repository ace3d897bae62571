"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Initialisation is independent of the tensor-parallel size: `init_method(full_weight)` fills the
full fp32 master weight on the CPU (shape [out, in] for the linears, [vocab, h] for the
embedding) and each rank keeps its contiguous shard. Each layer marks the parameters it cuts
(`set_tensor_model_parallel_attributes`): `tensor_model_parallel = True` and the
`partition_dim` it cut along, or False and -1 for replicated ones. These marks are the only
statement of how a parameter is split; gradient clipping, Muon, DeepSpeed's universal
checkpoints and the checkpoint converter (app.model.stage.parameter_records) read them.

`parallel_state=None` means the current default (`parallel_state.get_parallel_state()`), so the
layers also work in one process without torch.distributed.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from app.mpu import collectives
from app.mpu.mappings import (SEQUENCE_DIM, copy_to_tensor_model_parallel_region,
                              gather_from_tensor_model_parallel_region,
                              reduce_from_tensor_model_parallel_region,
                              reduce_scatter_to_sequence_parallel_region,
                              scatter_to_tensor_model_parallel_region,
                              sum_gradient_over_tensor_parallel)
from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.mpu.utils import shard_range, vocab_range

InitMethod = Callable[[torch.Tensor], object]


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int = -1) -> None:
    """Mark `param` as split over TP along `partition_dim` (or as replicated, partition_dim -1):
    the marks every reader of the split relies on (see the module docstring)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim if is_parallel else -1
    param.partition_stride = 1


def _sharded_param(full_shape: Tuple[int, int], init_method: InitMethod, dim: int,
                   start: int, end: int, dtype: torch.dtype) -> nn.Parameter:
    """Fill the full fp32 master weight with `init_method` and keep [start:end) along `dim`."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    shard = full.narrow(dim, start, end - start).to(dtype).contiguous()
    return nn.Parameter(shard)


def _state(parallel_state: Optional[ParallelState]) -> ParallelState:
    return get_parallel_state() if parallel_state is None else parallel_state


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    """all_gather_s(X) W^T + b, keeping only this rank's sequence slice of X for backward.

    Backward all-gathers X again for the weight gradient (Megatron's choice: the full input is
    the largest activation of the layer) and reduce-scatters the input gradient along s.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: object) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        full = collectives.all_gather_dim(x, group, SEQUENCE_DIM)  # [b, s, in]
        return F.linear(full, weight, bias)  # [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_full = grad.matmul(weight)  # [b, s, in], this rank's share of the sum
            grad_x = collectives.reduce_scatter(grad_full, ctx.group, dim=SEQUENCE_DIM)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [b*s, out/tp]
        if ctx.needs_input_grad[1]:
            full = collectives.all_gather_dim(x, ctx.group, SEQUENCE_DIM)  # [b, s, in]
            grad_weight = grad_2d.t().matmul(full.reshape(-1, full.shape[-1]))  # [out/tp, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(dim=0)
        return grad_x, grad_weight, grad_bias, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           parallel_state: ParallelState,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """X W^T + b for a weight split by output rows over TP: [*, in] -> [*, out/tp].

    The input is replicated over TP (its gradient is all-reduced in backward), or with
    `sequence_parallel` a [b, s/tp, in] slice that is all-gathered along s (reduce-scattered
    in backward). Used by ColumnParallelLinear and by the tied output layer.
    """
    if sequence_parallel and parallel_state.tensor_model_parallel_size > 1:
        return _LinearWithSequenceParallelInput.apply(
            x, weight, bias, parallel_state.tensor_model_parallel_group)
    return F.linear(copy_to_tensor_model_parallel_region(x, parallel_state), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns (weight rows) across the tensor-parallel group.

    [*, in] -> [*, out/tp], or [*, out] with `gather_output`. The weight is [out/tp, in]
    (rows [rank*out/tp, (rank+1)*out/tp) of the full [out, in] weight), the bias [out/tp].
    With `skip_bias_add` forward returns (output, bias) and does not add the bias. With
    `sequence_parallel` the input is this rank's [b, s/tp, in] slice of the sequence
    (see `column_parallel_linear`). `forward(x, weight)` may pass another weight of the same
    shape (Megatron's signature).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
        tp = self.parallel_state.tensor_model_parallel_size
        rank = self.parallel_state.tensor_model_parallel_rank
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel input with gather_output "
                             "is not supported (the output would be sequence- and "
                             "feature-complete on every rank)")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        start, end = shard_range(output_size, rank, tp, "output_size")
        self.output_size_per_partition = end - start
        self.weight = _sharded_param((output_size, input_size), init_method, 0, start, end,
                                     params_dtype)  # [out/tp, in]
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(end - start, dtype=params_dtype))  # [out/tp]
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        bias = None if self.skip_bias_add else self.bias
        out = column_parallel_linear(input_, self.weight if weight is None else weight, bias,
                                     self.parallel_state, self.sequence_parallel)  # [*, out/tp]
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.parallel_state)  # [*, out]
        if self.skip_bias_add:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"out_per_partition={self.output_size_per_partition}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows (weight columns) across the tensor-parallel group.

    [*, in/tp] -> [*, out] (or [*, in] -> [*, out] with input_is_parallel=False, which scatters
    the input first). The partial products are all-reduced over TP and the replicated bias [out]
    is added once after the reduce. The weight is [out, in/tp]: columns
    [rank*in/tp, (rank+1)*in/tp) of the full [out, in] weight. With `skip_bias_add` forward
    returns (output, bias) without adding it. With `sequence_parallel` the partial products
    [b, s, out] are reduce-scattered along s instead, giving this rank's [b, s/tp, out] slice;
    the bias's gradient is then summed over TP (each rank adds it to different tokens).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
        tp = self.parallel_state.tensor_model_parallel_size
        rank = self.parallel_state.tensor_model_parallel_rank
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        start, end = shard_range(input_size, rank, tp, "input_size")
        self.input_size_per_partition = end - start
        self.weight = _sharded_param((output_size, input_size), init_method, 1, start, end,
                                     params_dtype)  # [out, in/tp]
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))  # [out]
            set_tensor_model_parallel_attributes(self.bias, False)
            if sequence_parallel:
                sum_gradient_over_tensor_parallel(self.bias, self.parallel_state)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        x = input_
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.parallel_state)  # [*, in/tp]
        partial = F.linear(x, self.weight)  # [*, out], this rank's share of the sum
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.parallel_state)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.parallel_state)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"in_per_partition={self.input_size_per_partition}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the rows of E [vocab, h] split evenly across the tensor-parallel group.

    ids [*] -> [*, h]. Each rank looks up the ids in its range [start, end) (others give zeros)
    and the partial results are all-reduced over TP. The weight is [vocab/tp, h]. With
    `reduce_scatter_embeddings` (sequence parallelism without a position table) ids [b, s]
    give this rank's [b, s/tp, h] slice of the sequence through a reduce-scatter instead.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32,
                 reduce_scatter_embeddings: bool = False) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        tp = self.parallel_state.tensor_model_parallel_size
        rank = self.parallel_state.tensor_model_parallel_rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, rank, tp)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _sharded_param((num_embeddings, embedding_dim), init_method, 0,
                                     self.vocab_start_index, self.vocab_end_index,
                                     params_dtype)  # [vocab/tp, h]
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel_state.tensor_model_parallel_size == 1:
            return F.embedding(input_ids, self.weight)  # [*, h]
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight)  # [*, h]
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial, self.parallel_state)
        return reduce_from_tensor_model_parallel_region(partial, self.parallel_state)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start_index}, {self.vocab_end_index})")
