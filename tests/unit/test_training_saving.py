"""Saves that fail: what torch raises on a real full disk (a small tmpfs), the disk-full fault
that imitates it, the undo of such a save (synchronous and in the background) followed by a
save that commits, the trainer's failure policy (--max-failed-saves), and data-loader workers
that stop on every exit path."""
import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from app.checkpoint import commit, names
from app.checkpoint.legacy import per_rank as ckpt
from app.config.checkpoint import CheckpointConfig
from app.mpu.parallel_state import ParallelState
from app.training.data_loading import build_data_iterator, close_data_iterator
from tests.harness.datasets import IndexSamples
from app.training.checkpointing.saver import EXIT_SAVE_FAILED, CheckpointSaver, SaveFailed
from app.utils import faults
from tests.harness.filesystems import Ballast, small_tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_DISK_FULL = re.compile(r"\[enforce fail at inline_container\.cc:\d+\] \. unexpected pos "
                             r"\d+ vs \d+")
STATE = {"weights": torch.arange(60000, dtype=torch.float32)}  # 240 KB: more than the disk


def _temporaries(root):
    return [n for _, _, files in os.walk(root) for n in files if ".tmp." in n]


def test_the_disk_full_fault_raises_what_torch_raises_on_a_full_tmpfs(tmp_path):
    with small_tmpfs(tmp_path / "disk", 128 * 1024) as disk:
        with open(os.path.join(disk, "f.pt"), "wb") as f, pytest.raises(RuntimeError) as real:
            torch.save(STATE, f)
        with Ballast(disk):  # a RuntimeError without its OSError, judged by the free space
            bare = commit.storage_error(RuntimeError(str(real.value)), os.path.join(disk, "x"))
        with pytest.raises(OSError) as checked:  # the writer every checkpoint file goes through
            commit.write_checked_file(os.path.join(disk, "iter", "g.pt"),
                                      lambda f: torch.save(STATE, f))
        left = _temporaries(disk)
    injected = faults.torch_disk_full_error()
    for exc in (real.value, injected):
        assert type(exc) is RuntimeError and TORCH_DISK_FULL.fullmatch(str(exc)), str(exc)
        assert isinstance(exc.__context__, OSError) and exc.__context__.errno == errno.ENOSPC
        assert commit.storage_error(exc).errno == errno.ENOSPC
    assert bare.errno == errno.ENOSPC and "unexpected pos" in str(bare)
    assert checked.value.errno == errno.ENOSPC
    assert not left
    on_a_roomy_disk = commit.storage_error(RuntimeError(str(real.value)), str(tmp_path / "x"))
    assert on_a_roomy_disk.errno == errno.EIO
    assert commit.storage_error(RuntimeError("size mismatch for weight")) is None
    assert commit.storage_error(PermissionError(errno.EACCES, "denied")).errno == errno.EACCES


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_on_a_full_disk_is_undone_and_the_next_one_commits(tmp_path, background):
    """Real ENOSPC from torch.save (a full tmpfs): the save is undone, the tracker keeps naming
    the previous checkpoint; once space is free again the next save commits and loads."""
    def save(root, iteration):
        state = {"iteration": iteration, "model": STATE}
        pending = ckpt.start_save(root, iteration, state, agree=lambda ok: ok,
                                  background=background)
        return pending.finish()

    with small_tmpfs(tmp_path / "disk", 2 * 2**20) as disk:
        save(disk, 1)
        with Ballast(disk), pytest.raises(commit.CheckpointSaveError) as info:
            save(disk, 2)
        listing, left = sorted(os.listdir(disk)), _temporaries(disk)
        tracker_after_failure = names.read_tracker(disk)
        save(disk, 3)
        state, iteration = ckpt.load_checkpoint_dict(disk)
    message = str(info.value)
    assert f"could not save the checkpoint of iteration 2 to {disk}" in message, message
    assert "(ENOSPC)" in message and "the latest checkpoint is still iteration 1" in message
    assert tracker_after_failure == 1 and "iter_0000002" not in listing and not left
    assert iteration == 3 and torch.equal(state["model"]["weights"], STATE["weights"])


def _raising(error):
    """A SAVE_STAGE handler that fails the second save of the process with `error`."""
    started = [0]

    def handler(stage):
        started[0] += stage == "start"
        if stage == "rank_tmp_written" and started[0] == 2:
            raise error
    return handler


@pytest.mark.parametrize("fault,code", [
    (lambda: faults.disk_full(saves={2}), "ENOSPC"),
    (lambda: _raising(OSError(errno.EIO, os.strerror(errno.EIO))), "EIO"),
    (lambda: _raising(PermissionError(errno.EACCES, os.strerror(errno.EACCES))), "EACCES"),
    (lambda: _raising(TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))),
     "ETIMEDOUT")], ids=["disk-full", "eio", "permission", "timeout"])
