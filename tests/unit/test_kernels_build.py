"""The kernel build cache never hangs and always says why: real builds of tiny host-only libraries
through the same child process, lock and markers that build csrc/ on a GPU machine.

- a build is cached (READY) and reused by the builder and by other local ranks;
- a failed build reports its first compiler error, records FAILED, and other local ranks see it;
- a stale lock (dead owner, or no heartbeat by the file system's clock, whatever the local
  clock says) is broken; a live one is waited on, up to a timeout, and when local rank 0 gives
  up its local peers stop waiting at once;
- a lock is removed only by its owner; a live owner whose lock was wrongly broken finishes its
  build undisturbed (each build compiles in a directory of its own);
- a half-written build directory (torch's own lock file included) is never reused;
- a build over the timeout is killed and reported;
- `app.kernels.library`: a failed build falls back with one warning naming
  --require-fused-kernels, and is an error with it.
"""
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from app.kernels import build, library
from app.utils.fileio import is_temporary

GOOD = 'extern "C" int app_kernels_probe() { return 7; }\n'
BROKEN = "int broken( { return 1; }\n"


def _spec(tmp_path, name, text):
    src = tmp_path / f"{name}.cpp"
    src.write_text(text)
    return build.BuildSpec(name, (str(src),))


def _entry(root, spec):
    return root / spec.cache_dir_name(torch.__version__, torch.version.cuda)


def test_build_once_then_reuse_and_share_with_other_local_ranks(tmp_path):
    spec, root = _spec(tmp_path, "probe", GOOD), tmp_path / "cache"
    library = build.ensure_built(spec, root, local_rank=0, timeout_s=300)
    assert library.endswith("probe.so") and os.path.isfile(library)
    entry = _entry(root, spec)
    ready = json.loads((entry / "READY").read_text())
    assert ready["library"] == library and not (entry / ".lock").exists()
    stamp = os.stat(library).st_mtime_ns
    assert build.ensure_built(spec, root, local_rank=0, timeout_s=300) == library
    assert build.ensure_built(spec, root, local_rank=3, timeout_s=5) == library
    assert os.stat(library).st_mtime_ns == stamp  # not rebuilt
    # a truncated library is not trusted: it is rebuilt
    with open(library, "r+b") as f:
        f.truncate(10)
    assert build.read_ready(entry) is None
    assert os.path.getsize(build.ensure_built(spec, root, local_rank=0, timeout_s=300)) > 10
    # the key covers the sources' text, the torch and CUDA versions and the arch
    (tmp_path / "probe.cpp").write_text(GOOD.replace("7", "8"))
    assert _entry(root, spec) != entry
    names = {spec.cache_dir_name("2.13", "12.8"), spec.cache_dir_name("2.12", "12.8"),
             spec.cache_dir_name("2.13", "13.0"),
             build.BuildSpec("probe", spec.sources, cuda_arch="9.0").cache_dir_name("2.13", "12.8")}
    assert len(names) == 4


def test_failed_build_reports_first_error_and_other_ranks_see_it(tmp_path):
    spec, root = _spec(tmp_path, "broken", BROKEN), tmp_path / "cache"
    with pytest.raises(build.BuildError) as err:
        build.ensure_built(spec, root, local_rank=0, timeout_s=300)
    line = str(err.value)
    assert "broken.cpp:1" in line and "error" in line and "build.log" in line
    entry = _entry(root, spec)
    assert "error" in json.loads((entry / "FAILED").read_text())["error"]
    assert not (entry / ".lock").exists()
    with pytest.raises(build.BuildError, match="local rank 0 gave up: .*broken.cpp:1"):
        build.ensure_built(spec, root, local_rank=1, timeout_s=5, poll_s=0.1)


def test_first_error_line_skips_ninja_noise():
    log = ("[1/2] c++ -c a.cpp\nFAILED: a.o\nc++ -c a.cpp\n"
           "a.cpp:3:5: error: 'x' was not declared in this scope\n"
           "ninja: build stopped: subcommand failed.\nTraceback (most recent call last):\n"
           "RuntimeError: Error building extension 'app_kernels'\n")
    assert build.first_error_line(log) == "a.cpp:3:5: error: 'x' was not declared in this scope"
    nvcc = "softmax.cu(12): error: identifier \"v\" is undefined\n1 error detected"
    assert build.first_error_line(nvcc).startswith("softmax.cu(12): error")
    assert build.first_error_line("") == "no output"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_locks_are_broken_and_half_written_builds_wiped(tmp_path):
    spec, root = _spec(tmp_path, "probe", GOOD), tmp_path / "cache"
    entry = _entry(root, spec)
    (entry / "build").mkdir(parents=True)
    (entry / "build" / "lock").write_text("")  # torch's FileBaton from a killed build
    (entry / "build" / "probe.o").write_text("half-written")
    lock = entry / ".lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    assert build.lock_is_stale(lock, stale_s=3600)  # dead owner on this host
    library = build.ensure_built(spec, root, local_rank=0, timeout_s=300, poll_s=0.1)
    assert os.path.isfile(library) and not lock.exists()
    assert not (entry / "build" / "lock").exists()
    # another host's lock: stale only once its heartbeat is older than stale_s
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    assert not build.lock_is_stale(lock, stale_s=60)
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert build.lock_is_stale(lock, stale_s=60)


