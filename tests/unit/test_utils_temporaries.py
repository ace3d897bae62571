"""One temporary-name scheme that the cleaner recognises everywhere.

- every file or directory a writer creates on the way to its outputs (atomic writes, checkpoint
  files, the .bin/.idx builder, the converter's staged directory, the --save write probe, the
  file-system clock probe, lock asides, kernel build directories) has a `tmp_path` name that
  records this host and this process;
- `remove_temporaries` removes what a dead writer on this host left (files and directories,
  also when its pid now belongs to a younger process), and keeps a live writer's and another
  host's, whose writer cannot be seen from here.
"""
import builtins
import io
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from app.checkpoint.commit import write_checked_file
from app.checkpoint.state import staged_directory
from app.data.indexed_dataset import MMapIndexedDatasetBuilder
from app.kernels import build
from app.training.resilience.save_dir import ensure_writable_dir
from app.utils import fileio
from app.utils.fileio import (atomic_write_bytes, fs_now, is_temporary, remove_temporaries,
                              temporary_owner)
from app.utils.lease import Lease
from app.utils.processes import on_this_host, process_start

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def created(monkeypatch, tmp_path):
    """Every path under tmp_path that this process creates (opens for writing, makes as a
    directory, or renames or links to), in order."""
    paths = []
    root = str(tmp_path)

    def note(path):
        path = os.path.abspath(os.fspath(path))
        if path.startswith(root + os.sep):
            paths.append(path)

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def spy_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wxa+"):
            note(file)
        return real_open(file, mode, *args, **kwargs)

    def spy_os_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            note(path)
        return real_os_open(path, flags, *args, **kwargs)

    def spy_mkdir(path, *args, **kwargs):
        note(path)
        return real_mkdir(path, *args, **kwargs)

    def spy_move(real):
        def move(src, dst, *args, **kwargs):
            note(dst)
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(os, "mkdir", spy_mkdir)
    for name in ("rename", "replace", "link"):
        monkeypatch.setattr(os, name, spy_move(getattr(os, name)))
    return paths


def _in_temporary_directory(path, root):
    parts = os.path.relpath(os.path.dirname(path), root).split(os.sep)
    return any(is_temporary(part) for part in parts if part != ".")


def _check_names(paths, root, finals):
    """Each created path is a final output, inside a temporary directory, or a temporary of
    this host and process; returns the temporaries' base names."""
    temporaries = set()
    for path in paths:
        name = os.path.relpath(path, root)
        if name in finals or _in_temporary_directory(path, root):
            continue
        owner = temporary_owner(path)
        assert owner is not None, f"{name}: not a temporary name, nor one of {sorted(finals)}"
        assert on_this_host(owner.host) and owner.pid == os.getpid(), name
        temporaries.add(os.path.basename(path))
    return temporaries


FAKE_COMPILER = """
import os, sys
library = os.path.join(sys.argv[1], "probe.so")
open(library, "w").write("library")
print("APP_KERNELS_LIBRARY " + library, flush=True)
"""


def test_every_writer_names_its_temporaries_for_the_cleaner(tmp_path, created, monkeypatch):
    root = str(tmp_path)
    atomic_write_bytes(str(tmp_path / "tracker.txt"), b"1")
    write_checked_file(str(tmp_path / "ck" / "model.pt"), lambda f: torch.save({"w": 1}, f))
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "corpus.bin"), np.uint16)
    builder.add_item([1, 2, 3])
    builder.finalize(str(tmp_path / "corpus.idx"))
    with staged_directory(str(tmp_path / "hf")) as staged:
        with open(os.path.join(staged, "config.json"), "w") as f:
            f.write("{}")
    ensure_writable_dir(str(tmp_path / "save"))
    fs_now(root)
    lock = str(tmp_path / "x.lock")
    with open(lock, "w") as f:  # a dead owner's lock: taken over through an aside name
        json.dump({"host": socket.gethostname(), "pid": _dead_pid(), "token": "t"}, f)
    with Lease(lock, stale_s=60, heartbeat_s=60):
        pass
    monkeypatch.setattr(build, "_child_command", lambda spec, work: [
        sys.executable, "-c", FAKE_COMPILER, str(work)])
    (tmp_path / "probe.cpp").write_text("int x;\n")
    spec = build.BuildSpec("probe", (str(tmp_path / "probe.cpp"),))
    library = build.ensure_built(spec, tmp_path / "cache", local_rank=0, timeout_s=60)
    entry = os.path.relpath(os.path.dirname(os.path.dirname(library)), root)
    finals = {"tracker.txt", "ck", "ck/model.pt", "ck/model.pt.sha256", "corpus.bin",
              "corpus.idx", "hf", "hf/config.json", "save", "x.lock", "probe.cpp", "cache", entry,
              *(os.path.join(entry, n) for n in (".lock", "build", "READY", "build.log"))}
    temporaries = _check_names(created, root, finals)
    assert {n.split(".tmp.")[0] for n in temporaries} >= {
        "tracker.txt", "model.pt", "corpus.bin", "corpus.idx", ".hf", ".write-probe", ".clock",
        "x.lock.stale", "build", "READY"}, temporaries
    leftovers = [os.path.join(d, n) for d, subdirs, files in os.walk(root)
                 for n in subdirs + files if is_temporary(n)]
    assert leftovers == []


