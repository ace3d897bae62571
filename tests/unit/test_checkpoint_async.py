"""Saves written in the background (--async-save): the same files as a synchronous save, the
previous checkpoint latest until every file is durable, at most one save in flight."""
import os
import signal
import threading
import time

import pytest
import torch

from app.checkpoint import commit, names
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint.snapshot import HostBuffers, host_copy
from app.training.engines.base import Engine
from app.utils import faults
from tests.harness.checkpoints import (RANK_FILE_STAGES, Crash,
                                       assert_tracker_names_complete_checkpoint,
                                       save_two_ranks, small_dict)


def _file_bytes(save_dir, iteration, tp_rank=0):
    with open(names.checkpoint_path(save_dir, iteration, tp_rank=tp_rank), "rb") as f:
        return f.read()


def _shared_state():
    """A state whose tensors share storage and include a view with an offset, like an
    optimizer's flat buffers, a parameter and a view of one that is not a graph leaf."""
    flat = torch.arange(24, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.ones(6))
    return {"a": flat, "view": flat[4:12].view(2, 4), "again": flat, "weight": weight,
            "not_leaf": weight[2:4], "nested": [{"half": torch.ones(3, dtype=torch.float16)},
                                                7, "text"]}


def test_host_copy_saves_the_same_bytes_and_shares_nothing_with_the_live_state(tmp_path):
    state = _shared_state()
    copy = host_copy(state)
    for name, value in (("live", state), ("copy", copy)):  # same file name: same archive name
        (tmp_path / name).mkdir()
        torch.save(value, tmp_path / name / "state.pt")
    assert ((tmp_path / "live" / "state.pt").read_bytes()
            == (tmp_path / "copy" / "state.pt").read_bytes())
    state["a"].add_(1.0)  # training goes on
    assert torch.equal(copy["a"], torch.arange(24, dtype=torch.float32))
    assert copy["view"].untyped_storage().data_ptr() == copy["a"].untyped_storage().data_ptr()


def test_host_buffers_are_reused_by_the_next_save_and_hold_its_values():
    buffers, state = HostBuffers(), _shared_state()
    buffers.new_save()
    first = host_copy(state, buffers)
    state["a"].add_(1.0)
    buffers.new_save()  # the first save's write has ended
    second = host_copy(state, buffers)
    assert second["a"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()
    assert torch.equal(second["a"], torch.arange(24, dtype=torch.float32) + 1)
    assert torch.equal(second["view"], state["view"]) and torch.equal(second["weight"],
                                                                       state["weight"])


def test_background_save_writes_the_bytes_of_a_synchronous_one_and_commits_on_finish(tmp_path):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    ckpt.save_checkpoint(sync_dir, 10, small_dict(10, 10))
    live = small_dict(10, 10)
    pending = ckpt.start_save(async_dir, 10, host_copy(live), background=True)
    weight = live["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
    weight.add_(5.0)  # the live state changes while the file is written
    assert ckpt.read_tracker(async_dir) is None  # not the latest before finish
    assert pending.finish() == names.checkpoint_dir(async_dir, 10)
    assert ckpt.read_tracker(async_dir) == 10
    assert _file_bytes(sync_dir, 10) == _file_bytes(async_dir, 10)


def _blocked_save(save_dir, iteration, release, stages=None):
    """A background save (rank 0 of one) whose write waits for `release`."""
    state = small_dict(iteration, iteration)
    path = names.checkpoint_path(save_dir, iteration)

    def write():
        release.wait(30)
        commit.write_checked_file(path, lambda f: torch.save(state, f))

    return commit.start_save(save_dir, iteration, write=write, undo=lambda: None,
                             agree=lambda ok: ok, is_tracker_writer=True, background=True)


def test_finish_not_blocking_waits_for_every_write(tmp_path):
    s = str(tmp_path)
    release = threading.Event()
    pending = _blocked_save(s, 10, release)
    assert not pending.written()
    release.set()
    pending.finish()
    assert pending.written() and ckpt.read_tracker(s) == 10


class _RecordingEngine(Engine):
    """An engine whose saves write in the background after a pause; records what the tracker
    named when each save started."""

    def __init__(self):
        self.tracker_at_start = []

    def start_save(self, save_dir, iteration, client_state, asynchronous):
        self.tracker_at_start.append(ckpt.read_tracker(save_dir))
        release = threading.Event()
        threading.Timer(0.2, release.set).start()
        return _blocked_save(save_dir, iteration, release)

    zero_grad = backward = step = read_checkpoint = None


def test_at_most_one_save_in_flight_and_not_blocking_finish_waits_for_the_write(tmp_path):
    s, engine = str(tmp_path), _RecordingEngine()
    engine.save_checkpoint(s, 10, {}, asynchronous=True)
    assert engine.save_in_flight == 10
    assert engine.finish_save(blocking=False) is None  # still writing: nothing committed
    assert ckpt.read_tracker(s) is None
    engine.save_checkpoint(s, 20, {}, asynchronous=True)  # finishes 10 first
    assert engine.tracker_at_start == [None, 10]
    deadline = time.time() + 30
    while engine.finish_save(blocking=False) is None:
        assert time.time() < deadline
        time.sleep(0.05)
    assert engine.save_in_flight is None and ckpt.read_tracker(s) == 20


def test_an_error_in_the_background_write_undoes_the_save(tmp_path):
    s = str(tmp_path)
    save_two_ranks(s, 10)

    def hook(stage):
        if stage == "rank_checksum_committed" and threading.current_thread().name != "MainThread":
            raise Crash(stage)

    faults.arm(faults.SAVE_STAGE, hook)
    pending = [ckpt.start_save(s, 20, host_copy(small_dict(20, 20 + rank)), tp_rank=rank,
                               is_tracker_writer=rank == 0, background=True) for rank in (1, 0)]
    with pytest.raises(Crash):
        for p in pending:
            p.finish()
    faults.disarm(faults.SAVE_STAGE)
    assert assert_tracker_names_complete_checkpoint(s, tp_size=2) == 10


@pytest.mark.parametrize("stage", RANK_FILE_STAGES[1:])
def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path, stage):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    pid = os.fork()
    if pid == 0:  # child: the kill comes from the writing thread
        try:
            def hook(name):
                if name == stage and threading.current_thread().name != "MainThread":
                    os.kill(os.getpid(), signal.SIGKILL)
            faults.arm(faults.SAVE_STAGE, hook)
            for rank in (1, 0):
                ckpt.start_save(s, 20, host_copy(small_dict(20, 20 + rank)), tp_rank=rank,
                                is_tracker_writer=rank == 0, background=True).finish()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert assert_tracker_names_complete_checkpoint(s, tp_size=2) == 10


@pytest.mark.parametrize("had_latest", [True, False])
def test_a_failed_tracker_write_restores_deepspeeds_latest(tmp_path, monkeypatch, had_latest):
    s = str(tmp_path)
    if had_latest:
        names.write_latest_tag(s, "iter_0000010")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(names, "write_tracker", full_disk)
    with pytest.raises(commit.CheckpointSaveError, match="ENOSPC"):
        commit.commit_save(s, 20, write=lambda: None, undo=lambda: None, agree=lambda ok: ok,
                           is_tracker_writer=True, deepspeed_latest=True)
    assert names.read_latest_tag(s) == ("iter_0000010" if had_latest else None)
