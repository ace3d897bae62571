"""Build a kernel library once per (torch, CUDA, arch, sources) into a cache, without ever hanging.

Layout of one cache entry, `<build_root>/<name>-torch<v>-cuda<v>-sm<arch>-<hash>/`:

    .lock      held by the one process building; JSON {host, pid, started}; its mtime is a
               heartbeat refreshed every few seconds, so a lock whose owner died (same host: pid
               gone; any host: heartbeat older than `stale_s`) is broken and the build redone
    build/     torch.utils.cpp_extension's ninja directory, wiped before every build (a
               half-written one from a killed build is never reused, and torch's own `lock`
               file in it can never block us)
    READY      written atomically after the library built and loaded in the build process;
               names the library and its size, so a truncated file is rebuilt
    FAILED     the first error line of the last failed build, and the log's path
    build.log  the compiler output of the last build

The compiler runs in a child process (`python -m app.kernels.build`) in its own session: a
build over `timeout_s` is killed with its ninja/nvcc children and reported as a failure, so the
caller falls back instead of waiting. Only local rank 0 builds; other local ranks poll for READY
(or a fresh FAILED). Ranks on other nodes sharing the directory meet at the lock: one builds,
the rest wait for READY.
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
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC = REPO_ROOT / "csrc"
LIBRARY_NAME = "app_kernels"
KERNEL_SOURCES = ("binding.cpp", "softmax.cu", "layer_norm.cu", "cross_entropy.cu")
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
def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


def read_failure(entry: Path, since: float) -> Optional[str]:
    """The reason in FAILED when it was written at or after `since` (epoch seconds)."""
    failed = _read_json(entry / "FAILED")
    if failed and failed.get("time", 0.0) >= since:
        return f"{failed.get('error', 'unknown error')} (log: {failed.get('log', '?')})"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_is_stale(lock: Path, stale_s: float) -> bool:
    """True when the lock's owner is gone: a dead pid on this host, or no heartbeat for stale_s."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    owner = _read_json(lock) or {}
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        if not _pid_alive(owner["pid"]):
            return True
    return age > stale_s


def _break_lock(lock: Path) -> None:
    """Remove a stale lock; a rename first, so only one of several breakers succeeds."""
    grave = lock.with_name(f"{lock.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(lock, grave)
    except FileNotFoundError:
        return
    logger.warning("removed a stale kernel build lock %s (owner %s)", lock, _read_json(grave))
    grave.unlink(missing_ok=True)


@contextlib.contextmanager
def _held_lock(lock: Path, heartbeat_s: float) -> Iterator[bool]:
    """Yields True with `lock` created by us (and its mtime refreshed), False if it exists."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        yield False
        return
    with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}, f)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=beat, name="kernel-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join()
        lock.unlink(missing_ok=True)


# ---- building ----------------------------------------------------------------------------------
def _run_build(spec: BuildSpec, entry: Path, cuda_home: Optional[str], timeout_s: float) -> str:
    """Compile in a child process with a hard timeout; the library path, or BuildError."""
    build_dir = entry / "build"
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    log_path = entry / "build.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if spec.cuda_arch:
        env["TORCH_CUDA_ARCH_LIST"] = spec.cuda_arch
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    cmd = [sys.executable, "-m", "app.kernels.build", json.dumps(dataclasses.asdict(spec)),
           str(build_dir)]
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(REPO_ROOT), start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BuildError(f"build timed out after {timeout_s:.0f} s (log: {log_path})")
    text = log_path.read_text(errors="replace")
    libraries = [line[len(_LIBRARY_LINE):] for line in text.splitlines()
                 if line.startswith(_LIBRARY_LINE)]
    if proc.returncode != 0 or not libraries:
        raise BuildError(f"{first_error_line(text)} (log: {log_path})")
    logger.info("built %s in %.0f s: %s", spec.name, time.time() - started, libraries[-1])
    return libraries[-1]


def _build_as_owner(spec: BuildSpec, entry: Path, cuda_home: Optional[str], timeout_s: float,
                    stale_s: float, poll_s: float) -> str:
    start = time.time()
    while True:
        library = read_ready(entry)
        if library:
            return library
        failure = read_failure(entry, since=start)
        if failure:  # another node built the same sources for the same arch and failed
            raise BuildError(failure)
        with _held_lock(entry / ".lock", heartbeat_s=max(stale_s / 6, 0.5)) as mine:
            if mine:
                library = read_ready(entry)
                if library:
                    return library
                (entry / "FAILED").unlink(missing_ok=True)
                try:
                    library = _run_build(spec, entry, cuda_home, timeout_s)
                except BuildError as err:
                    _write_json_atomic(entry / "FAILED", {"error": str(err).split(" (log: ")[0],
                                                          "log": str(entry / "build.log"),
                                                          "time": time.time()})
                    raise
                _write_json_atomic(entry / "READY", {"library": library, "time": time.time(),
                                                     "size": os.path.getsize(library)})
                return library
        if lock_is_stale(entry / ".lock", stale_s):
            _break_lock(entry / ".lock")
            continue
        if time.time() - start > timeout_s:
            owner = _read_json(entry / ".lock")
            raise BuildError(f"timed out after {timeout_s:.0f} s waiting for the build lock "
                             f"held by {owner} in {entry}")
        time.sleep(poll_s)


def _wait_for_owner(entry: Path, wait_s: float, poll_s: float) -> str:
    start = time.time()
    while time.time() - start < wait_s:
        library = read_ready(entry)
        if library:
            return library
        if not (entry / ".lock").exists():
            # A failure from just before we started counts too: local rank 0 may fail fast.
            failure = read_failure(entry, since=start - 30.0)
            if failure:
                raise BuildError(f"local rank 0's build failed: {failure}")
        time.sleep(poll_s)
    raise BuildError(f"timed out after {wait_s:.0f} s waiting for local rank 0 to build in {entry}")


def ensure_built(spec: BuildSpec, build_root: Path, *, local_rank: int, timeout_s: float,
                 cuda_home: Optional[str] = None, torch_version: Optional[str] = None,
                 cuda_version: Optional[str] = None, stale_s: float = 60.0,
                 poll_s: float = 1.0) -> str:
    """Path of `spec`'s library in the cache under `build_root`; builds or waits as needed.

    Local rank 0 builds (after taking the entry's lock); other local ranks wait up to
    `timeout_s + stale_s` for it. Raises BuildError with a one-line reason on failure.
    """
    import torch

    entry = build_root / spec.cache_dir_name(torch_version or torch.__version__,
                                             cuda_version if cuda_version is not None
                                             else torch.version.cuda)
    entry.mkdir(parents=True, exist_ok=True)
    library = read_ready(entry)
    if library:
        return library
    if local_rank == 0:
        return _build_as_owner(spec, entry, cuda_home, timeout_s, stale_s, poll_s)
    return _wait_for_owner(entry, timeout_s + stale_s, poll_s)


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
