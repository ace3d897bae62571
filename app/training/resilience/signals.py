"""Stop on a signal with a checkpoint, and stop when the launcher above this rank is gone.

`--exit-signal-handler` (Megatron's flag): SIGTERM, SIGINT and SIGUSR1 only set a flag here.
The trainer asks every rank at the end of each iteration (one all-reduce, see
`app.training.resilience.guard.RunGuard.should_exit`); when any rank got a signal, all save a checkpoint of that iteration
and the process exits 0 with one line saying so. Signals that arrive while the checkpoint is
being written are noted and ignored, so nothing half-written is left (SIGKILL still stops a
rank at once; the crash-safe writer then keeps the previous checkpoint as the latest).

When is it on? `--exit-signal-handler` forces it on, `--no-exit-signal-handler` off; by default
it is on whenever `--save` is given. Every launcher and scheduler we know sends SIGTERM before
it kills (SLURM on scancel and at the time limit, torchrun's agent when it is stopped, the
`deepspeed` launcher's launch.py, Kubernetes, mpirun, a user's `kill`), so a run with somewhere
to save always has a checkpoint to resume from; without `--save` there is nothing to save and the
signals keep their default effect. The launcher detected (`detect_launcher`) is only named in
the log.

The `deepspeed` launcher on one node does not forward signals: killing its runner (the
`deepspeed` command) leaves `launch.py` and every rank running. `LauncherWatch` therefore
watches the launcher processes above this rank (launch.py, the runner, torchrun) and, when one
of them disappears, sends this rank SIGTERM: with the handler on the ranks save and exit 0,
without it they stop, and launch.py exits once its ranks have.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import psutil

logger = logging.getLogger(__name__)

HANDLED_SIGNALS: Tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_LAUNCHER_VARIABLES: Tuple[Tuple[str, str], ...] = (
    ("SLURM_JOB_ID", "SLURM"), ("TORCHELASTIC_RUN_ID", "torchrun"),
    ("CROSS_SIZE", "the deepspeed launcher"), ("OMPI_COMM_WORLD_SIZE", "mpirun"),
    ("PMI_RANK", "an MPI launcher"), ("PBS_JOBID", "PBS"), ("LSB_JOBID", "LSF"),
    ("KUBERNETES_SERVICE_HOST", "Kubernetes"),
)

_LAUNCHER_COMMANDS: Tuple[str, ...] = (
    "deepspeed.launcher.launch", "deepspeed.launcher.runner", "/bin/deepspeed",
    "torch.distributed.run", "torch.distributed.launch", "/bin/torchrun",
)
"""Command-line fragments of the launcher processes LauncherWatch follows."""


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15, ...; 'signal N' for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def detect_launcher(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The launcher or scheduler that started this process, from its environment; None when
    none is recognised (a plain `python pretrain_gpt2.py`)."""
    for variable, name in _LAUNCHER_VARIABLES:
        if environ.get(variable):
            return name
    return None


def handler_enabled(setting: Optional[bool], save: Optional[str]) -> bool:
    """--exit-signal-handler / --no-exit-signal-handler when given, else on iff --save is set."""
    return bool(save) if setting is None else setting


class ExitSignalHandler:
    """Records SIGTERM / SIGINT / SIGUSR1 instead of dying; install() in the main thread."""

    def __init__(self, signals: Sequence[int] = HANDLED_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: List[int] = []
        self.saving = False
        """Set by the trainer while it writes the final checkpoint (changes the message)."""
        self._previous: Dict[int, object] = {}

    def install(self) -> "ExitSignalHandler":
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def restore(self) -> None:
        """Put the handlers back that were there before install() - unless a signal was received:
        then the run is stopping and this handler stays, so a repeated signal (schedulers send
        more than one) does not kill the process on its way out with a misleading status."""
        if not self.received:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "ExitSignalHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def pending(self) -> int:
        """The first signal received (its number), or 0."""
        return self.received[0] if self.received else 0

    def _on_signal(self, signum: int, frame) -> None:
        self.received.append(signum)
        name = signal_name(signum)
        if not self._previous:
            text = f"received {name} again: already exiting"
        elif len(self.received) == 1:
            text = (f"received {name}: finishing this iteration, then saving a checkpoint and "
                    "exiting")
        elif self.saving:
            text = (f"received {name} again while the checkpoint is being written: ignored, the "
                    "run exits when the checkpoint is complete (SIGKILL stops it now and keeps "
                    "the previous checkpoint as the latest)")
        else:
            text = f"received {name} again: already stopping at the end of this iteration"
        _write_stderr(f"[pid {os.getpid()}] {text}\n")


def _write_stderr(text: str) -> None:
    """Write from a signal handler without the logging module's locks."""
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass


# ---------------------------------------------------------------------------- launcher watch

@dataclass(frozen=True)
class _Process:
    pid: int
    started: float
    command: str


def launcher_processes(pid: Optional[int] = None) -> List[_Process]:
    """The launcher processes directly above `pid` (default: this process), nearest first:
    the parent while its command is a known launcher, then its parent, and so on."""
    found: List[_Process] = []
    try:
        current = psutil.Process(pid or os.getpid()).parent()
        while current is not None and current.pid > 1:
            command = " ".join(current.cmdline())
            if not any(marker in command for marker in _LAUNCHER_COMMANDS):
                break
            found.append(_Process(current.pid, current.create_time(), command))
            current = current.parent()
    except (psutil.Error, OSError):
        pass
    return found


def _gone(process: _Process) -> bool:
    try:
        return abs(psutil.Process(process.pid).create_time() - process.started) > 1.0
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, OSError):
        return False


class LauncherWatch:
    """Sends this process SIGTERM when a launcher process above it exits (see module doc)."""

    def __init__(self, interval_s: float = 1.0,
                 processes: Optional[List[_Process]] = None) -> None:
        self.interval_s = interval_s
        self.processes = launcher_processes() if processes is None else processes
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "LauncherWatch":
        if self.processes:
            self._thread = threading.Thread(target=self._run, name="launcher-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "LauncherWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for process in self.processes:
                if _gone(process):
                    _write_stderr(
                        f"[pid {os.getpid()}] launcher process {process.pid} "
                        f"({process.command[:120]}) has exited: stopping this rank as if it had "
                        "received SIGTERM\n")
                    os.kill(os.getpid(), signal.SIGTERM)
                    return


__all__ = ["ExitSignalHandler", "HANDLED_SIGNALS", "LauncherWatch", "detect_launcher",
           "handler_enabled", "launcher_processes", "signal_name"]
