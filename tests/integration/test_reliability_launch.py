"""Faults tried on real launches (CPU, gloo), as a scheduler or a failing node would cause them.

- SIGTERM at a random iteration, on 1 process, TP=2 under torchrun (to one rank) and DeepSpeed
  ZeRO-2 DP=2 under the `deepspeed` launcher (to its runner, which does not forward it): exit 0,
  a checkpoint of that iteration, and the resumed run's losses equal an uninterrupted run's bit
  for bit.
- kill -9 of one of two ranks (torchrun and the deepspeed launcher): the launcher exits non-zero
  within 60 s, the previous checkpoint stays the latest, and it loads (the next run resumes from
  it and again matches the uninterrupted run bit for bit).
- A second run on the same --save fails at start naming the lock holder.
- SIGSTOP of one rank: the other stops after --distributed-timeout-minutes with exit code 4 and
  a message naming itself, the phase, and what the stopped rank last reported.
"""
import os
import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.harness.distributed import run_main, run_pretrain
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import BIN, ROOT, env, log_of, train_curve, wait_for_iteration

SCRIPT = os.path.join(ROOT, "pretrain_gpt2.py")
QUIET = ["--log-interval", "1", "--eval-iters", "0", "--peak-flops", "1e11"]


def start(cmd, log):
    """Start a launcher in its own session, output to `log`."""
    out = open(log, "w")
    proc = subprocess.Popen(list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT, env=env(),
                            cwd=os.path.dirname(log), start_new_session=True)
    proc.log = log
    out.close()
    return proc


def finish(proc, timeout=300):
    """The launcher's exit code; on timeout the whole session is killed and the test fails."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"launcher still running after {timeout} s:\n{log_of(proc, 4000)}")


def ranks(launcher_pid):
    """{global rank: psutil.Process} of the training processes under a launcher."""
    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if SCRIPT in " ".join(child.cmdline()):
                found[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError):
            continue
    return found


def tracker(directory):
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def curve(metrics):
    return train_curve(metrics)


def assert_same_losses(got, want, what):
    """Loss and grad norm equal, bit for bit, on every iteration `got` logged."""
    assert got, f"{what}: no iterations logged"
    for it in sorted(got):
        assert got[it] == want[it], f"{what}: iteration {it}: {got[it]} != {want[it]}"


def torchrun_cmd(nproc, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", SCRIPT, *args]


def deepspeed_cmd(nproc, args):
    from app.launch.ports import free_port
    port = free_port("127.0.0.1")
    return [os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port),
            SCRIPT, *args]


def run_chain(tmp_path, launch, args, *, signal_to, kill_rank):
    """Launched: a run stopped by SIGTERM at a random iteration k (`signal_to` picks the
    process); a resumed run saving every 3 iterations whose rank `kill_rank` gets kill -9. Then
    on forked ranks (their launcher does not matter): a last run resuming from the surviving
    checkpoint to 3 iterations past the killed run's last, and the uninterrupted run, to the
    same iteration (--exit-interval: the flags, and so every number, are the others'). Checks
    exit codes, the checkpoints and that every logged loss equals the uninterrupted run's."""
    ck = str(tmp_path / "ck")
    metrics = {name: str(tmp_path / f"{name}.jsonl") for name in ("straight", "a", "b", "c")}
    resumable = [*args, "--save", ck, "--load", ck]
    a = start(launch([*resumable, "--metrics-file", metrics["a"]]), str(tmp_path / "a.log"))
    k = random.randint(3, 10)
    wait_for_iteration(metrics["a"], k, a)
    launched = psutil.Process(a.pid).children(recursive=True)
    signal_to(a).send_signal(signal.SIGTERM)
    code = finish(a)
    _, alive = psutil.wait_procs(launched, timeout=60)  # every process below the launcher
    assert not alive, f"still running 60 s after SIGTERM: {alive}\n{log_of(a, 4000)}"
    stopped = max(curve(metrics["a"]))
    assert tracker(ck) == stopped, log_of(a, 4000)
    assert "exiting after SIGTERM: saved the checkpoint of iteration" in log_of(a, 20000)

    b = start(launch([*resumable, "--save-interval", "3", "--metrics-file", metrics["b"]]),
              str(tmp_path / "b.log"))
    wait_for_iteration(metrics["b"], stopped + 7, b)
    ranks(b.pid)[kill_rank].kill()
    t0 = time.time()
    failed = finish(b, timeout=120)
    assert failed != 0 and time.time() - t0 < 60, (failed, time.time() - t0, log_of(b, 4000))
    survivor = tracker(ck)
    assert survivor > stopped and survivor % 3 == 0, (stopped, survivor)

    end = ["--exit-interval", str(max(curve(metrics["b"])) + 3)]
    logs = run_pretrain(2, [*resumable, "--save-interval", "3", *end,
                            "--metrics-file", metrics["c"]])
    assert f"resuming at iteration {survivor}" in logs[0], logs[0][-4000:]
    run_pretrain(2, [*args, *end, "--metrics-file", metrics["straight"]])
    want = curve(metrics["straight"])
    assert_same_losses(curve(metrics["a"]), want, "run stopped by SIGTERM")
    assert_same_losses(curve(metrics["b"]), want, "run killed by kill -9")
    assert min(curve(metrics["c"])) == survivor + 1
    assert max(curve(metrics["c"])) == max(want), (max(curve(metrics["c"])), max(want))
    assert_same_losses(curve(metrics["c"]), want, "run resumed after kill -9")
    return code, a


def test_native_one_process_sigterm_and_the_writer_lock(tiny_corpus, tmp_path):
    """SIGTERM to a plain `python pretrain_gpt2.py` saves a checkpoint and exits 0 (not 143);
    while it is frozen mid-run, a second run on its --save fails at start naming it."""
    from pretrain_gpt2 import run
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "60", *QUIET)
    straight = str(tmp_path / "straight.jsonl")
    run([*args, "--metrics-file", straight])
    ck, first = str(tmp_path / "ck"), str(tmp_path / "first.jsonl")
    proc = start([sys.executable, SCRIPT, *args, "--save", ck, "--load", ck, "--metrics-file",
                  first], str(tmp_path / "first.log"))
    wait_for_iteration(first, random.randint(3, 12), proc)
    proc.send_signal(signal.SIGSTOP)  # frozen while holding the lock: k is now fixed
    try:
        # as `python pretrain_gpt2.py ...`, in a forked child (run_main)
        code, _, err = run_main([*args, "--save", ck, "--load", ck], str(tmp_path), env())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
    assert code == 2, err[-3000:]
    assert "in use by another run: host" in err and f"pid {proc.pid}" in err
    assert finish(proc) == 0, log_of(proc, 4000)
    k = max(curve(first))
    assert tracker(ck) == k
    assert not os.path.exists(os.path.join(ck, "writer.lock"))
    resumed = str(tmp_path / "resumed.jsonl")
    trainer = run([*args, "--save", ck, "--load", ck, "--metrics-file", resumed])
    assert trainer.state.iteration == 60
    want = curve(straight)
    assert_same_losses(curve(first), want, "stopped run")
    assert sorted(curve(resumed)) == list(range(k + 1, 61))
    assert_same_losses(curve(resumed), want, "resumed run")


