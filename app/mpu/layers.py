"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Initialisation is independent of the tensor-parallel size: `init_method(full_weight)` fills the
full fp32 master weight on the CPU (shape [out, in] for the linears, [vocab, h] for the
embedding) and each rank keeps its contiguous shard. Tensor-parallel parameters carry
`tensor_model_parallel = True` and `partition_dim`; replicated ones carry False.

`parallel_state=None` means the current default (`parallel_state.get_parallel_state()`), so the
layers also work in one process without torch.distributed.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from app.mpu.mappings import (copy_to_tensor_model_parallel_region,
                              gather_from_tensor_model_parallel_region,
                              reduce_from_tensor_model_parallel_region,
                              scatter_to_tensor_model_parallel_region)
from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.mpu.utils import shard_range, vocab_range

InitMethod = Callable[[torch.Tensor], object]


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int = -1) -> None:
    """Mark `param` as split over TP along `partition_dim` (or as replicated, partition_dim -1)."""
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


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns (weight rows) across the tensor-parallel group.

    [*, in] -> [*, out/tp], or [*, out] with `gather_output`. The weight is [out/tp, in]
    (rows [rank*out/tp, (rank+1)*out/tp) of the full [out, in] weight), the bias [out/tp].
    With `skip_bias_add` forward returns (output, bias) and does not add the bias.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
        tp = self.parallel_state.tensor_model_parallel_size
        rank = self.parallel_state.tensor_model_parallel_rank
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
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

    def forward(self, input_: torch.Tensor
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        x = copy_to_tensor_model_parallel_region(input_, self.parallel_state)  # [*, in]
        bias = None if self.skip_bias_add else self.bias
        out = F.linear(x, self.weight, bias)  # [*, out/tp]
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
    returns (output, bias) without adding it.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
        tp = self.parallel_state.tensor_model_parallel_size
        rank = self.parallel_state.tensor_model_parallel_rank
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        start, end = shard_range(input_size, rank, tp, "input_size")
        self.input_size_per_partition = end - start
        self.weight = _sharded_param((output_size, input_size), init_method, 1, start, end,
                                     params_dtype)  # [out, in/tp]
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))  # [out]
            set_tensor_model_parallel_attributes(self.bias, False)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        x = input_
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.parallel_state)  # [*, in/tp]
        partial = F.linear(x, self.weight)  # [*, out], this rank's share of the sum
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
    and the partial results are all-reduced over TP. The weight is [vocab/tp, h].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: InitMethod,
                 parallel_state: Optional[ParallelState] = None,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.parallel_state = _state(parallel_state)
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
        return reduce_from_tensor_model_parallel_region(partial, self.parallel_state)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start_index}, {self.vocab_end_index})")
