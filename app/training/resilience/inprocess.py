"""In-process restart (--inprocess-restart, Megatron-LM's flag): a rank's error is recovered
inside the same processes, without a relaunch.

    pretrain(cfg) -> InProcessRestart(cfg).run(attempt)   attempt: build everything, train

Megatron wraps its `pretrain` in nvidia-resiliency-ext's `inprocess.Wrapper`; this is our own,
smaller mechanism with the same shape: the whole attempt (process groups, model, engine,
datasets, trainer) is built again after a failure, so nothing keeps a reference to a group of
the failed generation. One failure goes through these steps on every rank:

1. Abandon. The rank that raised (an error, `--check-for-nan-in-loss-and-grad`'s
   TrainingAborted, anything but a clean stop) leaves the attempt: the trainer's exit paths stop
   data-loader workers and background saves, every process group is destroyed and its
   objects freed, which closes this rank's gloo connections. A peer blocked in a collective
   with it fails at once ("Connection closed by peer") and leaves the same way, as a
   PeerFailure. (gloo has no abort: a group still referenced somewhere would keep its
   connections open, and the peers would wait for --distributed-timeout-minutes instead.)
2. Rejoin. Generation g+1 of the process group starts on the original rendezvous store, under
   the key prefix `inprocess_restart/<g+1>/`: each rank posts the snapshots it holds and waits
   up to --inprocess-barrier-timeout for every rank to arrive. A rank that never arrives (a dead
   process) ends the run with PeerFailure (exit code 4): the launcher's restart (torchrun
   --max-restarts, the self-restart) resumes from --save as without this flag.
3. Restore. The newest snapshot that every rank holds is the state to continue from: weights,
   optimizer and LR schedule, every RNG stream and the run's position, copied in host memory
   after each --inprocess-snapshot-interval iterations (the last two kept, so a failure between
   two ranks' copies still finds a common one). Without one (interval 0, or no snapshot in
   common) the attempt loads the newest checkpoint from --load with the ordinary resume policy.
   Training goes on from there: the data iterators are rebuilt from the consumed-sample count,
   so the result is bit-identical to a run without the failure. A --rollback-on-spike drops
   the snapshots (they hold the abandoned data window) and takes one of the state it rolled
   back to, its position past the skipped window (`after_rollback`).

Not restarted: an error before training began (configuration, data, a checkpoint that does not
load: it would fail again), a stop the run asked for (SaveFailed after --max-failed-saves,
KeyboardInterrupt, SystemExit), and a failure after --inprocess-max-iterations restarts; those
end the run as without the flag. A killed process cannot be restarted from inside itself.
"""
from __future__ import annotations

import copy
import datetime
import gc
import json
import logging
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, TypeVar

import torch.distributed as dist

from app.checkpoint.snapshot import HostBuffers, host_copy
from app.config import InProcessRestartConfig
from app.mpu.parallel_state import destroy_model_parallel
from app.mpu.random import load_rng_state_dict, rng_state_dict
from app.training.checkpointing.saver import SaveFailed
from app.training.resilience.watchdog import PeerFailure
from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)

T = TypeVar("T")

KEEP_SNAPSHOTS = 2
"""Snapshots kept per rank: the newest, and the one before it for a rank that failed between
another rank's copy and its own."""

STORE_PREFIX = "inprocess_restart"
"""Key prefix of every generation's keys in the rendezvous store."""


@dataclass
class Snapshot:
    """One rank's training state after an iteration, in host memory. `sequence` counts the
    snapshots this process took; every rank takes them at the same points, so equal sequence
    numbers are the same moment of training on every rank (iterations may repeat after a
    --rollback-on-spike)."""

    sequence: int
    state: Any
    """The trainer's RunState then (a copy)."""
    engine_state: Dict[str, Any]
    buffers: HostBuffers
    """The host memory `engine_state` lives in, reused by the snapshot that replaces this one."""


@dataclass
class _Fault:
    """What ended an attempt: its description, when it was caught, and the last iteration the
    run had completed then (not the one it interrupted)."""

    reason: str
    time: float
    completed: int
    traceback: str
    """The error's traceback where it began on this rank ('' for a peer's failure)."""


