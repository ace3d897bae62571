"""The common (non-tensor) state of a torch_dist checkpoint, as Megatron-LM stores it.

Megatron-LM (megatron/training/checkpointing.py `generate_state_dict` and `save_checkpoint`,
core_v0.19.0) puts into its state dict `args`, `checkpoint_version` (3.0), `iteration`, the
model and optimizer sharded state dicts, `opt_param_scheduler`, `rng_state`,
`num_floating_point_operations_so_far` and `content_metadata`; dist_checkpointing.save stores
everything that is not a ShardedTensor/ShardedObject as the one `common_state` object. Of the
optimizer that leaves its non-tensor part, which depends on the optimizer
(megatron/core/optimizer): FP32Optimizer `{state: {common_step}, param_groups}`,
Float16Optimizer `{optimizer: {state: {common_step}, param_groups}, grad_scaler}`,
DistributedOptimizer `{optimizer: {param_groups (with step)}, grad_scaler,
param_state_sharding_type}`. `build_common` writes the same shapes; `saved_optimizer` reads any of
them back (and refuses the distributed optimizer's layout-bound formats).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from app.checkpoint import CheckpointError
from app.optim.model_space import MAIN, ModelSpaceState

CHECKPOINT_VERSION = 3.0
"""3.0: fused QKV rows ordered [heads, (q, k, v), head_dim]."""
RESHARDABLE = "fully_reshardable"
LAYOUT_BOUND = ("dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space")
"""Megatron's distributed-optimizer formats tied to its buffer layout: not readable here."""


def content_metadata(distributed_optimizer: bool) -> Dict[str, Any]:
    """Megatron's `content_metadata` (`_build_sharded_state_dict_metadata`): how the sharded
    state dict was built, so Megatron rebuilds the same one to load it."""
    meta: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        meta.update(distrib_optim_sharding_type=RESHARDABLE,
                    distrib_optim_fully_reshardable_mem_efficient=False)
    return meta


def optimizer_part(state: ModelSpaceState, *, distributed: bool) -> Dict[str, Any]:
    """The optimizer's non-tensor part in the shape Megatron's optimizer of the same kind has."""
    groups = [dict(g) for g in state.param_groups]
    scaler = {} if state.grad_scaler is None else {"grad_scaler": state.grad_scaler}
    if distributed:
        for group in groups:
            if state.step is not None:
                group["step"] = int(state.step)
        return {"optimizer": {"param_groups": groups}, **scaler,
                "param_state_sharding_type": RESHARDABLE}
    inner = {"state": {} if state.step is None else
             {"common_step": torch.tensor(float(state.step))}, "param_groups": groups}
    if any(MAIN in p.tensors for p in state.params):
        return {"optimizer": inner, **scaler}
    return inner



def build_common(args: argparse.Namespace, iteration: Any, *,
                 scheduler: Optional[Dict[str, Any]], optimizer: Optional[Dict[str, Any]],
                 distributed_optimizer: bool, flops_so_far: float = 0.0) -> Dict[str, Any]:
    """The `common_state` object of a save (optimizer and scheduler only when saved)."""
    common: Dict[str, Any] = {
        "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
        "num_floating_point_operations_so_far": float(flops_so_far),
        "content_metadata": content_metadata(distributed_optimizer),
    }
    if scheduler is not None:
        common["opt_param_scheduler"] = scheduler
    if optimizer is not None:
        common["optimizer"] = optimizer
    return common


@dataclass
class SavedOptimizer:
    """The optimizer's non-tensor state read back from a common state."""

    param_groups: List[Dict[str, Any]]
    named_groups: bool
    """Groups carry our names (decay / no_decay / muon): ours, so their settings are restored;
    Megatron-LM's carry none and this run's settings are kept."""
    step: Optional[float]
    grad_scaler: Optional[Dict[str, Any]]


def _number(value: Any) -> Optional[float]:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def optimizer_common(common: Dict[str, Any], where: str) -> SavedOptimizer:
    """The optimizer's non-tensor state of `common` (any of Megatron's shapes); CheckpointError
    when there is none (saved with --no-save-optim) or it is bound to its saving layout."""
    opt = common.get("optimizer")
    if not isinstance(opt, dict) or not opt:
        raise CheckpointError(f"checkpoint in {where} has no optimizer state (saved with "
                              "--no-save-optim); pass --no-load-optim (or --finetune) to start "
                              "the optimizer fresh")
    if all(isinstance(k, int) for k in opt):
        raise CheckpointError(f"checkpoint in {where} holds a chained optimizer (several "
                              "Megatron optimizers); pass --no-load-optim to load its weights")
    kind = opt.get("param_state_sharding_type") or (
        common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if kind in LAYOUT_BOUND:
        raise CheckpointError(
            f"checkpoint in {where} keeps the distributed optimizer's states in Megatron's "
            f"'{kind}' format, tied to its buffer layout: re-save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, or pass --no-load-optim")
    inner = opt["optimizer"] if isinstance(opt.get("optimizer"), dict) else opt
    groups = [dict(g) for g in inner.get("param_groups", [])]
    step = _number((inner.get("state") or {}).get("common_step"))
    if step is None:
        step = next((_number(g["step"]) for g in groups if g.get("step") is not None), None)
    for group in groups:
        group.pop("step", None)
    return SavedOptimizer(groups, bool(groups) and all("name" in g for g in groups), step,
                          opt.get("grad_scaler"))


def scheduler_state(common: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The LR scheduler's state: Megatron's `opt_param_scheduler` (or the older `lr_scheduler`)."""
    return common.get("opt_param_scheduler", common.get("lr_scheduler"))


def position(common: Dict[str, Any], iteration: Any) -> Dict[str, Any]:
    """Where training resumes: the iteration and the consumed samples stored in `args`."""
    args = common.get("args")
    out: Dict[str, Any] = {"iteration": iteration if iteration == "release" else int(iteration)}
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        out[key] = int(getattr(args, key, 0) or 0)
    return out


def check_checkpoint_version(state: Dict[str, Any], where: str) -> None:
    """Refuse checkpoints whose fused QKV rows are not ordered [heads, (q, k, v), head_dim].

    Megatron checkpoints before version 3.0 order them differently; loading one as is would
    scramble attention without any shape error.
    """
    version = float(state.get("checkpoint_version", 0) or 0)
    if version < CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{where} has checkpoint_version {version}: its fused QKV rows are ordered "
            f"differently from version {CHECKPOINT_VERSION}; convert it first (Megatron-LM's "
            "checkpoint conversion to version 3.0)")
