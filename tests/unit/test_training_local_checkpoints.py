"""Non-persistent checkpoints in one process, saved by the run's checkpointer
(app.training.checkpointing.checkpointer) and chosen by app.training.checkpointing.latest:
where local replicas live (app.training.checkpointing.local), which iteration a resume picks,
the files' integrity check, the flags' rules, a save -> restore round trip of an engine's
state, RNG and position, global saves beside persistent ones, and a failed local save. The
multi-rank cases (a SIGKILL, a lost rank folder restored from its replica) are in
tests/integration/test_chaos.py."""
import dataclasses
import logging
import os

import pytest
import torch

from app.checkpoint import CheckpointError, commit, names
from app.config.checkpoint import CheckpointConfig
from app.mpu.parallel_state import ParallelState
from app.training.checkpointing import latest
from app.training.checkpointing import local as lc
from app.training.checkpointing.checkpointer import Checkpointer
from app.training.state import RunState

CPU = torch.device("cpu")


def checkpointer(cfg, engine, writer=None, train_iters=100):
    """The checkpointer of a one-process run of `engine`, ready to save (failed saves
    recorded by `writer`)."""
    saves = Checkpointer(cfg, engine, ParallelState.single(), CPU, train_iters)
    saves.prepare_saves(writer)
    return saves


def after_iterations(saves, iterations, position=lambda i: {}):
    """The checkpointer's saves after each of `iterations` (RunState of `position(i)`), each
    committed before the next."""
    for iteration in iterations:
        saves.maybe_save(RunState(iteration, **position(iteration)), exiting=False,
                         nonfinite=False)
        saves.finish(blocking=True)


@pytest.mark.parametrize("world,jump,factor,want", [
    (2, 1, 2, {0: [0, 1], 1: [1, 0]}),
    # two nodes of two ranks, jump = ranks per node: each replica on the other node
    (4, 2, 2, {0: [0, 2], 1: [1, 3], 2: [2, 0], 3: [3, 1]}),
    (6, 1, 3, {0: [0, 1, 2], 4: [4, 3, 5], 5: [5, 3, 4]}),
    (8, 2, 2, {5: [5, 7], 6: [6, 4]}),
])
def test_replica_groups_are_megatrons_cliques(world, jump, factor, want):
    for rank, group in want.items():
        assert lc.replica_group(rank, world, jump, factor) == group


def test_replica_group_needs_whole_cliques():
    with pytest.raises(ValueError, match=r"world size \(6\).*--replication-jump \(2\) x "
                                         r"--replication-factor \(2\)"):
        lc.replica_group(0, 6, 2, 2)


def scan_of(tracker, **held):
    return {"tracker": tracker, "held": {int(k[1:]): v for k, v in held.items()}}


def test_newest_complete_prefers_own_copies_and_takes_replicas_for_lost_ones():
    # rank 1's folder is gone; rank 0 holds its replica of iteration 6
    it, holders, why = lc.newest_complete([scan_of(6, i6=[0, 1]), scan_of(None)])
    assert (it, holders, why) == (6, {0: 0, 1: 0}, "")
    both = [scan_of(6, i6=[0, 1]), scan_of(6, i6=[1, 0])]
    assert lc.newest_complete(both)[:2] == (6, {0: 0, 1: 1})


def test_newest_complete_skips_uncommitted_and_incomplete_iterations():
    # iteration 8 was written by rank 0 only, no tracker names it: not a checkpoint
    scans = [scan_of(6, i6=[0], i8=[0]), scan_of(4, i4=[1], i6=[1])]
    assert lc.newest_complete(scans)[:2] == (6, {0: 0, 1: 1})
    # rank 1's state of 6 is nowhere: 4 is the newest complete one (rank 0 still has it)
    scans = [scan_of(6, i4=[0], i6=[0]), scan_of(6, i4=[1])]
    assert lc.newest_complete(scans)[:2] == (4, {0: 0, 1: 1})
    it, _, why = lc.newest_complete([scan_of(6, i6=[0]), scan_of(None)])
    assert it is None and "iteration 6 lacks the state of rank(s) [1]" in why
    assert lc.newest_complete([scan_of(None), scan_of(None)])[2] == \
        "no rank has committed a local checkpoint"
    # a rollback at iteration 5 takes nothing after it (another run's 6 in the folder)
    scans = [scan_of(6, i4=[0], i6=[0]), scan_of(6, i4=[1], i6=[1])]
    assert lc.newest_complete(scans, at_most=5)[:2] == (4, {0: 0, 1: 1})
    it, _, why = lc.newest_complete(scans, at_most=3)
    assert it is None and "no iteration up to 3 (the run's position)" in why


