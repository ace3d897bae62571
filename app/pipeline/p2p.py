"""Point-to-point exchange of activations and their gradients between neighbouring stages.

Every function is a no-op (returning None for receives) where the neighbour does not exist
(before the first stage, after the last). Receive buffers are [b, s, h] tensors of the given
dtype on the given device; all traffic goes through `app.mpu.collectives`, posting sends and
receives together so that two stages exchanging at once cannot deadlock.

Activations (forward direction) travel over the pipeline group and gradients (backward
direction) over the world group: messages between two ranks match in posting order only within
one group, so with two stages, where the next and the previous rank are the same rank, an
activation can never be taken for a gradient of the same shape. `exchange(..., ring=True)` is
the interleaved schedule's version, where the last stage feeds the first (the next chunk).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState

Shape = Sequence[int]


def _neighbours(ps: ParallelState, ring: bool) -> Tuple[Optional[int], Optional[int]]:
    """(previous, next) global ranks of this stage; wrapping around when `ring`."""
    if not ring:
        return ps.pipeline_prev_rank(), ps.pipeline_next_rank()
    rank, size = ps.pipeline_model_parallel_rank, ps.pipeline_model_parallel_size
    return ps.pipeline_ranks[(rank - 1) % size], ps.pipeline_ranks[(rank + 1) % size]


def exchange(ps: ParallelState, send_next: Optional[torch.Tensor],
             send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
             shape: Shape, dtype: torch.dtype, device: torch.device, ring: bool = False
             ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One batched exchange; returns (activation from the previous stage, which requires grad,
    gradient from the next stage), None where nothing was asked for or there is no neighbour."""
    prev_rank, next_rank = _neighbours(ps, ring)
    forward_sends: List[Tuple[torch.Tensor, int]] = []
    forward_recvs: List[Tuple[torch.Tensor, int]] = []
    backward_sends: List[Tuple[torch.Tensor, int]] = []
    backward_recvs: List[Tuple[torch.Tensor, int]] = []
    from_prev = from_next = None
    if send_next is not None and next_rank is not None:
        forward_sends.append((send_next.detach(), next_rank))
    if recv_prev and prev_rank is not None:
        from_prev = torch.empty(tuple(shape), dtype=dtype, device=device)
        forward_recvs.append((from_prev, prev_rank))
    if send_prev is not None and prev_rank is not None:
        backward_sends.append((send_prev.detach(), prev_rank))
    if recv_next and next_rank is not None:
        from_next = torch.empty(tuple(shape), dtype=dtype, device=device)
        backward_recvs.append((from_next, next_rank))
    requests = collectives.post_send_recv(forward_sends, forward_recvs,
                                          ps.pipeline_model_parallel_group)
    requests += collectives.post_send_recv(backward_sends, backward_recvs)
    collectives.wait_all(requests)
    if from_prev is not None:
        from_prev.requires_grad_()
    return from_prev, from_next


def recv_forward(ps: ParallelState, shape: Shape, dtype: torch.dtype,
                 device: torch.device) -> Optional[torch.Tensor]:
    """Activation [b, s, h] from the previous stage (requires grad); None on the first stage."""
    received, _ = exchange(ps, None, None, True, False, shape, dtype, device)
    return received


def send_forward(ps: ParallelState, output: torch.Tensor) -> None:
    """Send this stage's output [b, s, h] to the next stage (no-op on the last stage)."""
    exchange(ps, output, None, False, False, output.shape, output.dtype, output.device)


def recv_backward(ps: ParallelState, shape: Shape, dtype: torch.dtype,
                  device: torch.device) -> Optional[torch.Tensor]:
    """Gradient of this stage's output from the next stage; None on the last stage."""
    _, received = exchange(ps, None, None, False, True, shape, dtype, device)
    return received


def send_backward(ps: ParallelState, input_grad: Optional[torch.Tensor]) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first)."""
    if input_grad is not None:
        exchange(ps, None, input_grad, False, False, input_grad.shape, input_grad.dtype,
                  input_grad.device)


def send_forward_recv_backward(ps: ParallelState, output: torch.Tensor, shape: Shape,
                               dtype: torch.dtype, device: torch.device
                               ) -> Optional[torch.Tensor]:
    """Send the output forward and receive its gradient, in one exchange (1F1B steady state)."""
    _, grad = exchange(ps, output, None, False, True, shape, dtype, device)
    return grad


def send_backward_recv_forward(ps: ParallelState, input_grad: Optional[torch.Tensor],
                               shape: Shape, dtype: torch.dtype, device: torch.device
                               ) -> Optional[torch.Tensor]:
    """Send the input gradient backward and receive the next activation, in one exchange."""
    received, _ = exchange(ps, None, input_grad, True, False, shape, dtype, device)
    return received
