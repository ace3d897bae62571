"""Which network interface the collectives use when the ranks span hosts.

gloo (and NCCL's socket transport) advertise one address of this host to the other ranks. By
default gloo takes the address its host name resolves to, and on many clusters /etc/hosts maps
the host name to a loopback address (127.0.1.1): the other hosts are then told to connect to
127.0.x.x and the process group fails with "Gloo connectFullMesh failed ... Connection refused".

`select_socket_interfaces`, called by app.launch.distributed.init_distributed before the process
group forms, makes that just work. When the world spans hosts (MASTER_ADDR is not loopback, and
LOCAL_WORLD_SIZE < WORLD_SIZE or MASTER_ADDR is not an address of this host) and
GLOO_SOCKET_IFNAME is not set, it sets GLOO_SOCKET_IFNAME to the interface whose address the
kernel would send from to reach MASTER_ADDR: the interface the other hosts can reach this one
on (a UDP socket's connect asks the kernel and sends nothing). With the nccl backend,
NCCL_SOCKET_IFNAME gets the same interface only where NCCL's own choice would be loopback (no
interface but lo, docker* and virbr*). A user's setting always wins; the choice is printed once
per host. If no interface reaches MASTER_ADDR, start-up stops with one line (InterfaceError)
naming MASTER_ADDR, the interfaces seen and the variable to set.

The decision (`choose`) is a pure function of the environment and the observed `Network`, so
it is tested without any network; `observe` gathers the facts (name resolution, the route to
MASTER_ADDR, the interfaces and their IPv4 addresses).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Dict, Mapping, MutableMapping, Optional, Sequence, Tuple

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
NCCL_VARIABLE = "NCCL_SOCKET_IFNAME"
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""Ranks on this host: torchrun / our MPI discovery, the deepspeed launcher, Open MPI."""
NCCL_SKIPPED_PREFIXES = ("lo", "docker", "virbr")
"""Interfaces NCCL passes over when it picks one itself (it takes them only if nothing else)."""


class InterfaceError(ValueError):
    """No interface of this host reaches MASTER_ADDR; the message says what to set."""


@dataclass(frozen=True)
class Interface:
    """One network interface: its name, IPv4 addresses and whether it is up."""

    name: str
    addresses: Tuple[str, ...]
    up: bool = True

    @property
    def loopback(self) -> bool:
        return self.name == "lo" or (bool(self.addresses) and all(
            ipaddress.ip_address(a).is_loopback for a in self.addresses))

    def describe(self) -> str:
        text = f"{self.name} {','.join(self.addresses) or '(no IPv4)'}"
        return text if self.up else text + " (down)"


@dataclass(frozen=True)
class Network:
    """What this host sees of the way to the master: the facts `choose` decides from.

    `master_ip` is MASTER_ADDR resolved to IPv4 (None: it does not resolve); `route_source` is
    the local address the kernel sends from to reach it (None: no route); `problem` says why
    one of them is missing.
    """

    master_addr: str
    master_ip: Optional[str]
    route_source: Optional[str]
    interfaces: Tuple[Interface, ...]
    problem: str = ""


@dataclass(frozen=True)
class Choice:
    """The variables to set (name -> interface), whether the ranks span hosts, and a one-line
    account of the decision."""

    settings: Dict[str, str] = field(default_factory=dict)
    summary: str = ""
    spans_hosts: bool = False


def _is_loopback(address: Optional[str]) -> bool:
    return address is not None and ipaddress.ip_address(address).is_loopback


def _seen(network: Network) -> str:
    return "; ".join(i.describe() for i in network.interfaces) or "none"


