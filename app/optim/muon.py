"""Muon (--optimizer muon), Megatron-LM's way: momentum, Newton-Schulz orthogonalisation of the
whole matrix under tensor parallelism, and AdamW for everything that is not a hidden matrix.

Per step, for every 2-D weight of the transformer layers and every routed expert's matrix
(`param_groups.get_muon_param_groups`; the embeddings, the output layer, biases and LayerNorms
go to --muon-scalar-optimizer, AdamW):

    M <- beta M + (1 - beta) G                          (--muon-momentum; EMA, as Megatron)
    U <- (1 - beta) G + beta M  with --muon-nesterov, else M
    W <- W (1 - lr wd) - lr scale(W) NS(U)              (decoupled weight decay)

NS is `newton_schulz.newton_schulz` (--muon-num-ns-steps, --muon-coefficient-type,
--muon-fp32-matmul-prec) and `scale` `newton_schulz.scale_factor` (--muon-scale-mode,
--muon-extra-scale-factor) of the full matrix's shape. The fused QKV weight is orthogonalised
as its query, key and value matrices separately unless --muon-no-split-qkv.

Tensor parallelism (--muon-tp-mode): a rank holds a shard of a column-parallel (partition_dim
0) or row-parallel (partition_dim 1) weight.
- duplicated: all-gather the shards into the full matrix on every TP rank, orthogonalise it,
  keep this rank's shard. The result does not depend on the TP size.
- distributed: the iteration runs on the shards, transposed so that the sharded dimension is
  the one the Gram matrix sums over (X X^T = sum of the ranks' X_i X_i^T, one all-reduce per
  step, and one for the Frobenius norm); does not depend on the TP size either (up to rounding).
- blockwise: every shard is orthogonalised alone and scaled by its own shape, so the update
  changes with the TP size (cheapest: no communication).
Key/value rows that grouped-query attention replicates over r TP ranks (fewer query groups than
TP ranks) are counted once: duplicated keeps one copy of each, distributed divides their sums
by r. Mixture of Experts: a 3-D expert weight [E/EP, rows, cols] is E/EP matrices, each
orthogonalised as one matrix split over the expert-tensor group (the same modes).

`Muon` is one torch optimizer over all the param groups: its state holds `momentum_buffer` for
each Muon matrix and AdamW's `step`, `exp_avg`, `exp_avg_sq` for the others, so state dicts
have torch's format with one entry per parameter (what checkpoints and the converter read).
How the orthogonalisation reaches the whole matrix is the caller's `orthogonalize` function:
the plain wrappers pass `TensorParallelOrthogonalizer.for_params`, the distributed optimizer
gathers its data-parallel shards first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from app.config import OptimizerConfig
from app.mpu import collectives
from app.optim.newton_schulz import join_qkv_rows, newton_schulz, scale_factor, split_qkv_rows

Orthogonalize = Callable[[List[torch.Tensor], List[torch.Tensor]], List[torch.Tensor]]
"""(Muon parameters, their momentum-derived updates U) -> the scaled, orthogonalised updates."""


@dataclass(frozen=True)
class MatrixSpec:
    """How this rank's 2-D tensor of a Muon parameter sits in the full matrix."""

    partition_dim: Optional[int] = None
    """0 (column-parallel: rows split over TP), 1 (row-parallel: columns), None (whole)."""
    qkv: Optional[Tuple[int, int, int]] = None
    """For the fused QKV weight: this rank's (query groups, query heads per group, head dim)."""
    kv_replicas: int = 1
    """TP ranks holding the same key/value rows (grouped-query attention with fewer groups
    than TP ranks), else 1."""
    experts: bool = False
    """A 3-D routed-expert weight [E/EP, rows, cols]: one matrix per local expert, split over
    the expert-tensor group (partition_dim counts within one expert's matrix)."""


def matrix_specs(model: nn.Module) -> Dict[int, MatrixSpec]:
    """{id(param): MatrixSpec} for every 2-D parameter of `model`: the partition dimension from
    `param.tensor_model_parallel` / `param.partition_dim`, the QKV geometry from the attention
    modules (those with `query_key_value`, `heads`, `kv_heads` and `head_dim`), the key/value
    replication from `param.replicated_rows`."""
    specs: Dict[int, MatrixSpec] = {}
    for param in model.parameters():
        if param.dim() == 2:
            specs[id(param)] = MatrixSpec(partition_dim=_partition_dim(param))
        elif param.dim() == 3 and getattr(param, "allreduce", True) is False:  # MoE experts
            dim = _partition_dim(param)
            specs[id(param)] = MatrixSpec(partition_dim=None if dim is None else dim - 1,
                                          experts=True)
    for module in model.modules():
        qkv = getattr(module, "query_key_value", None)
        if qkv is None or not hasattr(module, "kv_heads"):
            continue
        weight = qkv.weight
        replicated = getattr(weight, "replicated_rows", None)
        specs[id(weight)] = MatrixSpec(
            partition_dim=_partition_dim(weight),
            qkv=(module.kv_heads, module.heads // module.kv_heads, module.head_dim),
            kv_replicas=replicated[1] if replicated else 1)
    return specs


def _partition_dim(param: torch.Tensor) -> Optional[int]:
    """The dimension a tensor-parallel parameter is split along; None for a replicated one."""
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel",
                                                            False) else None