def test_live_lock_is_waited_on_until_the_timeout(tmp_path):
    spec, root = _spec(tmp_path, "probe", GOOD), tmp_path / "cache"
    entry = _entry(root, spec)
    entry.mkdir(parents=True)
    (entry / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))  # fresh mtime
    start = time.time()
    with pytest.raises(build.BuildError, match="timed out after 1 s waiting for the build lock"):
        build.ensure_built(spec, root, local_rank=0, timeout_s=1.0, stale_s=600, poll_s=0.1)
    assert time.time() - start < 10
    # local rank 0 gave up: its local peers stop waiting at once, with its reason
    with pytest.raises(build.BuildError, match="local rank 0 gave up: timed out after 1 s "
                                               "waiting for the build lock"):
        build.ensure_built(spec, root, local_rank=1, timeout_s=5, stale_s=0, poll_s=0.1)
    build.host_failure_marker(entry).unlink()  # no word from local rank 0: peers time out
    with pytest.raises(build.BuildError, match="waiting for local rank 0"):
        build.ensure_built(spec, root, local_rank=1, timeout_s=0.5, stale_s=0.5, poll_s=0.1)


def test_a_long_wait_says_what_it_waits_for(tmp_path, caplog):
    """Local rank 0 waiting for another node's lock, and a local peer waiting for local rank 0,
    each log once, after notice_s, which lock, who holds it since when, and how to clear it."""
    spec, root = _spec(tmp_path, "probe", GOOD), tmp_path / "cache"
    entry = _entry(root, spec)
    entry.mkdir(parents=True)
    lock = entry / ".lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": time.time() - 90}))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(build.BuildError, match="timed out after 1 s waiting for the build "
                                                   "lock held by host elsewhere, pid 4242"):
            build.ensure_built(spec, root, local_rank=0, timeout_s=1.0, stale_s=600,
                               poll_s=0.05, notice_s=0.2)
        build.host_failure_marker(entry).unlink()
        with pytest.raises(build.BuildError, match="waiting for local rank 0"):
            build.ensure_built(spec, root, local_rank=1, timeout_s=0.5, stale_s=0.5,
                               poll_s=0.05, notice_s=0.2)
    notes = [r.getMessage() for r in caplog.records if "wait" in r.getMessage()]
    assert len(notes) == 2, notes
    for note in notes:
        assert str(lock) in note and "host elsewhere, pid 4242 (since " in note, note
        assert f"delete {lock}" in note, note
    assert notes[0].startswith("waiting for the kernel build lock")
    assert notes[1].startswith("local rank 1 has waited")


def test_lock_staleness_uses_the_file_systems_clock(tmp_path, monkeypatch):
    """Another node's lock is judged by its heartbeat's age on the file system's clock, so a
    local clock an hour off (NFS clients with skewed clocks) neither breaks a live lock nor
    keeps a dead one."""
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "t"}))  # beat: now
    dead = tmp_path / "dead.lock"
    dead.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "u"}))
    old = time.time() - 120
    os.utime(dead, (old, old))  # last beat 2 minutes ago
    real = time.time
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(build.time, "time", lambda skew=skew: real() + skew)
        assert not build.lock_is_stale(lock, stale_s=60), skew
        assert build.lock_is_stale(dead, stale_s=60), skew


def test_lock_is_removed_only_by_its_owner(tmp_path):
    lock = tmp_path / ".lock"
    with build._held_lock(lock, heartbeat_s=3600) as token:
        assert token and json.loads(lock.read_text())["token"] == token
        with build._held_lock(lock, heartbeat_s=3600) as other:
            assert other is None  # held
        # a peer judged it stale, broke it and took it: ours ends without touching theirs
        lock.unlink()
        lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs"}))
    assert json.loads(lock.read_text())["token"] == "theirs"
    # a breaker that judged an older owner stale leaves a lock that changed hands in place
    build._break_lock(lock, {"host": "elsewhere", "pid": 1, "token": "before"})
    assert json.loads(lock.read_text())["token"] == "theirs"
    build._break_lock(lock, {"host": "elsewhere", "pid": 1, "token": "theirs"})
    assert not lock.exists()
    with build._held_lock(lock, heartbeat_s=3600) as token:
        assert token
    assert not lock.exists()


