"""Start-up waits say what they wait for; restarts get their own keys and log line; the NCCL
diagnostics environment fills in only what the user left unset."""
import os
import subprocess
import sys
import time

import pytest

from app.launch import distributed, waits


# ---------------------------------------------------------------------------- WaitReport

def test_a_slow_step_is_reported_with_what_since_when_and_details():
    said = []
    with waits.WaitReport("the thing", lambda: "because of X; fix: Y", after_s=0.05,
                          log=said.append) as report:
        time.sleep(0.4)
    assert report.reports == len(said) >= 2  # repeated, at doubling intervals (0.05, 0.1, 0.2)
    assert len(said) <= 3
    assert said[0].startswith("start-up has waited 0 s (since ")
    assert said[0].endswith(") for the thing: because of X; fix: Y")
    assert time.strftime("%H:%M", time.localtime(report.since)) in said[0]


def test_a_quick_step_is_not_reported_and_the_thread_ends():
    said = []
    with waits.WaitReport("the thing", after_s=0.5, log=said.append) as report:
        pass
    time.sleep(0.6)
    assert said == [] and report._thread is None


def test_a_failing_details_callback_is_reported_not_raised():
    def broken():
        raise OSError("no /proc")
    said = []
    with waits.WaitReport("the thing", broken, after_s=0.05, log=said.append):
        time.sleep(0.12)
    assert said and "could not inspect it: OSError: no /proc" in said[0]


def test_report_interval_from_the_environment():
    assert waits.report_after_s({}) == waits.DEFAULT_REPORT_AFTER_S
    assert waits.report_after_s({waits.REPORT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match=waits.REPORT_ENV):
            waits.report_after_s({waits.REPORT_ENV: bad})


# ---------------------------------------------------------------------------- build locks

def test_extension_build_root_is_torchs(monkeypatch, tmp_path):
    from torch.utils import cpp_extension
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension.os, "makedirs", lambda *a, **k: None)  # create nothing
    torchs = os.path.dirname(cpp_extension._get_build_directory("probe", False))
    assert waits.extension_build_root({}) == torchs
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert os.path.dirname(cpp_extension._get_build_directory("probe", False)) == str(tmp_path)
    assert waits.extension_build_root({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == str(tmp_path)


def _plant(root, op, age_s=0.0):
    path = root / op / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))
    return str(path)


def _holding(code, **kw):
    """A child process running `code`, started and given a moment to get there."""
    child = subprocess.Popen([sys.executable, "-c", code], **kw)
    time.sleep(0.5)
    return child


def test_a_lock_no_process_holds_is_stale_and_the_message_says_rm(tmp_path):
    path = _plant(tmp_path, "deepspeed_shm_comm", age_s=600)
    (lock,) = waits.build_locks(str(tmp_path))
    assert lock.path == path and lock.stale and 590 < lock.age_s < 700
    text = lock.describe()
    assert f"build lock {path} (created 10 min ago)" in text
    assert "held by no process on this host" in text and text.endswith(f"rm {path}")


def test_a_lock_held_open_by_its_builder_is_not_stale(tmp_path):
    path = _plant(tmp_path, "fused_adam")
    child = _holding(f"import time; f = open({path!r}); time.sleep(60)")
    try:
        (lock,) = waits.build_locks(str(tmp_path))
    finally:
        child.kill()
        child.wait()
    assert not lock.stale
    assert any(h.startswith(f"pid {child.pid} (python") for h in lock.holders), lock.holders
    assert "a build of this op is running" in lock.describe()


def test_a_compiler_working_in_the_build_directory_holds_the_lock(tmp_path):
    path = _plant(tmp_path, "cpu_adam")
    child = _holding("import time; time.sleep(60)", cwd=os.path.dirname(path))
    try:
        (lock,) = waits.build_locks(str(tmp_path))
    finally:
        child.kill()
        child.wait()
    assert any(h.startswith(f"pid {child.pid} ") for h in lock.holders), lock.holders


def test_no_lock_is_said_plainly_and_stale_ones_are_warned(tmp_path, caplog):
    assert waits.describe_build_locks(str(tmp_path)) == (
        f"no torch extension build lock is held under {tmp_path}")
    path = _plant(tmp_path, "deepspeed_shm_comm")
    with caplog.at_level("WARNING", logger="app.launch.waits"):
        stale = waits.warn_stale_build_locks(str(tmp_path))
    assert [lock.path for lock in stale] == [path]
    assert f"rm {path}" in caplog.text


# ---------------------------------------------------------------------------- restarts

TORCHRUN_ENV = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_each_torchrun_attempt_has_its_own_prefix_in_the_agents_store():
    assert distributed.attempt_prefix(TORCHRUN_ENV) == "torchrun_restart_1/"
    first = dict(TORCHRUN_ENV, TORCHELASTIC_RESTART_COUNT="0")
    assert distributed.attempt_prefix(first) == "torchrun_restart_0/"
    # a store that rank 0 hosts anew for every start needs none; nor do other launchers
    own_store = dict(TORCHRUN_ENV, TORCHELASTIC_USE_AGENT_STORE="False")
    assert distributed.attempt_prefix(own_store) == ""
    assert distributed.attempt_prefix({}) == ""


def test_restart_note():
    assert distributed.restart_note(8, TORCHRUN_ENV) == (
        "restart 1 of torchrun's --max-restarts 2: resuming from iteration 8")
    assert distributed.restart_note(None, TORCHRUN_ENV).startswith(
        "restart 1 of torchrun's --max-restarts 2: no checkpoint to resume from")
    assert distributed.restart_note(8, dict(TORCHRUN_ENV, TORCHELASTIC_RESTART_COUNT="0")) is None
    assert distributed.restart_note(8, {}) is None


# ---------------------------------------------------------------------------- NCCL

def test_nccl_diagnostics_are_set_only_for_nccl_and_where_unset(tmp_path):
    trace = str(tmp_path / "ck-nccl-traces")
    full = distributed.nccl_diagnostics_environment({}, "nccl", trace)
    assert full == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(trace, "rank_")}
    assert distributed.nccl_diagnostics_environment({}, "gloo", trace) == {}
    # no --save: PyTorch's own dump path is kept
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in distributed.nccl_diagnostics_environment(
        {}, "nccl", None)
    # the user's settings win, under either of PyTorch's names
    user = {"TORCH_FR_BUFFER_SIZE": "500", "NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}
    assert distributed.nccl_diagnostics_environment(user, "nccl", trace) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    # a recorder switched off is not asked to dump
    off = distributed.nccl_diagnostics_environment({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
                                                   "nccl", trace)
    assert off == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_nccl_trace_dir_is_beside_save():
    assert distributed.nccl_trace_dir("/runs/ck/") == "/runs/ck-nccl-traces"
    assert distributed.nccl_trace_dir(None) is None