def spans_hosts(env: Mapping[str, str], network: Network) -> Tuple[bool, str]:
    """Whether the world's ranks run on more than one host, and the evidence.

    A loopback MASTER_ADDR means one host (only this host can reach it, e.g. several "nodes"
    started on one machine). Otherwise True when a launcher says fewer ranks run here than in
    the world (LOCAL_WORLD_SIZE, LOCAL_SIZE or OMPI_COMM_WORLD_LOCAL_SIZE < WORLD_SIZE), or
    when MASTER_ADDR is not one of this host's addresses (the master is elsewhere).
    """
    world = int(env.get("WORLD_SIZE", "1"))
    ip = network.master_ip
    if _is_loopback(ip):
        return False, f"MASTER_ADDR {network.master_addr} is a loopback address"
    for name in LOCAL_SIZE_VARIABLES:
        if env.get(name) and int(env[name]) < world:
            return True, f"{name} {env[name]} < WORLD_SIZE {world}"
    if ip is None:
        local_known = any(env.get(name) for name in LOCAL_SIZE_VARIABLES)
        return (not local_known,
                f"MASTER_ADDR {network.master_addr} does not resolve ({network.problem})")
    if not any(ip in i.addresses for i in network.interfaces):
        return True, f"MASTER_ADDR {network.master_addr} ({ip}) is not an address of this host"
    return False, f"all {world} ranks on this host"


def _interface_of(address: str, network: Network) -> Optional[Interface]:
    return next((i for i in network.interfaces if address in i.addresses), None)


def nccl_default_is_loopback(interfaces: Sequence[Interface]) -> bool:
    """Whether NCCL, left to itself, would pick a loopback interface: no up interface with an
    IPv4 address outside lo, docker* and virbr*."""
    return not any(i.up and i.addresses and not i.name.startswith(NCCL_SKIPPED_PREFIXES)
                   for i in interfaces)


def _fix(network: Network) -> str:
    return (f"set {GLOO_VARIABLE} (and {NCCL_VARIABLE} on GPUs) to the interface that reaches "
            f"the master host, or give every host the master's reachable address "
            f"(torchrun --master-addr, deepspeed --master_addr, MASTER_ADDR for mpirun); "
            f"interfaces seen: {_seen(network)}")


def _route_interface(network: Network, why: str) -> Interface:
    """The interface that routes to MASTER_ADDR; InterfaceError naming the fix otherwise."""
    master = f"MASTER_ADDR {network.master_addr}"
    if network.master_ip is None:
        raise InterfaceError(f"{master} does not resolve to an IPv4 address on this host "
                             f"({network.problem}) and the ranks span hosts ({why}): "
                             + _fix(network))
    if network.master_ip != network.master_addr:
        master += f" ({network.master_ip})"
    if network.route_source is None:
        raise InterfaceError(f"no network interface of this host reaches {master} "
                             f"({network.problem or 'no route'}), and the ranks span hosts "
                             f"({why}): " + _fix(network))
    found = _interface_of(network.route_source, network)
    if found is None:
        raise InterfaceError(f"the route to {master} leaves from {network.route_source}, which "
                             f"no interface lists, and the ranks span hosts ({why}): "
                             + _fix(network))
    if found.loopback or _is_loopback(network.route_source):
        raise InterfaceError(f"the route to {master} leaves through the loopback interface "
                             f"{found.name}, which other hosts cannot reach, but the ranks span "
                             f"hosts ({why}): " + _fix(network))
    return found