def test_scan_counts_only_files_whose_checksum_verifies(tmp_path):
    directory = names.checkpoint_dir(str(tmp_path), 4)
    for owner in (0, 1):
        commit.write_checked_file(lc.state_file(directory, owner), lambda f: f.write(b"x" * 64))
    names.write_tracker(str(tmp_path), 4)
    assert lc.scan(str(tmp_path)) == {"tracker": 4, "held": {4: [0, 1]}}
    with open(lc.state_file(directory, 1), "r+b") as f:  # one flipped byte
        f.write(b"y")
    assert lc.scan(str(tmp_path)) == {"tracker": 4, "held": {4: [0]}}
    assert lc.scan(str(tmp_path / "gone")) == {"tracker": None, "held": {}}


@pytest.mark.parametrize("flags,message", [
    (dict(non_persistent_save_interval=2), "needs --non-persistent-ckpt-type global .* or local"),
    (dict(non_persistent_ckpt_type="in_memory"), "in_memory is not implemented .*use "
                                                 "--non-persistent-ckpt-type local .*/dev/shm"),
    (dict(non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/l",
          non_persistent_global_ckpt_dir="/g"), "only used with --non-persistent-ckpt-type global"),
    (dict(non_persistent_save_interval=2, non_persistent_ckpt_type="global"),
     "global needs --non-persistent-global-ckpt-dir DIR or --save"),
    (dict(non_persistent_ckpt_type="local"), "needs --non-persistent-local-ckpt-dir"),
    (dict(replication=True, non_persistent_ckpt_type="local",
          non_persistent_local_ckpt_dir="/l"), "--replication needs --replication-jump"),
    (dict(replication=True, replication_jump=1), "--replication needs --non-persistent-ckpt-type"),
    (dict(replication=True, replication_jump=1, replication_factor=1,
          non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/l"),
     "--replication-factor must be at least 2"),
    (dict(non_persistent_save_interval=0), "--non-persistent-save-interval must be positive"),
])
def test_flag_rules_name_the_flag_and_the_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**flags)


def test_replication_settings_without_replication_are_refused_from_the_command_line():
    """Megatron-LM warns and ignores --replication-jump without --replication; a run its user
    thinks replicated would keep no replica, so we refuse it, naming the flags and the fix."""
    import arguments

    local = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "4",
             "--micro-batch-size", "1", "--non-persistent-save-interval", "2",
             "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/l"]

    def config(*extra):
        return arguments.build_run_config(arguments.parse_args(local + list(extra)), 4, 100, 128)

    for extra, given in ((["--replication-jump", "2"], "--replication-jump 2 given"),
                         (["--replication-factor", "3"], "--replication-factor 3 given"),
                         (["--replication-jump", "2", "--replication-factor", "2"],
                          "--replication-jump 2 and --replication-factor 2 given")):
        with pytest.raises(ValueError) as info:
            config(*extra)
        message = str(info.value)
        assert message.startswith(given) and "without --replication" in message, message
        assert "Add --replication" in message and "or drop --replication-" in message, message
    assert config().checkpoint.replication_factor is None
    assert config("--replication", "--replication-jump", "2").checkpoint.replication_factor == 2
    replicated = config("--replication", "--replication-jump", "1", "--replication-factor", "4")
    assert lc.group_of(replicated.checkpoint, 1, 4) == [1, 0, 2, 3]


class FakeEngine:
    """An engine whose whole state is one tensor dict (`local_state` / `load_local_state`)."""

    name = "FakeEngine"
    save_in_flight = None  # it makes no persistent saves

    def __init__(self, value):
        self.weights = {"w": torch.full((3,), float(value))}

    def local_state(self):
        return {"weights": {k: v.clone() for k, v in self.weights.items()}}

    def load_local_state(self, state, where):
        self.weights = state["weights"]

    def local_safe_globals(self):
        return []

    def local_parameters(self):
        return iter(self.weights.items())


