"""Build a kernel library once per (torch, CUDA, arch, sources) into a cache, without ever hanging.

Layout of one cache entry, `<build_root>/<name>-torch<v>-cuda<v>-sm<arch>-<hash>/`:

    .lock      held by the one process building: a lease (app.utils.lease) whose record names
               the owner (host, pid, process start, token, since when) and whose mtime is a
               heartbeat refreshed every few seconds, so a lock whose owner died (same host: pid
               gone or reused; any host: heartbeat older than `stale_s`) is taken over and the
               build redone. The heartbeat's age is measured against the file system's own
               clock (a probe file's mtime), so clock skew between nodes sharing it over NFS
               does not matter. The owner removes the lock only while it still holds its token.
    build.tmp.<host>.<pid>.<thread>/  one owner's torch.utils.cpp_extension (ninja) directory,
               named by `app.utils.fileio.tmp_path`: new for every build and touched by no one
               else, so breaking a lock never disturbs a live build, and a half-written directory
               (with torch's own `lock` file) is never reused; left behind by a dead owner, it is
               removed by the next build on its host (`remove_temporaries`)
    build/     the last good build, renamed into place from its build.tmp.* directory
    READY      written atomically once the library built, loaded in the build process and was
               renamed into place; names the library and its size, so a truncated file is rebuilt
    FAILED     the first error line of the last failed build, and the log's path
    FAILED.<host>  why local rank 0 on <host> gave up (its build failed, another node's build
               failed, or it timed out waiting for another node's lock): the other local ranks
               read it and fall back at once
    build.log  the compiler output of the last build

The compiler runs in a child process (`python -m app.kernels.build`) in its own session; local
rank 0 spends at most `timeout_s` in all (waiting for another node's lock included): a build
still running then is killed with its ninja/nvcc children and reported as a failure, so the
caller falls back instead of waiting. Only local rank 0 builds; other local ranks poll for READY
or their FAILED.<host>. Ranks on other nodes sharing the directory meet at the lock: one builds,
the rest wait for READY (or a fresh FAILED).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from app.utils.fileio import TMP_MARKER, atomic_write_bytes, fs_now, remove_temporaries, tmp_path
from app.utils.lease import Lease, LeaseOwner, LeaseState
from app.utils.processes import process_gone
from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC = REPO_ROOT / "csrc"
LIBRARY_NAME = "app_kernels"
KERNEL_SOURCES = ("binding.cpp", "softmax.cu", "layer_norm.cu", "rms_norm.cu",
                  "cross_entropy.cu")
KERNEL_HEADERS = ("kernels.h", "common.cuh")
BUILD_DIR_ENV = "APP_KERNELS_BUILD_DIR"
_LIBRARY_LINE = "APP_KERNELS_LIBRARY "


class BuildError(RuntimeError):
    """The library is not available; `str(err)` is one line saying why."""


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What to build: a library `name` from `sources` (+ `headers`, hashed into the cache key).

    `cuda_arch` ("9.0") builds .cu sources for that architecture; None builds a host-only
    library (the tests use that to exercise this module without a GPU).
    """

    name: str
    sources: Tuple[str, ...]
    headers: Tuple[str, ...] = ()
    cuda_arch: Optional[str] = None
    extra_cflags: Tuple[str, ...] = ("-O3",)
    extra_cuda_cflags: Tuple[str, ...] = ("-O3", "--expt-relaxed-constexpr")

    def cache_dir_name(self, torch_version: str, cuda_version: Optional[str]) -> str:
        """`<name>-torch<v>-cuda<v>-sm<arch>-<12 hex of sources, headers and flags>`."""
        digest = hashlib.sha256()
        for path in sorted(self.sources + self.headers):
            digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
        digest.update(repr((self.extra_cflags, self.extra_cuda_cflags)).encode())
        arch = f"sm{self.cuda_arch.replace('.', '')}" if self.cuda_arch else "host"
        cuda = f"cuda{cuda_version}" if cuda_version else "nocuda"
        torch_tag = re.sub(r"[^A-Za-z0-9.]+", "_", torch_version)
        return f"{self.name}-torch{torch_tag}-{cuda}-{arch}-{digest.hexdigest()[:12]}"