class InProcessRestart:
    """Runs training attempts until one finishes, rebuilding the process group in-process after
    a failure (module docstring). The trainer calls `after_iteration`; the attempt calls
    `restore` where it would load a checkpoint."""

    def __init__(self, config: InProcessRestartConfig, timeout_minutes: float) -> None:
        self.config = config
        self.pg_timeout = datetime.timedelta(minutes=timeout_minutes)
        self.restarts = 0
        """In-process restarts done so far."""
        self.generation = 0
        self._snapshots: Deque[Snapshot] = deque(maxlen=KEEP_SNAPSHOTS)
        self._taken = 0
        self._restore_from: Optional[Snapshot] = None
        self._fault: Optional[_Fault] = None
        self._completed = 0
        """The last iteration whose end the trainer reported (`after_iteration`)."""
        self._store: Any = None
        self._rank, self._world_size, self._backend = 0, 1, "gloo"
        self.history: List[Dict[str, Any]] = []
        """One record per restart: {restart, resumed_at (iteration), seconds (fault to the
        next training step), redone (completed iterations lost)}."""

    # ------------------------------------------------------------------ the attempts

    def run(self, attempt: Callable[["InProcessRestart"], T]) -> T:
        """`attempt(self)` until it returns; after a failure that may be restarted (module
        docstring) the process group is rebuilt and the attempt called again."""
        while True:
            try:
                return attempt(self)
            except BaseException as exc:  # noqa: BLE001 - re-raised unless restarted
                if not self._restartable(exc):
                    raise
                self._fault = _Fault(f"{type(exc).__name__}: {_first_line(exc)}", time.time(),
                                     self._completed,
                                     "" if isinstance(exc, PeerFailure) else traceback.format_exc())
            # outside the handler: the exception and its frames (which hold the groups) are gone
            self._abandon()
            self._rejoin()

    def _restartable(self, exc: BaseException) -> bool:
        if not isinstance(exc, Exception) or isinstance(exc, SaveFailed):
            return False
        if self._store is None:  # training never began: the same error would come back
            return False
        if self.restarts >= self.config.max_iterations:
            logger.error("in-process restart: %d restarts used (--inprocess-max-iterations); "
                         "this failure ends the run: %s", self.restarts, _first_line(exc))
            return False
        return True

    def _abandon(self) -> None:
        """Destroy every process group and free its objects, closing this rank's connections
        so a peer blocked in a collective with it fails at once."""
        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def _rejoin(self) -> None:
        """Start the next generation of the process group with every rank, and pick the newest
        snapshot all of them hold; PeerFailure when a rank does not come back in time."""
        self.restarts += 1
        self.generation += 1
        fault = self._fault
        assert fault is not None
        rank, size = self._rank, self._world_size
        store = dist.PrefixStore(f"{STORE_PREFIX}/{self.generation}/", self._store)
        store.set(f"snapshots/{rank}", json.dumps([s.sequence for s in self._snapshots]))
        store.set(f"arrived/{rank}", fault.reason)
        logger.warning("in-process restart %d of %d (rank %d, pid %d): %s; rebuilding the "
                       "process group (generation %d)%s", self.restarts,
                       self.config.max_iterations, rank, os.getpid(), fault.reason,
                       self.generation, f"\n{fault.traceback}" if fault.traceback else "",
                       extra=ALL_RANKS)
        arrived = [f"arrived/{r}" for r in range(size)]
        try:
            store.wait(arrived, datetime.timedelta(seconds=self.config.barrier_timeout))
        except Exception as exc:  # noqa: BLE001 - the store's timeout error
            missing = [r for r in range(size) if not store.check([arrived[r]])]
            raise PeerFailure(
                f"in-process restart: rank(s) {missing} did not rejoin within "
                f"{self.config.barrier_timeout:g} s (--inprocess-barrier-timeout) after "
                f"{fault.reason}; a dead process needs the launcher's restart, which resumes "
                "from the latest checkpoint") from exc
        reasons = {r: store.get(arrived[r]).decode() for r in range(size)}
        held = [set(json.loads(store.get(f"snapshots/{r}"))) for r in range(size)]
        common = set.intersection(*held) if held else set()
        self._restore_from = next((s for s in reversed(self._snapshots)
                                   if s.sequence == max(common, default=-1)), None)
        dist.init_process_group(self._backend, store=dist.PrefixStore("pg/", store),
                                rank=rank, world_size=size, timeout=self.pg_timeout)
        first = min(reasons, key=lambda r: "PeerFailure" in reasons[r])
        logger.warning("in-process restart %d: every rank rejoined (rank %d: %s); continuing "
                       "from %s", self.restarts, first, reasons[first],
                       f"the snapshot of iteration {self._restore_from.state.iteration}"
                       if self._restore_from else "the newest checkpoint (--load)")

    # ------------------------------------------------------------------ trainer and attempt hooks

    def after_iteration(self, engine: Any, state: Any) -> None:
        """Trainer side, before the first iteration and after each one, on every rank: take a
        snapshot when the interval says so; the first call after a restart reports it."""
        if self._store is None:
            self._adopt_group()
        self._completed = state.iteration
        if self._fault is not None:
            self._report_resumed(state)
        interval = self.config.snapshot_interval
        if interval and (state.iteration % interval == 0 or not self._snapshots):
            self._take(engine, state)

    def after_rollback(self, engine: Any, state: Any) -> None:
        """Trainer side, on every rank after a --rollback-on-spike reload: the snapshots hold
        the abandoned timeline (the newest one sits before the spike's data window, which a
        restart to it would read again), so they go, and the rolled-back state is the newest
        snapshot (none with --inprocess-snapshot-interval 0: a restart reloads --load's
        checkpoint)."""
        self._snapshots.clear()
        self._completed = state.iteration
        if self.config.snapshot_interval:
            self._take(engine, state)

    def _adopt_group(self) -> None:
        """Remember the rendezvous store, rank, world size and backend of the process group
        this run started with (None without one: one process has no peer to restart with)."""
        if not dist.is_initialized():
            return
        self._store = dist.distributed_c10d._get_default_store()
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._backend = str(dist.get_backend())

    def _take(self, engine: Any, state: Any) -> None:
        """Copy this rank's training state into host memory (module docstring, step 3)."""
        if self._snapshots and self._snapshots[-1].state == state:
            return  # the state just restored: its snapshot is the newest already
        buffers = HostBuffers()
        if len(self._snapshots) == KEEP_SNAPSHOTS:  # the oldest goes: its memory takes the copy
            buffers = self._snapshots.popleft().buffers
            buffers.new_save()
        engine_state = host_copy({"model": engine.module.state_dict(),
                                  "optimizer": engine.optimizer.state_dict(),
                                  "lr_scheduler": engine.lr_scheduler.state_dict(),
                                  "rng": rng_state_dict()}, buffers)
        self._taken += 1
        self._snapshots.append(Snapshot(self._taken, copy.deepcopy(state), engine_state,
                                        buffers))

    def restore(self, engine: Any) -> Optional[Any]:
        """Attempt side, in place of loading a checkpoint: after a restart, put the chosen
        snapshot into the freshly built `engine` and return the run's position then; None on
        the first attempt or when no snapshot is common to all ranks (load --load then)."""
        snapshot, self._restore_from = self._restore_from, None
        if snapshot is None:
            return None
        saved = host_copy(snapshot.engine_state)  # the engine takes ownership of its tensors
        engine.module.load_state_dict(saved["model"])
        engine.optimizer.load_state_dict(saved["optimizer"])
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        load_rng_state_dict(saved["rng"])
        return copy.deepcopy(snapshot.state)

    def _report_resumed(self, state: Any) -> None:
        fault, self._fault = self._fault, None
        assert fault is not None
        redone = max(fault.completed - state.iteration, 0)
        logger.warning("in-process restart %d: training resumes at iteration %d, %.2f s after "
                       "the fault; %d completed iteration(s) to redo, plus the one interrupted",
                       self.restarts, state.iteration, time.time() - fault.time, redone)
        self.history.append({"restart": self.restarts, "resumed_at": state.iteration,
                             "seconds": time.time() - fault.time, "redone": redone})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


__all__ = ["InProcessRestart", "Snapshot"]