class TensorParallelOrthogonalizer:
    """Scaled Newton-Schulz of Muon updates under tensor parallelism (see the module docstring).

    Every rank of the tensor-parallel group must call it for the same parameters in the same
    order (duplicated and distributed communicate).
    """

    def __init__(self, config: OptimizerConfig, tensor_group: Any = None,
                 expert_tensor_group: Any = None) -> None:
        self.config = config
        self.group = tensor_group
        self.size = collectives.group_size(tensor_group)
        self.rank = collectives.group_rank(tensor_group)
        self.experts = (TensorParallelOrthogonalizer(config, expert_tensor_group)
                        if expert_tensor_group is not None else None)

    def __call__(self, update: torch.Tensor, spec: MatrixSpec) -> torch.Tensor:
        """The scaled orthogonalisation of this rank's part `update` of one Muon matrix (of
        each local expert's matrix for a routed-expert weight, over the expert-tensor group)."""
        if spec.experts:
            own = self.experts or self
            plain = MatrixSpec(partition_dim=spec.partition_dim)
            return torch.stack([own(expert, plain) for expert in update.unbind(0)])
        if spec.qkv is not None and self.config.muon_split_qkv:
            groups, queries, head_dim = spec.qkv
            parts = split_qkv_rows(update, groups, queries, head_dim)
            replicas = (1, spec.kv_replicas, spec.kv_replicas)
            done = [self._one(part, spec.partition_dim, r) for part, r in zip(parts, replicas)]
            return join_qkv_rows(done, groups)
        if spec.kv_replicas > 1 and self.config.muon_tp_mode != "blockwise":
            raise ValueError("--muon-no-split-qkv with key/value heads replicated over TP ranks "
                             "needs --muon-tp-mode blockwise (app.config refuses this at start)")
        return self._one(update, spec.partition_dim, 1)

    def for_params(self, specs: Dict[int, MatrixSpec]) -> Orthogonalize:
        """The `Muon(orthogonalize=...)` function for parameters that are whole local tensors,
        with their specs by id."""
        def orthogonalize(params: List[torch.Tensor], updates: List[torch.Tensor]
                          ) -> List[torch.Tensor]:
            return [self(u, specs.get(id(p), MatrixSpec())) for p, u in zip(params, updates)]
        return orthogonalize

    def _one(self, local: torch.Tensor, partition_dim: Optional[int], replicas: int
             ) -> torch.Tensor:
        """Scaled NS of one matrix whose shard along `partition_dim` this rank holds, each shard
        held by `replicas` consecutive TP ranks."""
        c = self.config
        mode = c.muon_tp_mode
        iterate = dict(steps=c.muon_num_ns_steps, coefficient_type=c.muon_coefficient_type,
                       precision=c.muon_fp32_matmul_prec)
        shape = list(local.shape)
        if partition_dim is None or mode == "blockwise":
            result = newton_schulz(local, **iterate)
        elif mode == "duplicated":
            shards = collectives.all_gather(local.contiguous(), self.group)[::replicas]
            full = torch.cat(shards, dim=partition_dim)
            shape = list(full.shape)
            result = newton_schulz(full, **iterate).chunk(len(shards), dim=partition_dim)[
                self.rank // replicas]
        else:  # distributed: the sharded dimension is the one the Gram matrix sums over
            def reduce(tensor: torch.Tensor) -> torch.Tensor:
                collectives.all_reduce(tensor, self.group)
                return tensor.div_(replicas) if replicas > 1 else tensor
            shape[partition_dim] *= self.size // replicas
            result = newton_schulz(local, transpose=partition_dim == 0, reduce=reduce,
                                   **iterate)
        return result * scale_factor(shape[0], shape[1], c.muon_scale_mode,
                                     c.muon_extra_scale_factor)


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with `use_muon`, the `scalar` optimizer (AdamW) on the others,
    stepped and saved as one torch optimizer (see the module docstring).

    Muon groups carry `lr`, `weight_decay`, `momentum` and `nesterov`; `orthogonalize` turns
    their updates into scaled orthogonalised ones. `scalar` must be built over exactly the
    other groups (the same dicts, in order); it shares this optimizer's state.
    """

    def __init__(self, groups: Sequence[Dict[str, Any]],
                 scalar: Optional[torch.optim.Optimizer], orthogonalize: Orthogonalize) -> None:
        super().__init__(list(groups), {})
        self.scalar = scalar
        self.orthogonalize = orthogonalize
        self._link_scalar()

    def _link_scalar(self) -> None:
        """Point the scalar optimizer at this optimizer's non-Muon groups and its state."""
        if self.scalar is not None:
            self.scalar.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.scalar.state = self.state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """One update of every parameter (a missing gradient counts as zero)."""
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        params, updates, groups = [], [], []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            beta = group["momentum"]
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                momentum = state["momentum_buffer"]
                momentum.lerp_(grad, 1.0 - beta)
                updates.append(grad.lerp(momentum, beta) if group["nesterov"] else momentum)
                params.append(p)
                groups.append(group)
        for p, update, group in zip(params, self.orthogonalize(params, updates), groups):
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.add_(update.view_as(p), alpha=-group["lr"])
        if self.scalar is not None:
            self.scalar.step()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's load (new group dicts, state cast to the parameters), then the scalar
        optimizer is pointed at the loaded groups and state."""
        super().load_state_dict(state_dict)
        self._link_scalar()


def muon_group_settings(config: OptimizerConfig) -> Dict[str, Any]:
    """The keys a Muon param group carries (its LR is the schedule's, like every group's)."""
    return dict(use_muon=True, lr=config.lr, weight_decay=config.weight_decay,
                momentum=config.muon_momentum, nesterov=config.muon_nesterov)