def kernel_spec(cuda_arch: str) -> BuildSpec:
    """The csrc/ kernel library for one GPU architecture ("8.0", "9.0", ...)."""
    return BuildSpec(LIBRARY_NAME, tuple(str(CSRC / s) for s in KERNEL_SOURCES),
                     tuple(str(CSRC / h) for h in KERNEL_HEADERS), cuda_arch)


def default_build_root() -> Path:
    """$APP_KERNELS_BUILD_DIR, else $XDG_CACHE_HOME/app_kernels (~/.cache/app_kernels)."""
    if os.environ.get(BUILD_DIR_ENV):
        return Path(os.environ[BUILD_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "app_kernels"


def find_cuda_home() -> Optional[str]:
    """A CUDA toolkit root with bin/nvcc and include/cuda_runtime_api.h, or None.

    Tried in order: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, /usr/local/cuda-*, and the parent of
    the directory holding the `nvcc` on PATH.
    """
    candidates: List[str] = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
                             "/usr/local/cuda"]
    if os.path.isdir("/usr/local"):
        candidates += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
                os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


def nvcc_version(cuda_home: str) -> Optional[str]:
    """"13.0" from `nvcc --version`, or None when it cannot be run."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def first_error_line(log: str) -> str:
    """The first compiler/linker error in a build log (else its last non-empty line)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("FAILED:", "ninja:", "Traceback")):
            continue
        if re.search(r"\b(error|Error|ERROR)\b", line):
            return line[:400]
    return lines[-1][:400] if lines else "no output"


# ---- the cache entry: READY / FAILED markers and the lock --------------------------------------
LOCK_NAME = ".lock"


def _write_json_atomic(path: Path, payload: dict) -> None:
    atomic_write_bytes(str(path), json.dumps(payload).encode("utf-8"))


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_with_mtime(path: Path) -> Optional[Tuple[dict, float]]:
    """(JSON content or {}, mtime) of a file, or None when it does not exist."""
    try:
        with open(path, "rb") as f:  # open() revalidates NFS's cached attributes (close-to-open)
            mtime = os.fstat(f.fileno()).st_mtime
            text = f.read()
    except OSError:
        return None
    try:
        content = json.loads(text)
    except ValueError:  # being written
        content = None
    return (content if isinstance(content, dict) else {}), mtime


def _host() -> str:
    return socket.gethostname()


def read_ready(entry: Path) -> Optional[str]:
    """The library path recorded in READY, if that file still exists with the recorded size."""
    ready = _read_json(entry / "READY")
    if not ready:
        return None
    library = ready.get("library", "")
    try:
        if os.path.getsize(library) == ready.get("size"):
            return library
    except OSError:
        pass
    return None


def host_failure_marker(entry: Path) -> Path:
    """FAILED.<host>: where local rank 0 on this host says why it gave up."""
    return entry / ("FAILED." + re.sub(r"[^A-Za-z0-9._-]+", "_", _host()))


def _write_failure(marker: Path, error: str, log: Optional[str]) -> None:
    _write_json_atomic(marker, {"error": error, "log": log, "host": _host()})


def read_failure(marker: Path, since: float) -> Optional[str]:
    """The reason in a FAILED marker written at or after `since` (file-system time, fs_now)."""
    found = _read_with_mtime(marker)
    if found is None or found[1] < since:
        return None
    failed, _ = found
    log = failed.get("log")
    return failed.get("error", "unknown error") + (f" (log: {log})" if log else "")


def _lock_lease(lock: Path, stale_s: float, notice_after_s: float = 5.0,
                heartbeat_s: Optional[float] = None) -> Lease:
    """The lease on an entry's build lock. Unlike the --save lock, a live owner on this host
    that stopped beating for `stale_s` loses it too: its build runs in a directory of its own,
    so a second build disturbs nothing, and the caller's timeout bounds the wait."""
    return Lease(str(lock), stale_s=stale_s, heartbeat_s=heartbeat_s or max(stale_s / 6, 0.5),
                 what="kernel build lock", trust_local_pid=False,
                 notice_after_s=notice_after_s, thread_name="kernel-build-heartbeat")


