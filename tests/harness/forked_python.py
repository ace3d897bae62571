"""A `python` command for the shell scripts a test runs, whose script runs are forked from the
test session's forkserver (torch and the trainer already imported) instead of starting an
interpreter that imports them again (~3.6 s of CPU each on this machine).

    with ForkedPython(tmp_path / "bin") as forked:
        subprocess.run(["bash", "-c", "python tools/x.py --flag"], stdin=subprocess.DEVNULL,
                       env={**env, "PATH": forked.folder + os.pathsep + env["PATH"]})

`forked.python` is a small bash script (`forked.folder/python`) that sends its process id and
arguments to a server thread of this process, and waits for the exit code. The server runs
`python SCRIPT.py ARGS`, `python -m MODULE ARGS` or `python -c CODE ARGS` in a child forked
from run_distributed's forkserver (tests/harness/distributed.py), as run_main runs
pretrain_gpt2.py: with the caller's arguments, working directory and environment (read from
/proc/PID of the script), its output going to the script's own standard output and error,
sys.path[0] as the interpreter sets it, the script run as __main__ (runpy), its atexit
handlers run at the end, the exit code (or 128 + signal) returned as the interpreter's. It
falls back to the real interpreter, as a plain `exec python ARGS`, for anything else: other
options (-u, -W, ...), a standard input that is a pipe or a file (a here-document, `cmd |
python`), or an output that cannot be reopened (a socket). A script killed while it waits (a
`timeout`) closes its connection, and its child is killed with it.
"""
from __future__ import annotations

import atexit
import io
import os
import runpy
import select
import shlex
import socketserver
import sys
import threading
import traceback
import types
from typing import Dict, List, Optional, Tuple

from tests.harness.distributed import _context, start_child, wait_child

SHIM = """#!/bin/bash
# python ARGS in a child forked by the test process (tests/harness/forked_python.py); the
# real interpreter when the standard input is a pipe or a file, or the server says "fallback"
real={real}
if [ -p /dev/stdin ] || [ -f /dev/stdin ] || ! {{ exec 3<>/dev/tcp/127.0.0.1/{port}; }} 2> /dev/null
then
    exec "$real" "$@"
fi
printf '%s\\0' "$$" "$#" "$@" >&3
read -r rc <&3
exec 3>&-
if [ "$rc" = fallback ]; then exec "$real" "$@"; fi
exit "${{rc:-1}}"
"""

LAUNCHER = """#!/bin/bash
# {name} ARGS: this environment's {name} run by the forked python; its ranks forked too
export FORKED_PYTHON_EXECUTABLE={python}
exec {python} {real} "$@"
"""


def _argv_of(args: List[str]) -> Optional[List[str]]:
    """The command line `python args` would run as forked here, less a leading -u (unbuffered
    output, as a launcher starts its ranks), or None (the real interpreter runs it)."""
    args = args[1:] if args[:1] == ["-u"] else args
    if len(args) >= 2 and args[0] in ("-m", "-c"):
        return args
    if args and not args[0].startswith("-"):
        return args
    return None


def _text_stream(fd: int, unbuffered: bool, error: bool) -> io.TextIOWrapper:
    """sys.stdout / sys.stderr over `fd` as a new interpreter makes them (stderr line-buffered,
    both unbuffered under PYTHONUNBUFFERED)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8",
                            errors="backslashreplace" if error else "strict",
                            line_buffering=error or os.isatty(fd), write_through=unbuffered)


def _run_as_main(args: List[str], cwd: str) -> None:
    """Run `python args` (script, -m or -c) in this process as __main__."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, cwd)
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path.insert(0, "")
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.realpath(os.path.join(cwd, args[0]))))
        runpy.run_path(os.path.abspath(args[0]), run_name="__main__")


def _python_in_child(args: List[str], cwd: str, environ: Dict[str, str], pid: int,
                     unbuffered: bool = False) -> None:
    """Child side: as `python args` (`python -u args` if `unbuffered`) started by process `pid`
    (its output, directory and environment; sys.executable:  when set,
    so that a launcher run here starts its ranks the same way); exits with the interpreter's code (2 for a usage error, 1 and the traceback
    for an exception)."""
    for fd in (1, 2):
        target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    unbuffered = unbuffered or bool(environ.get("PYTHONUNBUFFERED"))
    sys.executable = environ.get("FORKED_PYTHON_EXECUTABLE", sys.executable)
    sys.stdout = sys.__stdout__ = _text_stream(1, unbuffered, error=False)
    sys.stderr = sys.__stderr__ = _text_stream(2, unbuffered, error=True)
    if environ.get("OMP_NUM_THREADS", "").isdigit():  # torch read it when the forkserver began
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        _run_as_main(args, cwd)
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


class _Handler(socketserver.BaseRequestHandler):
    """One `python` call: read the caller's pid and arguments, run them, answer the exit code
    ("fallback": run the real interpreter)."""

    def handle(self) -> None:
        fields = self._fields()
        if fields is None:
            return
        pid, args = int(fields[0]), fields[2:]
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(item.decode(errors="surrogateescape").split("=", 1)
                               for item in f.read().split(b"\0") if b"=" in item)
            cwd = os.readlink(f"/proc/{pid}/cwd")
            for fd in (1, 2):  # an output that cannot be reopened (a socket): the real python
                os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND))
        except OSError:
            args = []
        run = _argv_of(args)
        if run is None:
            self.request.sendall(b"fallback\n")
            return
        proc = _context().Process(target=_python_in_child, name="python",
                                  args=(run, cwd, environ, pid, run is not args))
        start_child(proc)
        while (code := wait_child(proc, 0.1)) is None:
            readable, _, _ = select.select([self.request], [], [], 0)
            if readable and not self.request.recv(1):  # the caller is gone (killed)
                proc.kill()
                wait_child(proc, 5)
                return
        code = code if code >= 0 else 128 - code
        self.request.sendall(f"{code}\n".encode())

    def _fields(self) -> Optional[List[str]]:
        """pid, argument count, arguments (NUL-terminated strings); None if the caller left."""
        data = b""
        while True:
            parts = data.split(b"\0")
            if len(parts) > 2 and parts[1].isdigit() and len(parts) - 1 >= 2 + int(parts[1]):
                return [p.decode(errors="surrogateescape") for p in parts[:2 + int(parts[1])]]
            chunk = self.request.recv(65536)
            if not chunk:
                return None
            data += chunk


class ForkedPython:
    """The `python` script in `folder` and its server, for the length of a `with` block."""

    def __init__(self, folder: str, launchers: Tuple[str, ...] = ()) -> None:
        """`launchers`: console scripts of this environment ("deepspeed") that get a command
        in `folder` too, run by the forked python, whose ranks (started through
        sys.executable) are forked as well."""
        self.folder = str(folder)
        self.launchers = launchers
        self.python = os.path.join(self.folder, "python")
        self._server: Optional[socketserver.ThreadingTCPServer] = None

    def __enter__(self) -> "ForkedPython":
        _context()  # the forkserver's settings, before any thread uses it
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="forked-python",
                         daemon=True).start()
        os.makedirs(self.folder, exist_ok=True)
        with open(self.python, "w") as f:
            f.write(SHIM.format(real=shlex.quote(sys.executable),
                                port=self._server.server_address[1]))
        os.chmod(self.python, 0o755)
        for name in self.launchers:
            path = os.path.join(self.folder, name)
            with open(path, "w") as f:
                real = os.path.join(os.path.dirname(sys.executable), name)
                f.write(LAUNCHER.format(name=name, python=shlex.quote(self.python),
                                        real=shlex.quote(real)))
            os.chmod(path, 0o755)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
