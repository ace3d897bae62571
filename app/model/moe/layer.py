"""The MoE layer (Megatron Core's MoELayer): a router (pure routing math), a token dispatcher (the
only part that communicates) and the experts (local matmuls), plus the optional shared expert.

    x [b, s, h] ([b, s/tp, h] under sequence parallelism) -> tokens [T, h]
      -> router: probs, routing map [T, E]
      -> dispatcher: this rank's experts' rows [N, h], grouped by local expert
      -> experts: p x act(x W1^T) W2^T  [N, h]
      -> dispatcher: each token's outputs summed back [T, h]
      (+ shared expert(x), times sigmoid(x . gate_weight) with --moe-shared-expert-gate)
    -> ([b, s, h], None)

Parameters under `{prefix}` (= language_model.transformer.layers.{i}.mlp):
`router.weight` [E, h] (+ `router.expert_bias` [E] fp32 buffer), `shared_experts.dense_h_to_4h
.weight` [2 F_sh / tp, h] and `dense_4h_to_h.weight` [h, F_sh / tp] (a ParallelMLP over TP),
`shared_experts.gate_weight` [1, h], `experts.dense_h_to_4h.weight` [E/EP, 2F/ETP, h] and
`experts.dense_4h_to_h.weight` [E/EP, h, F/ETP] (app.model.moe.experts).

Recompute (--recompute-granularity selective): with `moe` in --recompute-modules the
transformer layer runs this whole layer through a checkpoint (app.model.gpt2); with
`shared_experts` the shared expert alone is. The checkpoint's first pass runs without
gradients, so the router attaches and records its auxiliary losses and token counts only in
the recompute (app.model.moe.router): once per micro-batch either way.

`begin_iteration(model, scale)` and `update_expert_bias(model)` are what an engine calls around
an iteration; `moe_layers(model)` finds the layers (every model chunk's).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from app.config import ModelConfig
from app.model.mlp import ParallelMLP
from app.model.moe.dispatcher import build_dispatcher
from app.model.moe.experts import GroupedExperts
from app.model.moe.router import TopKRouter
from app.mpu.layers import set_tensor_model_parallel_attributes
from app.mpu import random as mpu_random
from app.mpu.mappings import sum_gradient_over_tensor_parallel
from app.mpu.parallel_state import ParallelState
from app.utils.dtypes import torch_dtype


class SharedExpert(ParallelMLP):
    """The shared expert: a ParallelMLP of width --moe-shared-expert-intermediate-size over
    TP, its output scaled by sigmoid(x . gate_weight) with --moe-shared-expert-gate
    (`gate_weight` [1, h], replicated over TP; its gradient summed under sequence
    parallelism). [b, s, h] -> [b, s, h]."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: Any,
                 prefix: str) -> None:
        super().__init__(config, parallel_state, init, prefix,
                         ffn_hidden_size=config.moe.moe_shared_expert_intermediate_size)
        self.gate_weight: Optional[nn.Parameter] = None
        if config.moe.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size,
                                                        dtype=torch_dtype(config.params_dtype)))
            init.normal(f"{prefix}.gate_weight")(self.gate_weight)
            set_tensor_model_parallel_attributes(self.gate_weight, False)
            if config.sequence_parallel:
                sum_gradient_over_tensor_parallel(self.gate_weight, parallel_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, _ = super().forward(x)  # no biases in MoE layers
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    """See the module docstring. forward(x [b, s, h]) -> ([b, s, h], None) like ParallelMLP."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: Any,
                 prefix: str, layer_number: int) -> None:
        super().__init__()
        moe = config.moe
        self.layer_number = layer_number
        """Global index of the transformer layer (the log's row)."""
        self.router = TopKRouter(config, parallel_state, init, f"{prefix}.router")
        self.shared_experts: Optional[SharedExpert] = None
        if moe.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(config, parallel_state, init,
                                               f"{prefix}.shared_experts")
        self.recompute_shared = (config.recomputes("shared_experts")
                                 and not config.recomputes("moe"))  # moe reruns it anyway
        self.shared_inputs_replicated_over_tp = not config.sequence_parallel
        self.experts = GroupedExperts(config, parallel_state, init, f"{prefix}.experts")
        self.dispatcher = build_dispatcher(moe.moe_token_dispatcher_type, moe.num_experts,
                                           parallel_state)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, None]:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h], T = b x s (this rank's)
        probs, routing_map = self.router(tokens, batch=x.shape[0])  # [T, E] each
        dispatched = self.dispatcher.dispatch(tokens, probs, routing_map)
        rows = self.experts(dispatched.rows, dispatched.tokens_per_expert, dispatched.probs)
        out = self.dispatcher.combine(rows, dispatched).view_as(x)  # [b, s, h]
        if self.shared_experts is None:
            return out, None
        if self.recompute_shared and self.training and torch.is_grad_enabled():
            shared = mpu_random.checkpoint(  # [b, s, h], recomputed in backward
                self.shared_experts, x,
                inputs_replicated_over_tp=self.shared_inputs_replicated_over_tp)
        else:
            shared = self.shared_experts(x)  # [b, s, h]
        return out + shared, None


def moe_layers(model: nn.Module) -> List[MoELayer]:
    """The MoE layers of a model stage (or of all its chunks), in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def begin_iteration(model: nn.Module, loss_scale: Optional[float], context_parallel_size: int,
                    num_micro_batches: int, per_token: Optional[float] = None) -> None:
    """Before an iteration's forward-backward (Megatron's schedule sets it per step): the scale
    the auxiliary losses' gradients carry, the main loss's = loss scale (1 without fp16) x
    context-parallel size / micro-batches per rank; with --calculate-per-token-loss
    (`per_token`: the data x context ranks the gradients are averaged over / the global batch's
    token count) loss scale x `per_token`, as Megatron's per-token mode, where the auxiliary
    gradients are divided by the token count with the others. The per-iteration
    global_aux_loss counts reset. No-op for a dense model."""
    scale = ((loss_scale or 1.0) * context_parallel_size / num_micro_batches
             if per_token is None else (loss_scale or 1.0) * per_token)
    for layer in moe_layers(model):
        layer.router.begin_iteration(scale)


def update_expert_bias(model: nn.Module) -> None:
    """After an iteration's backward, before the optimizer step (Megatron's
    finalize_model_grads): every router with --moe-router-enable-expert-bias moves its bias;
    one all-reduce per MoE layer over tensor x data x context ranks (all on this stage)."""
    for layer in moe_layers(model):
        layer.router.update_expert_bias()