# Stands in for the compiler: leaves an object file in its build directory, waits for "go",
# and fails if that file is gone (another builder wiped the directory it compiles in).
FAKE_COMPILER = """
import os, sys, time
build_dir, sync = sys.argv[1], sys.argv[2]
mine = os.path.join(build_dir, "part-%d.o" % os.getpid())
open(mine, "w").close()
open(os.path.join(sync, "started-%d" % os.getpid()), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(sync, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
if not os.path.exists(mine):
    sys.exit("error: another builder wiped this build directory")
library = os.path.join(build_dir, "probe.so")
with open(library, "w") as f:
    f.write("library")
print("APP_KERNELS_LIBRARY " + library, flush=True)
"""


def test_breaking_a_live_owners_lock_never_disturbs_its_build(tmp_path, monkeypatch):
    """Owner A is compiling when B wrongly judges A's lock stale (A's heartbeat looks old),
    breaks it and builds too. Each compiles in a directory of its own, so both succeed and
    agree on the library, which ends up in build/; no lock or work directory is left over,
    and a dead owner's leftover directory on this host is cleaned up."""
    spec, root, sync = _spec(tmp_path, "probe", GOOD), tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    monkeypatch.setattr(build, "_child_command", lambda spec, work: [
        sys.executable, "-c", FAKE_COMPILER, str(work), str(sync)])
    entry = _entry(root, spec)
    leftover = entry / "build.tmp-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "owner.json").write_text(json.dumps({"host": socket.gethostname(),
                                                      "pid": _dead_pid()}))
    results = {}

    def owner(name, stale_s):
        try:
            results[name] = build.ensure_built(spec, root, local_rank=0, timeout_s=120,
                                               stale_s=stale_s, poll_s=0.05)
        except Exception as err:  # noqa: BLE001 - reported by the asserts below
            results[name] = err

    def wait_for_compilers(n):
        deadline = time.monotonic() + 60
        while len(list(sync.glob("started-*"))) < n:
            assert time.monotonic() < deadline, f"{n} fake compilers did not start: {results}"
            time.sleep(0.05)

    threads = [threading.Thread(target=owner, args=("A", 3600))]
    threads[0].start()
    wait_for_compilers(1)
    old = time.time() - 600
    os.utime(entry / ".lock", (old, old))  # A beats every 600 s: to B it looks dead
    threads.append(threading.Thread(target=owner, args=("B", 60)))
    threads[1].start()
    wait_for_compilers(2)
    (sync / "go").touch()
    for t in threads:
        t.join(120)
    library = str(entry / "build" / "probe.so")
    assert results == {"A": library, "B": library}
    assert build.read_ready(entry) == library
    assert not (entry / ".lock").exists() and not (entry / "FAILED").exists()
    assert not list(entry.glob("build.tmp-*")) and not list(entry.glob("build.old-*"))
    assert not [name for name in os.listdir(entry) if is_temporary(name)]


def test_build_over_the_timeout_is_killed(tmp_path):
    spec, root = _spec(tmp_path, "probe", GOOD), tmp_path / "cache"
    start = time.time()
    with pytest.raises(build.BuildError, match="build timed out after 0 s"):
        build.ensure_built(spec, root, local_rank=0, timeout_s=0.2)
    assert time.time() - start < 30
    entry = _entry(root, spec)
    assert not (entry / ".lock").exists() and (entry / "FAILED").exists()


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A CUDA machine as app.kernels.library sees it, whose kernel spec is a broken library."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(build, "find_cuda_home", lambda: str(tmp_path))
    broken = _spec(tmp_path, "broken", BROKEN)
    monkeypatch.setattr(build, "kernel_spec", lambda arch: broken)
    library.reset()
    yield tmp_path / "cache"
    library.reset()
    library.configure()


def test_failed_build_falls_back_with_a_warning(fake_gpu, caplog):
    library.configure(build_root=str(fake_gpu), timeout_s=300)
    with caplog.at_level(logging.WARNING, logger="app.kernels.library"):
        status = library.status()
        assert library.status() is status  # decided once per process
    assert not status.available and status.reason.startswith("build failed: ")
    assert "broken.cpp:1" in status.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--require-fused-kernels" in warnings[0]


def test_failed_build_is_fatal_with_require_fused_kernels(fake_gpu, monkeypatch):
    library.configure(required=True, build_root=str(fake_gpu), timeout_s=300)
    with pytest.raises(RuntimeError, match=r"required \(--require-fused-kernels\).*broken.cpp:1"):
        library.status()
    library.reset()
    monkeypatch.setattr(build, "find_cuda_home", lambda: None)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        library.status()


def test_no_cuda_is_never_fatal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    library.reset()
    library.configure(required=True)
    try:
        assert library.status() == library.Status(False, library.NO_CUDA)
    finally:
        library.reset()
        library.configure()
    with pytest.raises(ValueError, match="timeout must be positive"):
        library.configure(timeout_s=0)
