"""Build the optimizer of --optimizer: AdamW (apex FusedAdam when it imports, else torch AdamW,
fused/foreach), SGD with momentum, or Muon with AdamW for the scalar parameters (app.optim.muon)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from app.config import OptimizerConfig
from app.optim.muon import Muon, Orthogonalize, TensorParallelOrthogonalizer, matrix_specs
from app.optim.muon import muon_group_settings
from app.optim.param_groups import get_muon_param_groups, get_param_groups, split_decoupled


def _apex_fused_adam():
    """apex's FusedAdam class, or None when apex is not installed (the usual case)."""
    try:
        from apex.optimizers import FusedAdam  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken build raising something else
        return None
    return FusedAdam


def _torch_adamw(groups: List[Dict[str, Any]], kwargs: Dict[str, Any]) -> torch.optim.Optimizer:
    """torch AdamW with fused=True where the device/dtype supports it, else foreach=True."""
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of `config.optimizer` over `optimizer_param_groups(model, config)` (see
    build_inner_optimizer); Muon orthogonalises each local tensor whole (one process)."""
    orthogonalize = None
    if config.optimizer == "muon":
        orthogonalize = TensorParallelOrthogonalizer(config).for_params(matrix_specs(model))
    return build_inner_optimizer(optimizer_param_groups(model, config), config, orthogonalize)


def optimizer_param_groups(model: nn.Module, config: OptimizerConfig) -> List[Dict[str, Any]]:
    """The param groups of `config.optimizer`: `[decay, no_decay]` (get_param_groups) for adam
    and sgd, `[muon, decay, no_decay]` (get_muon_param_groups) for muon; with --decoupled-lr
    the embeddings and output layer in a last group `decoupled` (split_decoupled)."""
    if config.optimizer == "muon":
        groups = get_muon_param_groups(model, muon_group_settings(config), config.weight_decay)
    else:
        groups = get_param_groups(model, config.weight_decay)
    return split_decoupled(groups, model, config.decoupled_lr_range)


def build_inner_optimizer(groups: List[Dict[str, Any]], config: OptimizerConfig,
                          orthogonalize: Optional[Orthogonalize] = None) -> torch.optim.Optimizer:
    """The torch optimizer of `config.optimizer` over `groups` (from optimizer_param_groups,
    or their fp32 main copies): AdamW (build_adamw); SGD with --sgd-momentum and L2 weight
    decay (torch.optim.SGD, as Megatron); or `Muon` with AdamW over the groups not marked
    `use_muon` (--muon-scalar-optimizer adam), which needs `orthogonalize`."""
    if config.optimizer == "adam":
        return build_adamw(groups, config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay)
    if orthogonalize is None:
        raise ValueError("Muon needs the function that orthogonalises its updates")
    scalar_groups = [g for g in groups if not g["use_muon"]]
    scalar = build_adamw(scalar_groups, config) if scalar_groups else None
    return Muon(groups, scalar, orthogonalize)


def build_adamw(groups: List[Dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over param `groups` with the config's lr, betas, eps and weight decay.

    apex `FusedAdam` (decoupled weight decay, i.e. AdamW) is used only if
    `from apex.optimizers import FusedAdam` works and every parameter is on CUDA; otherwise
    `torch.optim.AdamW(fused=True)` when torch supports it for the parameters' device and dtype
    (CPU and CUDA in torch 2.13), else `torch.optim.AdamW(foreach=True)`. The LR written here is
    replaced by `OptimizerParamScheduler` before the first step.
    """
    if not groups:
        raise ValueError("the model has no trainable parameters to optimise")
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                  eps=config.adam_eps, weight_decay=config.weight_decay)
    fused_adam = _apex_fused_adam()
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    if fused_adam is not None and on_cuda:
        return fused_adam(groups, adam_w_mode=True, **kwargs)
    return _torch_adamw(groups, kwargs)
