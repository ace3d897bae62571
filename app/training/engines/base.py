"""The engine interface the training loop talks to, and helpers shared by the engines.

The trainer drives one iteration as: `zero_grad()`, then for every micro-batch a forward pass
and `backward(loss / num_micro_batches)`, then `step()` once. Everything that differs between
the native path and DeepSpeed (gradient synchronisation, clipping, loss scaling, the optimizer
and LR-schedule step, checkpoint files) lives behind this interface, so the loop never asks
which engine it has. `native_engine.NativeEngine` and `deepspeed_engine.DeepSpeedEngineAdapter`
implement it; `app.training.run.build_engine` picks one. Loading follows one policy for both
(`app.training.resilience.resume`); an engine only reads its own files.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from app.checkpoint import commit
from app.config import RunConfig
from app.training.resilience.resume import (CheckpointContents, LoadResult, ResumePlan,
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


class Engine(abc.ABC):
    """Backward, step and checkpoint I/O for one model replica, whatever implements them.

    `module` is the GPT-2 model (the engine may wrap it; calling `module(...)` runs the forward
    of the local pipeline stage). `lr_scheduler` is the schedule that drives the optimizer the
    engine steps, so the LR it reports is the LR the update used.
    """

    cfg: RunConfig
    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    _pending_save: Optional[commit.PendingSave] = None
    """The save being written in the background (--async-save), until finish_save commits it."""

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

    def save_checkpoint(self, save_dir: str, iteration: int, client_state: Dict[str, Any],
                        asynchronous: bool = False) -> str:
        """Write a checkpoint of `iteration` (all ranks call it); return the directory written.

        The save in flight, if any, is finished first (at most one at a time). With
        `asynchronous` this returns once the state is copied to host memory and this rank's
        files are being written in the background; `finish_save` commits it later.
        """
        self.finish_save()
        pending = self.start_save(save_dir, iteration, client_state, asynchronous)
        if not asynchronous:
            return pending.finish()
        self._pending_save = pending
        return pending.directory

    def finish_save(self, blocking: bool = True) -> Optional[str]:
        """Commit the save in flight on every rank (all ranks call it at the same point); its
        directory, or None when none was in flight or (not `blocking`) some rank is still
        writing. Not blocking costs one agreement over the ranks while a save is in flight."""
        pending = self._pending_save
        if pending is None or (not blocking and not pending.agree(pending.written())):
            return None
        self._pending_save = None
        return pending.finish()

    def abandon_save(self, timeout_s: float) -> None:
        """On an exit path that cannot commit (an error, no collective): end the save in
        flight, waiting up to `timeout_s` for its background writer, and remove this rank's
        files of it (commit.PendingSave.abandon); the tracker never named it."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.abandon(timeout_s)

    @property
    def save_in_flight(self) -> Optional[int]:
        """The iteration of the save being written in the background, or None."""
        return None if self._pending_save is None else self._pending_save.iteration

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
        (app.training.resilience.resume); None when the directory holds none."""
        return resume_from_checkpoint(self, self.cfg.checkpoint, load_dir)

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