def _stale_owner(lease: Lease) -> Tuple[Optional[LeaseState], Optional[str]]:
    """The lock's state (None: no lock) and why its owner is gone (dead or reused pid on this
    host, or no heartbeat for stale_s by the file system's clock); the reason is None when
    the owner may be alive."""
    state = lease.look()
    return state, (lease.stale_reason(state) if state is not None else None)


def lock_is_stale(lock: Path, stale_s: float) -> bool:
    """True when the lock's owner is gone: a dead pid on this host, or no heartbeat for stale_s."""
    return _stale_owner(_lock_lease(lock, stale_s))[1] is not None


def _break_lock(lock: Path, owner: dict, reason: str = "its owner is gone") -> bool:
    """Remove the stale lock of `owner` (the record judged stale); a rename first, so only one
    of several breakers succeeds, and a lock that changed hands meanwhile is put back. True
    when this call removed it."""
    lease = _lock_lease(lock, stale_s=0.0)
    state = lease.look()
    if state is None:
        return False
    judged = LeaseState(LeaseOwner.from_json(owner), state.mtime, state.age_s)
    return lease.take_over(judged, reason)


@contextlib.contextmanager
def _held_lock(lock: Path, heartbeat_s: float) -> Iterator[Optional[str]]:
    """Yields a token with `lock` created by us (refreshed every heartbeat_s while it holds that
    token), None if the lock exists. On exit the lock is removed only if it still holds our
    token: a peer that judged it stale may have broken it and taken it since."""
    lease = _lock_lease(lock, stale_s=6 * heartbeat_s, heartbeat_s=heartbeat_s)
    if not lease.try_acquire():
        yield None
        return
    try:
        yield lease.token
    finally:
        lease.release()


# ---- building ----------------------------------------------------------------------------------
def _child_command(spec: BuildSpec, build_dir: Path) -> List[str]:
    """The compiler process: this module's `_child_main` (tests substitute a fake compiler)."""
    return [sys.executable, "-m", "app.kernels.build", json.dumps(dataclasses.asdict(spec)),
            str(build_dir)]


def _remove_dead_builds(entry: Path) -> None:
    """Delete what builders on this host that are gone left in `entry` (their build directories,
    lock asides and probes: `remove_temporaries`; other hosts' may belong to live builds), the
    replaced build/ directories (garbage once renamed aside), and the build directories of
    older versions (`build.tmp-<token>` with an owner.json naming host and pid)."""
    remove_temporaries(str(entry))
    for old in entry.glob("build.old" + TMP_MARKER + "*"):
        shutil.rmtree(old, ignore_errors=True)
    for legacy in entry.glob("build.tmp-*"):
        owner = _read_json(legacy / "owner.json") or {}
        pid = owner.get("pid")
        if isinstance(pid, int) and process_gone(str(owner.get("host")), pid) is not None:
            shutil.rmtree(legacy, ignore_errors=True)


def _install(entry: Path, work: Path, library: str) -> str:
    """Rename the finished build directory `work` to entry/build and return the library's path
    there; if another owner's build is already in place (READY), keep that one instead."""
    final = entry / "build"
    old = Path(tmp_path(str(entry / "build.old"), unique=True))
    try:
        if read_ready(entry) is None:
            with contextlib.suppress(FileNotFoundError):
                os.rename(final, old)
            os.rename(work, final)
            shutil.rmtree(old, ignore_errors=True)
            return str(final / Path(library).relative_to(work))
    except OSError:  # another owner renamed its build into place first
        pass
    shutil.rmtree(work, ignore_errors=True)
    library = read_ready(entry)
    if library is None:
        raise BuildError(f"another process replaced {final} while this build finished")
    return library