def choose(env: Mapping[str, str], network: Network, backend: str) -> Choice:
    """The socket interfaces for a world described by `env` (WORLD_SIZE, the local sizes, the
    *_SOCKET_IFNAME variables) on a host that sees `network`; raises InterfaceError when the
    ranks span hosts and no interface reaches MASTER_ADDR. Settings already in `env` are
    kept and reported, never replaced."""
    many, why = spans_hosts(env, network)
    if not many:
        return Choice({}, f"one host ({why}): collectives use the default interfaces")
    user = {name: env[name] for name in (GLOO_VARIABLE, NCCL_VARIABLE) if env.get(name)}
    kept = "; ".join(f"kept your {k}={v}" for k, v in user.items())
    wanted = [] if GLOO_VARIABLE in user else [GLOO_VARIABLE]
    if (backend == "nccl" and NCCL_VARIABLE not in user
            and nccl_default_is_loopback(network.interfaces)):
        wanted.append(NCCL_VARIABLE)
    if not wanted:
        return Choice({}, f"ranks span hosts ({why}): {kept or 'nothing to set'}", True)
    interface = _route_interface(network, why)
    settings = {name: interface.name for name in wanted}
    chosen = ", ".join(f"{k}={v}" for k, v in settings.items())
    return Choice(settings, f"ranks span hosts ({why}): {chosen} ({interface.name} has "
                            f"{network.route_source}, the address that routes to MASTER_ADDR "
                            f"{network.master_addr}){'; ' + kept if kept else ''}; set "
                            f"{GLOO_VARIABLE} to choose another", True)


def external_address(interfaces: Sequence[Interface]) -> Optional[str]:
    """The first IPv4 address of an up, non-loopback interface (None: there is none)."""
    return next((i.addresses[0] for i in interfaces if i.up and i.addresses and not i.loopback),
                None)


def local_interfaces() -> Tuple[Interface, ...]:
    """This host's interfaces with their IPv4 addresses and up/down state (psutil)."""
    import psutil
    stats = psutil.net_if_stats()
    found = []
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        ipv4 = tuple(a.address for a in addresses if a.family == socket.AF_INET)
        found.append(Interface(name, ipv4, stats[name].isup if name in stats else False))
    return tuple(found)


def observe(master_addr: str, master_port: int) -> Network:
    """Resolve `master_addr`, ask the kernel which local address routes to it (a UDP socket's
    connect sends nothing) and list the interfaces."""
    interfaces = local_interfaces()
    try:
        master_ip = socket.getaddrinfo(master_addr, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError) as exc:
        return Network(master_addr, None, None, interfaces, str(exc))
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_ip, master_port))
        return Network(master_addr, master_ip, probe.getsockname()[0], interfaces)
    except OSError as exc:
        return Network(master_addr, master_ip, None, interfaces, exc.strerror or str(exc))
    finally:
        probe.close()


def describe_choice(backend: str, env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """(level, message) for --dry-run: what `select_socket_interfaces` would set under this
    launcher environment ("ok"), or its InterfaceError ("ERROR"); nothing is set."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) <= 1 or not env.get("MASTER_ADDR"):
        return "ok", (f"network: one process here, no launcher environment; ranks that span "
                      f"hosts get {GLOO_VARIABLE} = the interface that routes to MASTER_ADDR")
    try:
        network = observe(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "29500")))
        return "ok", "network: " + choose(env, network, backend).summary
    except InterfaceError as exc:
        return "ERROR", f"network: {exc}"


_REPORTED = False


def select_socket_interfaces(backend: str,
                             env: Optional[MutableMapping[str, str]] = None) -> Choice:
    """Set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME where needed) in `env` (os.environ) as
    `choose` decides, printing the choice once per host (local rank 0); call before the
    process group forms. A world of one, or one without MASTER_ADDR, is left alone; nothing is
    printed for a world on one host."""
    global _REPORTED
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) <= 1 or not env.get("MASTER_ADDR"):
        return Choice()
    network = observe(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "29500")))
    choice = choose(env, network, backend)
    env.update(choice.settings)
    if choice.spans_hosts and not _REPORTED and env.get("LOCAL_RANK", "0") == "0":
        print(f"> network interfaces on {socket.gethostname()}: {choice.summary}",
              file=sys.stdout, flush=True)
        _REPORTED = True
    return choice


__all__ = ["Choice", "Interface", "InterfaceError", "Network", "choose", "describe_choice",
           "external_address", "local_interfaces", "nccl_default_is_loopback", "observe", "select_socket_interfaces",
           "spans_hosts"]