CHILD = """
import os, socket, sys
root, host, live = sys.argv[1], sys.argv[2], sys.argv[3] == "live"
if host != "here":
    socket.gethostname = lambda: host
from app.data.indexed_dataset import MMapIndexedDatasetBuilder
from app.utils.fileio import atomic_open, tmp_path
os.makedirs(root)
writing = atomic_open(os.path.join(root, "tracker.txt"))
writing.__enter__().write(b"1")
builder = MMapIndexedDatasetBuilder(os.path.join(root, "corpus.bin"))
builder.add_item([1, 2])
with open(tmp_path(os.path.join(root, "model.pt")), "wb") as f:
    f.write(b"x")
os.mkdir(tmp_path(os.path.join(root, ".converted")))
open(os.path.join(tmp_path(os.path.join(root, ".converted")), "part"), "w").close()
print("ready", flush=True)
if live:
    sys.stdin.read()
os._exit(0)
"""


def _writer(root, host, live):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, host, live],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_cleaner_removes_only_what_dead_writers_on_this_host_left(tmp_path):
    def listing(name):
        return sorted(os.listdir(tmp_path / name))

    dead = _writer(str(tmp_path / "dead"), "here", "exit")
    foreign = _writer(str(tmp_path / "foreign"), "elsewhere", "exit")
    live = _writer(str(tmp_path / "live"), "here", "live")
    try:
        dead.wait()
        foreign.wait()
        reused = tmp_path / "reused"  # our pid, but written before this process started
        reused.mkdir()
        old, fresh = (fileio.tmp_path(str(reused / name)) for name in ("old.pt", "fresh.pt"))
        for path in (old, fresh):
            open(path, "w").close()
        then = process_start(os.getpid()) - 3600
        os.utime(old, (then, then))
        written = {name: listing(name) for name in ("dead", "foreign", "live")}
        assert len(written["dead"]) == 4 and all(is_temporary(n) for n in written["dead"])
        removed = remove_temporaries(str(tmp_path))
        assert sorted(os.path.relpath(p, tmp_path) for p in removed) == sorted(
            [os.path.join("dead", n) for n in written["dead"]] + [os.path.relpath(old, tmp_path)])
        assert listing("dead") == []
        assert listing("foreign") == written["foreign"] and listing("live") == written["live"]
        assert os.listdir(reused) == [os.path.basename(fresh)]
    finally:
        live.kill()
        live.wait()
    assert len(remove_temporaries(str(tmp_path / "live"))) == 4  # its writer is gone now
    assert listing("foreign") == written["foreign"]  # only its own host can judge those
    assert len(remove_temporaries(str(tmp_path / "foreign"), only_dead=False)) == 4


def test_names_of_older_versions_and_lookalikes():
    assert temporary_owner(f"model.pt.tmp.{os.getpid()}") == (None, os.getpid())  # pre-host
    assert temporary_owner("a.tmp.node-1_x.12.34") == ("node-1_x", 12)
    for name in ("a.tmp", "a.tmp.", "a.tmp.host", ".tmp.12", "a.tmp.h.1.2.3", "a.tmp-12",
                 "build.tmp-deadbeef", "notes.tmp.txt"):
        assert not is_temporary(name), name


def test_tmp_path_names_are_recognised():
    name = fileio.tmp_path("/a/b.pt")
    assert name.startswith("/a/b.pt.tmp.") and name.endswith(f".{os.getpid()}")
    assert is_temporary(name) and temporary_owner(name).pid == os.getpid()
