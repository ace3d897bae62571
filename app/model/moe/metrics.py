"""The MoE log: each iteration's load-balancing and z losses (Megatron's names and reductions),
tokens per expert and dropped tokens, reduced over the ranks.

Each router records, per training micro-batch, its losses / coefficients, the tokens routed to
each expert (after capacity) and the dropped (token, expert) pairs (app.model.moe.router).
`MoEMetrics.take(num_micro_batches)` gathers them into one [layers, values] tensor whose rows
are the global layer indices (zeros for layers this rank does not hold, or dense ones), sums it
over the whole world in one all-reduce (every rank, every iteration, the shape fixed by the
config: a pipeline stage without MoE layers joins it too), resets the routers' sums and returns:

- each tracked loss (`load_balancing_loss`, `seq_load_balancing_loss`,
  `global_load_balancing_loss`, `z_loss`): per layer the world sum divided by the ranks whose
  values are copies (data-parallel ranks for the load-balancing losses, whose tensor x context
  ranks hold partial sums; tensor x data x context ranks for z_loss, averaged as Megatron-LM
  main does; none for global_load_balancing_loss) and by the micro-batches, then the mean over
  the MoE layers (Megatron's track_moe_metrics);
- `tokens_per_expert`: the iteration's tokens of each expert, the mean over the MoE layers
  ([E]); `expert_load_imbalance`: max / mean of those counts, averaged over the MoE layers;
  `dropped_tokens` (with a capacity factor): dropped pairs, summed over the layers;
- with --moe-per-layer-logging also `moe/{name}_layer_{i}` for every layer i (0 for dense
  ones, as Megatron), `moe/tokens_per_expert_layer_{i}` and `moe/dropped_tokens_layer_{i}`
  for the MoE layers.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from app.config import ModelConfig
from app.model.moe.layer import moe_layers
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState


class MoEMetrics:
    """The MoE values of each training iteration (see the module docstring); empty for a
    dense model (no communication)."""

    def __init__(self, model: nn.Module, config: ModelConfig, parallel_state: ParallelState,
                 world_group: Any) -> None:
        self.moe = config.moe
        self.num_layers = config.num_layers
        self.layers = {layer.layer_number: layer.router.log_state for layer in moe_layers(model)}
        self.device = next(model.parameters()).device
        self.pattern = self.moe.layer_pattern(self.num_layers)
        self.ps, self.group = parallel_state, world_group
        ps = parallel_state
        dp, tp_cp = ps.data_parallel_size, (ps.tensor_model_parallel_size
                                            * ps.context_parallel_size)
        copies = {"load_balancing_loss": dp, "seq_load_balancing_loss": dp,
                  "global_load_balancing_loss": 1, "z_loss": dp * tp_cp}
        self.names = self.moe.tracked_losses
        self.copies = [copies[name] for name in self.names]

    def take(self, num_micro_batches: int) -> Dict[str, Any]:
        """This iteration's values (every rank must call it; see the module docstring)."""
        if not self.moe.enabled:
            return {}
        experts = self.moe.num_experts
        width = len(self.names) + experts + 1
        device = self.device  # NCCL reduces device tensors only
        table = torch.zeros(self.num_layers, width, dtype=torch.float64, device=device)
        for index, state in self.layers.items():
            table[index] = torch.cat([state.losses, state.tokens_per_expert,
                                      state.dropped]).double()
            state.reset()
        collectives.all_reduce(table, self.group)
        losses = table[:, :len(self.names)] / torch.tensor(
            self.copies, dtype=torch.float64, device=device) / num_micro_batches
        tokens, dropped = table[:, len(self.names):-1], table[:, -1]
        moe_rows = [i for i, is_moe in enumerate(self.pattern) if is_moe]
        out: Dict[str, Any] = {name: float(losses[moe_rows, n].sum()) / len(moe_rows)
                               for n, name in enumerate(self.names)}
        counts = tokens[moe_rows]  # [MoE layers, E]
        out["tokens_per_expert"] = counts.mean(dim=0).tolist()
        out["expert_load_imbalance"] = float(
            (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).mean())
        if self.moe.moe_expert_capacity_factor is not None:
            out["dropped_tokens"] = float(dropped[moe_rows].sum())
        if self.moe.moe_per_layer_logging:
            out.update(self._per_layer(losses, tokens, dropped, moe_rows))
        return out

    def _per_layer(self, losses: torch.Tensor, tokens: torch.Tensor, dropped: torch.Tensor,
                   moe_rows: List[int]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for n, name in enumerate(self.names):
            for i in range(self.num_layers):
                out[f"moe/{name}_layer_{i}"] = float(losses[i, n])
        for i in moe_rows:
            out[f"moe/tokens_per_expert_layer_{i}"] = tokens[i].tolist()
            if self.moe.moe_expert_capacity_factor is not None:
                out[f"moe/dropped_tokens_layer_{i}"] = float(dropped[i])
        return out
