"""app.training.resilience on its own, in this process: the writer lock of --save, writability,
the resume-or-refuse policy, temporary-file cleanup, the signal handler and the launcher watch,
the watchdog and peer-failure recognition."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from app.config import CheckpointConfig
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import names
from app.training.checkpointing import resume
from app.training.resilience.save_dir import (LOCK_FILENAME, SaveDirError, SaveDirLock, SaveDirLocked,
                                   claim_save_dir, ensure_writable_dir)
from app.training.resilience.signals import ExitSignalHandler, LauncherWatch, _Process, handler_enabled
from app.training.resilience.watchdog import EXIT_PEER_FAILURE, Watchdog, is_peer_failure
from app.utils.fileio import remove_temporaries


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_lock(directory, **fields):
    record = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": 0.0,
              "heartbeat": time.time(), "command": "python pretrain_gpt2.py --fake", **fields}
    with open(os.path.join(directory, LOCK_FILENAME), "w") as f:
        json.dump(record, f)


# ---------------------------------------------------------------------------- the writer lock

def test_lock_names_a_live_holder_and_is_released_only_by_it(tmp_path):
    first = claim_save_dir(str(tmp_path / "ck"))
    try:
        with pytest.raises(SaveDirLocked) as err:
            SaveDirLock(str(tmp_path / "ck")).acquire()
        message = str(err.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "--save" in message and LOCK_FILENAME in message
    finally:
        first.release()
    assert not (tmp_path / "ck" / LOCK_FILENAME).exists()
    with SaveDirLock(str(tmp_path / "ck")):  # free again
        assert (tmp_path / "ck" / LOCK_FILENAME).exists()


@pytest.mark.parametrize("case", ["dead pid", "reused pid", "other host, old heartbeat",
                                  "other host, silent heartbeat"])
def test_stale_locks_are_taken_over(tmp_path, case):
    fields = {"dead pid": dict(pid=_dead_pid()),
              "reused pid": dict(process_start=1.0),  # our pid, but another start time
              "other host, old heartbeat": dict(host="elsewhere", heartbeat=time.time() - 3600),
              "other host, silent heartbeat": dict(host="elsewhere")}[case]
    _write_lock(str(tmp_path), **fields)
    lock = SaveDirLock(str(tmp_path), stale_after_s=0.5, heartbeat_s=0.1)
    lock.acquire()
    try:
        with open(tmp_path / LOCK_FILENAME) as f:
            assert json.load(f)["pid"] == os.getpid()
    finally:
        lock.release()


def test_other_host_with_an_advancing_heartbeat_holds_the_lock(tmp_path):
    _write_lock(str(tmp_path), host="elsewhere")
    beats = iter(range(1, 100))

    def sleep(_):  # the holder refreshes its heartbeat while we watch
        _write_lock(str(tmp_path), host="elsewhere", heartbeat=time.time() + next(beats))

    with pytest.raises(SaveDirLocked, match="host elsewhere"):
        SaveDirLock(str(tmp_path), stale_after_s=30.0, sleep=sleep).acquire()


def test_heartbeat_refreshes_the_lock(tmp_path):
    lock = SaveDirLock(str(tmp_path), heartbeat_s=0.05)
    lock.acquire()
    try:
        with open(tmp_path / LOCK_FILENAME) as f:
            first = json.load(f)["heartbeat"]
        time.sleep(0.3)
        with open(tmp_path / LOCK_FILENAME) as f:
            assert json.load(f)["heartbeat"] > first
    finally:
        lock.release()


def test_unwritable_save_is_found_at_start(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(SaveDirError, match="existing file"):
        ensure_writable_dir(str(afile))
    with pytest.raises(SaveDirError, match="cannot be created"):
        ensure_writable_dir(str(afile / "sub"))
    ensure_writable_dir(str(tmp_path / "new" / "dir"))
    assert os.listdir(tmp_path / "new" / "dir") == []  # the probe is gone


def test_temporaries_of_dead_writers_are_removed(tmp_path):
    (tmp_path / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    dead = tmp_path / "iter_0000002" / "mp_rank_00" / f"model_optim_rng.pt.tmp.{_dead_pid()}"
    live = tmp_path / f"corpus.bin.tmp.{os.getpid()}"
    keep = tmp_path / "model_optim_rng.pt"
    for path in (dead, live, keep):
        path.write_bytes(b"x" * 10)
    assert remove_temporaries(str(tmp_path)) == [str(dead)]
    assert live.exists() and keep.exists()
    assert remove_temporaries(str(tmp_path), only_dead=False) == [str(live)]  # owner: all
    _write_lock(str(tmp_path), pid=_dead_pid())
    (tmp_path / f"x.tmp.{os.getpid()}").write_bytes(b"x")
    lock = claim_save_dir(str(tmp_path))  # a new run on --save cleans what a killed save left
    lock.release()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "model_optim_rng.pt"]


# ---------------------------------------------------------------------------- resume policy

def _ckpt_dir(root, iterations=(), tracker=None, latest=None):
    os.makedirs(root, exist_ok=True)
    for it in iterations:
        os.makedirs(ckpt.checkpoint_dir(root, it), exist_ok=True)
    if tracker is not None:
        names.write_tracker(root, tracker)
    if latest is not None:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(latest)
    return root


def test_start_policy_never_trains_over_checkpoints_by_accident(tmp_path):
    d = lambda name: str(tmp_path / name)  # noqa: E731
    full = _ckpt_dir(d("full"), (2, 4), tracker=4)
    lost = _ckpt_dir(d("lost"), (2, 4))
    ds_lost = _ckpt_dir(d("dslost"), (6,), latest="iter_0000006")
    empty = _ckpt_dir(d("empty"))
    decide = lambda **kw: resume.decide_start(CheckpointConfig(**kw))  # noqa: E731

    assert decide(save=full, load=full).load == full                      # resume
    assert decide(load=full).load == full                                 # load only
    assert decide(save=d("new"), load=full).load == full                  # into a fresh dir
    start = decide(save=d("missing"), load=d("missing"))                  # resume-or-start
    assert start.load is None and "does not exist yet" in start.note
    assert decide(save=empty, load=empty).load is None
    assert decide(save=d("fresh")).load is None
    refusals = [
        (dict(load=d("typo"), save=full), "does not exist"),
        (dict(load=empty, save=d("x")), "holds no checkpoint"),
        (dict(save=full), "pass --load"),
        (dict(save=full, load=lost), "no latest_checkpointed_iteration.txt"),
        (dict(save=lost, load=lost), "echo 4 >"),
        (dict(save=ds_lost, load=ds_lost), "DeepSpeed 'latest' naming 'iter_0000006'"),
        (dict(save=full, load=_ckpt_dir(d("other"), (8,), tracker=8)), "loads from --load"),
        (dict(save=full, load=full, finetune=True), "starts at iteration 0"),
    ]
    for kwargs, pattern in refusals:
        with pytest.raises(ckpt.CheckpointError, match=pattern):
            decide(**kwargs)
    # the explicit flag allows what was refused for its checkpoints
    assert decide(save=full, overwrite_checkpoints=True).load is None
    assert decide(save=lost, load=lost, overwrite_checkpoints=True).load is None


# ---------------------------------------------------------------------------- signals

def test_signals_only_set_a_flag_and_a_second_one_during_the_save_is_ignored(capfd):
    assert handler_enabled(None, "/ck") and not handler_enabled(None, None)
    assert handler_enabled(True, None) and not handler_enabled(False, "/ck")
    previous = signal.getsignal(signal.SIGTERM)
    handler = ExitSignalHandler().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.pending() == signal.SIGUSR1
        handler.saving = True
        os.kill(os.getpid(), signal.SIGTERM)  # still alive: the handler only records it
        assert handler.received == [signal.SIGUSR1, signal.SIGTERM]
    finally:
        handler.restore()
    err = capfd.readouterr().err
    assert "received SIGUSR1: finishing this iteration" in err
    assert "received SIGTERM again while the checkpoint is being written: ignored" in err
    # after a signal the handler stays, so a late repeat cannot kill the exiting process
    assert signal.getsignal(signal.SIGTERM) == handler._on_signal
    signal.signal(signal.SIGTERM, previous)
    quiet = ExitSignalHandler().install()
    quiet.restore()  # nothing received: the previous handlers come back
    assert signal.getsignal(signal.SIGTERM) == previous


def test_launcher_watch_stops_the_rank_when_its_launcher_dies():
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    import psutil
    started = psutil.Process(launcher.pid).create_time()
    handler = ExitSignalHandler().install()
    watch = LauncherWatch(0.05, [_Process(launcher.pid, started, "deepspeed.launcher.launch")])
    try:
        watch.start()
        time.sleep(0.3)
        assert handler.pending() == 0  # alive launcher: nothing happens
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while not handler.pending() and time.time() < deadline:
            time.sleep(0.05)
        assert handler.pending() == signal.SIGTERM
    finally:
        watch.stop()
        handler._previous = {s: signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler
                             for s in handler.signals}
        handler.received.clear()
        handler.restore()


# ---------------------------------------------------------------------------- hangs

def test_watchdog_names_rank_phase_and_iteration_then_exits(capfd):
    exits = []
    wd = Watchdog(1.0, rank=3, world_size=4, exit_fn=exits.append).start()
    try:
        wd.beat("optimizer", 17)
        deadline = time.time() + 20
        while not exits and time.time() < deadline:
            time.sleep(0.1)
    finally:
        wd.stop()
    assert exits == [EXIT_PEER_FAILURE]
    err = capfd.readouterr().err
    assert "rank 3" in err and "'optimizer' of iteration 17" in err and "Stacks" in err
    quiet = []
    wd = Watchdog(0.5, exit_fn=quiet.append).start()  # idle: never fires
    time.sleep(1.2)
    wd.stop()
    assert quiet == []


def test_peer_failures_are_told_from_other_errors():
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error "
                                        "[127.0.0.1]:21176: Connection reset by peer"))
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed "
                                        "out waiting 5000ms for recv operation to complete"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("gloo"))


# ---------------------------------------------------------------------------- ports

# ---------------------------------------------------------------------------- ETA, progress

