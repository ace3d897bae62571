"""The top-k router of an MoE layer (Megatron Core's TopKRouter): gating, routing, capacity, and
the auxiliary losses, whose gradients are injected in backward (never added to the loss).

    hidden [T, H] -> logits = hidden W^T [T, E] (in --moe-router-dtype) -> z-loss attached
      -> top-k probabilities and routing map [T, E] (app.model.moe.routing) -> capacity
      -> load-balancing losses attached to the probabilities -> (probs, routing map)

The losses follow Megatron: each rank's value is its share of the loss of the tokens that
share its micro-batch (token counts summed over tensor x context ranks, or over tensor x data x
context ranks and the iteration's micro-batches for global_aux_loss), and `AuxLossInjection`
puts d(loss) x `aux_loss_scale` into backward where it was attached. The engine sets that scale
each iteration (`begin_iteration`): loss scale x context size / micro-batches, what the main
loss's gradient carries. Only training forwards with gradients attach and record (not
evaluation, not the no-grad first pass of full recompute).

What is recorded for the log (`MoELogState`): each tracked loss / its coefficient, the tokens
routed to each expert (after capacity) and the dropped (token, expert) pairs, summed over the
iteration's micro-batches; app.model.moe.metrics reduces them over the ranks.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ModelConfig
from app.config.moe import AUX_LOSS_NAMES
from app.model.moe import routing
from app.mpu import collectives
from app.mpu.layers import set_tensor_model_parallel_attributes
from app.mpu.mappings import sum_gradient_over_tensor_parallel
from app.mpu.parallel_state import ParallelState
from app.utils.dtypes import torch_dtype

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class AuxLossInjection(torch.autograd.Function):
    """forward(output, aux, scale) = output; backward gives `aux` the gradient `scale` (so
    d(aux)/d(parameters) x scale joins the parameters' gradients) and passes output's through."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux) * ctx.scale, None


class MoELogState(nn.Module):
    """The per-iteration sums one router records for the log (non-persistent buffers):
    `losses` [len(names)] (loss / coeff per name), `tokens_per_expert` [E], `dropped` [1]."""

    def __init__(self, names: Tuple[str, ...], num_experts: int) -> None:
        super().__init__()
        self.names = names
        self.register_buffer("losses", torch.zeros(len(names)), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(1), persistent=False)

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        self.losses[self.names.index(name)] += value.detach().float()

    def reset(self) -> None:
        for buffer in (self.losses, self.tokens_per_expert, self.dropped):
            buffer.zero_()


class TopKRouter(nn.Module):
    """Megatron's top-k router: weight [E, H] (replicated over TP; under sequence parallelism
    its gradient is summed over TP), `expert_bias` [E] fp32 with
    --moe-router-enable-expert-bias. forward(hidden [T, H], batch=b) -> (probs [T, E] in the
    router dtype, routing_map [T, E] bool); `batch` splits T into b sequences (seq_aux_loss)."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: Any,
                 prefix: str) -> None:
        super().__init__()
        moe = config.moe
        self.moe, self.num_experts, self.topk = moe, moe.num_experts, moe.moe_router_topk
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size,
                                               dtype=torch_dtype(config.params_dtype)))
        init.normal(f"{prefix}.weight")(self.weight)  # drawn in fp32 (app.model.gpt2.normal_init)
        set_tensor_model_parallel_attributes(self.weight, False)
        if config.sequence_parallel:  # each TP rank routes other tokens
            sum_gradient_over_tensor_parallel(self.weight, parallel_state)
        self.router_dtype = ROUTER_DTYPES.get(moe.moe_router_dtype)
        bias = moe.moe_router_enable_expert_bias  # fp32 buffers; the bias is checkpointed
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if bias else None)
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(moe.num_experts) if bias else None, persistent=False)
        self.count_group = parallel_state.tensor_context_group
        self.global_group = parallel_state.tensor_data_context_group
        tp_cp = (parallel_state.tensor_model_parallel_size
                 * parallel_state.context_parallel_size)
        self.z_coeff = None if moe.moe_z_loss_coeff is None else moe.moe_z_loss_coeff / tp_cp
        self.aux_loss_scale = 1.0
        """Set each iteration by `begin_iteration` (app.model.moe.layer)."""
        self.log_state = MoELogState(tuple(moe.tracked_losses), moe.num_experts)
        self.register_buffer("global_tokens", torch.zeros(moe.num_experts), persistent=False)
        self.global_micro_batches = 0

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """logits [T, E] = hidden W^T in the router dtype (the model's when unset)."""
        dtype = self.router_dtype or hidden.dtype
        return F.linear(hidden.to(dtype), self.weight.to(dtype))

    def forward(self, hidden: torch.Tensor, batch: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.gating(hidden)  # [T, E]
        recording = self.training and torch.is_grad_enabled()
        if recording and self.z_coeff is not None:
            z = routing.z_loss(logits, self.z_coeff)
            logits = AuxLossInjection.apply(logits, z, self.aux_loss_scale)
            self.log_state.add_loss("z_loss", z / self.z_coeff)
        m = self.moe
        bias = None if self.expert_bias is None else self.expert_bias.float()
        probs, routing_map = routing.topk_routing(
            logits, self.topk, m.moe_router_score_function, m.moe_router_pre_softmax,
            m.moe_router_topk_scaling_factor, bias)
        if m.moe_expert_capacity_factor is not None:
            routed = routing_map
            probs, routing_map = routing.drop_over_capacity(
                probs, routing_map, self.topk, m.moe_expert_capacity_factor,
                m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity)
            if recording:
                self.log_state.dropped += (routed & ~routing_map).sum()
        if recording:
            probs = self._attach_balancing_losses(probs, logits, batch)
            with torch.no_grad():
                counts = routing_map.sum(dim=0).float()  # [E]
                self.log_state.tokens_per_expert += counts
                if self.expert_bias is not None:
                    self.local_tokens_per_expert += counts
        return probs, routing_map

    def _attach_balancing_losses(self, probs: torch.Tensor, logits: torch.Tensor,
                                 batch: int) -> torch.Tensor:
        """Each load-balancing loss in use, attached to `probs` and recorded."""
        coeffs = {kind: self.moe.aux_loss_coeff(kind)
                  for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss")}
        if not any(coeffs.values()):
            return probs
        scores, aux_map = routing.aux_loss_scores(logits, self.topk,
                                                  self.moe.moe_router_score_function)
        for kind, coeff in coeffs.items():
            if not coeff:
                continue
            loss = self._balancing_loss(kind, coeff, scores, aux_map, batch)
            probs = AuxLossInjection.apply(probs, loss, self.aux_loss_scale)
            self.log_state.add_loss(AUX_LOSS_NAMES[kind], loss / coeff)
        return probs

    def _balancing_loss(self, kind: str, coeff: float, scores: torch.Tensor,
                        aux_map: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's share of one load-balancing loss (see the module docstring)."""
        if kind == "seq_aux_loss":  # per sequence: [b, s, E] -> [s, b*E], Megatron's columns
            seq = scores.shape[0] // batch
            scores = scores.reshape(batch, seq, -1).transpose(0, 1).reshape(seq, -1)
            aux_map = aux_map.reshape(batch, seq, -1).transpose(0, 1).reshape(seq, -1)
        group = self.global_group if kind == "global_aux_loss" else self.count_group
        with torch.no_grad():
            counts = collectives.all_reduce(aux_map.sum(dim=0).float(), group)
            if kind == "global_aux_loss":  # averaged over the iteration's micro-batches
                self.global_tokens += counts
                self.global_micro_batches += 1
                counts = self.global_tokens / self.global_micro_batches
        total = scores.shape[0] * collectives.group_size(group)
        loss = routing.load_balancing_loss(scores, counts, total, self.topk, self.num_experts,
                                           coeff)
        return loss / batch if kind == "seq_aux_loss" else loss

    def begin_iteration(self, aux_loss_scale: float) -> None:
        """Before an iteration's first forward: the scale of the auxiliary gradients, and the
        iteration's global_aux_loss counts reset."""
        self.aux_loss_scale = aux_loss_scale
        self.global_tokens.zero_()
        self.global_micro_batches = 0

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After backward (every rank of the tensor x data x context group): sum the
        iteration's token counts over it and move the bias towards balance; reset the counts."""
        if self.expert_bias is None:
            return
        counts = collectives.all_reduce(self.local_tokens_per_expert.clone(), self.global_group)
        self.expert_bias.copy_(routing.expert_bias_update(
            self.expert_bias.float(), counts, self.moe.moe_router_bias_update_rate))
        self.local_tokens_per_expert.zero_()

