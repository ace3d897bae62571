"""What runs around the training steps, as Megatron-LM runs it (megatron/training/training.py,
train and train_step): manual garbage collection, emptying the CUDA cache and the profiler
window. One object, `RuntimeHooks`, called by the trainer at four points:

    with hooks.training():                  # the whole loop
        with hooks.iteration(done):         # each training iteration; `done` = iterations
            ... forward-backward ...        #   completed before it
            hooks.after_forward_backward()  # (also after each evaluation step)
            ... optimizer step ...
    with hooks.evaluation(): ...            # each evaluation

- --manual-gc: `gc.disable(); gc.collect()` when training starts (Python's collector is
  enabled again when it ends), `gc.collect()` after every --manual-gc-interval-th iteration,
  and around each evaluation `gc.collect()` before and `gc.collect(generation=0)` after
  (unless --no-manual-gc-eval);
- --empty-unused-memory-level: `torch.cuda.empty_cache()` after each forward-backward (and
  each evaluation step) from level 1, after each optimizer step at level 2; nothing on the CPU;
- --profile with --profile-step-start S / --profile-step-end E, on the ranks of
  --profile-ranks (all by default):
  * torch.profiler (--use-pytorch-profiler, and on a machine without CUDA, which has no nsys):
    Megatron's schedule (wait S-1, warm-up 1, active E-S) stepped at the top of every
    iteration, so iterations S .. E-1 (counted from 1) are recorded; the trace is written as a
    gzipped Chrome trace to {--tensorboard-dir}/../torch_profile/rank-R.json.gz (./torch_profile
    without --tensorboard-dir); each iteration is a record_function range "iteration N";
  * nsys (CUDA, without --use-pytorch-profiler): cudaProfilerStart when S iterations are done
    (with --record-shapes inside emit_nvtx(record_shapes=True)), cudaProfilerStop after
    iteration E: the capture range of `nsys profile --capture-range=cudaProfilerApi`.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch

from app.config import RuntimeConfig

logger = logging.getLogger(__name__)


def profile_dir(tensorboard_dir: Optional[str]) -> str:
    """Where Megatron writes torch.profiler traces: {tensorboard_dir}/../torch_profile."""
    return os.path.normpath(os.path.join(tensorboard_dir or ".", "..", "torch_profile")
                            if tensorboard_dir else "torch_profile")


class RuntimeHooks:
    """Garbage collection, CUDA cache and profiler of one rank's training (module docstring)."""

    def __init__(self, config: RuntimeConfig, rank: int, device: torch.device,
                 tensorboard_dir: Optional[str], log: Callable[[str], None] = logger.info
                 ) -> None:
        self.config, self.rank, self.device = config, rank, torch.device(device)
        self.tensorboard_dir, self.log = tensorboard_dir, log
        self.cuda = self.device.type == "cuda"
        self.profiling = config.profiles(rank)
        self.torch_profiler = self.profiling and (config.use_pytorch_profiler or not self.cuda)
        self._prof: Any = None
        self._nvtx: Any = None
        self._nsys = False
        self._gc_was_enabled = True

    # ------------------------------------------------------------------ the loop

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The training loop: manual GC takes over and the torch profiler starts; both undone
        when the loop ends, however it ends."""
        c = self.config
        if c.manual_gc:
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        if self.torch_profiler:
            self._start_torch_profiler()
        try:
            yield
        finally:
            self._stop_profilers()
            if c.manual_gc and self._gc_was_enabled:
                gc.enable()

    @contextlib.contextmanager
    def iteration(self, done: int) -> Iterator[None]:
        """One training iteration after `done` completed ones: the profiler window around it;
        after it the optimizer-level cache release and the periodic collection."""
        c = self.config
        if self.profiling and self._prof is not None:
            self._prof.step()
        elif self.profiling and not self.torch_profiler and done == c.profile_step_start:
            self._start_nsys()
        with torch.profiler.record_function(f"iteration {done + 1}"):
            yield
        if c.empty_unused_memory_level >= 2:
            self._empty_cache()
        if self.profiling and done + 1 == c.profile_step_end:
            self._stop_profilers()
        if c.manual_gc and c.manual_gc_interval and (done + 1) % c.manual_gc_interval == 0:
            gc.collect()

    def after_forward_backward(self) -> None:
        """After a training step's forward-backward or an evaluation step's forward."""
        if self.config.empty_unused_memory_level >= 1:
            self._empty_cache()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """An evaluation: collected before and after with --manual-gc (unless
        --no-manual-gc-eval)."""
        collect = self.config.manual_gc and self.config.manual_gc_eval
        if collect:
            gc.collect()
        try:
            yield
        finally:
            if collect:
                gc.collect(generation=0)

    # ------------------------------------------------------------------ pieces

    def _empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def _start_torch_profiler(self) -> None:
        c = self.config
        path = os.path.join(profile_dir(self.tensorboard_dir), f"rank-{self.rank}.json.gz")

        def trace_handler(prof: Any) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            prof.export_chrome_trace(path)
            self.log(f"torch.profiler trace of iterations {c.profile_step_start}.."
                     f"{c.profile_step_end - 1} written to {path}")

        why = ("--use-pytorch-profiler" if c.use_pytorch_profiler
               else "--profile without CUDA: this machine has no nsys, so torch.profiler "
                    "records Megatron's --use-pytorch-profiler window instead")
        self.log(f"profiling with torch.profiler ({why}): iterations {c.profile_step_start}.."
                 f"{c.profile_step_end - 1} on rank {self.rank}, trace {path}")
        self._prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=max(c.profile_step_start - 1, 0),
                                             warmup=1 if c.profile_step_start > 0 else 0,
                                             active=c.profile_step_end - c.profile_step_start,
                                             repeat=1),
            on_trace_ready=trace_handler, record_shapes=c.pytorch_profiler_collect_shapes,
            with_stack=c.pytorch_profiler_collect_callstack)
        self._prof.start()

    def _start_nsys(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        if self.config.record_shapes:
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
        self._nsys = True

    def _stop_profilers(self) -> None:
        """Stop whichever profiler runs (idempotent)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
        if self._nsys:
            self._nsys = False
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            if self._nvtx is not None:
                self._nvtx.__exit__(None, None, None)
                self._nvtx = None
