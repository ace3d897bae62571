"""The DeepSpeed engine's Mixture-of-Experts parts that need no deepspeed import: the marker that
makes DeepSpeed treat our MoE layers as its own, its view of our experts for DeepSpeed's
per-expert checkpoint files, and the checks of DeepSpeed's expert groups and of a checkpoint's
expert split.

DeepSpeed (0.19) runs a model as MoE only if a module of it is an instance of its
`deepspeed.moe.layer.MoE`; then ZeRO-1/2 partitions and reduces the parameter groups marked
`{'moe': True, 'name': 'ep_size_{EP}'}` over that name's expert-data-parallel group (each expert
gradient summed over it after the whole bucket was divided by the data-parallel size: the
native path's arithmetic), and save_checkpoint writes each expert to its own file. Our
MoELayer owns the experts as two 3-D weights (app.model.moe.experts), marked `allreduce = False`
and `group_name = 'ep_size_{EP}'` as DeepSpeed's own experts are. engines.deepspeed therefore
adds to every MoE layer, as its child `deepspeed_moe`, a parameter-less `MoEMarker` made an
instance of DeepSpeed's MoE (`MoEMarker` mixed into it there) that

- answers DeepSpeed's questions (num_experts, ep_size, num_local_experts, expert_group_name);
- shows this rank's experts in its state_dict as DeepSpeed's MoE layer names them, one 2-D
  tensor per local expert j and projection:
      {layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{j}.dense_h_to_4h.weight   [2F, h]
      {layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{j}.dense_4h_to_h.weight   [h, F]
  (views of experts.dense_h_to_4h.weight[j] and experts.dense_4h_to_h.weight[j]), which
  DeepSpeed renames to the global expert ep_rank x E/EP + j and writes one file per global
  expert, `layer_{moe_layer_id}_expert_{g}_mp_rank_00_model_states.pt` (moe_layer_id counts the
  MoE layers from 0 in module order), leaving them out of mp_rank_00_model_states.pt.

Two hooks on the MoE layer keep the model's own state dict in step: its state dict leaves out
the 3-D expert weights (the views stand for them), and a load stacks the views back into them.
The parameters themselves (names, 3-D shapes, ZeRO's flat groups) are unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from app.checkpoint.deepspeed import EXPERT_MODULE, expert_view_name
from app.model.moe import moe_layers
from app.mpu.parallel_state import ParallelState, expert_rank_layout

MARKER = EXPERT_MODULE
"""The marker's name in its MoE layer (DeepSpeed's MoE layer keeps its experts under it)."""
PROJECTIONS = ("dense_h_to_4h", "dense_4h_to_h")
"""The two expert weights of app.model.moe.experts.GroupedExperts."""


def view_name(local_expert: int, projection: str) -> str:
    """The name, under the marker, of one local expert's weight (DeepSpeed's MoE layout)."""
    return expert_view_name(local_expert, f"{projection}.weight")


class MoEMarker(nn.Module):
    """A parameter-less stand-in for DeepSpeed's MoE layer (module docstring); engines.deepspeed
    mixes it into `deepspeed.moe.layer.MoE`, whose __init__ is not called. `experts` is the
    layer's GroupedExperts, held without being registered as a submodule."""

    def __init__(self, experts: nn.Module, num_experts: int, ep_size: int) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        self.__dict__["experts_module"] = experts  # not a child: no second path to its weights

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed calls this in initialize; the engine created the groups before."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the DeepSpeed MoE marker only describes its layer's experts; the "
                           "MoE layer computes them")

    def expert_views(self, keep_vars: bool = False) -> Dict[str, torch.Tensor]:
        """{view_name(j, projection): weight[j]} for this rank's experts."""
        views = {}
        for projection in PROJECTIONS:
            weight = getattr(self.experts_module, projection).weight
            weight = weight if keep_vars else weight.detach()
            for j in range(self.num_local_experts):
                views[view_name(j, projection)] = weight[j]
        return views

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        for name, tensor in self.expert_views(keep_vars).items():
            destination[prefix + name] = tensor


