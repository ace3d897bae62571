"""Rendezvous ports: the one place that asks the OS whether a port is free or for a free one
(start-up, a one-process DeepSpeed run, and the tests' launchers all use it)."""
from __future__ import annotations

import socket

DEFAULT_MASTER_PORT = 29500


def port_is_free(port: int, host: str = "") -> bool:
    """True when a TCP socket can listen on `port` of `host` (all addresses for "") right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A port the OS reports free on `host` now (another process may take it before use: bind
    soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pick_master_port(preferred: int = DEFAULT_MASTER_PORT) -> int:
    """`preferred` when it is free on this host, else a free port the OS hands out (for rank 0
    when the project chooses the rendezvous port itself)."""
    return preferred if port_is_free(preferred) else free_port()
