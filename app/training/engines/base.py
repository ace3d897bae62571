"""The engine interface the training loop talks to, and helpers shared by the engines.

The trainer drives one iteration as: `zero_grad()`, then for every micro-batch a forward pass
and `backward(loss / num_micro_batches)`, then `step()` once. Everything that differs between
the native path and DeepSpeed (gradient synchronisation, clipping, loss scaling, the optimizer
and LR-schedule step, checkpoint files) lives behind this interface, so the loop never asks
which engine it has. `native_engine.NativeEngine` and `deepspeed_engine.DeepSpeedEngineAdapter`
implement it; `app.training.run.build_engine` picks one. Loading follows one policy for both
(`app.training.checkpointing.resume`); an engine only reads its own files.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from app.checkpoint import commit
from app.config import RunConfig
from app.training.checkpointing.resume import (CheckpointContents, LoadResult, ResumePlan,
                                 resume_from_checkpoint)


@dataclass
class StepResult:
    """What one optimizer step did: the pre-clip global gradient norm, whether the update was
    skipped (non-finite gradients or loss-scale overflow), the LR it used and the loss scale."""

    grad_norm: Optional[float]
    skipped: bool
    lr: float
    loss_scale: Optional[float] = None
    nonfinite: bool = False
    """A non-finite step that counts toward --max-consecutive-skipped-iterations (any skip in
    fp32/bf16; in fp16 an overflow at the minimum or a static loss scale; on DeepSpeed a
    non-finite loss)."""
    nonfinite_loss: bool = False
    """Some rank's loss of this iteration was inf/nan (agreed over all ranks)."""


class Engine(commit.OneSaveAtATime, abc.ABC):
    """Backward, step and checkpoint I/O for one model replica, whatever implements them.

    `module` is the GPT-2 model (the engine may wrap it; calling `module(...)` runs the forward
    of the local pipeline stage). `lr_scheduler` is the schedule that drives the optimizer the
    engine steps, so the LR it reports is the LR the update used.
    """

    cfg: RunConfig
    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear gradients before the first micro-batch of an iteration."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already divided by the number of micro-batches)."""

    def backward_output(self, output: torch.Tensor, output_grad: torch.Tensor) -> None:
        """Accumulate gradients of a pipeline stage's `output` given the gradient the next stage
        sent back (it already carries the loss scale and the 1 / num_micro_batches)."""
        torch.autograd.backward(output, grad_tensors=output_grad)

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Synchronise gradients, clip, update the weights and advance the LR schedule by one
        update (an iteration, or its global batch when the schedule counts samples)."""

    def set_global_batch(self, global_batch_size: int, num_micro_batches: int) -> None:
        """The coming iteration's global batch and micro-batches per rank (a batch-size
        schedule changes them between iterations): a schedule that counts samples advances by
        the batch."""
        if getattr(self.lr_scheduler, "in_samples", False):
            self.lr_scheduler.increment = global_batch_size

    @abc.abstractmethod
    def start_save(self, save_dir: str, iteration: int, client_state: Dict[str, Any],
                   asynchronous: bool) -> commit.PendingSave:
        """Begin this rank's part of a checkpoint of `iteration` (app.checkpoint.commit's
        `start_save`); with `asynchronous` copy the state and write it in the background."""

    @abc.abstractmethod
    def read_checkpoint(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """Read this engine's files of `plan.iteration` under `load_dir`: load the weights (after
        checking the saved shape with `resume.check_saved_args`), and the optimizer and
        LR-scheduler states when `plan.load_optimizer`; return what the policy needs."""

    def load_checkpoint(self, load_dir: str) -> Optional[LoadResult]:
        """Restore from the latest checkpoint under `load_dir` with the shared resume policy
        (app.training.checkpointing.resume); None when the directory holds none."""
        return resume_from_checkpoint(self, self.cfg.checkpoint, load_dir)

    def local_state(self) -> Dict[str, Any]:
        """This rank's whole training state, for a local checkpoint of this rank alone
        (app.training.checkpointing.local): weights, optimizer and LR schedule, as
        `load_local_state` takes them back at the same layout (all ranks call it together)."""
        raise NotImplementedError(f"{self.name} has no local checkpoints")

    def load_local_state(self, state: Dict[str, Any], where: str) -> None:
        """Restore what `local_state` returned (read from `where`, for messages)."""
        raise NotImplementedError(f"{self.name} has no local checkpoints")

    def local_safe_globals(self) -> List[Any]:
        """Classes besides tensors and containers that `local_state` pickles (the allow-list
        for reading it back with weights_only)."""
        return []

    def local_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, values) of every weight as this rank holds it (the module's parameters; an
        engine that partitions the weights themselves yields this rank's pieces)."""
        return self.module.named_parameters()

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
