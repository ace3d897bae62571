"""Self-restarting jobs: `torchrun --max-restarts` recovers a run whose rank was SIGKILLed.

A rank kills itself (kill_once.py) in the middle of an iteration after a checkpoint, on
torchrun's first attempt only. The job must finish with exit 0 on a restarted attempt that
forms its process groups afresh (the default group and every group of the layout), takes over
the dead rank's --save writer lock at once, says which restart it is and the iteration it
resumes from, and replays the iterations after the checkpoint exactly: its losses, and its
final weights, equal, bit for bit, those of a run that was never interrupted.
"""
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from app.checkpoint.files import safe_torch_load
from tests.harness.distributed import run_pretrain
from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.launch import ROOT, env
from tests.harness.checkpoints import tensors

CHILD = os.path.join(ROOT, "tests", "harness", "children", "kill_once.py")
TRAIN_ITERS, SAVED, KILLED_IN = 8, 4, 6  # killed in iteration 6: resumes from 4, replays 5
GLOBAL_BATCH = 4
RUN = ["--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-iters", "0",
       "--save-interval", "2", "--distributed-timeout-minutes", "1"]  # a hung attempt: 1 min
RESTARTED = f"restart 1 of torchrun's --max-restarts 2: resuming from iteration {SAVED}"


def assert_same_final_weights(got_dir, want_dir, rank_dir):
    """The checkpoints of the last iteration hold the same tensors, bit for bit."""
    rel = os.path.join(f"iter_{TRAIN_ITERS:07d}", rank_dir, "model_optim_rng.pt")
    got = tensors(safe_torch_load(os.path.join(got_dir, rel)))
    want = tensors(safe_torch_load(os.path.join(want_dir, rel)))
    assert sorted(got) == sorted(want), rel
    assert any(name.startswith("/model/") for name in want), sorted(want)[:5]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{rel}: {name} differs"


def train_rows(metrics_file):
    """[(iteration, loss, grad norm)] of every train row, in the order written."""
    return [(r["iteration"], r["lm_loss"], r["grad_norm"])
            for r in read_metrics(metrics_file) if r["kind"] == "train"]


def leftovers(marker):
    """Processes still running whose command line names `marker` (a test's tmp dir)."""
    return [proc for proc in psutil.process_iter(["cmdline"])
            if marker in " ".join(proc.info["cmdline"] or [])]


def run_killed_once(args, cwd, kill_rank):
    """`torchrun --nproc-per-node 2 --max-restarts 2` of kill_once.py, killing `kill_rank` in
    iteration KILLED_IN on the first attempt; asserts exit 0 and returns the output."""
    extra = dict(KILL_RANK=str(kill_rank), KILL_AT_SAMPLE=str((KILLED_IN - 1) * GLOBAL_BATCH))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=2", CHILD, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env(), **extra), cwd=cwd, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun still running after 240 s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{log[-6000:]}"
    assert RESTARTED in log and "restart 2 of" not in log, log[-6000:]
    return log


def assert_replayed(rows):
    """The first attempt logged 1..KILLED_IN-1, the restarted one SAVED+1..TRAIN_ITERS."""
    iterations = [it for it, _, _ in rows]
    first, second = list(range(1, KILLED_IN)), list(range(SAVED + 1, TRAIN_ITERS + 1))
    assert iterations == first + second, iterations


def test_data_parallel_job_restarts_after_rank0_is_killed(tiny_corpus, tmp_path):
    """DP 2 with a data-loader worker per rank: rank 0, which holds the --save writer lock,
    dies; the restart takes the lock over at once and ends equal to an uninterrupted run."""
    args = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--num-workers", "1")
    straight, ck = str(tmp_path / "straight"), str(tmp_path / "ck")
    # the reference run: forked ranks (run_pretrain), its launcher does not matter
    run_pretrain(2, [*args, "--save", straight, "--metrics-file", str(tmp_path / "straight.jsonl")])
    log = run_killed_once([*args, "--save", ck, "--load", ck, "--metrics-file",
                           str(tmp_path / "restarted.jsonl")], tmp_path, kill_rank=0)
    assert "took over the stale writer lock" in log and "on this host is gone" in log, log
    want = {it: (loss, norm) for it, loss, norm in train_rows(tmp_path / "straight.jsonl")}
    rows = train_rows(tmp_path / "restarted.jsonl")
    assert_replayed(rows)
    for it, loss, norm in rows:
        assert (loss, norm) == want[it], f"iteration {it}: {(loss, norm)} != {want[it]}"
    assert_same_final_weights(ck, straight, "mp_rank_00")
    assert not leftovers(str(tmp_path)), "processes of the killed attempt outlived the job"


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_tensor_parallel_job_restarts_after_rank1_is_killed(tiny_corpus, tmp_path, ckpt_format):
    """TP 2 (the layout's subgroups must form again too): rank 1 dies; the restarted attempt
    replays the iteration after the checkpoint with the first attempt's loss, bit for bit,
    from legacy or torch_dist checkpoints."""
    ck = str(tmp_path / "ck")
    args = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--tensor-model-parallel-size", "2",
                         "--ckpt-format", ckpt_format,
                         "--save", ck, "--load", ck, "--metrics-file", str(tmp_path / "m.jsonl"))
    run_killed_once(args, tmp_path, kill_rank=1)
    rows = train_rows(tmp_path / "m.jsonl")
    assert_replayed(rows)
    replayed = [(loss, norm) for it, loss, norm in rows if it == SAVED + 1]
    assert replayed[0] == replayed[1], replayed
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == TRAIN_ITERS