def test_tensor_parallel_torchrun_sigterm_and_kill9(tiny_corpus, tmp_path):
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "40",
                         "--tensor-model-parallel-size", "2", *QUIET)
    code, _ = run_chain(tmp_path, lambda a: torchrun_cmd(2, a), args,
                        signal_to=lambda p: ranks(p.pid)[1], kill_rank=0)
    assert code == 0


def test_deepspeed_launcher_runner_sigterm_and_kill9(tiny_corpus, tmp_path):
    """SIGTERM to the `deepspeed` runner: it dies at once and does not forward it; the ranks
    notice their launcher is gone, save and exit 0, and launch.py exits with them.

    The ranks poll their launcher once a second, so the run must outlast the signal by a few
    seconds: at ~30 ms per iteration on a quiet CPU, 30 iterations ended before the ranks
    noticed; 150 leave ~4 s after the latest signal (iteration 10)."""
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "150", *QUIET,
                         "--global-batch-size", "8", "--hidden-dropout", "0",
                         "--attention-dropout", "0", "--deepspeed", "--deepspeed_config",
                         os.path.join(ROOT, "ds_configs", "zero2.json"))
    code, a = run_chain(tmp_path, lambda x: deepspeed_cmd(2, x), args, signal_to=lambda p: p,
                        kill_rank=1)
    assert code == -signal.SIGTERM  # the runner itself dies of the signal; launch.py and the
    log = log_of(a, 100000)           # ranks are gone too (checked in run_chain)
    assert log.count("exits successfully") == 2 and "has exited: stopping this rank" in log


def test_stopped_rank_does_not_hang_the_other(tiny_corpus, tmp_path):
    """SIGSTOP of rank 1 does not hang rank 0 for the default timeout: rank 0 stops
    after --distributed-timeout-minutes (0.2 = 12 s) with exit code 4, naming the phase and what
    rank 1 last reported; the checkpoint it had is still the latest. (The launcher then kills
    the stopped rank after its own grace period, 30 s for torchrun; the test does it at once.)"""
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "400", *QUIET, "--save", ck,
                         "--save-interval", "2", "--distributed-timeout-minutes", "0.2",
                         "--metrics-file", metrics)
    proc = start(torchrun_cmd(2, args), str(tmp_path / "run.log"))
    wait_for_iteration(metrics, 20, proc)
    procs = ranks(proc.pid)
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.time()
    try:
        procs[0].wait(timeout=90)
        waited = time.time() - t0
    finally:  # what the launcher does to a stopped rank after its grace period, now
        procs[1].kill()
    assert finish(proc, timeout=90) != 0
    log = log_of(proc, 100000)
    assert 10 < waited < 60, (waited, log[-3000:])
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: 4 ", log), log[-3000:]
    error = next(line for line in log.splitlines() if line.startswith("error: rank 0 (host"))
    assert "a collective failed in '" in error and "Timed out" in error
    assert re.search(r"rank 1: '[a-z -]+' of iteration \d+, \d+ s ago", error), error
    last = tracker(ck)
    assert last >= 18 and last % 2 == 0  # 20 was logged; its save may have been cut
