"""Checkpoint faults on both paths: a full disk during a save, flipped bytes, a crafted pickle
that would run a command, non-finite weights. Each must end with a clear error (exit 2; exit 5
when the run's last save failed), nothing executed, no temporary file left and the previous
checkpoint still the latest; a disk full for one interval only costs that checkpoint."""
import contextlib
import errno
import io
import os
import shutil

import torch

from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import commit, names
from app.checkpoint import files as ckpt_files
from app.utils import faults
from tests.harness.distributed import run_distributed
from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.launch import main_in_process, temporaries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["--log-interval", "1", "--eval-iters", "0", "--peak-flops", "1e11"]


class RunsACommand:
    """Unpickling this runs `touch <marker>` (what an attacker would make run anything)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _full_disk(monkeypatch, when):
    """Checkpoint files whose path contains `when` put 1 KiB on disk, then fail with ENOSPC."""
    real = commit.atomic_open

    @contextlib.contextmanager
    def full(path, *args, **kwargs):
        with real(path, *args, **kwargs) as f:
            if when in path:
                f.write(b"\0" * 1024)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            yield f
    monkeypatch.setattr(commit, "atomic_open", full)


def _rewrite(path, change):
    """Load a checkpoint file, change it, and write it back with a valid checksum sidecar (so
    only the content, not the checksum, can stop it)."""
    with torch.serialization.safe_globals(ckpt_files.allowed_globals()):
        state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    hidden = os.path.exists(ckpt_files.sidecar_path(path, hidden=True))
    commit.write_checked_file(path, lambda f: torch.save(state, f), hidden_sidecar=hidden)


def _first_weight(module_state):
    return next(k for k, v in module_state.items() if torch.is_tensor(v) and v.is_floating_point())


def test_native_full_disk_and_non_finite_weights(tiny_corpus, tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "4", *QUIET, "--save", ck,
                         "--load", ck, "--save-interval", "2")
    _full_disk(monkeypatch, "iter_0000004")
    code, err = main_in_process(args)
    assert code == 5, err  # the run's last save failed: never exit 0 as if all were saved
    assert "the run's last checkpoint could not be saved" in err
    assert "could not save the checkpoint of iteration 4" in err and "ENOSPC" in err
    assert "latest checkpoint is still iteration 2" in err and "Traceback" not in err
    assert not os.path.exists(os.path.join(ck, "iter_0000004")) and not temporaries(ck)
    assert ckpt.read_tracker(ck) == 2 and not os.path.exists(os.path.join(ck, "writer.lock"))
    monkeypatch.undo()

    path = ckpt.checkpoint_path(ck, 2)
    _rewrite(path, lambda s: s["model"]["language_model"]["embedding"]["word_embeddings"]
             ["weight"].view(-1)[7].fill_(float("nan")))
    code, err = main_in_process(args)
    assert code == 2 and "non-finite weights (1 NaN/Inf values in " in err, err
    assert "word_embeddings.weight" in err and path.rsplit("/", 2)[0] in err


def _deepspeed_faults(corpus, tmp):
    """Runs in a child process (DeepSpeed sets process-wide state); returns what happened."""
    import pytest as _pytest
    from tools import convert_checkpoint
    os.environ.setdefault("LOCAL_RANK", "0")
    ck, out = os.path.join(tmp, "ck"), {}
    args = tiny_gpt_args(corpus, _Path(tmp), "--train-iters", "4", *QUIET, "--deepspeed",
                         "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"),
                         "--save", ck, "--load", ck, "--save-interval", "2",
                         "--lr-decay-iters", "4")
    with _pytest.MonkeyPatch.context() as mp:
        _full_disk(mp, "iter_0000004")
        out["enospc"] = main_in_process(args) + (ckpt.read_tracker(ck), sorted(os.listdir(ck)),
                                       temporaries(ck))
    out["finish"] = main_in_process(args)[0], ckpt.read_tracker(ck), sorted(
        os.listdir(os.path.join(ck, "iter_0000004")))
    # full for one interval, the save written in the background: that save is undone, the run
    # goes on and finishes with exit 0
    once = os.path.join(tmp, "once")
    with faults.injected(faults.SAVE_STAGE, faults.disk_full(saves={2})):
        code, err = main_in_process([a if a != ck else once for a in args]
                          + ["--save-interval", "1", "--async-save", "--metrics-file",
                             os.path.join(tmp, "once.jsonl")])
    out["once"] = (code, err, ckpt.read_tracker(once), names.list_checkpoint_iterations(once),
                   temporaries(once), [r for r in read_metrics(os.path.join(tmp, "once.jsonl"))
                                        if r["kind"] == "save_failed"])
    more = list(args)
    more[more.index("--train-iters") + 1] = "6"  # more iterations than were saved

    def variant(name, change):
        copy = os.path.join(tmp, name)
        shutil.copytree(ck, copy)
        change(os.path.join(copy, "iter_0000004", "mp_rank_00_model_states.pt"))
        return main_in_process([a if a != ck else copy for a in more])

    def flip(path):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 300)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))

    marker = os.path.join(tmp, "marker")
    evil = lambda p: _rewrite(p, lambda s: s.update(evil=RunsACommand(marker)))  # noqa: E731
    out["flipped"] = variant("flipped", flip)
    out["evil"] = variant("evil", evil) + (os.path.exists(marker),)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = convert_checkpoint.main(["--input-format", "deepspeed", "--load",
                                        os.path.join(tmp, "evil"), "--save",
                                        os.path.join(tmp, "converted")])
    out["converter"] = (code, err.getvalue())
    out["converter_marker"] = os.path.exists(marker)
    out["nan"] = variant("nan", lambda p: _rewrite(
        p, lambda s: s["module"][_first_weight(s["module"])].view(-1)[3].fill_(float("inf"))))
    return out


class _Path(str):
    def __truediv__(self, other):
        return os.path.join(self, other)


def test_deepspeed_full_disk_corruption_unsafe_pickle_and_non_finite(tiny_corpus, tmp_path):
    got = run_distributed(_deepspeed_faults, 1, tiny_corpus, str(tmp_path), timeout=600)[0]
    code, err, tracker, listing, temporaries = got["enospc"]
    assert code == 5 and "could not save the checkpoint of iteration 4" in err, err
    assert "ENOSPC" in err and "latest checkpoint is still iteration 2" in err
    assert tracker == 2 and "iter_0000004" not in listing and not temporaries
    assert open(os.path.join(tmp_path, "ck", "latest")).read() == "iter_0000004"  # 2nd run
    code, tracker, files = got["finish"]
    assert code == 0 and tracker == 4
    code, err, tracker, saved, temporaries, failed = got["once"]
    assert code == 0 and tracker == 4 and saved == [1, 3, 4] and not temporaries, err
    assert [(r["iteration"], r["latest"]) for r in failed] == [(2, 1)]
    assert "(ENOSPC)" in failed[0]["error"]
    # DeepSpeed's files have sidecars, hidden so that DeepSpeed's tools do not take them for its own
    assert ".mp_rank_00_model_states.pt.sha256" in files
    assert all(f".{f}.sha256" in files for f in files if f.endswith(".pt"))
    code, err = got["flipped"]
    assert code == 2 and "is corrupt: its SHA-256" in err and "mp_rank_00_model_states" in err
    code, err, ran = got["evil"]
    assert code == 2 and not ran, err
    assert "outside the allow-list (posix.system)" in err and "mp_rank_00_model_states" in err
    code, err = got["converter"]
    assert code == 2 and "refused" in err and "posix.system" in err and not got["converter_marker"]
    code, err = got["nan"]
    assert code == 2 and "non-finite weights" in err, err


def test_signals_during_a_save_leave_complete_checkpoints(tiny_corpus, tmp_path, capfd):
    """SIGTERM twice while the checkpoint of iteration 3 is being written: that save completes,
    the run stops after the next iteration with a checkpoint of it, exit 0, and both load."""
    import signal
    ck = str(tmp_path / "ck")
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "10", *QUIET, "--save", ck,
                         "--load", ck, "--save-interval", "3")
    sent = []

    def hook(stage):
        if stage == "rank_tmp_written" and not sent:
            sent.append(stage)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    faults.arm(faults.SAVE_STAGE, hook)
    try:
        code, err = main_in_process(args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert code == 0 and sent, err
    assert "received SIGTERM again while the checkpoint is being written" in capfd.readouterr().err
    assert ckpt.read_tracker(ck) == 4 and names.list_checkpoint_iterations(ck) == [3, 4]
    for it in (3, 4):
        state, _ = ckpt.load_checkpoint_dict(ck, iteration=it)  # checksum verified, complete
        assert state["iteration"] == it


def test_a_signal_during_a_background_save_exits_with_every_save_committed(tiny_corpus, tmp_path,
                                                                            capfd):
    """--async-save: SIGTERM twice while the writer thread writes the checkpoint of iteration
    3: training finishes the iteration it is in (4, or a later one when the writer thread got
    there late, as on a loaded machine), saves it, and only exits 0 once that save and the one
    of iteration 3 are committed; both load, the tracker names the last."""
    import re
    import signal
    import threading
    ck = str(tmp_path / "ck")
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "10", *QUIET, "--save", ck,
                         "--load", ck, "--save-interval", "3", "--async-save")
    sent = []

    def hook(stage):
        if stage == "rank_tmp_written" and not sent:
            sent.append(threading.current_thread().name)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    faults.arm(faults.SAVE_STAGE, hook)
    try:
        code, err = main_in_process(args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert code == 0 and sent and sent[0] != "MainThread", (sent, err)
    out = capfd.readouterr()
    found = re.search(r"saved the checkpoint of iteration (\d+)", out.out + out.err)
    assert found, out.out + out.err
    last = int(found.group(1))
    assert 4 <= last < 10, last  # the signal stopped the run before its end
    assert ckpt.read_tracker(ck) == last
    assert names.list_checkpoint_iterations(ck) == sorted({3, *range(6, last + 1, 3), last})
    for it in names.list_checkpoint_iterations(ck):
        state, _ = ckpt.load_checkpoint_dict(ck, iteration=it)  # checksum verified, complete
        assert state["iteration"] == it
