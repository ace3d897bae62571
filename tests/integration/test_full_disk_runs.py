"""Saves that fail on a real full file system (a small tmpfs), end to end through
pretrain_gpt2.py: a --save that is full for one interval costs that checkpoint only (the run
finishes exactly as an uninterrupted one, and its log and metrics name the failed save); a
--save full throughout stops the run with exit code 5 naming the directory, without hanging on
its data-loader workers. DeepSpeed's saves: tests/integration/test_checkpoint_faults.py."""
import os
import subprocess
import sys

import pytest
import torch

from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import names
from app.utils import faults
from tests.harness.filesystems import Ballast, small_tmpfs
from tests.harness.corpus import read_metrics
from tests.harness.launch import ROOT, env, train_curve
from tests.harness.launch import main_in_process, temporaries

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--mock-data", "--vocab-size", "96", "--make-vocab-size-divisible-by", "16",
        "--distributed-backend", "gloo", "--peak-flops", "1e11"]


def _tensors(tree, prefix=""):
    """{path: tensor} of every tensor in a nested checkpoint dict."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else (
        enumerate(tree) if isinstance(tree, (list, tuple)) else ())
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def _full_during_save(number):
    """A SAVE_STAGE handler: the file system of --save fills up as save `number` starts and
    has room again when the next one starts (a real ENOSPC, raised by torch.save)."""
    started, ballast = [0], []

    def handler(stage):
        if stage != "start":
            return
        started[0] += 1
        if ballast:
            ballast.pop().remove()
        if started[0] == number:
            ballast.append(Ballast(handler.disk))
            ballast[0].fill()
    return handler


@pytest.mark.parametrize("variant", [[], ["--async-save", "--ckpt-format", "torch_dist"]],
                         ids=["torch-sync", "torch_dist-async"])
def test_a_save_dir_full_for_one_interval_costs_that_checkpoint_only(tmp_path, capfd, variant):
    run = ARGS + ["--train-iters", "6", "--save-interval", "2", *variant]
    straight = tmp_path / "straight.jsonl"
    code, err = main_in_process(run + ["--save", str(tmp_path / "straight"), "--metrics-file",
                             str(straight)])
    assert code == 0, err
    metrics = tmp_path / "full.jsonl"
    with small_tmpfs(tmp_path / "disk", 8 * 2**20) as disk:
        ck = os.path.join(disk, "ck")
        handler = _full_during_save(2)  # the save of iteration 4
        handler.disk = disk
        with faults.injected(faults.SAVE_STAGE, handler):
            code, err = main_in_process(run + ["--save", ck, "--metrics-file", str(metrics)])
        log = capfd.readouterr()
        assert code == 0, err
        assert names.read_tracker(ck) == 6 and names.list_checkpoint_iterations(ck) == [2, 6]
        assert not temporaries(ck)
        if not variant:  # the final checkpoint holds the uninterrupted run's tensors bit for bit
            got = _tensors(ckpt.load_checkpoint_dict(ck)[0])
            want = _tensors(ckpt.load_checkpoint_dict(str(tmp_path / "straight"))[0])
            assert sorted(got) == sorted(want) and len(got) > 10
            assert all(torch.equal(got[k], want[k]) for k in want)
    assert train_curve(metrics) == train_curve(straight)  # every loss and grad norm, exactly
    failed = [r for r in read_metrics(metrics) if r["kind"] == "save_failed"]
    assert [(r["iteration"], r["directory"], r["latest"], r["failures_in_a_row"])
            for r in failed] == [(4, ck, 2, 1)]
    assert "(ENOSPC)" in failed[0]["error"]
    lines = [line for line in (log.out + log.err).splitlines() if "save failed" in line]
    assert len(lines) == 1 and "training goes on" in lines[0] and ck in lines[0], lines


def _pretrain(argv, cwd, timeout=180):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"), *argv],
                          capture_output=True, text=True, env=env(), cwd=cwd, timeout=timeout)


def test_a_save_dir_full_throughout_stops_with_exit_5_and_no_hang(tmp_path):
    """--num-workers 2 (the workers ignore SIGTERM; a rank that kept them running waited for
    them forever at exit): --max-failed-saves in a row stop the run, and so does a failed last
    save, each with exit 5 naming --save, well within the timeout."""
    with small_tmpfs(tmp_path / "disk", 64 * 1024) as disk:  # room for the lock, not a checkpoint
        ck = os.path.join(disk, "ck")
        common = ARGS + ["--num-workers", "2", "--save", ck]
        in_a_row = _pretrain(common + ["--train-iters", "6", "--save-interval", "1",
                                       "--max-failed-saves", "2"], tmp_path)
        last = _pretrain(common + ["--train-iters", "3", "--save-interval", "2"], tmp_path)
        listing = os.listdir(ck)
    assert in_a_row.returncode == 5, in_a_row.stderr[-3000:]
    assert "2 saves in a row failed (--max-failed-saves 2)" in in_a_row.stderr
    assert f"could not save the checkpoint of iteration 2 to {ck}" in in_a_row.stderr
    assert "(ENOSPC)" in in_a_row.stderr and "Traceback" not in in_a_row.stderr
    assert last.returncode == 5, last.stderr[-3000:]
    assert "the run's last checkpoint could not be saved" in last.stderr
    assert f"could not save the checkpoint of iteration 3 to {ck}" in last.stderr
    assert "save failed (1 in a row" in last.stdout + last.stderr  # iteration 2: went on
    assert listing == []  # no partial checkpoint, no temporary file, the lock released


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2"],
    ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"),
     "--global-batch-size", "8"]], ids=["native-tp2", "deepspeed-zero2-dp2"])
def test_one_ranks_full_disk_fails_that_save_on_every_rank_and_the_run_goes_on(tmp_path, layout):
    """Rank 1 alone cannot write its part of the save of iteration 4 (its file of TP rank 1, or
    its ZeRO-2 optimizer shard, written inside DeepSpeed's save between its barriers): every
    rank undoes that save and goes on, no rank waits on another, and the run ends with exit 0
    and the checkpoints of iterations 2 and 6."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         os.path.join(ROOT, "tests", "harness", "children", "disk_full_once.py"), *ARGS, *layout,
         "--train-iters", "6", "--save-interval", "2", "--save", str(ck),
         "--metrics-file", str(metrics)],
        capture_output=True, text=True, cwd=tmp_path, timeout=400,
        env={**env(), "DISK_FULL_RANK": "1", "DISK_FULL_SAVES": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert names.read_tracker(str(ck)) == 6
    assert names.list_checkpoint_iterations(str(ck)) == [2, 6] and not temporaries(str(ck))
    failed = [r for r in read_metrics(metrics) if r["kind"] == "save_failed"]
    assert [(r["iteration"], r["latest"]) for r in failed] == [(4, 2)]
    # the logging rank is the last one, the rank whose disk was full
    assert "(ENOSPC)" in failed[0]["error"] and str(ck) in failed[0]["error"]
    assert sorted(train_curve(metrics)) == [1, 2, 3, 4, 5, 6]
