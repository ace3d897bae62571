"""Forward/backward schedules over the micro-batches of one iteration.

Both schedules have one signature, so the trainer picks one with `get_forward_backward_func`
and never branches on the pipeline size itself:

    losses = schedule(forward_step_func, data_iterator, model, num_microbatches,
                      parallel_state=ps, tensor_shape=(b, s, h), backward_func=engine_backward)

- `forward_step_func(batch)` runs this stage's part of the model on one micro-batch and returns
  the scalar loss on the last stage, the activation [b, s, h] on the others. Before each call
  the schedule hands the stage its input with `model.set_input_tensor(t)` (None on the first
  stage); every stage draws one batch per micro-batch from `data_iterator`.
- The loss is divided by `num_microbatches` before backward, so gradients accumulate to the
  mean over micro-batches. `backward_func(output, output_grad)` runs the backward pass
  (output_grad is None for the loss on the last stage); the default is torch.autograd.backward.
  An engine with loss scaling passes its own (scaling only when output_grad is None).
- The return value is the list of the unscaled, detached per-micro-batch losses on the last
  stage and [] elsewhere. Gradient all-reduces (data parallel, tied embeddings) are left to
  the caller, after the schedule.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.pipeline import p2p

ForwardStep = Callable[[Any], torch.Tensor]
BackwardFunc = Callable[[torch.Tensor, Optional[torch.Tensor]], None]


def default_backward(output: torch.Tensor, output_grad: Optional[torch.Tensor]) -> None:
    """d(output) . output_grad backpropagated (plain backward of the loss when grad is None)."""
    torch.autograd.backward(output, grad_tensors=output_grad)


def _set_input(model: Any, input_tensor: Optional[torch.Tensor]) -> None:
    setter = getattr(model, "set_input_tensor", None)
    if setter is not None:
        setter(input_tensor)
    elif input_tensor is not None:
        raise TypeError(f"{type(model).__name__} has no set_input_tensor(); a pipeline stage "
                        "after the first needs one to receive its input")


def _forward_step(forward_step_func: ForwardStep, data_iterator: Iterator[Any], model: Any,
                  input_tensor: Optional[torch.Tensor], ps: ParallelState,
                  num_microbatches: int, losses: List[torch.Tensor]) -> torch.Tensor:
    """Run one micro-batch; on the last stage record the loss and return it / num_microbatches."""
    _set_input(model, input_tensor)
    output = forward_step_func(next(data_iterator))
    if ps.is_pipeline_last_stage():
        losses.append(output.detach())
        output = output / num_microbatches
    return output


def _backward_step(backward_func: BackwardFunc, input_tensor: Optional[torch.Tensor],
                   output: torch.Tensor, output_grad: Optional[torch.Tensor]
                   ) -> Optional[torch.Tensor]:
    """Backward through this stage; returns the gradient of its input (None on stage 0)."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    backward_func(output, output_grad)
    return None if input_tensor is None else input_tensor.grad


def forward_backward_no_pipelining(forward_step_func: ForwardStep, data_iterator: Iterator[Any],
                                   model: Any, num_microbatches: int, *,
                                   parallel_state: Optional[ParallelState] = None,
                                   tensor_shape: Optional[Sequence[int]] = None,
                                   dtype: torch.dtype = torch.float32,
                                   device: Optional[torch.device] = None,
                                   backward_func: BackwardFunc = default_backward,
                                   forward_only: bool = False) -> List[torch.Tensor]:
    """PP = 1: forward and backward each micro-batch in turn, accumulating gradients.

    `tensor_shape`, `dtype` and `device` are accepted for a uniform signature and unused.
    """
    ps = get_parallel_state() if parallel_state is None else parallel_state
    if ps.pipeline_model_parallel_size != 1:
        raise ValueError(f"forward_backward_no_pipelining needs pipeline_model_parallel_size 1, "
                         f"got {ps.pipeline_model_parallel_size}")
    losses: List[torch.Tensor] = []
    for _ in range(num_microbatches):
        if forward_only:
            with torch.no_grad():
                _forward_step(forward_step_func, data_iterator, model, None, ps,
                              num_microbatches, losses)
            continue
        loss = _forward_step(forward_step_func, data_iterator, model, None, ps,
                             num_microbatches, losses)
        backward_func(loss, None)
    return losses


def forward_backward_pipelining_1f1b(forward_step_func: ForwardStep,
                                     data_iterator: Iterator[Any], model: Any,
                                     num_microbatches: int, *,
                                     parallel_state: Optional[ParallelState] = None,
                                     tensor_shape: Sequence[int],
                                     dtype: torch.dtype = torch.float32,
                                     device: Optional[torch.device] = None,
                                     backward_func: BackwardFunc = default_backward,
                                     forward_only: bool = False) -> List[torch.Tensor]:
    """PP > 1: one-forward-one-backward (PipeDream-flush) over `num_microbatches`.

    Stage r first runs min(PP - r - 1, M) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards, so at most PP - r activations are alive.
    Activations and gradients exchanged between stages are `tensor_shape` = [b, s, h] of `dtype`
    on `device` (default CPU; pass the CUDA device with NCCL).
    """
    ps = get_parallel_state() if parallel_state is None else parallel_state
    device = torch.device("cpu") if device is None else device
    shape, rank = tuple(tensor_shape), ps.pipeline_model_parallel_rank
    num_warmup = min(ps.pipeline_model_parallel_size - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    losses: List[torch.Tensor] = []
    inputs: List[Optional[torch.Tensor]] = []
    outputs: List[torch.Tensor] = []

    def forward(input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        with torch.set_grad_enabled(not forward_only):
            return _forward_step(forward_step_func, data_iterator, model, input_tensor, ps,
                                 num_microbatches, losses)

    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(ps, shape, dtype, device)
        output = forward(input_tensor)
        p2p.send_forward(ps, output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = p2p.recv_forward(ps, shape, dtype, device) if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output = forward(input_tensor)
        if forward_only:
            p2p.send_forward(ps, output)
            input_tensor = None if last else p2p.recv_forward(ps, shape, dtype, device)
            continue
        output_grad = p2p.send_forward_recv_backward(ps, output, shape, dtype, device)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = _backward_step(backward_func, inputs.pop(0), outputs.pop(0), output_grad)
        if last:
            input_tensor = None
            p2p.send_backward(ps, input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(ps, input_grad, shape, dtype, device)

    if not forward_only:
        for _ in range(num_warmup):
            output_grad = p2p.recv_backward(ps, shape, dtype, device)
            input_grad = _backward_step(backward_func, inputs.pop(0), outputs.pop(0), output_grad)
            p2p.send_backward(ps, input_grad)
    return losses


def get_forward_backward_func(parallel_state: Optional[ParallelState] = None) -> Callable[..., Any]:
    """The schedule for this layout: 1F1B when PP > 1, else no pipelining."""
    ps = get_parallel_state() if parallel_state is None else parallel_state
    if ps.pipeline_model_parallel_size > 1:
        return forward_backward_pipelining_1f1b
    return forward_backward_no_pipelining
