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
  the received output gradient (it already carries any scale) with
  `output_backward_func(output, output_grad)`, torch.autograd.backward unless the engine
  gives its own (`Engine.backward_output`).
- Returns the unscaled, detached micro-batch losses on the last stage and [] elsewhere.
  Gradient all-reduces (data parallel, tied embeddings) are left to the caller.

With model chunks (`ModelChunks`, `parallel_state.virtual_pipeline_model_parallel_size` > 1)
`get_forward_backward_func` returns Megatron's interleaved 1F1B; the schedule selects the chunk
with `model.set_chunk(v)` before each forward and draws each micro-batch once, keeping it for
the rank's later chunks.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
                 num_microbatches: int, output_backward_func: Optional[Callable] = None) -> None:
        self.forward_step_func, self.batch_func, self.model = forward_step_func, batch_func, model
        self.loss_func, self.backward_func, self.ps = loss_func, backward_func, ps
        self.output_backward_func = output_backward_func or _autograd_backward
        self.num_microbatches = num_microbatches
        self.losses: List[torch.Tensor] = []

    def forward(self, input_tensor: Optional[torch.Tensor], batch: Any = None,
                last: Optional[bool] = None) -> torch.Tensor:
        """Run one micro-batch (drawn from batch_func unless given); returns the loss / M on the
        last (virtual) stage, the activation elsewhere."""
        _set_input(self.model, input_tensor)
        output, loss_mask = self.forward_step_func(self.batch_func() if batch is None else batch)
        if not (self.ps.is_pipeline_last_stage() if last is None else last):
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
            self.output_backward_func(output, output_grad)
        return None if input_tensor is None else input_tensor.grad


def _autograd_backward(output: torch.Tensor, output_grad: torch.Tensor) -> None:
    torch.autograd.backward(output, grad_tensors=output_grad)


