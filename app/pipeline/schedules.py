"""Forward/backward schedules over the micro-batches of one iteration.

Both schedules take the keywords of `app.training.schedule` (the trainer's convention), so the
trainer picks one by pipeline size and never branches otherwise:

    losses = schedule(forward_step_func=step, batch_func=next_batch, model=stage,
                      num_microbatches=M, loss_func=loss_fn, backward_func=engine.backward,
                      parallel_state=ps, forward_only=False, tensor_shape=(b, s, h))

- `batch_func()` returns this rank's next micro-batch; every stage draws one per micro-batch.
- Before each forward the schedule hands the stage its input with `model.set_input_tensor(t)`
  (None on the first stage; skipped when the model has no such method and PP = 1).
- `forward_step_func(batch) -> (output, loss_mask)`: the output is what the model returns
  (per-token loss [b, s] on the last stage, hidden [b, s, h] elsewhere).
- `loss_func(output, loss_mask) -> scalar` on the last stage; that loss / M goes to
  `backward_func(loss)` (the engine's backward, which may scale it). Other stages backpropagate
  the received output gradient with torch.autograd.backward (it already carries any scale).
- Returns the unscaled, detached micro-batch losses on the last stage and [] elsewhere.
  Gradient all-reduces (data parallel, tied embeddings) are left to the caller.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.pipeline import p2p


def _set_input(model: Any, input_tensor: Optional[torch.Tensor]) -> None:
    setter = getattr(model, "set_input_tensor", None)
    if setter is not None:
        setter(input_tensor)
    elif input_tensor is not None:
        raise TypeError(f"{type(model).__name__} has no set_input_tensor(); a pipeline stage "
                        "after the first needs one to receive its input")


class _Stage:
    """One rank's view of the schedule: forward and backward of single micro-batches."""

    def __init__(self, forward_step_func: Callable, batch_func: Callable, model: Any,
                 loss_func: Callable, backward_func: Callable, ps: ParallelState,
                 num_microbatches: int) -> None:
        self.forward_step_func, self.batch_func, self.model = forward_step_func, batch_func, model
        self.loss_func, self.backward_func, self.ps = loss_func, backward_func, ps
        self.num_microbatches = num_microbatches
        self.losses: List[torch.Tensor] = []

    def forward(self, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Run one micro-batch; returns the loss / M on the last stage, the activation elsewhere."""
        _set_input(self.model, input_tensor)
        output, loss_mask = self.forward_step_func(self.batch_func())
        if not self.ps.is_pipeline_last_stage():
            return output  # [b, s, h]
        loss = self.loss_func(output, loss_mask)
        self.losses.append(loss.detach())
        return loss / self.num_microbatches

    def backward(self, input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward through this stage; returns the gradient of its input (None on stage 0)."""
        if output_grad is None:
            self.backward_func(output)  # the loss, on the last stage
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        return None if input_tensor is None else input_tensor.grad


def forward_backward_no_pipelining(*, forward_step_func: Callable, batch_func: Callable,
                                   model: Any, num_microbatches: int, loss_func: Callable,
                                   backward_func: Callable,
                                   parallel_state: Optional[ParallelState] = None,
                                   forward_only: bool = False, tensor_shape: Any = None,
                                   dtype: Optional[torch.dtype] = None,
                                   device: Optional[torch.device] = None) -> List[torch.Tensor]:
    """PP = 1: forward then backward of each micro-batch in turn (gradient accumulation).

    `tensor_shape`, `dtype` and `device` are accepted for a uniform signature and unused.
    """
    ps = get_parallel_state() if parallel_state is None else parallel_state
    if ps.pipeline_model_parallel_size != 1:
        raise ValueError(f"forward_backward_no_pipelining needs pipeline_model_parallel_size 1, "
                         f"got {ps.pipeline_model_parallel_size}")
    stage = _Stage(forward_step_func, batch_func, model, loss_func, backward_func, ps,
                   num_microbatches)
    for _ in range(num_microbatches):
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            loss = stage.forward(None)
        if not forward_only:
            stage.backward(None, loss, None)
    return stage.losses


def _activation_format(model: Any, dtype: Optional[torch.dtype], device: Optional[torch.device]
                       ) -> Tuple[torch.dtype, torch.device]:
    """dtype/device of exchanged activations: given, else those of the model's parameters."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if dtype is None:
        dtype = param.dtype if param is not None else torch.float32
    if device is None:
        device = param.device if param is not None else torch.device("cpu")
    return dtype, device


def forward_backward_pipelining_1f1b(*, forward_step_func: Callable, batch_func: Callable,
                                     model: Any, num_microbatches: int, loss_func: Callable,
                                     backward_func: Callable,
                                     parallel_state: Optional[ParallelState] = None,
                                     forward_only: bool = False,
                                     tensor_shape: Sequence[int],
                                     dtype: Optional[torch.dtype] = None,
                                     device: Optional[torch.device] = None
                                     ) -> List[torch.Tensor]:
    """PP > 1: one-forward-one-backward (PipeDream-flush) over `num_microbatches` M.

    Stage r runs min(PP - r - 1, M) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards, so at most PP - r activations are alive.
    Activations and their gradients exchanged between stages are `tensor_shape` = [b, s, h]
    of `dtype` on `device` (default: those of the model's parameters).
    """
    ps = get_parallel_state() if parallel_state is None else parallel_state
    dtype, device = _activation_format(model, dtype, device)
    shape, rank = tuple(tensor_shape), ps.pipeline_model_parallel_rank
    stage = _Stage(forward_step_func, batch_func, model, loss_func, backward_func, ps,
                   num_microbatches)
    num_warmup = min(ps.pipeline_model_parallel_size - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    inputs: List[Optional[torch.Tensor]] = []
    outputs: List[torch.Tensor] = []

    def forward(input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        with torch.set_grad_enabled(not forward_only):
            return stage.forward(input_tensor)

    def recv_forward() -> Optional[torch.Tensor]:
        return p2p.recv_forward(ps, shape, dtype, device)

    for _ in range(num_warmup):
        input_tensor = recv_forward()
        output = forward(input_tensor)
        p2p.send_forward(ps, output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output = forward(input_tensor)
        if forward_only:
            p2p.send_forward(ps, output)
            input_tensor = None if last else recv_forward()
            continue
        output_grad = p2p.send_forward_recv_backward(ps, output, shape, dtype, device)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = stage.backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last:
            input_tensor = None
            p2p.send_backward(ps, input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(ps, input_grad, shape, dtype, device)

    if not forward_only:
        for _ in range(num_warmup):
            output_grad = p2p.recv_backward(ps, shape, dtype, device)
            input_grad = stage.backward(inputs.pop(0), outputs.pop(0), output_grad)
            p2p.send_backward(ps, input_grad)
    return stage.losses


def get_forward_backward_func(parallel_state: Optional[ParallelState] = None) -> Callable[..., Any]:
    """The schedule for this layout: 1F1B when PP > 1, else no pipelining."""
    ps = get_parallel_state() if parallel_state is None else parallel_state
    if ps.pipeline_model_parallel_size > 1:
        return forward_backward_pipelining_1f1b
    return forward_backward_no_pipelining