def _run_build(spec: BuildSpec, entry: Path, cuda_home: Optional[str], timeout_s: float) -> str:
    """Compile in a child process, in a directory of our own, with a hard timeout; put the
    result in place and return the library's path, or raise BuildError."""
    timeout_s = max(timeout_s, 0.0)  # what is left of local rank 0's budget
    work = Path(tmp_path(str(entry / "build"), unique=True))
    shutil.rmtree(work, ignore_errors=True)  # a dead process's with our pid and thread id
    work.mkdir()
    log_path, own_log = entry / "build.log", work / "build.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if spec.cuda_arch:
        env["TORCH_CUDA_ARCH_LIST"] = spec.cuda_arch
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    started = time.monotonic()
    try:
        with open(own_log, "w") as log:
            proc = subprocess.Popen(_child_command(spec, work), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise BuildError(f"build timed out after {timeout_s:.0f} s (log: {log_path})")
        text = own_log.read_text(errors="replace")
        libraries = [line[len(_LIBRARY_LINE):] for line in text.splitlines()
                     if line.startswith(_LIBRARY_LINE)]
        if proc.returncode != 0 or not libraries:
            raise BuildError(f"{first_error_line(text)} (log: {log_path})")
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(own_log, log_path)
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.copyfile(own_log, log_path)
    library = _install(entry, work, libraries[-1])
    logger.info("built %s in %.0f s: %s", spec.name, time.monotonic() - started, library)
    return library


def _build_locked(spec: BuildSpec, entry: Path, cuda_home: Optional[str],
                  timeout_s: float) -> str:
    """The build itself, with the lock held: READY on success, FAILED on failure."""
    library = read_ready(entry)
    if library:
        return library
    (entry / "FAILED").unlink(missing_ok=True)
    _remove_dead_builds(entry)
    try:
        library = _run_build(spec, entry, cuda_home, timeout_s)
    except BuildError as err:
        _write_failure(entry / "FAILED", str(err).split(" (log: ")[0], str(entry / "build.log"))
        raise
    _write_json_atomic(entry / "READY", {"library": library, "time": time.time(),
                                         "size": os.path.getsize(library)})
    return library


def _build_as_owner(spec: BuildSpec, entry: Path, cuda_home: Optional[str], timeout_s: float,
                    stale_s: float, poll_s: float, notice_s: float) -> str:
    """Take the entry's lock and build (the lock of an owner that is gone is taken over), or
    wait while a live owner holds it, up to `timeout_s`; BuildError when time runs out."""
    begun = time.monotonic()
    since = fs_now(entry)
    lock = entry / LOCK_NAME
    lease = _lock_lease(lock, stale_s, notice_after_s=notice_s)
    while True:
        library = read_ready(entry)
        if library:
            return library
        failure = read_failure(entry / "FAILED", since)
        if failure:  # another node built the same sources for the same arch and failed
            raise BuildError(failure)
        with _held_lock(lock, heartbeat_s=lease.heartbeat_s) as token:
            if token is not None:
                return _build_locked(spec, entry, cuda_home, begun + timeout_s - time.monotonic())
        state, reason = _stale_owner(lease)
        if reason is not None and state is not None:
            record = state.owner.to_json() if state.owner is not None else {}
            if _break_lock(lock, record, reason):
                continue
        waited = time.monotonic() - begun
        if waited > timeout_s:
            holder = state.describe() if state is not None else "no one any more"
            raise BuildError(f"timed out after {timeout_s:.0f} s waiting for the build lock "
                             f"held by {holder} in {entry}")
        lease.notice_wait(state, waited)
        time.sleep(poll_s)


def _wait_for_owner(entry: Path, local_rank: int, wait_s: float, poll_s: float,
                    notice_s: float) -> str:
    """Wait for local rank 0's build (READY) or its reason for giving up (FAILED.<host>); after
    `notice_s` say once what is awaited and who holds the build lock."""
    begun = time.monotonic()
    marker = host_failure_marker(entry)
    since = fs_now(entry) - 30.0  # local rank 0 may fail fast, just before we started
    noticed = False
    while time.monotonic() < begun + wait_s:
        library = read_ready(entry)
        if library:
            return library
        failure = read_failure(marker, since)
        if failure:
            raise BuildError(f"local rank 0 gave up: {failure}")
        if not noticed and time.monotonic() - begun >= notice_s:
            noticed = True
            _log_rank_wait(entry, local_rank, time.monotonic() - begun, marker)
        time.sleep(poll_s)
    raise BuildError(f"timed out after {wait_s:.0f} s waiting for local rank 0 to build in {entry}")


def _log_rank_wait(entry: Path, local_rank: int, waited_s: float, marker: Path) -> None:
    lock = entry / LOCK_NAME
    state = _lock_lease(lock, stale_s=0.0).look()
    holder = (f"its build lock {lock} is held by {state.describe()}; if that process is gone "
              f"for good, delete {lock}" if state is not None else
              f"no one holds its build lock {lock} at the moment")
    logger.warning("local rank %d has waited %.0f s for local rank 0's kernel build in %s: %s. "
                   "It ends with READY there, or with local rank 0's reason in %s",
                   local_rank, waited_s, entry, holder, marker.name, extra=ALL_RANKS)


def ensure_built(spec: BuildSpec, build_root: Path, *, local_rank: int, timeout_s: float,
                 cuda_home: Optional[str] = None, torch_version: Optional[str] = None,
                 cuda_version: Optional[str] = None, stale_s: float = 60.0,
                 poll_s: float = 1.0, notice_s: float = 5.0) -> str:
    """Path of `spec`'s library in the cache under `build_root`; builds or waits as needed.

    Local rank 0 builds (after taking the entry's lock), within `timeout_s` in all; when it
    gives up it says why in FAILED.<host>, and the other local ranks, which otherwise wait up
    to `timeout_s + stale_s` for it, stop at once. A wait longer than `notice_s` (for another
    process's lock, or for local rank 0) logs once what it waits for and how to clear a lock
    left by a process that is gone. Raises BuildError with a one-line reason.
    """
    import torch

    key = spec.cache_dir_name(torch_version or torch.__version__,
                              cuda_version if cuda_version is not None else torch.version.cuda)
    entry = Path(os.path.abspath(build_root)) / key  # absolute: the compiler runs elsewhere
    entry.mkdir(parents=True, exist_ok=True)
    library = read_ready(entry)
    if library:
        return library
    if local_rank != 0:
        return _wait_for_owner(entry, local_rank, timeout_s + stale_s, poll_s, notice_s)
    marker = host_failure_marker(entry)
    marker.unlink(missing_ok=True)  # a previous run's
    try:
        return _build_as_owner(spec, entry, cuda_home, timeout_s, stale_s, poll_s, notice_s)
    except (BuildError, OSError) as err:
        with contextlib.suppress(OSError):
            _write_failure(marker, str(err), None)
        raise


# ---- the child process -------------------------------------------------------------------------
def _child_main(argv: Sequence[str]) -> int:
    """`python -m app.kernels.build <spec JSON> <build dir>`: build (and load, as a check) one
    library and print its path after _LIBRARY_LINE. Internal: `_run_build` is the caller."""
    if len(argv) != 2:
        print("usage: python -m app.kernels.build <spec JSON> <build dir> (internal; use "
              "tools/build_kernels.py)", file=sys.stderr)
        return 2
    spec = BuildSpec(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in json.loads(argv[0]).items()})
    from torch.utils import cpp_extension

    include = sorted({str(Path(h).parent) for h in spec.headers + spec.sources})
    library = cpp_extension.load(
        name=spec.name, sources=list(spec.sources), extra_include_paths=include,
        extra_cflags=list(spec.extra_cflags), extra_cuda_cflags=list(spec.extra_cuda_cflags),
        build_directory=argv[1], with_cuda=spec.cuda_arch is not None,
        is_python_module=False, verbose=True)
    print(_LIBRARY_LINE + str(library), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
