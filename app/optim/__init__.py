"""Optimizer pieces: param groups, the builder (AdamW, SGD, Muon), Megatron's LR schedule."""
from app.optim.lr_schedule import OptimizerParamScheduler, learning_rate_at
from app.optim.optimizer import build_optimizer
from app.optim.param_groups import get_param_groups, no_weight_decay

__all__ = ["OptimizerParamScheduler", "learning_rate_at", "build_optimizer", "get_param_groups",
           "no_weight_decay"]
