"""RNG streams for tensor parallelism, activation checkpointing, and RNG state in checkpoints.

Two streams per rank (Megatron's scheme):
- the default torch generators (CPU, and CUDA when available), seeded identically on every
  tensor-parallel rank: dropout on replicated activations (embeddings, residual) matches;
- the tracker's "model-parallel-rng" stream, seeded with seed + 2718 + tp_rank, entered with
  `get_rng_tracker().fork()`: dropout on tensor-parallel activations (attention probabilities
  of this rank's heads) differs across TP ranks.
`checkpoint(fn, *args)` recomputes `fn` in backward with every stream restored to its state at
forward time, so the recomputed dropout masks are the ones used in forward.
"""
from __future__ import annotations

import contextlib
import random as _py_random
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from app.mpu.parallel_state import ParallelState, get_parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


def _cuda() -> bool:
    return torch.cuda.is_available()


def _get_device_states() -> Dict[str, torch.Tensor]:
    """Current default-generator states: {"cpu": ..., "cuda": ... (when available)}."""
    states = {"cpu": torch.get_rng_state()}
    if _cuda():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_device_states(states: Dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _cuda():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named generator states (CPU and CUDA) that `fork(name)` swaps in and out of the defaults."""

    def __init__(self) -> None:
        self.states: Dict[str, Dict[str, torch.Tensor]] = {}
        self.seeds: Dict[str, int] = {}

    def reset(self) -> None:
        self.states, self.seeds = {}, {}

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed` (the default generators are left untouched)."""
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_device_states()
        torch.random.default_generator.manual_seed(seed)  # the CPU generator only
        if _cuda():
            torch.cuda.manual_seed(seed)  # the current CUDA device only
        self.states[name] = _get_device_states()
        _set_device_states(saved)
        self.seeds[name] = seed

    def get_states(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """A copy of every stream's states (for checkpoints and recomputation)."""
        return {name: {dev: s.clone() for dev, s in st.items()} for name, st in self.states.items()}

    def set_states(self, states: Dict[str, Dict[str, torch.Tensor]]) -> None:
        self.states = {name: {dev: s.clone() for dev, s in st.items()}
                       for name, st in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with stream `name` as the default generators, then switch back."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added; call model_parallel_seed() "
                           "before building or running the model")
        outside = _get_device_states()
        _set_device_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_states()
            _set_device_states(outside)


_TRACKER = RNGStatesTracker()
_CHECKPOINT_IMPL: Optional[Callable[..., Any]] = None
_TRACKER_GETTER: Optional[Callable[[], Any]] = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (one per process, as the default generators are).

    After `set_checkpoint_implementation(..., tracker_getter)` it is the one that returns.
    """
    if _TRACKER_GETTER is not None:
        return _TRACKER_GETTER()
    return _TRACKER


def set_checkpoint_implementation(checkpoint_fn: Optional[Callable[..., Any]],
                                  tracker_getter: Optional[Callable[[], Any]] = None) -> None:
    """Route `checkpoint` and `get_rng_tracker` to another implementation (DeepSpeed's).

    `checkpoint_fn(fn, *args)` replaces ours; `tracker_getter()` returns the tracker that
    `get_rng_tracker()` hands out (it must offer fork(), get_states(), set_states()).
    Passing None restores ours.
    """
    global _CHECKPOINT_IMPL, _TRACKER_GETTER
    _CHECKPOINT_IMPL, _TRACKER_GETTER = checkpoint_fn, tracker_getter


def model_parallel_seed(seed: int, parallel_state: Optional[ParallelState] = None) -> None:
    """Seed python, numpy and torch with seed + 100 * pp_rank; the TP stream with + 2718 + tp_rank.

    Every tensor-parallel rank of a stage gets the same default stream and a distinct
    model-parallel stream; data-parallel replicas get the same streams (their data differs).
    """
    state = get_parallel_state() if parallel_state is None else parallel_state
    default_seed = seed + _PP_SEED_STRIDE * state.pipeline_model_parallel_rank
    _py_random.seed(default_seed)
    np.random.seed(default_seed % 2 ** 32)
    torch.manual_seed(default_seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG,
                 default_seed + _TP_SEED_OFFSET + state.tensor_model_parallel_rank)


def rng_state_dict() -> Dict[str, Any]:
    """Every RNG state of this process, under Megatron's checkpoint keys."""
    state: Dict[str, Any] = {
        "random_rng_state": _py_random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_rng_tracker().get_states(),
    }
    if _cuda():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def load_rng_state_dict(state: Dict[str, Any]) -> None:
    """Restore what `rng_state_dict` returned (the CUDA state only when CUDA is available)."""
    _py_random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and _cuda():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def _detach_inputs(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            d = a.detach()
            d.requires_grad_(a.requires_grad)
            out.append(d)
        else:
            out.append(a)
    return tuple(out)


class _CheckpointFunction(torch.autograd.Function):
    """Run fn without saving activations; in backward restore the RNG streams and recompute."""

    @staticmethod
    def forward(ctx, fn, _anchor: torch.Tensor, *args: Any):
        ctx.fn = fn
        ctx.device_states = _get_device_states()
        ctx.tracker_states = get_rng_tracker().get_states()
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_idx = tensor_idx
        ctx.others = [None if i in tensor_idx else a for i, a in enumerate(args)]
        ctx.save_for_backward(*[args[i] for i in tensor_idx])
        with torch.no_grad():
            outputs = fn(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            args[i] = t
        inputs = _detach_inputs(tuple(args))
        tracker = get_rng_tracker()
        now_device, now_tracker = _get_device_states(), tracker.get_states()
        _set_device_states(ctx.device_states)
        tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            _set_device_states(now_device)
            tracker.set_states(now_tracker)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in inputs)
        return (None, None) + input_grads


def checkpoint(fn, *args: Any, inputs_replicated_over_tp: bool = True):
    """fn(*args) without keeping its activations; recomputed in backward with RNG restored.

    `fn` returns a tensor or a tuple of tensors. Non-tensor arguments (None masks, flags) are
    passed through. Gradients reach the parameters used by `fn` even when no input requires grad.
    The implementation set by `set_checkpoint_implementation` (DeepSpeed's) is used only for
    inputs that are the same on every tensor-parallel rank (`inputs_replicated_over_tp`):
    DeepSpeed's partition_activations keeps 1/TP of each input and all-gathers it in backward,
    which would mix the ranks' different tensors (the attention core's heads) otherwise. Either
    way the active tracker's RNG streams (`get_rng_tracker()`) are saved and restored.
    """
    if _CHECKPOINT_IMPL is not None and inputs_replicated_over_tp:
        return _CHECKPOINT_IMPL(fn, *args)
    anchor = torch.empty(0, requires_grad=True)  # keeps the graph alive without grad inputs
    return _CheckpointFunction.apply(fn, anchor, *args)

