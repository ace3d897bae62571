"""Is the process that owns a file still running? The one rule for every owner named by (host, pid).

A lock holder, a half-written file's writer and a kernel build directory's builder are each
named by the host they ran on and their pid, sometimes with the process's start time. Only an
owner on this host can be checked: its pid is gone, or the pid now belongs to a process that
started at another time (pids are reused). An owner on another host cannot be seen from here;
the callers judge those by a heartbeat (see `app.utils.lease`) or leave them alone.

Hosts are compared by `host_tag`, the form that also goes into temporary file names, so a
lock's recorded host name and a name's host field compare alike.
"""
from __future__ import annotations

import os
import re
import socket
from typing import Optional

import psutil

START_TOLERANCE_S = 1.0
"""Two recorded start times of one process differ by less than this (psutil's rounding)."""

ACTIVE_TOLERANCE_S = 5.0
"""Slack for `active_at`: file-time granularity and the measured file-system clock offset."""


def this_host() -> str:
    """This machine's host name, as recorded in lock files."""
    return socket.gethostname()


def host_tag(host: Optional[str] = None) -> str:
    """`host` (default: this host) with every character but letters, digits and '-' made '_':
    the form stored in temporary names, where '.' separates fields."""
    return re.sub(r"[^A-Za-z0-9-]", "_", this_host() if host is None else host) or "_"


def on_this_host(host: str) -> bool:
    """True when `host` (a host name or its `host_tag`) names this machine."""
    return host_tag(host) == host_tag()


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists on this host (it may belong to another user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> float:
    """The start time (seconds since the epoch, this host's clock) of process `pid`; 0.0 when
    it does not exist or cannot be read."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return 0.0


def process_gone(host: str, pid: int, started: float = 0.0, *,
                 active_at: Optional[float] = None) -> Optional[str]:
    """Why the owner (host, pid) certainly no longer runs, or None when it may still run.

    It is gone when it was on this host and either no process `pid` exists, or the process now
    holding `pid` is another one: its start time differs from `started` (the owner's recorded
    start; 0.0 = unknown), or it started after `active_at` (a time, on this host's clock, at
    which the owner is known to have been running, such as the last change of a file it
    wrote). An owner on another host is never judged gone here.
    """
    if not on_this_host(host):
        return None
    if not pid_alive(pid):
        return f"its process {pid} on this host is gone"
    now_started = process_start(pid)
    if not now_started:
        return None
    if started and abs(now_started - started) > START_TOLERANCE_S:
        return f"pid {pid} now belongs to another process"
    if active_at is not None and now_started > active_at + ACTIVE_TOLERANCE_S:
        return f"pid {pid} now belongs to a process started after its owner was last active"
    return None


__all__ = ["ACTIVE_TOLERANCE_S", "START_TOLERANCE_S", "host_tag", "on_this_host", "pid_alive",
           "process_gone", "process_start", "this_host"]
