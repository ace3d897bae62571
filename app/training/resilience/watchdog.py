"""No rank waits forever for a dead or stuck peer: collective failures named, and a watchdog.

Two mechanisms bound the time a rank spends waiting for another one:

1. Every process group carries `--distributed-timeout-minutes` (app.launch.distributed,
   app.mpu.parallel_state), so a collective whose peer is stopped (SIGSTOP, a hung node) fails
   after that time, and one whose peer died (kill -9, a lost node) fails at once. The trainer
   turns such an error into `PeerFailure` (`is_peer_failure` recognises it), whose message names
   this rank, the phase and the iteration, and what the other ranks last reported.
2. `Watchdog` is a thread that ends the process (exit code `EXIT_PEER_FAILURE`) when the
   training loop makes no progress for the timeout plus a margin: a backstop for waits no
   collective timeout covers (NCCL without async error handling, a rank stuck outside any
   collective). Before exiting it prints the same report and every thread's stack.

Heartbeats: each rank's watchdog publishes "phase, iteration, time" in the process group's
key-value store every second (when it changed); a report reads them back with a short
deadline, so it can say "rank 1 last reported 'forward-backward' of iteration 7, 63 s ago". If the store itself does
not answer (its host, rank 0 or the launcher, is the stopped one) the report says so.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, List, Optional

import torch.distributed as dist

EXIT_PEER_FAILURE = 4
"""Exit code of a rank that stopped because another rank died, stopped or hung; the last
complete checkpoint is intact and a relaunch resumes from it."""

_PEER_FAILURE_PATTERNS = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|broken pipe|timed out|timeout|"
    r"socket|peer|ProcessGroup", re.IGNORECASE)


class PeerFailure(RuntimeError):
    """A collective failed because another rank is dead, stopped or stuck."""

    exit_code = EXIT_PEER_FAILURE


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors a collective raises when a peer died or timed out (not model bugs)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_FAILURE_PATTERNS.search(str(exc)))


def _default_store():
    if not dist.is_initialized():
        return None
    try:  # the process group's store: rank 0's TCPStore, or torchrun's agent store
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - heartbeats are a diagnostic, never fatal
        return None


class Watchdog:
    """Ends this process when the loop shows no progress for `limit_s` (see the module doc).

    The trainer calls `beat(phase, iteration)` at every step of its loop (each micro-batch, the
    optimizer step, each evaluation iteration, the save) and `idle()` when it leaves the loop.
    """

    def __init__(self, limit_s: float, rank: int = 0, world_size: int = 1, *,
                 heartbeat_s: float = 1.0, exit_code: int = EXIT_PEER_FAILURE,
                 on_expire: Optional[Callable[[], None]] = None,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.limit_s = limit_s
        self.rank, self.world_size = rank, world_size
        self.heartbeat_s = heartbeat_s
        self.exit_code = exit_code
        self.on_expire = on_expire
        self._exit = exit_fn
        self._state: Optional[tuple] = None  # (phase, iteration, monotonic, wall time)
        self._stop = threading.Event()
        self._wake = threading.Event()  # publish at once when the loop starts
        self._threads: List[threading.Thread] = []
        self._store = None

    # ------------------------------------------------------------------ the loop's side

    def beat(self, phase: str, iteration: int) -> None:
        """Record progress: this rank is now in `phase` of `iteration`."""
        first = self._state is None
        self._state = (phase, iteration, time.monotonic(), time.time())
        if first:
            self._wake.set()

    def idle(self) -> None:
        """Stop watching until the next beat (outside the training loop)."""
        self._state = None

    @property
    def phase(self) -> str:
        state = self._state
        return f"'{state[0]}' of iteration {state[1]}" if state else "no phase"

    # ------------------------------------------------------------------ threads

    def start(self) -> "Watchdog":
        self._store = _default_store() if self.world_size > 1 else None
        targets = [self._watch] + ([self._publish] if self._store is not None else [])
        for target in targets:
            thread = threading.Thread(target=target, name=f"watchdog-{target.__name__}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._state = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        period = max(0.5, min(5.0, self.limit_s / 20.0))
        while not self._stop.wait(period):
            state = self._state
            if state is None or time.monotonic() - state[2] <= self.limit_s:
                continue
            waited = time.monotonic() - state[2]
            sys.stderr.write(
                f"ERROR: watchdog: {self._who()} made no progress for {waited:.0f} s in "
                f"{self.phase} (limit {self.limit_s:.0f} s, from --distributed-timeout-minutes "
                f"plus a margin). {self.peer_report()} A rank is dead, stopped or stuck; "
                f"stopping this process with exit code {self.exit_code}; the last complete "
                "checkpoint stays the latest.\nStacks of this process:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            if self.on_expire is not None:
                try:
                    self.on_expire()
                except Exception:  # noqa: BLE001 - exiting regardless
                    pass
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit(self.exit_code)
            return

    def _publish(self) -> None:
        key = f"app_watchdog/rank{self.rank}"
        last = None  # nothing published until the first beat: "no report yet"
        while True:
            state = self._state
            value = None if state is None else (state[0], state[1], state[3])
            if value != last:
                try:
                    self._store.set(key, json.dumps(value))
                except Exception:  # noqa: BLE001 - the store may be gone with a dead rank
                    return
                last = value
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._stop.is_set():
                return

    # ------------------------------------------------------------------ reports

    def _who(self) -> str:
        return f"rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()})"

    def peer_report(self, deadline_s: float = 5.0) -> str:
        """What every rank last published ("rank 1: 'optimizer' of iteration 6, 70 s ago"),
        read from the store within `deadline_s`; a sentence saying why not otherwise."""
        if self._store is None:
            return ""
        result: List[str] = []

        def read() -> None:
            now = time.time()
            for rank in range(self.world_size):
                key = f"app_watchdog/rank{rank}"
                if not self._store.check([key]):
                    result.append(f"rank {rank}: no report yet")
                    continue
                value = json.loads(self._store.get(key).decode("utf-8"))
                if value is None:
                    result.append(f"rank {rank}: outside the training loop")
                else:
                    phase, iteration, wall = value
                    result.append(f"rank {rank}: '{phase}' of iteration {iteration}, "
                                  f"{now - wall:.0f} s ago")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(deadline_s)
        if reader.is_alive() or len(result) < self.world_size:
            return ("Other ranks' last phases are unknown: the process group's store does not "
                    "answer (its host, rank 0 or the launcher, may be the one that is stopped).")
        return "Last reports (published every second): " + "; ".join(result) + "."

    def failure(self, exc: BaseException) -> PeerFailure:
        """The PeerFailure for collective error `exc` raised in the current phase."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return PeerFailure(
            f"{self._who()}: a collective failed in {self.phase}: {first[:300]}. Another rank "
            f"died, stopped or timed out (--distributed-timeout-minutes). {self.peer_report()} "
            "The last complete checkpoint stays the latest; relaunch to resume from it.")


__all__ = ["EXIT_PEER_FAILURE", "PeerFailure", "Watchdog", "is_peer_failure"]