def test_save_then_restore_one_rank_keeps_the_newest_and_its_rng(tmp_path, caplog):
    cfg = CheckpointConfig(non_persistent_save_interval=2, non_persistent_ckpt_type="local",
                           non_persistent_local_ckpt_dir=str(tmp_path / "local"))
    engine = FakeEngine(1.0)
    records = []
    writer = type("W", (), {"write": lambda self, *a: records.append(a)})()
    saves = checkpointer(cfg, engine, writer)
    with caplog.at_level(logging.INFO, logger="app.training.checkpointing"):
        for iteration in (1, 2, 3, 4):
            engine.weights["w"] += 1  # the "training step"
            torch.manual_seed(iteration)
            after_iterations(saves, [iteration],
                             lambda i: {"consumed_train_samples": 4 * i})
    expected_rng = torch.rand(4)  # drawn right after the save of iteration 4
    folder = tmp_path / "local" / "rank_0"
    assert sorted(os.listdir(folder)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("local: saved checkpoint at iteration 4" in line for line in lines), lines
    assert not records  # no save failed
    # the choice a resume and a rollback share, against a persistent tracker beside it: a
    # persistent checkpoint newer than the local one wins (Megatron: local when >=)
    ck = str(tmp_path / "ck")
    for iteration in (3, 4, 5, "release"):
        os.makedirs(names.checkpoint_dir(ck, iteration))
    for tracker, use_local, local in ((5, True, False), (4, True, True), ("release", True, True),
                                      (4, False, False)):
        names.write_tracker(ck, tracker)
        chosen = latest.newest_checkpoint(cfg, ck, use_local)
        assert (chosen.local is not None, chosen.iteration) == (local, 4 if local else tracker)
        assert chosen.describe() == (f"the local checkpoint of iteration 4 in {tmp_path / 'local'}"
                                     if local else
                                     f"the persistent checkpoint of iteration {tracker} in {ck}")
    assert latest.newest_checkpoint(cfg, str(tmp_path / "none"), True).iteration == 4
    assert latest.newest_checkpoint(cfg, str(tmp_path / "none"), False).iteration is None
    names.write_tracker(ck, 3)
    restored = FakeEngine(0)
    loaded = latest.load_newest(restored, latest.newest_checkpoint(cfg, ck, True), cfg, CPU)
    assert (loaded.iteration, loaded.consumed_train_samples) == (4, 16)
    assert restored.weights["w"].tolist() == [5.0, 5.0, 5.0]
    assert torch.rand(4).equal(expected_rng)


class FileEngine(commit.OneSaveAtATime):
    """An engine whose checkpoint is its client state in one file, committed by app.checkpoint
    .commit without rotation (as the engines with no --keep-last-n-checkpoints)."""

    def start_save(self, save_dir, iteration, client_state, asynchronous):
        path = os.path.join(names.checkpoint_dir(save_dir, iteration), "state.pt")
        return commit.start_save(
            save_dir, iteration, agree=lambda ok: ok, is_tracker_writer=True,
            write=lambda: commit.write_checked_file(path, lambda f: torch.save(client_state, f)),
            undo=lambda: None, background=asynchronous)


def test_global_saves_keep_the_newest_and_the_choice_takes_it_when_newest(tmp_path, caplog):
    """--non-persistent-ckpt-type global: saves of iterations 2, 4, 6 through the persistent
    saver into <--save>/non_persistent (Megatron's default) leave 4 and 6 (the older ones
    removed before each save), the tracker naming 6; none on a persistent save's iteration
    (5, into --save). The choice (newest_checkpoint) takes it against an older persistent
    checkpoint, not a newer one, not after a rollback's iteration, and a 'release' tracker
    there is refused."""
    ck = str(tmp_path / "ck")
    cfg = CheckpointConfig(save=ck, load=ck, save_interval=5, non_persistent_save_interval=2,
                           non_persistent_ckpt_type="global")
    glob_dir = os.path.join(ck, "non_persistent")
    with caplog.at_level(logging.INFO, logger="app.training.checkpointing"):
        after_iterations(checkpointer(cfg, FileEngine()), (2, 4, 5, 6))
    assert names.list_checkpoint_iterations(glob_dir) == [4, 6], os.listdir(glob_dir)
    assert names.read_tracker(glob_dir) == 6 and not os.path.exists(ck + "/iter_0000006")
    assert names.list_checkpoint_iterations(ck) == [5] and names.read_tracker(ck) == 5
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"saved checkpoint at iteration 6 to {glob_dir}" in line for line in lines), lines
    for persistent, at_most, want in ((None, None, 6), (5, None, 6), (6, None, 6), (8, None, 8),
                                      (5, 5, 5)):
        if persistent is not None:
            os.makedirs(names.checkpoint_dir(ck, persistent), exist_ok=True)
            names.write_tracker(ck, persistent)
        chosen = latest.newest_checkpoint(cfg, ck, True, at_most=at_most)
        assert chosen.iteration == want, (persistent, at_most)
        assert chosen.describe() == (
            f"the global non-persistent checkpoint of iteration 6 in {glob_dir}" if want == 6
            else f"the persistent checkpoint of iteration {want} in {ck}")
    assert latest.newest_checkpoint(cfg, ck, False).iteration == 5  # --finetune: not looked at
    os.makedirs(names.checkpoint_dir(glob_dir, "release"))
    names.write_tracker(glob_dir, "release")
    with pytest.raises(CheckpointError, match="a non-persistent checkpoint cannot be one"):
        latest.newest_checkpoint(cfg, ck, True)


