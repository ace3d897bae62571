"""The engine interface the training loop talks to, and the native (non-DeepSpeed) engine.

The trainer drives one iteration as: `zero_grad()`, then for every micro-batch a forward pass
and `backward(loss / num_micro_batches)`, then `step()` once. Everything that differs between
the native path and DeepSpeed (gradient synchronisation, clipping, loss scaling, the optimizer
and LR-schedule step, checkpoint files) lives behind this interface, so the loop never asks
which engine it has. `app/training/deepspeed_engine.py` implements the same interface.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from app.config import RunConfig


@dataclass
class StepResult:
    """What one optimizer step did: the pre-clip global gradient norm, whether the update was
    skipped (non-finite gradients or loss-scale overflow), the LR it used and the loss scale."""

    grad_norm: Optional[float]
    skipped: bool
    lr: float
    loss_scale: Optional[float] = None


@dataclass
class LoadResult:
    """State recovered from a checkpoint: where training resumes and the run's client state."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    path: str


class Engine(abc.ABC):
    """Backward, step and checkpoint I/O for one model replica, whatever implements them.

    `module` is the GPT-2 model (the engine may wrap it; calling `module(...)` runs the forward
    of the local pipeline stage). `lr_scheduler` is the schedule that drives the optimizer the
    engine steps, so the LR it reports is the LR the update used.
    """

    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear gradients before the first micro-batch of an iteration."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already divided by the number of micro-batches)."""

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Synchronise gradients, clip, update the weights and advance the LR schedule by one."""

    @abc.abstractmethod
    def save_checkpoint(self, save_dir: str, iteration: int, client_state: Dict[str, Any]) -> str:
        """Write a checkpoint of `iteration` (all ranks call it); return the directory written."""

    @abc.abstractmethod
    def load_checkpoint(self, load_dir: str) -> Optional[LoadResult]:
        """Restore from the latest checkpoint under `load_dir`, honouring --no-load-optim,
        --no-load-rng and --finetune; None (with a message) when the directory holds none."""

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    @property
    def loss_scale(self) -> Optional[float]:
        """Current loss scale, or None when the engine does not scale the loss."""
        return None

    @property
    def name(self) -> str:
        return type(self).__name__

    def state_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer states, from the tensors.

        Gradients are those present after the last backward; optimizer states exist after the
        first step. Engines that partition state (ZeRO) override this.
        """
        params = sum(tensor_bytes(p) for p in self.module.parameters())
        grads = sum(tensor_bytes(p.grad) for p in self.module.parameters() if p.grad is not None)
        return {"params": params, "grads": grads,
                "optimizer": optimizer_state_bytes(self.optimizer)}


def tensor_bytes(t: Any) -> int:
    """Storage of one tensor in bytes (0 for anything that is not a tensor)."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in a torch optimizer's per-parameter state (exp_avg, ...)."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        total += sum(tensor_bytes(v) for v in state.values() if getattr(v, "dim", lambda: 0)() > 0)
    return total


def grad_norm_is_finite(norm: Optional[float]) -> bool:
    """True when there is no norm to check or it is a finite number."""
    return norm is None or math.isfinite(norm)


def build_engine(cfg: RunConfig, model: torch.nn.Module, parallel_state: Any,
                 log: Any = print, explicit_flags: Any = ()) -> Engine:
    """The engine this run asks for: DeepSpeed's with --deepspeed, else the native one.

    DeepSpeed is imported only when asked for, inside app.training.deepspeed_engine.
    `explicit_flags` are the flags given on the command line (checked against the JSON).
    """
    from app.optim import OptimizerParamScheduler, build_optimizer

    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = OptimizerParamScheduler(optimizer, cfg.optimizer)
    if cfg.deepspeed.enabled:
        from app.training.deepspeed_engine import DeepSpeedEngineAdapter
        return DeepSpeedEngineAdapter(cfg, model, optimizer, scheduler, parallel_state, log=log,
                                      explicit_flags=explicit_flags)
    from app.training.native_engine import NativeEngine
    return NativeEngine(cfg, model, optimizer, scheduler, parallel_state, log=log)
