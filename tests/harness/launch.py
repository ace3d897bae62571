"""Run pretrain_gpt2.py under torchrun / deepspeed / mpirun in tests and read its metrics."""
import contextlib
import io
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple, Union

import pytest

from tests.harness.corpus import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")
"""What a launcher sets for its ranks; an in-process DeepSpeed run of an earlier test sets them in
this process too, and a child started with them would join that run's rendezvous."""


def env() -> Dict[str, str]:
    """The environment of a command a test launches: this one, less the launch variables."""
    e = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    e.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    return e


def run(cmd: Sequence[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a launcher command; on failure the assertion shows the end of its output."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env(), cwd=cwd,
                          timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd[:6])} ... exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def torchrun(nproc: int, args: List[str], cwd, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain_gpt2.py"), *args],
               cwd, **kw)


def train_curve(metrics_file) -> Dict[int, Tuple[float, float]]:
    """{iteration: (lm_loss, grad_norm)} of the train rows."""
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"])
            for r in read_metrics(metrics_file) if r["kind"] == "train"}


def assert_close_curves(got, want, rel: float = 1e-5, what: str = "") -> float:
    """Each iteration's loss and grad norm agree to `rel`; returns the largest relative gap."""
    assert sorted(got) == sorted(want), f"{what}: iterations {sorted(got)} != {sorted(want)}"
    worst = 0.0
    for it in sorted(want):
        for a, b, name in zip(got[it], want[it], ("loss", "grad norm")):
            gap = abs(a - b) / max(abs(b), 1e-12)
            worst = max(worst, gap)
            assert gap < rel, f"{what} iteration {it} {name}: {a} vs {b} (relative {gap:.2e})"
    return worst


def log_of(proc: subprocess.Popen, n: int = 0) -> str:
    """The output a launched process wrote to the log file its launcher named `proc.log` (the
    last `n` characters, or all of it when n is 0)."""
    with open(proc.log, errors="replace") as f:
        text = f.read()
    return text[-n:] if n else text


def wait_for_iteration(metrics, k: int,
                       procs: Union[subprocess.Popen, Sequence[subprocess.Popen]],
                       timeout: float = 240) -> int:
    """Block until the metrics file logs iteration k or later and return the last one logged;
    the test fails if a launcher in `procs` exits first or `timeout` seconds pass."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(metrics):
            done = [r["iteration"] for r in read_metrics(metrics) if r["kind"] == "train"]
            if done and max(done) >= k:
                return max(done)
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a launcher exited ({p.returncode}) before iteration {k}:\n"
                            f"{log_of(p, 3000)}")
        time.sleep(0.02)
    pytest.fail(f"no iteration {k} after {timeout} s:\n" + "\n".join(log_of(p, 3000) for p in procs))


def main_in_process(argv):
    """pretrain_gpt2.main in this process: (exit code, stderr text)."""
    from pretrain_gpt2 import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def temporaries(root):
    return [os.path.join(d, n) for d, _, entries in os.walk(root) for n in entries if ".tmp." in n]