def test_a_failed_local_save_is_undone_recorded_and_training_goes_on(tmp_path):
    """The second local save hits a full disk (the error torch.save gives): its files are
    removed, iteration 2 stays the newest, a save_failed record names the folder; the third
    commits; --max-failed-saves 1 would have stopped the run (SaveFailed)."""
    from app.training.checkpointing.saver import SaveFailed
    from app.utils import faults
    cfg = CheckpointConfig(non_persistent_save_interval=2, non_persistent_ckpt_type="local",
                           non_persistent_local_ckpt_dir=str(tmp_path / "local"))
    records = []
    writer = type("W", (), {"write": lambda self, *a: records.append(a)})()
    saves = checkpointer(cfg, FakeEngine(1.0), writer)
    folder = str(tmp_path / "local" / "rank_0")
    with faults.injected(faults.SAVE_STAGE, faults.disk_full(saves={2})):
        after_iterations(saves, (2, 4))
        assert names.read_tracker(folder) == 2
        assert names.list_checkpoint_iterations(folder) == [2]
        after_iterations(saves, [6])
    assert names.list_checkpoint_iterations(folder) == [6]
    [(kind, iteration, record)] = records
    assert (kind, iteration, record["directory"], record["latest"]) == \
        ("save_failed", 4, folder, 2)
    strict = checkpointer(dataclasses.replace(cfg, max_failed_saves=1), FakeEngine(1.0), writer)
    with faults.injected(faults.SAVE_STAGE, faults.disk_full()), pytest.raises(SaveFailed):
        after_iterations(strict, [8])


def test_a_local_checkpoint_of_another_world_size_is_refused_with_the_fix(tmp_path):
    """Rank 0's state saved by a 2-rank run (held as a replica-free folder of its own) does
    not resume a 1-rank run: the message names both sizes and how to go on."""
    cfg = CheckpointConfig(non_persistent_save_interval=2, non_persistent_ckpt_type="local",
                           non_persistent_local_ckpt_dir=str(tmp_path / "local"))
    saver = lc.LocalCheckpoints(cfg, FakeEngine(1.0), 0, 1, CPU)
    saver.world_size = 2  # as rank 0 of a two-rank run writes it
    saver.save_checkpoint(saver.folder, 2, {"iteration": 2}, asynchronous=False)
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks and this run has 1.*remove "):
        latest.load_newest(FakeEngine(0), latest.newest_checkpoint(cfg, None, True), cfg, CPU)


def test_an_error_exit_abandons_the_saves_in_flight(tmp_path):
    """The trainer's error exit (`Checkpointer.abandon`): the local save still in the
    background is given up, its iteration directory removed, the committed one kept and
    still named by the tracker; with nothing in flight it does nothing."""
    cfg = CheckpointConfig(non_persistent_save_interval=2, non_persistent_ckpt_type="local",
                           non_persistent_local_ckpt_dir=str(tmp_path / "local"))
    saves = checkpointer(cfg, FakeEngine(1.0))
    after_iterations(saves, [2])
    saves.maybe_save(RunState(4), exiting=False, nonfinite=False)  # written in the background
    saves.abandon()
    folder = str(tmp_path / "local" / "rank_0")
    assert names.read_tracker(folder) == 2
    assert names.list_checkpoint_iterations(folder) == [2], os.listdir(folder)
    saves.abandon()
    assert names.list_checkpoint_iterations(folder) == [2]
