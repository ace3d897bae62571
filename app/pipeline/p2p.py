"""Point-to-point exchange of activations and their gradients between neighbouring stages.

Every function is a no-op (returning None for receives) where the neighbour does not exist
(before the first stage, after the last). Receive buffers are [b, s, h] tensors of the given
dtype on the given device; all traffic goes through `app.mpu.collectives.send_recv`, which
posts sends and receives together so that two stages exchanging at once cannot deadlock.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState

Shape = Sequence[int]


def _exchange(ps: ParallelState, send_next: Optional[torch.Tensor],
              send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
              shape: Shape, dtype: torch.dtype, device: torch.device
              ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One batched exchange; returns (tensor from previous stage, tensor from next stage)."""
    prev_rank, next_rank = ps.pipeline_prev_rank(), ps.pipeline_next_rank()
    sends: List[Tuple[torch.Tensor, int]] = []
    recvs: List[Tuple[torch.Tensor, int]] = []
    from_prev = from_next = None
    if send_next is not None and next_rank is not None:
        sends.append((send_next.detach(), next_rank))
    if send_prev is not None and prev_rank is not None:
        sends.append((send_prev.detach(), prev_rank))
    if recv_prev and prev_rank is not None:
        from_prev = torch.empty(tuple(shape), dtype=dtype, device=device)
        recvs.append((from_prev, prev_rank))
    if recv_next and next_rank is not None:
        from_next = torch.empty(tuple(shape), dtype=dtype, device=device)
        recvs.append((from_next, next_rank))
    collectives.send_recv(sends, recvs)
    return from_prev, from_next


def recv_forward(ps: ParallelState, shape: Shape, dtype: torch.dtype,
                 device: torch.device) -> Optional[torch.Tensor]:
    """Activation [b, s, h] from the previous stage (requires grad); None on the first stage."""
    received, _ = _exchange(ps, None, None, True, False, shape, dtype, device)
    return None if received is None else received.requires_grad_()


def send_forward(ps: ParallelState, output: torch.Tensor) -> None:
    """Send this stage's output [b, s, h] to the next stage (no-op on the last stage)."""
    _exchange(ps, output, None, False, False, output.shape, output.dtype, output.device)


def recv_backward(ps: ParallelState, shape: Shape, dtype: torch.dtype,
                  device: torch.device) -> Optional[torch.Tensor]:
    """Gradient of this stage's output from the next stage; None on the last stage."""
    _, received = _exchange(ps, None, None, False, True, shape, dtype, device)
    return received


def send_backward(ps: ParallelState, input_grad: Optional[torch.Tensor]) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first)."""
    if input_grad is not None:
        _exchange(ps, None, input_grad, False, False, input_grad.shape, input_grad.dtype,
                  input_grad.device)


def send_forward_recv_backward(ps: ParallelState, output: torch.Tensor, shape: Shape,
                               dtype: torch.dtype, device: torch.device
                               ) -> Optional[torch.Tensor]:
    """Send the output forward and receive its gradient, in one exchange (1F1B steady state)."""
    _, grad = _exchange(ps, output, None, False, True, shape, dtype, device)
    return grad


def send_backward_recv_forward(ps: ParallelState, input_grad: Optional[torch.Tensor],
                               shape: Shape, dtype: torch.dtype, device: torch.device
                               ) -> Optional[torch.Tensor]:
    """Send the input gradient backward and receive the next activation, in one exchange."""
    received, _ = _exchange(ps, None, input_grad, True, False, shape, dtype, device)
    return None if received is None else received.requires_grad_()
