"""The training objective as a Python entry point: a function of the model's output and the batch.

    from app.training.loss import LossFunction

    def z_loss(logits, batch):                       # logits [b, s, V] (full vocabulary)
        ...
        return loss, {"z loss": z.detach()}

    pretrain_gpt2.run(argv, loss_function=LossFunction(z_loss, inputs="logits"))

`fn(output, batch) -> (loss, metrics)` runs once per micro-batch on the last pipeline stage:
- `output` is the per-token cross-entropy [b, s] fp32 (`inputs="per_token_loss"`, the default:
  the model computes it without materialising full logits), or the logits [b, s, V] over the
  whole padded vocabulary (`inputs="logits"`; gathered over tensor-parallel ranks, with their
  gradient flowing back to each rank's shard);
- `batch` is the micro-batch dict: tokens, labels, loss_mask, attention_mask, position_ids;
- `loss` is the scalar to minimise (the schedule divides it by the number of micro-batches);
- `metrics` maps names to scalars (tensors or floats); the trainer averages them over the
  micro-batches and data-parallel ranks and logs them next to the loss. Every rank must return
  the same names.

`DEFAULT_LOSS` is Megatron's: the mean of the per-token loss over the tokens whose loss mask is
1, with no extra metrics; the trainer keeps its fast path for it.

With --calculate-per-token-loss (Megatron's per-token normalisation, `per_token=True` below) the
objective of an iteration is the sum of the masked token losses of the whole global batch
divided by its count N of loss-mask tokens (over every micro-batch and data x context rank),
instead of the mean of the micro-batches' masked means. N is counted before the forward passes
from the iteration's batches (`prepare`), so each micro-batch's backward can carry
sum x M x R / N (M micro-batches, R data x context ranks): after the schedule's 1/M and the
engines' average over R, the gradient is that of sum / N, as Megatron's finalize_model_grads
makes it. The logged loss is Megatron's too: the sum of the token losses over the count, both
summed over the global batch (`reported_loss`; evaluation sums over all its iterations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from app.model.gpt2 import lm_loss
from app.mpu import collectives
from app.model.moe import begin_iteration as begin_moe_iteration
from app.mpu.context_parallel import context_parallel_mean_loss
from app.mpu.mappings import gather_from_tensor_model_parallel_region
from app.utils import faults

Metrics = Mapping[str, Union[torch.Tensor, float]]
LossFn = Callable[[torch.Tensor, Dict[str, torch.Tensor]], Tuple[torch.Tensor, Metrics]]
LOSS_INPUTS = ("per_token_loss", "logits")


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the per-token loss `[b, s]` over the tokens whose `loss_mask` is 1."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)


def language_model_loss(per_token_loss: torch.Tensor,
                        batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Metrics]:
    """Megatron's LM loss: the masked mean of the per-token cross-entropy; no extra metrics."""
    return masked_mean_loss(per_token_loss, batch["loss_mask"]), {}


@dataclass(frozen=True)
class LossFunction:
    """A training loss `fn(output, batch) -> (loss, metrics)` and which output it takes:
    "per_token_loss" ([b, s] fp32 cross-entropy) or "logits" ([b, s, V], full vocabulary)."""

    fn: LossFn
    inputs: str = "per_token_loss"

    def __post_init__(self) -> None:
        if self.inputs not in LOSS_INPUTS:
            raise ValueError(f"LossFunction inputs must be one of {', '.join(LOSS_INPUTS)}, got "
                             f"{self.inputs!r}")
        if not callable(self.fn):
            raise TypeError(f"LossFunction fn must be callable, got {type(self.fn).__name__}")

    @property
    def takes_logits(self) -> bool:
        return self.inputs == "logits"


DEFAULT_LOSS = LossFunction(language_model_loss)