def forward_backward_no_pipelining(*, forward_step_func: Callable, batch_func: Callable,
                                   model: Any, num_microbatches: int, loss_func: Callable,
                                   backward_func: Callable,
                                   parallel_state: Optional[ParallelState] = None,
                                   forward_only: bool = False, tensor_shape: Any = None,
                                   dtype: Optional[torch.dtype] = None,
                                   device: Optional[torch.device] = None,
                                   output_backward_func: Optional[Callable] = None
                                   ) -> List[torch.Tensor]:
    """PP = 1: forward then backward of each micro-batch in turn (gradient accumulation).

    `tensor_shape`, `dtype`, `device` and `output_backward_func` are accepted for a uniform
    signature and unused.
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
                                     device: Optional[torch.device] = None,
                                     output_backward_func: Optional[Callable] = None
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
                   num_microbatches, output_backward_func)
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


class InterleavedPlan:
    """The order of work of one rank under interleaved 1F1B (pure arithmetic, Megatron's order).

    The rank runs N = M x V forward units and N backward units, unit k being one micro-batch
    through one of its V chunks. Units go in groups of PP x V: PP micro-batches through chunk 0,
    the same PP through chunk 1, ..., then the next PP micro-batches (so M must be a multiple of
    PP); backward units visit the chunks in reverse. The rank first runs `num_warmup` forwards
    (all of them when forward-only or M == PP), then alternates one forward and one backward,
    then drains the backwards. Chunk v of this rank is virtual stage v x PP + rank: the very first
    one (no input to receive) is chunk 0 of rank 0, the very last (computes the loss, no output
    gradient to receive) chunk V - 1 of rank PP - 1.
    """

    def __init__(self, pipeline_size: int, num_chunks: int, num_microbatches: int, rank: int,
                 forward_only: bool = False) -> None:
        if num_microbatches % pipeline_size:
            raise ValueError(f"the interleaved schedule needs the number of micro-batches "
                             f"({num_microbatches}) to be a multiple of the pipeline size "
                             f"({pipeline_size})")
        self.pp, self.vp, self.rank = pipeline_size, num_chunks, rank
        self.num_microbatches = num_microbatches
        self.total = num_microbatches * num_chunks
        self.all_warmup = forward_only or num_microbatches == pipeline_size
        if self.all_warmup:
            self.num_warmup = self.total
        else:
            self.num_warmup = min((pipeline_size - rank - 1) * 2 + (num_chunks - 1) * pipeline_size,
                                  self.total)

    def chunk(self, unit: int, forward: bool = True) -> int:
        """Chunk run by forward (or backward) unit `unit`; negative units wrap as in Megatron."""
        in_group = unit % (self.pp * self.vp)
        chunk = in_group // self.pp
        return chunk if forward else self.vp - 1 - chunk

    def microbatch(self, unit: int) -> int:
        """Micro-batch index of unit `unit` (the same for its forward and its backward)."""
        return unit // (self.pp * self.vp) * self.pp + unit % self.pp

    def is_first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.rank == self.pp - 1 and chunk == self.vp - 1

    def needs_input(self, unit: int) -> bool:
        """Forward unit `unit` exists and takes its input from the previous rank."""
        return unit < self.total and not self.is_first(self.chunk(unit, True))

    def needs_output_grad(self, unit: int) -> bool:
        """Backward unit `unit` exists and takes its output gradient from the next rank."""
        return unit < self.total and not self.is_last(self.chunk(unit, False))

    def steady_receives(self, step: int) -> Tuple[bool, bool]:
        """(receive an activation, receive a gradient) in the exchange after steady step `step`.

        Paired with what the neighbours send in the same exchange: rank 0 hears from the last
        rank, whose forward unit PP - 1 units behind may be the very last chunk (nothing sent);
        the last rank hears from rank 0, whose backward unit PP - 1 behind may be the very first.
        """
        forward_unit = step + self.num_warmup
        recv_prev = recv_next = True
        if self.rank == 0:
            recv_prev = self.chunk(forward_unit - (self.pp - 1), True) != self.vp - 1
        if self.rank == self.pp - 1:
            recv_next = self.chunk(step - (self.pp - 1), False) != 0
        if step == self.total - self.num_warmup - 1:
            recv_prev = False
        return recv_prev, recv_next


class _InterleavedRun:
    """Executes an InterleavedPlan: per-chunk queues, micro-batch cache, chunk selection."""

    def __init__(self, plan: InterleavedPlan, stage: _Stage, model: Any, forward_only: bool,
                 ps: ParallelState, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.plan, self.stage, self.model, self.forward_only = plan, stage, model, forward_only
        self.ps, self.shape, self.dtype, self.device = ps, shape, dtype, device
        vp = plan.vp
        self.received: List[List[torch.Tensor]] = [[] for _ in range(vp)]
        self.grads: List[List[torch.Tensor]] = [[] for _ in range(vp)]
        self.saved: List[List[Tuple[Optional[torch.Tensor], torch.Tensor]]] = [[] for _ in range(vp)]
        # Activations and gradients arrive in the order the neighbour produces them, which is
        # the order of this rank's units that need them (see docs/parallelism.md)
        self.input_chunks = iter([plan.chunk(k, True) for k in range(plan.total)
                                  if plan.needs_input(k)])
        self.grad_chunks = iter([plan.chunk(k, False) for k in range(plan.total)
                                 if plan.needs_output_grad(k)])
        self.batches: Dict[int, Any] = {}

    def forward(self, unit: int) -> Optional[torch.Tensor]:
        """Forward unit `unit`; returns the activation to send (None from the very last chunk)."""
        plan = self.plan
        chunk, micro = plan.chunk(unit, True), plan.microbatch(unit)
        if micro not in self.batches:  # chunk 0 meets each micro-batch first
            self.batches[micro] = self.stage.batch_func()
        input_tensor = None if plan.is_first(chunk) else self.received[chunk].pop(0)
        self.model.set_chunk(chunk)
        with torch.set_grad_enabled(not self.forward_only):
            output = self.stage.forward(input_tensor, batch=self.batches[micro],
                                        last=plan.is_last(chunk))
        if chunk == plan.vp - 1:
            del self.batches[micro]
        if not self.forward_only:
            self.saved[chunk].append((input_tensor, output))
        return None if plan.is_last(chunk) else output

    def backward(self, unit: int) -> Optional[torch.Tensor]:
        """Backward unit `unit`; returns the input gradient to send (None from the first chunk)."""
        chunk = self.plan.chunk(unit, False)
        input_tensor, output = self.saved[chunk].pop(0)
        output_grad = None if self.plan.is_last(chunk) else self.grads[chunk].pop(0)
        self.model.set_chunk(chunk)
        input_grad = self.stage.backward(input_tensor, output, output_grad)
        return None if self.plan.is_first(chunk) else input_grad

    def exchange(self, send_next: Optional[torch.Tensor] = None,
                 send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
                 recv_next: bool = False) -> None:
        """One exchange with both ring neighbours; files what arrives under its chunk."""
        activation, grad = p2p.exchange(self.ps, send_next, send_prev, recv_prev, recv_next,
                                        self.shape, self.dtype, self.device, ring=True)
        if activation is not None:
            self.received[next(self.input_chunks)].append(activation)
        if grad is not None:
            self.grads[next(self.grad_chunks)].append(grad)

    def run(self) -> None:
        plan, forward_only = self.plan, self.forward_only
        warmup, total = plan.num_warmup, plan.total
        self.exchange(recv_prev=plan.needs_input(0))
        for unit in range(warmup):
            output = self.forward(unit)
            last_warmup = unit == warmup - 1 and not plan.all_warmup
            self.exchange(send_next=output, recv_prev=plan.needs_input(unit + 1),
                          recv_next=last_warmup and plan.needs_output_grad(0))
        for step in range(total - warmup):
            output = self.forward(step + warmup)
            input_grad = self.backward(step)
            recv_prev, recv_next = plan.steady_receives(step)
            self.exchange(send_next=output, send_prev=input_grad, recv_prev=recv_prev,
                          recv_next=recv_next)
        if forward_only:
            return
        if plan.all_warmup:
            self.exchange(recv_next=plan.needs_output_grad(0))
        for unit in range(total - warmup, total):
            input_grad = self.backward(unit)
            self.exchange(send_prev=input_grad, recv_next=plan.needs_output_grad(unit + 1))
        leftover = sum(map(len, self.received + self.grads + self.saved))
        assert leftover == 0 and not self.batches, "interleaved schedule left work behind"


def forward_backward_pipelining_interleaved(*, forward_step_func: Callable, batch_func: Callable,
                                            model: Any, num_microbatches: int,
                                            loss_func: Callable, backward_func: Callable,
                                            parallel_state: Optional[ParallelState] = None,
                                            forward_only: bool = False,
                                            tensor_shape: Sequence[int],
                                            dtype: Optional[torch.dtype] = None,
                                            device: Optional[torch.device] = None,
                                            output_backward_func: Optional[Callable] = None
                                            ) -> List[torch.Tensor]:
    """PP > 1 with V = `model.num_chunks` model chunks per rank: Megatron's interleaved 1F1B.

    The pipeline bubble shrinks V-fold ((PP - 1) / (V x M) of the ideal time instead of
    (PP - 1) / M) at the price of V times more point-to-point traffic. `num_microbatches` must
    be a multiple of PP; see `InterleavedPlan` for the order of work.
    """
    ps = get_parallel_state() if parallel_state is None else parallel_state
    dtype, device = _activation_format(model, dtype, device)
    plan = InterleavedPlan(ps.pipeline_model_parallel_size, model.num_chunks, num_microbatches,
                           ps.pipeline_model_parallel_rank, forward_only)
    stage = _Stage(forward_step_func, batch_func, model, loss_func, backward_func, ps,
                   num_microbatches, output_backward_func)
    _InterleavedRun(plan, stage, model, forward_only, ps, tuple(tensor_shape), dtype, device).run()
    return stage.losses


def get_forward_backward_func(parallel_state: Optional[ParallelState] = None) -> Callable[..., Any]:
    """The schedule for this layout: interleaved 1F1B with model chunks, 1F1B when PP > 1, else
    no pipelining."""
    ps = get_parallel_state() if parallel_state is None else parallel_state
    if ps.pipeline_model_parallel_size > 1 and ps.virtual_pipeline_model_parallel_size > 1:
        return forward_backward_pipelining_interleaved
    if ps.pipeline_model_parallel_size > 1:
        return forward_backward_pipelining_1f1b
    return forward_backward_no_pipelining
