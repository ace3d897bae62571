"""The transformer layer's MLP (Megatron's ParallelMLP): column-parallel h -> ffn, GeLU or
SwiGLU, row-parallel ffn -> h; also the shared expert of an MoE layer (app.model.moe).

Initial values come from the model's `ParamInit` (app.model.gpt2), so they depend only on the
seed and each parameter's global name, not on TP.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from app.config import ModelConfig
from app.model import fused
from app.mpu.layers import ColumnParallelLinear, RowParallelLinear
from app.mpu.parallel_state import ParallelState
from app.mpu.utils import divide
from app.utils.dtypes import torch_dtype

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def glu_init(full_init: InitMethod, ffn_hidden_size: int, tp: int) -> InitMethod:
    """init_method for SwiGLU's first projection [2f, h] as ColumnParallelLinear splits it:
    draws the full [gate (f rows); up (f rows)] weight with `full_init` and stacks each rank's
    gate shard followed by its up shard, so rank r's contiguous slice is [gate_r; up_r] (as
    Megatron holds it: the gated product is local to the rank)."""
    def init(stacked: torch.Tensor) -> torch.Tensor:
        full = torch.empty(stacked.shape, dtype=torch.float32)
        full_init(full)
        gate, up = full.chunk(2)  # [f, h] each
        parts = [half for pair in zip(gate.chunk(tp), up.chunk(tp)) for half in pair]
        with torch.no_grad():
            return stacked.copy_(torch.cat(parts))
    return init




class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> bias+GeLU -> h (row-parallel, TP-reduced); with --swiglu
    h -> [gate, up] (2 x ffn, each rank its shard of both) -> silu(gate) * up -> h.

    [b, s, h] -> ([b, s, h], output bias [h] or None): the last bias is returned for
    bias+dropout+add ([b, s/tp, h] in and out with sequence parallelism). `init` is the model's
    ParamInit (app.model.gpt2); `ffn_hidden_size` overrides the config's width (the shared
    expert of an MoE layer).
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: Any,
                 prefix: str, ffn_hidden_size: Optional[int] = None) -> None:
        super().__init__()
        dtype = torch_dtype(config.params_dtype)
        tp = parallel_state.tensor_model_parallel_size
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.openai_gelu, self.swiglu = config.openai_gelu, config.swiglu
        self.swiglu_fusion = config.bias_swiglu_fusion
        # The bias goes to the fused bias+GeLU op where that op is fused (CUDA); otherwise it
        # stays inside the GEMM (addmm), which is cheaper than a separate add.
        self.bias_gelu_flag = config.bias_gelu_fusion
        self.bias_gelu_fusion = (fused.bias_gelu_fusion_applies(config.bias_gelu_fusion)
                                 and not config.swiglu)
        fc1_init = init.normal(f"{prefix}.dense_h_to_4h.weight")
        if config.swiglu:
            divide(ffn, tp, "ffn_hidden_size", "tensor_model_parallel_size")
            fc1_init = glu_init(fc1_init, ffn, tp)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, ffn * (2 if config.swiglu else 1), gather_output=False,
            bias=config.add_bias_linear, init_method=fc1_init,
            parallel_state=parallel_state, params_dtype=dtype,
            skip_bias_add=self.bias_gelu_fusion, sequence_parallel=config.sequence_parallel)
        if config.swiglu:  # checkpoints place [gate_r; up_r] by this mark (app.checkpoint.sharding)
            for param in self.dense_h_to_4h.parameters():
                param.glu_halves = True
        self.dense_4h_to_h = RowParallelLinear(
            ffn, config.hidden_size, input_is_parallel=True, bias=config.add_bias_linear,
            init_method=init.scaled_normal(f"{prefix}.dense_4h_to_h.weight"),
            parallel_state=parallel_state, params_dtype=dtype, skip_bias_add=True,
            sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.swiglu:
            intermediate = fused.swiglu(self.dense_h_to_4h(x), self.swiglu_fusion)  # [b,s,f/tp]
        elif self.bias_gelu_fusion:
            intermediate, bias = self.dense_h_to_4h(x)  # [b, s, ffn/tp], [ffn/tp] or None
            intermediate = fused.bias_gelu(bias, intermediate, self.openai_gelu)
        else:
            intermediate = fused.bias_gelu(None, self.dense_h_to_4h(x), self.openai_gelu,
                                           self.bias_gelu_flag)  # [b, s, ffn/tp]
        return self.dense_4h_to_h(intermediate)  # [b, s, h], [h] or None
