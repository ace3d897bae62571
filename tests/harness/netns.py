"""Test hosts: Linux network namespaces with their own addresses, joined by one link.

    with TestHosts(2) as hosts:             # 10.77.0.1 and 10.77.0.2 over a veth pair
        proc = hosts.popen(1, ["python", "-m", "torch.distributed.run", ...])
        hosts.link_down(1)                  # a network partition; link_up(1) heals it

Each host is a namespace with `lo` up and one interface (`HOST_INTERFACE` + its index) holding
the host's address in a private /24 (10.77.0.0/24 unless told otherwise). Two hosts are joined
by a veth pair; more by a bridge in a further "switch" namespace. Interfaces are created inside
the namespaces, so nothing is added to this machine's own network, and only the hosts' own
addresses are ever used.

Every host sees the machine's host name as in /etc/hosts of many clusters: resolving to the
loopback address 127.0.1.1 (a private /etc/hosts per namespace, which `ip netns exec` mounts
from /etc/netns/NAME/hosts). So whatever this machine's /etc/hosts says, gloo left to its
default advertises a loopback address, as it does on such a cluster.

Names are `apptest-<pid of the creating process>-<serial>-...`: unique per run, and namespaces
whose creator is gone (a killed test run) are removed by the next `TestHosts` (with the
processes still inside them). Needs root and iproute2; `HostsUnavailable` says why not.
"""
from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import socket
import subprocess
from typing import List, Mapping, Optional, Sequence

from app.utils.processes import pid_alive

PREFIX = "apptest-"
HOST_INTERFACE = "veth"
NETNS_ETC = "/etc/netns"
_serial = itertools.count()


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no `ip`, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _namespaces() -> List[str]:
    proc = _ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _remove_namespace(name: str) -> None:
    """Kill the processes inside namespace `name`, delete it and its /etc/netns files."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "delete", name, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


def _creator_alive(name: str) -> bool:
    """Whether the process that made namespace `name` (its pid is in the name) still runs."""
    try:
        pid = int(name[len(PREFIX):].split("-")[0])
    except ValueError:
        return True  # not one of ours after all: leave it
    return pid_alive(pid)


def remove_leftovers() -> List[str]:
    """Remove test namespaces whose creating process is gone; returns their names."""
    stale = [n for n in _namespaces() if n.startswith(PREFIX) and not _creator_alive(n)]
    for name in stale:
        _remove_namespace(name)
    return stale


def unavailable_reason() -> Optional[str]:
    """Why test hosts cannot be made here, or None when they can (root and `ip` present)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


class TestHosts:
    """`count` test hosts (network namespaces) on one private /24; see the module doc.

    `names[i]`, `addresses[i]` and `interfaces[i]` are host i's namespace, IPv4 address and
    interface. Use as a context manager: the namespaces, and every process left in them, are
    removed on exit, also when the body fails.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, count: int = 2, subnet: str = "10.77.0.0/24") -> None:
        if count < 2:
            raise ValueError(f"TestHosts needs at least 2 hosts, got count={count}")
        network = ipaddress.ip_network(subnet)
        self.prefix_length = network.prefixlen
        base = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.names = [f"{base}-h{i}" for i in range(count)]
        self.switch = f"{base}-sw" if count > 2 else None
        self.addresses = [str(network.network_address + i + 1) for i in range(count)]
        self.interfaces = [f"{HOST_INTERFACE}{i}" for i in range(count)]
        self._created: List[str] = []

    # ------------------------------------------------------------------ set-up / tear-down

    def __enter__(self) -> "TestHosts":
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        for name in self.names:
            self._add_namespace(name)
            self._write_hosts_file(name)
        if self.switch is None:
            a, b = self.names
            _ip("link", "add", self.interfaces[0], "netns", a, "type", "veth",
                "peer", "name", self.interfaces[1], "netns", b)
        else:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "switch", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "switch", "up")
            for i, name in enumerate(self.names):
                port = f"port{i}"
                _ip("link", "add", self.interfaces[i], "netns", name, "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "switch")
                _ip("-n", self.switch, "link", "set", port, "up")
        for i, name in enumerate(self.names):
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/{self.prefix_length}",
                "dev", self.interfaces[i])
            self.link_up(i)

    def _write_hosts_file(self, name: str) -> None:
        """/etc/hosts inside namespace `name`: the machine's host name is a loopback address."""
        directory = os.path.join(NETNS_ETC, name)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        except OSError as exc:
            raise HostsUnavailable(f"cannot write {directory}/hosts: {exc}") from exc

    def add_host_names(self, names: Mapping[str, str]) -> None:
        """Make every host resolve each name of `names` ({name: address}), as a cluster's DNS
        resolves its node names (a line per name in each host's /etc/hosts)."""
        lines = "".join(f"{address} {name}\n" for name, address in names.items())
        for name in self.names:
            with open(os.path.join(NETNS_ETC, name, "hosts"), "a") as f:
                f.write(lines)

    def close(self) -> None:
        """Remove the namespaces this object created (and the processes inside them)."""
        while self._created:
            _remove_namespace(self._created.pop())

    # ------------------------------------------------------------------ use

    def command(self, host: int, argv: Sequence[str]) -> List[str]:
        """`argv` as a command that runs inside host `host`."""
        return ["ip", "netns", "exec", self.names[host], *map(str, argv)]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside host `host` (subprocess.Popen keyword arguments pass through);
        `ip netns exec` execs the command, so the Popen's pid is the command's own."""
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside host `host` to completion (subprocess.run keyword arguments)."""
        return subprocess.run(self.command(host, argv), **kwargs)

    def link_down(self, host: int) -> None:
        """Cut host `host` off the link (its interface down): a network partition."""
        _ip("-n", self.names[host], "link", "set", self.interfaces[host], "down")

    def link_up(self, host: int) -> None:
        """Reconnect host `host` (its interface up again, with its address and route)."""
        _ip("-n", self.names[host], "link", "set", self.interfaces[host], "up")


__all__ = ["HostsUnavailable", "TestHosts", "remove_leftovers", "unavailable_reason"]
