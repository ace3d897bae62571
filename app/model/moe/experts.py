"""The routed experts of an MoE layer: this rank's E / EP experts as two 3-D weights, local
matmuls only (the dispatcher brings the rows and takes the outputs away).

    dense_h_to_4h.weight  [E/EP, 2F/ETP, H]   (F/ETP rows without --swiglu)
    dense_4h_to_h.weight  [E/EP, H, F/ETP]

Expert j of this rank is global expert ep_rank x E/EP + j. With --swiglu its first weight's
rows are [gate_r; up_r], this expert-tensor rank r's shard of each half (as the dense MLP and
Megatron hold them). Each global expert's full weights are drawn from their own generator
(`init.normal(f"{name}.{expert}")`, std and std / sqrt(2L) like the dense MLP), then cut for
this rank, so initial values do not depend on EP or ETP.

Marks (app.mpu.layers' contract, plus the expert ones every consumer reads):
`allreduce = False` (an expert parameter: its gradient is summed over the expert-data-parallel
group and its norm counted over expert tensor x expert x pipeline ranks; DeepSpeed's mark too),
`group_name = "ep_size_{EP}"` (DeepSpeed's expert group name), `expert_axis = (0, ep_rank, EP)`
(dim 0 holds global experts [ep_rank E/EP, (ep_rank + 1) E/EP)), `tensor_model_parallel = True`
with `partition_dim` 1 (fc1 rows) / 2 (fc2 columns) split over the expert-tensor group
(`expert_tensor_parallel = True`), and `glu_halves` on fc1 with --swiglu.

forward(rows [N, H], tokens_per_expert, probs [N]) -> [N, H]: per expert
probs x act(x W1^T) W2^T (the probability scales the activated intermediate, as Megatron),
either a loop over the experts or, with --moe-grouped-gemm, torch's grouped matmul (where the
shapes meet its 16-byte alignment; else the loop). Every local expert's weights get a gradient
(zeros) even when no token reached it.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ModelConfig
from app.model import fused
from app.mpu.parallel_state import ParallelState
from app.utils.dtypes import torch_dtype


def mark_expert_parameter(param: torch.Tensor, partition_dim: int, ep_rank: int, ep: int) -> None:
    """The expert marks of the module docstring."""
    param.allreduce = False
    param.group_name = f"ep_size_{ep}"
    param.expert_axis = (0, ep_rank, ep)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.expert_tensor_parallel = True


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch.nn.functional.grouped_mm can take x [N, K] against weight [G, M, K] in both
    directions: it exists, the dtype is a float one and every row is a multiple of 16 bytes."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16,
                                                       torch.float16):
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (weight.shape[1], weight.shape[2]))


class _GroupedLinear(torch.autograd.Function):
    """y = x W_g^T row-group by row-group ([N, K] x [G, M, K] -> [N, M]) with grouped_mm both
    ways; backward takes a contiguous gradient (grouped_mm refuses expanded strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
        ctx.save_for_backward(x, weight, offsets)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = F.grouped_mm(grad.t(), x, offs=offsets)  # [G, M, K]
        return grad_x, grad_w, None


def _linear_by_expert(x: torch.Tensor, weight: torch.Tensor, counts: List[int],
                      grouped: bool) -> torch.Tensor:
    """[N, K] rows grouped by expert (`counts`) x weight [G, M, K] -> [N, M]."""
    if grouped and grouped_mm_applies(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _GroupedLinear.apply(x, weight, offsets)
    outs = [F.linear(part, w) for part, w in zip(x.split(counts), weight.unbind(0))]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class ExpertWeight(nn.Module):
    """One projection of all local experts, `weight` [E/EP, rows, cols] with the expert marks
    (a module so that the name ends in `.weight`, as the dense MLP's)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, ep_rank: int, ep: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        mark_expert_parameter(self.weight, partition_dim, ep_rank, ep)


class GroupedExperts(nn.Module):
    """This rank's routed experts (see the module docstring)."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: Any,
                 prefix: str) -> None:
        super().__init__()
        moe, ps = config.moe, parallel_state
        ep, etp = ps.expert_model_parallel_size, ps.expert_tensor_parallel_size
        ep_rank, etp_rank = ps.expert_model_parallel_rank, ps.expert_tensor_parallel_rank
        self.num_local = moe.num_experts // ep
        self.swiglu, self.openai_gelu = config.swiglu, config.openai_gelu
        self.swiglu_fusion = config.bias_swiglu_fusion
        self.grouped = moe.moe_grouped_gemm
        h, f = config.hidden_size, moe.moe_ffn_hidden_size
        halves = 2 if config.swiglu else 1
        dtype = torch_dtype(config.params_dtype)
        fc1 = torch.empty(self.num_local, halves * f // etp, h, dtype=dtype)
        fc2 = torch.empty(self.num_local, h, f // etp, dtype=dtype)
        fc1_name, fc2_name = f"{prefix}.dense_h_to_4h.weight", f"{prefix}.dense_4h_to_h.weight"
        for j in range(self.num_local):
            expert = ep_rank * self.num_local + j
            full1 = torch.empty(halves * f, h, dtype=torch.float32)
            init.normal(f"{fc1_name}.{expert}")(full1)
            parts = [half.chunk(etp)[etp_rank] for half in full1.chunk(halves)]
            full2 = torch.empty(h, f, dtype=torch.float32)
            init.scaled_normal(f"{fc2_name}.{expert}")(full2)
            with torch.no_grad():
                fc1[j].copy_(torch.cat(parts))
                fc2[j].copy_(full2.chunk(etp, dim=1)[etp_rank])
        self.dense_h_to_4h = ExpertWeight(fc1, 1, ep_rank, ep)
        self.dense_4h_to_h = ExpertWeight(fc2, 2, ep_rank, ep)
        if config.swiglu:
            self.dense_h_to_4h.weight.glu_halves = True

    def forward(self, rows: torch.Tensor, tokens_per_expert: List[int],
                probs: torch.Tensor) -> torch.Tensor:
        hidden = _linear_by_expert(rows, self.dense_h_to_4h.weight, tokens_per_expert,
                                   self.grouped)  # [N, 2F/ETP]
        if self.swiglu:
            hidden = fused.swiglu(hidden, self.swiglu_fusion)  # [N, F/ETP]
        else:
            hidden = fused.gelu(hidden, self.openai_gelu)
        hidden = (hidden * probs.unsqueeze(-1)).to(rows.dtype)  # Megatron's per-token scale
        return _linear_by_expert(hidden, self.dense_4h_to_h.weight, tokens_per_expert,
                                 self.grouped)  # [N, H] (partial sums over ETP)