class MicroBatchObjective:
    """The schedules' `forward_step_func` and `loss_func` for one LossFunction.

    `forward_step(model, batch) -> (output, batch)` asks the model for the per-token loss (the
    default path: labels passed in, no logits kept) or, when the loss takes logits or
    `return_logits` is on, for this rank's logits [b, s, V/tp]. `loss_func(output, batch)`
    (last stage) calls the loss function and records its metrics and, with `return_logits`,
    the detached full-vocabulary logits; `take()` hands both over and starts afresh.
    `per_token` is --calculate-per-token-loss (module docstring): `prepare` sets the
    iteration's scale, `reported_loss` gives the loss to log.
    """

    def __init__(self, loss_function: LossFunction, parallel_state: Any,
                 return_logits: bool = False, per_token: bool = False) -> None:
        self.loss_function, self.ps, self.return_logits = loss_function, parallel_state, return_logits
        self.context_parallel = getattr(parallel_state, "context_parallel_size", 1) > 1
        if self.context_parallel and (loss_function is not DEFAULT_LOSS or return_logits):
            raise ValueError("--context-parallel-size > 1 trains with the default language-model"
                             " loss only (each rank holds part of every sequence); drop the "
                             "custom loss function / return_logits or the context parallelism")
        if per_token and loss_function is not DEFAULT_LOSS:
            raise ValueError("--calculate-per-token-loss normalises Megatron's language-model "
                             "loss over the global batch's tokens; a custom loss function "
                             "normalises itself: drop one of the two")
        self.per_token = per_token
        self.token_scale: Optional[torch.Tensor] = None
        """M x R / N for this iteration's backward (per_token; None in evaluation)."""
        self.token_sums: List[torch.Tensor] = []
        """[sum of masked token losses, tokens] of each micro-batch since the last report."""
        self.wants_logits = loss_function.takes_logits or return_logits
        self.metrics: List[Dict[str, torch.Tensor]] = []
        self.logits: List[torch.Tensor] = []

    def prepare(self, batches: List[Dict[str, torch.Tensor]], num_micro_batches: int) -> None:
        """Per-token loss: count the loss-mask tokens of this iteration's micro-batches over the
        data x context ranks (every pipeline stage holds the batches, so every stage counts
        alike) and set the backward scale M x R / max(N, 1)."""
        replicas = self.ps.gradient_state()
        local = torch.stack([b["loss_mask"].float().sum() for b in batches]).sum()
        count = collectives.all_reduce(local, replicas.data_parallel_group)
        self.token_scale = (float(num_micro_batches * replicas.data_parallel_size)
                            / count.clamp(min=1.0))

    def prefetch(self, next_batch: Callable[[], Dict[str, torch.Tensor]],
                 num_micro_batches: int) -> Callable[[], Dict[str, torch.Tensor]]:
        """A training iteration's batch source: per token, its `num_micro_batches` batches read
        at once and counted (`prepare`) before the passes, then handed out in order; otherwise
        `next_batch` itself."""
        if not self.per_token:
            return next_batch
        batches = [next_batch() for _ in range(num_micro_batches)]
        self.prepare(batches, num_micro_batches)
        return iter(batches).__next__

    def aux_loss_scale(self, num_micro_batches: int) -> Optional[float]:
        """Per-token loss: the factor of this iteration's MoE auxiliary-loss gradients, R / N
        (Megatron divides them by the token count with the others); None otherwise."""
        if not self.per_token or self.token_scale is None:
            return None
        return float(self.token_scale) / num_micro_batches

    def reported_loss(self, losses: List[torch.Tensor]) -> Optional[float]:
        """The loss to log for the micro-batch `losses` of one or more iterations (last stage;
        None elsewhere): their mean, averaged over the data-parallel ranks; per token, the sum
        of the recorded token losses over their count, both summed over data x context ranks
        (Megatron's report). Starts the per-token record afresh."""
        self.token_scale = None
        if not losses:
            return None
        if self.per_token:
            totals = torch.stack(self.token_sums).sum(dim=0)  # [2]: loss sum, token count
            self.token_sums = []
            collectives.all_reduce(totals, self.ps.gradient_state().data_parallel_group)
            return float(totals[0] / totals[1].clamp(min=1.0))
        loss = torch.stack([x.detach().float() for x in losses]).mean()
        if self.ps.data_parallel_size > 1:
            collectives.all_reduce(loss, self.ps.data_parallel_group)
            loss = loss / self.ps.data_parallel_size
        return float(loss)

    def forward_step(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]
                     ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        labels = None if self.wants_logits else batch["labels"]
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=labels)
        return output, batch

    def loss_func(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        if self.loss_function.takes_logits:  # output: this rank's logits [b, s, V/tp]
            output = gather_from_tensor_model_parallel_region(output, self.ps)  # [b, s, V]
            if self.return_logits:
                self.logits.append(output.detach())
        elif self.return_logits:
            with torch.no_grad():
                full = gather_from_tensor_model_parallel_region(output, self.ps)  # [b, s, V]
            self.logits.append(full.detach())
            output = lm_loss(output, batch["labels"], self.ps)  # [b, s] fp32
        if self.per_token:
            mask = batch["loss_mask"].float()
            total = (output.float() * mask).sum()  # this rank's tokens of the micro-batch
            self.token_sums.append(torch.stack([total.detach(), mask.sum()]))
            return total if self.token_scale is None else total * self.token_scale
        if self.context_parallel:  # the whole sequence's mean over the context group
            return context_parallel_mean_loss(output, batch["loss_mask"], self.ps)
        loss, metrics = self.loss_function.fn(output, batch)
        if metrics:
            self.metrics.append({name: torch.as_tensor(value).detach().float().reshape(())
                                 for name, value in metrics.items()})
        return loss

    def begin_training_iteration(self, model: torch.nn.Module, loss_scale: Optional[float],
                                 num_micro_batches: int) -> None:
        """Before a training iteration's forward-backward: the scale the MoE auxiliary losses'
        gradients carry, the main loss's (app.model.moe.begin_iteration: loss scale x
        context-parallel size / micro-batches, per token R / N: `aux_loss_scale`); nothing for
        a dense model."""
        begin_moe_iteration(model, loss_scale, getattr(self.ps, "context_parallel_size", 1),
                            num_micro_batches, self.aux_loss_scale(num_micro_batches))

    def training_loss_func(self, first_sample: int) -> Callable[..., torch.Tensor]:
        """`loss_func` as an iteration of training (whose first sample is `first_sample`)
        calls it: through the fault-injection point `faults.TRAINING_LOSS` when a test armed
        it (app.utils.faults), else `loss_func` itself."""
        inject = faults.armed(faults.TRAINING_LOSS)
        if inject is None:
            return self.loss_func
        return lambda output, batch: inject(first_sample, self.loss_func(output, batch))

    def take(self) -> Tuple[List[Dict[str, torch.Tensor]], List[torch.Tensor]]:
        """The metrics and logits recorded since the last call."""
        metrics, logits = self.metrics, self.logits
        self.metrics, self.logits = [], []
        return metrics, logits
