"""Split a model's parameters into a weight-decay group and a no-weight-decay group."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn

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
