"""Build the AdamW optimizer: apex FusedAdam when it imports, else torch AdamW (fused/foreach)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from app.config import OptimizerConfig
from app.optim.param_groups import get_param_groups


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
    """AdamW over `get_param_groups(model)` (see build_adamw)."""
    return build_adamw(get_param_groups(model, config.weight_decay), config)


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
