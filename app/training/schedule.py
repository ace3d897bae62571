"""Forward/backward schedules over the micro-batches of one iteration.

`get_forward_backward_func(pp_size)` returns the no-pipelining schedule for a single stage and
the 1F1B pipeline schedule (app.pipeline) otherwise. Every schedule takes the same keywords:

    forward_step_func(batch) -> (model output, loss_mask)  # output: per-token loss [b, s] on the
                                                           # last stage, hidden [b, s, h] elsewhere
    batch_func() -> batch dict                             # next micro-batch of this rank
    loss_func(per_token_loss [b, s], loss_mask [b, s]) -> scalar loss of the micro-batch
    backward_func(loss)                                    # the engine's backward
and returns the list of micro-batch losses (detached) on the last stage, [] elsewhere. Each
loss is divided by `num_microbatches` before backward, so the accumulated gradient is the mean.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch


def forward_backward_no_pipelining(*, forward_step_func: Callable, batch_func: Callable,
                                   model: Any, num_microbatches: int, loss_func: Callable,
                                   backward_func: Callable, parallel_state: Any,
                                   forward_only: bool, tensor_shape: Any = None
                                   ) -> List[torch.Tensor]:
    """Run each micro-batch forward then backward in turn (gradient accumulation)."""
    losses: List[torch.Tensor] = []
    for _ in range(num_microbatches):
        output, loss_mask = forward_step_func(batch_func())
        loss = loss_func(output, loss_mask)
        if not forward_only:
            backward_func(loss / num_microbatches)
        losses.append(loss.detach())
    return losses


def get_forward_backward_func(pipeline_model_parallel_size: int) -> Callable[..., List[torch.Tensor]]:
    """The schedule for this pipeline depth (see the module docstring for its keywords)."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    from app.pipeline import forward_backward_pipelining_1f1b
    return forward_backward_pipelining_1f1b
