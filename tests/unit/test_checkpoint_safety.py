"""Checkpoint crash safety, tracker corruption, damaged files and the weights_only allow-list."""
import os
import pickle
import signal
import time

import pytest
import torch

from app.checkpoint import commit, names
from app.checkpoint import files as ckpt_files
from app.checkpoint.legacy import per_rank as ckpt
from app.utils import faults
from tests.harness.checkpoints import (H, RANK_FILE_STAGES, Crash,
                                       assert_tracker_names_complete_checkpoint, save_two_ranks,
                                       small_dict)

TRACKER_STAGES = ("before_tracker", "tracker_tmp_written", "tracker_committed")


@pytest.mark.parametrize("crashing_rank, stage",
                         [(1, s) for s in RANK_FILE_STAGES]
                         + [(0, s) for s in RANK_FILE_STAGES + TRACKER_STAGES])
def test_exception_at_any_save_stage_keeps_previous_checkpoint(tmp_path, stage, crashing_rank):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    state = {"rank": None}

    def hook(name):
        if name == stage and state["rank"] == crashing_rank:
            raise Crash(name)

    faults.arm(faults.SAVE_STAGE, hook)
    with pytest.raises(Crash):
        for rank in (1, 0):
            state["rank"] = rank
            ckpt.save_checkpoint(s, 20, small_dict(20, 20 + rank), tp_rank=rank,
                                 is_tracker_writer=rank == 0)
    faults.disarm(faults.SAVE_STAGE)
    got = assert_tracker_names_complete_checkpoint(s, tp_size=2)
    committed = crashing_rank == 0 and stage == "tracker_committed"
    assert got == (20 if committed else 10)


def _fork_and_kill_at(stage, target):
    """Fork a child that runs target() and SIGKILLs itself at `stage`; return its signal."""
    pid = os.fork()
    if pid == 0:  # child
        try:
            def hook(name):
                if name == stage:
                    os.kill(os.getpid(), signal.SIGKILL)
            faults.arm(faults.SAVE_STAGE, hook)
            target()
        finally:
            os._exit(0)
    deadline = time.time() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child stuck at stage {stage}")
        time.sleep(0.01)


@pytest.mark.parametrize("stage", commit.SAVE_STAGES)
def test_sigkill_at_any_save_stage_keeps_a_loadable_checkpoint(tmp_path, stage):
    s = str(tmp_path)
    save_two_ranks(s, 10)

    def second_save():
        save_two_ranks(s, 20)
        ckpt.save_checkpoint(s, 30, small_dict(30, 30), keep_last_n=1)  # rotation stages

    sig = _fork_and_kill_at(stage, second_save)
    assert sig == signal.SIGKILL
    iteration = ckpt.read_tracker(s)
    tp_size = 1 if iteration == 30 else 2
    assert_tracker_names_complete_checkpoint(s, tp_size=tp_size, allowed=(10, 20, 30))
    if iteration == 30:
        assert names.list_checkpoint_iterations(s)[-1] == 30


def test_sigkill_while_rewriting_the_tracked_iteration(tmp_path):
    """Re-saving the iteration the tracker names: the old file stays verifiable until replaced."""
    s = str(tmp_path)
    save_two_ranks(s, 10)
    for stage in ("rank_tmp_written", "rank_checksum_committed", "rank_file_committed"):
        sig = _fork_and_kill_at(stage, lambda: ckpt.save_checkpoint(
            s, 10, small_dict(10, 10), tp_rank=0))
        assert sig == signal.SIGKILL
        assert_tracker_names_complete_checkpoint(s, tp_size=2, allowed=(10,))


@pytest.mark.parametrize("content, fragment", [
    ("", "holds ''"), ("abc", "holds 'abc'"), ("1", "names iteration 1"),
    ("20\x00", "holds"), ("-5", "holds '-5'"),
])
def test_tracker_corruption_raises_naming_the_file(tmp_path, content, fragment):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    with open(names.tracker_path(s), "w") as f:
        f.write(content)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint_dict(s)
    message = str(info.value)
    assert names.tracker_path(s) in message and fragment in message
    assert "[10]" in message  # says which iterations exist


def test_tracker_naming_a_missing_directory(tmp_path):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    names.write_tracker(s, 20)
    with pytest.raises(ckpt.CheckpointError, match="iter_0000020 does not exist"):
        ckpt.read_tracker(s)


def _damage(path, how):
    data = open(path, "rb").read()
    if how == "truncate":
        data = data[:len(data) // 2]
    elif how == "flip":
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    elif how == "garbage":
        data = os.urandom(len(data))
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage", "delete"])
@pytest.mark.parametrize("keep_checksum", [True, False])
def test_damaged_file_raises_naming_it(tmp_path, how, keep_checksum):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    path = ckpt.checkpoint_path(s, 10, tp_rank=1)
    if not keep_checksum:
        os.remove(path + ckpt_files.CHECKSUM_SUFFIX)
    if how == "delete":
        os.remove(path)
    else:
        _damage(path, how)
    if how == "flip" and not keep_checksum:
        return  # a flipped tensor byte is only detectable with the checksum
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint_dict(s, tp_rank=1)
    assert path in str(info.value)
    assert ckpt.load_checkpoint_dict(s, tp_rank=0)[1] == 10  # the other rank's file is fine


def test_missing_rank_file_says_what_exists(tmp_path):
    s = str(tmp_path)
    save_two_ranks(s, 10)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint_dict(s, tp_rank=0, pp_rank=0, pp_size=2)
    assert "mp_rank_00_000" in str(info.value) and "['mp_rank_00', 'mp_rank_01']" in str(
        info.value)


class Payload:
    """A class that is not on the allow-list (it could run code when unpickled)."""

    def __reduce__(self):
        return (print, ("pwned",))


class Harmless:
    pass


@pytest.mark.parametrize("obj", [Payload(), Harmless()])
def test_unexpected_pickled_class_is_refused(tmp_path, obj):
    s = str(tmp_path)
    state = small_dict(10, 10)
    state["optimizer"]["extra"] = obj
    ckpt.save_checkpoint(s, 10, state)
    with pytest.raises(pickle.UnpicklingError) as info:
        ckpt.load_checkpoint_dict(s)
    assert isinstance(info.value, ckpt_files.UnsafeCheckpointError)
    assert ckpt.checkpoint_path(s, 10) in str(info.value)


def test_allow_list_is_needed_for_namespace(tmp_path):
    """Our files need the allow-list (Namespace, numpy RNG state) and load with it."""
    s = str(tmp_path)
    ckpt.save_checkpoint(s, 10, small_dict(10, 10))
    path = ckpt.checkpoint_path(s, 10)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert ckpt.load_checkpoint_dict(s)[0]["args"].hidden_size == H


def test_iteration_in_file_must_match_directory(tmp_path):
    s = str(tmp_path)
    ckpt.save_checkpoint(s, 10, small_dict(10, 10))
    os.rename(os.path.join(s, "iter_0000010"), os.path.join(s, "iter_0000011"))
    names.write_tracker(s, 11)
    with pytest.raises(ckpt.CheckpointError, match="says iteration 10"):
        ckpt.load_checkpoint_dict(s)
