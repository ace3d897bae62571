"""Split a model's parameters into a weight-decay group and a no-weight-decay group (and, with
--optimizer muon, a Muon group; with --decoupled-lr, a group for the embeddings and the output
layer with their own peak and floor LR)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from app.config.param_names import OUTPUT_LAYER, TIED_HEAD, WORD_EMBEDDINGS

DECOUPLED_GROUP = "decoupled"
"""The name of --decoupled-lr's group; it carries `max_lr` and `min_lr` (Megatron's keys)."""

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)


def no_weight_decay(module: nn.Module, param_name: str) -> bool:
    """True for a bias or any parameter of a normalisation layer (Megatron's rule)."""
    return param_name == "bias" or isinstance(module, _NORM_TYPES)


def get_param_groups(model: nn.Module,
                     weight_decay: Optional[float] = None) -> List[Dict[str, Any]]:
    """Trainable parameters as `[decay group, no-decay group, expert group]`, empty groups
    dropped.

    The no-decay group holds every bias and every LayerNorm parameter and has `weight_decay`
    0.0; the decay group holds everything else (linear weights, embeddings) and carries
    `weight_decay` only when given (otherwise the optimizer's default applies); the routed
    experts' weights of an MoE model (marked `allreduce = False`) form `expert_decay` (weight
    decay like `decay`, and `moe: True`). A parameter shared by two modules (a tied embedding)
    appears once. Each group has a `name` key.
    """
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    seen = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if no_weight_decay(module, name) else decay).append(param)
    experts = [p for p in decay if getattr(p, "allreduce", True) is False]
    decay = [p for p in decay if getattr(p, "allreduce", True) is not False]
    decay_group: Dict[str, Any] = {"name": "decay", "params": decay}
    if weight_decay is not None:
        decay_group["weight_decay"] = float(weight_decay)
    no_decay_group: Dict[str, Any] = {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}
    # Mixture of Experts: the routed experts' weights in a group of their own (Megatron keys its
    # groups by is_expert_parallel; DeepSpeed's ZeRO needs them in groups marked 'moe')
    expert_group = {**decay_group, "name": "expert_decay", "moe": True, "params": experts}
    return [g for g in (decay_group, no_decay_group, expert_group) if g["params"]]


def is_embedding_or_output(param_name: str) -> bool:
    """True for the word and position embeddings (and the last stage's tied copy) and the
    untied output layer: matrices that Muon leaves to the scalar optimizer (Megatron's
    `is_embedding_or_output_parameter`)."""
    return "embedding" in param_name or "output_layer" in param_name


def get_muon_param_groups(model: nn.Module, settings: Dict[str, Any],
                          weight_decay: Optional[float] = None) -> List[Dict[str, Any]]:
    """`[muon, expert_muon, decay, no_decay]` for --optimizer muon, empty groups dropped.

    `muon` holds the 2-D weights that are not embeddings or the output layer
    (`is_embedding_or_output`), `expert_muon` the routed experts' 3-D weights of an MoE model
    (`moe: True`), both with the Muon keys `settings` (`use_muon` True among them);
    `decay` and `no_decay` are `get_param_groups`' split of the rest (embeddings and output
    layer decay; biases and LayerNorms do not), marked `use_muon` False. Each group has a `name`.
    """
    muon: List[nn.Parameter] = []
    experts: List[nn.Parameter] = []
    seen = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if (param.requires_grad and param.dim() == 2 and id(param) not in seen
                    and not is_embedding_or_output(full)):
                muon.append(param)
            elif param.requires_grad and getattr(param, "allreduce", True) is False:
                experts.append(param)  # [E/EP, rows, cols]: a matrix per expert
            seen.add(id(param))
    chosen = {id(p) for p in muon + experts}
    groups: List[Dict[str, Any]] = [{"name": "muon", **settings, "params": muon},
                                    {"name": "expert_muon", "moe": True, **settings,
                                     "params": experts}]
    for group in get_param_groups(model, weight_decay):
        rest = [p for p in group["params"] if id(p) not in chosen]
        groups.append({**group, "params": rest, "use_muon": False})
    return [g for g in groups if g["params"]]


def is_decoupled_lr_parameter(param_name: str) -> bool:
    """True for the parameters --decoupled-lr schedules (Megatron's
    `is_embedding_or_output_parameter`): the word embeddings, the last stage's tied copy of
    them and the untied output layer; not the position table. `param_name` may carry a
    wrapper's prefix."""
    return any(param_name == name or param_name.endswith("." + name)
               for name in (WORD_EMBEDDINGS, OUTPUT_LAYER, TIED_HEAD))


def split_decoupled(groups: List[Dict[str, Any]], model: nn.Module,
                    lr_range: Optional[Tuple[float, float]]) -> List[Dict[str, Any]]:
    """`groups` with the `is_decoupled_lr_parameter` parameters moved out of the group holding
    them into a last group named DECOUPLED_GROUP with that group's settings and `max_lr`,
    `min_lr` = `lr_range` (--decoupled-lr and its floor); `groups` unchanged when `lr_range` is
    None or the stage holds none of them. Empty groups are dropped."""
    if lr_range is None:
        return groups
    chosen = {id(p) for n, p in model.named_parameters() if is_decoupled_lr_parameter(n)}
    moved: List[nn.Parameter] = []
    settings: Dict[str, Any] = {}
    out = []
    for group in groups:
        keep = [p for p in group["params"] if id(p) not in chosen]
        taken = [p for p in group["params"] if id(p) in chosen]
        if taken and not moved:
            settings = {k: v for k, v in group.items() if k not in ("params", "name")}
        moved += taken
        out.append({**group, "params": keep})
    if moved:
        out.append({**settings, "name": DECOUPLED_GROUP, "params": moved,
                    "max_lr": lr_range[0], "min_lr": lr_range[1]})
    return [g for g in out if g["params"]]
