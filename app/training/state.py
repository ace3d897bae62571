"""What the training loop keeps and returns: the run's position (`RunState`, what checkpoints
carry) and one iteration's or evaluation batch's results (`StepOutput`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class RunState:
    """Where the run stands; what a checkpoint's client state carries."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    data_order: Optional[Dict[str, Any]] = None
    """The run's data-order record (app.data.plan.order_record), saved with every checkpoint."""

    def client_state(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"iteration": self.iteration,
                                 "consumed_train_samples": self.consumed_train_samples,
                                 "consumed_valid_samples": self.consumed_valid_samples}
        if self.data_order is not None:
            state["data_order"] = self.data_order
        return state


@dataclass
class StepOutput:
    """What one training iteration (`Trainer.train_step`) or one evaluation batch
    (`Trainer.eval_step`) produced. `loss` is the mean over micro-batches and data-parallel ranks
    (None off the last pipeline stage); `metrics` the loss function's extra metrics averaged the
    same way; `logits` every micro-batch's full-vocabulary logits with `return_logits`. The
    engine's fields (`grad_norm` .. `nonfinite_loss`, see app.training.engines.base.StepResult)
    are left at their defaults by evaluation."""

    loss: Optional[float]
    metrics: Dict[str, float] = field(default_factory=dict)
    logits: Optional[List[torch.Tensor]] = None
    grad_norm: Optional[float] = None
    skipped: bool = False
    lr: float = float("nan")
    loss_scale: Optional[float] = None
    nonfinite: bool = False
    nonfinite_loss: bool = False
