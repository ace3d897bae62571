"""Rendezvous ports: one in use is named with the flags that change it, and a free one is picked."""
import os
import socket
import subprocess
import sys

from app.launch.ports import pick_master_port, port_is_free


def test_rendezvous_port_in_use_is_named_and_a_free_one_is_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_is_free(port)
        other = pick_master_port(port)
        assert other != port and port_is_free(other)
        code = ("from app.launch.distributed import init_distributed\n"
                "try:\n    init_distributed('gloo', timeout_minutes=0.2)\n"
                "except ValueError as e:\n    print('ERR', type(e).__name__, e)\n")
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120).stdout
    assert "ERR RendezvousPortInUse" in out and f"port {port}" in out
    assert "--master_port" in out and "MASTER_PORT" in out
    assert pick_master_port(other) == other