def test_a_save_that_fails_on_storage_fails_alone(tmp_path, fault, code):
    """The chosen save fails with its error named, the saves before and after it commit."""
    root = str(tmp_path)
    outcomes = []
    with faults.injected(faults.SAVE_STAGE, fault()):
        for iteration in (1, 2, 3):
            try:
                ckpt.save_checkpoint(root, iteration, {"iteration": iteration, "model": STATE})
                outcomes.append("saved")
            except commit.CheckpointSaveError as exc:
                outcomes.append(str(exc))
    assert outcomes[0] == outcomes[2] == "saved"
    assert "iteration 2" in outcomes[1] and f"({code})" in outcomes[1]
    assert names.list_checkpoint_iterations(root) == [1, 3] and not _temporaries(root)


class _Engine:
    """Stands in for an engine: saves succeed or fail (CheckpointSaveError) as told."""

    save_in_flight = None

    def __init__(self, outcomes):
        self.outcomes = iter(outcomes)

    def save_checkpoint(self, save_dir, iteration, client_state, asynchronous):
        if not next(self.outcomes):
            raise commit.CheckpointSaveError(f"could not save the checkpoint of iteration "
                                             f"{iteration} to {save_dir}: disk full")
        return names.checkpoint_dir(save_dir, iteration)


class _Writer:
    def __init__(self):
        self.records = []

    def write(self, kind, iteration, values):
        self.records.append((kind, iteration, dict(values)))


def test_failed_saves_are_logged_recorded_and_stop_the_run_at_the_limit(tmp_path):
    cfg = CheckpointConfig(save=str(tmp_path), max_failed_saves=2)
    writer, lines = _Writer(), []
    saver = CheckpointSaver(cfg, _Engine([False, True, False, False]), writer, lines.append)
    assert [saver.save(i, {}, final=False) for i in (1, 2, 3)] == [False, True, False]
    with pytest.raises(SaveFailed) as stopped:
        saver.save(4, {}, final=False)
    assert "2 saves in a row failed (--max-failed-saves 2)" in str(stopped.value)
    assert str(tmp_path) in str(stopped.value) and stopped.value.exit_code == EXIT_SAVE_FAILED
    assert [(r[1], r[2]["failures_in_a_row"]) for r in writer.records] == [(1, 1), (3, 1),
                                                                          (4, 2)]
    assert all(r[0] == "save_failed" and r[2]["directory"] == str(tmp_path)
               for r in writer.records)
    failed = [line for line in lines if line.startswith("save failed")]
    assert len(failed) == 2 and "training goes on" in failed[0] and str(tmp_path) in failed[0]

    last = CheckpointSaver(cfg, _Engine([False]), _Writer(), lines.append)
    with pytest.raises(SaveFailed, match="the run's last checkpoint could not be saved"):
        last.save(9, {}, final=True)  # the first failure, but the save that ends the run
    with pytest.raises(ValueError, match="--max-failed-saves must be at least 1, got 0"):
        CheckpointConfig(save=str(tmp_path), max_failed_saves=0)


def test_data_loader_workers_stop_when_closed_and_at_an_exit_with_an_error(tmp_path):
    iterator = build_data_iterator(IndexSamples(), 0, 2, ParallelState.single(), num_workers=2)
    next(iterator)
    workers = list(iterator._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    close_data_iterator(iterator)
    assert not any(w.is_alive() for w in workers)
    # a process that dies of an exception with the iterator still referenced exits at once
    # (the workers ignore SIGTERM, which the interpreter's exit sends them before it waits)
    script = textwrap.dedent("""
        from app.mpu.parallel_state import ParallelState
        from app.training.data_loading import build_data_iterator
        from tests.harness.datasets import IndexSamples
        iterator = build_data_iterator(IndexSamples(), 0, 2, ParallelState.single(), num_workers=2)
        next(iterator)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1 and "unexpected pos" in proc.stderr, proc.stderr[-2000:]


def test_a_save_whose_directory_cannot_be_marked_still_writes_and_is_undone(tmp_path,
                                                                            monkeypatch):
    """The in-progress mark is the save's first write; when it fails (ENOSPC on the
    directory) the write step still runs (DeepSpeed's barriers are in it, so every rank must
    reach them) and the agreement undoes the save."""
    root, wrote = str(tmp_path), []

    def no_room(directory):
        os.makedirs(directory, exist_ok=True)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)

    monkeypatch.setattr(commit, "_mark_in_progress", no_room)
    with pytest.raises(commit.CheckpointSaveError, match=r"\(ENOSPC\)"):
        commit.commit_save(root, 1, write=lambda: wrote.append(1), undo=lambda: None,
                           agree=lambda ok: ok, is_tracker_writer=True)
    assert wrote == [1] and not os.listdir(root)
