"""Optimizer state in model space: per model parameter, the state tensors this rank holds.

The layout-free form a sharded checkpoint (app.checkpoint.torch_dist) writes and reads,
whatever wrapper holds the state: `Float32Optimizer` and `MixedPrecisionOptimizer` hold every
parameter's whole local (tensor-parallel) tensor, the `DistributedOptimizer` a flat range of it
(`piece`). Each wrapper's `model_space_state()` gives this rank's `ModelSpaceState` (no
communication) and `load_model_space_state(state)` takes one built for its own `pieces`, so a
state saved at any TP x PP x DP, with or without the distributed optimizer, loads into any
other.

State names are torch's (`exp_avg`, `exp_avg_sq` for AdamW, `momentum_buffer` for Muon's
matrices and SGD) plus MAIN for separate fp32 main weights; AdamW's step count is one number for
every parameter (`step`), as Megatron Core stores it (`common_step`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

MAIN = "main"
"""The fp32 main weight of a parameter (mixed precision, or the distributed optimizer)."""
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENTUM = ("momentum_buffer",)


@dataclass
class ParamState:
    """One model parameter's optimizer state on this rank."""

    name: str
    """The model parameter's name (global layer indices)."""
    piece: Optional[Tuple[int, int]]
    """None: the whole local tensor; (lo, hi): that flat range of it (distributed optimizer)."""
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    """State name -> tensor (the local tensor's shape, or flat [hi - lo] for a piece)."""
    keys: Tuple[str, ...] = ()
    """The per-element states the parameter has once stepped (MOMENTS or MOMENTUM)."""


@dataclass
class ModelSpaceState:
    """A rank's optimizer state in model space (see the module docstring)."""

    params: List[ParamState]
    param_groups: List[Dict[str, Any]]
    """Hyper-parameters of the torch optimizer's groups, without 'params' (with 'name')."""
    step: Optional[float] = None
    """AdamW's step count (None before the first step, or without AdamW groups)."""
    grad_scaler: Optional[Dict[str, Any]] = None


def state_keys(group: Dict[str, Any], inner: torch.optim.Optimizer) -> Tuple[str, ...]:
    """The per-element states a parameter of `group` has once stepped: Muon's groups and SGD
    keep a momentum buffer, AdamW its two moments."""
    if group.get("use_muon") or isinstance(inner, torch.optim.SGD):
        return MOMENTUM
    return MOMENTS


def hyperparameters(groups: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The groups without their parameters (what a checkpoint keeps of them)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def common_step(states: Sequence[Dict[str, Any]]) -> Optional[float]:
    """The step count shared by every state holding one (None when none does); ValueError when
    they differ (Megatron Core supports one step for all parameters, and so do we)."""
    steps = {float(s["step"]) for s in states if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's step differs between parameters: {sorted(steps)}")
    return steps.pop() if steps else None


def from_torch_state(inner: torch.optim.Optimizer, names: Sequence[str],
                     mains: Optional[Dict[str, torch.Tensor]] = None) -> ModelSpaceState:
    """A plain wrapper's state: `inner`'s params in group order are the model parameters
    `names` (or their fp32 main copies, given in `mains` by name)."""
    torch_state = inner.state_dict()
    params: List[ParamState] = []
    index = 0
    for group in inner.param_groups:
        keys = state_keys(group, inner)
        for _ in group["params"]:
            name = names[index]
            saved = torch_state["state"].get(index, {})
            tensors = {k: v for k, v in saved.items() if k in keys and torch.is_tensor(v)}
            if mains is not None:
                tensors[MAIN] = mains[name]
            params.append(ParamState(name, None, tensors, keys))
            index += 1
    return ModelSpaceState(params, hyperparameters(inner.param_groups),
                           common_step(list(torch_state["state"].values())))


def to_torch_state(inner: torch.optim.Optimizer, names: Sequence[str],
                   state: ModelSpaceState) -> Dict[str, Any]:
    """The torch state dict of `inner` (params = model parameters `names` in group order) that
    `state` describes; parameters without state tensors get none (never stepped)."""
    by_name = {p.name: p for p in state.params}
    entries: Dict[int, Dict[str, Any]] = {}
    groups, index = [], 0
    for group, saved in zip(inner.param_groups, state.param_groups):
        ids = list(range(index, index + len(group["params"])))
        for i in ids:
            found = by_name.get(names[i])
            tensors = {k: v for k, v in (found.tensors if found else {}).items() if k != MAIN}
            if tensors:
                entries[i] = dict(tensors)
                if state.step is not None and "exp_avg" in tensors:
                    entries[i]["step"] = torch.tensor(state.step, dtype=torch.float32)
        groups.append({**saved, "params": ids})
        index += len(ids)
    return {"state": entries, "param_groups": groups}
