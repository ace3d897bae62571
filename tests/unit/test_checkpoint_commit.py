"""The two-phase commit both engines save through, driven with stand-in write and undo steps:
a failure on any rank undoes this rank's part and keeps the previous checkpoint; a success
leaves DeepSpeed's `latest` and the tracker naming the new iteration, and old ones rotated."""
import errno
import os

import pytest

from app.checkpoint import commit
from app.utils import faults


def previous_checkpoint(root, iteration=1):
    """A complete checkpoint of `iteration` that the tracker names (laid out by hand)."""
    os.makedirs(os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


class RankFiles:
    """One rank's part of a save: writes `name` into the iteration's directory (or fails with
    ENOSPC), and counts its undos."""

    def __init__(self, root, iteration, name="part.pt", fail=False):
        self.path = os.path.join(root, f"iter_{iteration:07d}", name)
        self.fail, self.undos = fail, 0

    def write(self):
        if self.fail:
            return self.path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        commit.write_checked_file(self.path, lambda f: f.write(b"weights"))
        return None

    def undo(self):
        self.undos += 1
        commit.remove_written_file(self.path, os.path.dirname(self.path))


def save(root, iteration, part, outcomes, **kwargs):
    """commit_save on one rank; the other ranks' outcomes of the two agreements are `outcomes`."""
    answers = iter(outcomes)
    return commit.commit_save(root, iteration, write=part.write, undo=part.undo,
                              agree=lambda ok: ok and next(answers), **kwargs)


def tracker(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return f.read()


def test_another_ranks_failure_undoes_this_rank_and_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    previous_checkpoint(root)
    part = RankFiles(root, 2)
    with pytest.raises(commit.CheckpointSaveError) as info:
        save(root, 2, part, [False], is_tracker_writer=True)
    message = str(info.value)
    assert "another rank could not write its part" in message
    assert "the latest checkpoint is still iteration 1" in message
    assert part.undos == 1 and not os.path.exists(os.path.join(root, "iter_0000002"))
    assert tracker(root) == "1" and not os.path.exists(os.path.join(root, "latest"))


def test_this_ranks_failure_is_named_with_its_file_and_errno(tmp_path):
    root = str(tmp_path)
    previous_checkpoint(root)
    part = RankFiles(root, 2, fail=True)
    with pytest.raises(commit.CheckpointSaveError) as info:
        save(root, 2, part, [True], is_tracker_writer=True)
    assert f"writing {part.path} failed" in str(info.value) and "(ENOSPC)" in str(info.value)
    assert tracker(root) == "1" and not os.path.exists(os.path.join(root, "iter_0000002"))


def test_a_failure_after_the_tracker_on_another_rank_undoes_this_save(tmp_path):
    root = str(tmp_path)
    previous_checkpoint(root)
    part = RankFiles(root, 2)
    with pytest.raises(commit.CheckpointSaveError):
        save(root, 2, part, [True, False], is_tracker_writer=False)
    assert part.undos == 1 and not os.path.exists(part.path)


def test_success_writes_latest_then_the_tracker_and_rotates(tmp_path):
    root = str(tmp_path)
    previous_checkpoint(root, 1)
    stages = []
    faults.arm(faults.SAVE_STAGE, stages.append)
    for iteration in (2, 3):
        directory = save(root, iteration, RankFiles(root, iteration), [True, True],
                         is_tracker_writer=True, keep_last_n=2, deepspeed_latest=True)
        assert directory == os.path.join(root, f"iter_{iteration:07d}")
    with open(os.path.join(root, "latest"), "rb") as f:
        assert f.read() == b"iter_0000003"
    assert tracker(root) == "3"
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == \
        ["iter_0000002", "iter_0000003"]
    assert stages[:len(commit.SAVE_STAGES)] == list(commit.SAVE_STAGES)


def test_a_rank_that_is_not_the_tracker_writer_writes_no_pointer(tmp_path):
    root = str(tmp_path)
    save(root, 5, RankFiles(root, 5), [True, True], is_tracker_writer=False,
         deepspeed_latest=True, keep_last_n=1)
    assert sorted(os.listdir(root)) == ["iter_0000005"]


class Killed(BaseException):
    """Stands for a SIGKILL at a stage of a save: nothing of the save runs after it."""


def kill_at(stage):
    def hook(at):
        if at == stage:
            raise Killed(stage)
    return hook


@pytest.mark.parametrize("stage", ["rank_file_committed", "before_tracker", "tracker_tmp_written"])
def test_a_first_save_killed_before_its_commit_is_not_a_checkpoint(tmp_path, stage):
    """A save killed before the tracker names it leaves a marked directory: the next start into
    the same --save starts fresh (no 'checkpoints but no tracker' refusal) and removes it, while a
    directory that no save marked (a lost tracker) is still refused."""
    from app.checkpoint import names
    from app.config import CheckpointConfig
    from app.training.checkpointing.resume import decide_start
    from app.training.resilience.save_dir import claim_save_dir
    root = str(tmp_path / "ck")
    faults.arm(faults.SAVE_STAGE, kill_at(stage))
    with pytest.raises(Killed):
        save(root, 2, RankFiles(root, 2), [True, True], is_tracker_writer=True)
    faults.disarm(faults.SAVE_STAGE)
    assert os.path.isdir(os.path.join(root, "iter_0000002"))
    assert names.interrupted_saves(root) == [2]
    same = CheckpointConfig(save=root, load=root)
    assert decide_start(same).load is None  # a fresh start, not a refusal
    claim_save_dir(root).release()
    assert not os.path.exists(os.path.join(root, "iter_0000002"))

    os.makedirs(os.path.join(root, "iter_0000005", "mp_rank_00"))  # no mark, no tracker
    with pytest.raises(Exception, match="no latest_checkpointed_iteration.txt"):
        decide_start(same)


def test_a_committed_save_leaves_no_mark_and_a_later_kill_keeps_the_committed_one(tmp_path):
    from app.checkpoint import names
    root = str(tmp_path / "ck")
    save(root, 1, RankFiles(root, 1), [True, True], is_tracker_writer=True)
    assert not [n for n in os.listdir(os.path.join(root, "iter_0000001"))
                if n.startswith(".save-in-progress")]
    faults.arm(faults.SAVE_STAGE, kill_at("rank_file_committed"))
    with pytest.raises(Killed):
        save(root, 2, RankFiles(root, 2), [True, True], is_tracker_writer=True)
    assert names.interrupted_saves(root) == [2]
    assert names.read_tracker(root) == 1