def _drop_stacked_weights(layer: nn.Module, state_dict: Dict[str, Any], prefix: str,
                          local_metadata: Any) -> None:
    """State-dict post-hook of an MoE layer: the 3-D expert weights leave (the marker's views
    stand for them)."""
    for projection in PROJECTIONS:
        state_dict.pop(f"{prefix}experts.{projection}.weight", None)


def _stack_views(layer: nn.Module, state_dict: Dict[str, Any], prefix: str,
                 *unused: Any) -> None:
    """Load pre-hook of an MoE layer: the marker's per-expert views, when all are present,
    become the 3-D expert weights they stand for (then loaded as usual)."""
    marker = getattr(layer, MARKER)
    for projection in PROJECTIONS:
        keys = [f"{prefix}{MARKER}.{view_name(j, projection)}"
                for j in range(marker.num_local_experts)]
        stacked = f"{prefix}experts.{projection}.weight"
        if stacked not in state_dict and all(k in state_dict for k in keys):
            state_dict[stacked] = torch.stack([state_dict.pop(k) for k in keys])


def attach_markers(model: nn.Module, marker_class: type, num_experts: int,
                   ep_size: int) -> int:
    """Add a `marker_class` (an MoEMarker that is also DeepSpeed's MoE) to every MoE layer of
    `model`, with the state-dict hooks of the module docstring; the number of MoE layers."""
    layers = moe_layers(model)
    for layer in layers:
        layer.add_module(MARKER, marker_class(layer.experts, num_experts, ep_size))
        layer.register_state_dict_post_hook(_drop_stacked_weights)
        layer.register_load_state_dict_pre_hook(_stack_views)
    return len(layers)


def check_expert_groups(ps: ParallelState, expert_ranks: Sequence[int],
                        expert_data_ranks: Sequence[int]) -> None:
    """DeepSpeed's expert-parallel and expert-data-parallel groups of this rank must be ours
    (app.mpu.parallel_state.expert_rank_layout), or ZeRO would reduce the expert gradients over
    other ranks than the ones that hold the same experts: RuntimeError naming both otherwise."""
    layout = expert_rank_layout(ps.world_size, ps.tensor_model_parallel_size,
                                ps.pipeline_model_parallel_size, ps.context_parallel_size,
                                ps.expert_model_parallel_size, ps.expert_tensor_parallel_size)
    ours = {kind: next(g for g in layout[kind] if ps.rank in g)
            for kind in ("expert", "expert_data")}
    theirs = {"expert": sorted(expert_ranks), "expert_data": sorted(expert_data_ranks)}
    if ours != theirs:
        raise RuntimeError(f"DeepSpeed's expert groups of rank {ps.rank} ({theirs}) differ from "
                           f"this run's expert grid ({ours}); MoE under DeepSpeed needs tensor "
                           "and pipeline parallel size 1")


def expert_split_problem(model: nn.Module, saved_shapes: Optional[List[Dict[str, Any]]],
                         where: str) -> Optional[str]:
    """Why the ZeRO optimizer partitions of a DeepSpeed checkpoint (its module file's
    `param_shapes`) cannot be loaded into `model`: its experts split over another number of
    expert-parallel ranks (DeepSpeed cannot re-split the flat expert partitions); None if they
    can."""
    if not saved_shapes:
        return None
    shapes = {name: tuple(shape) for group in saved_shapes for name, shape in group.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for layer in moe_layers(model):
        weight = layer.experts.dense_h_to_4h.weight
        saved = shapes.get(names[id(weight)])
        if saved is not None and saved[0] != weight.shape[0]:
            total = getattr(layer, MARKER).num_experts
            return (f"checkpoint {where} holds {saved[0]} experts per rank of each MoE layer "
                    f"(expert-parallel size {total // saved[0]}), this run {weight.shape[0]} "
                    f"(--expert-model-parallel-size {total // weight.shape[0]}); DeepSpeed "
                    "cannot re-split the experts' ZeRO partitions: resume at the saved "
                    "expert-parallel size, load the weights only (--no-load-optim), or convert "
                    "it (tools/convert_checkpoint.py --input-format deepspeed) for the native "
                    "path")
    return None
