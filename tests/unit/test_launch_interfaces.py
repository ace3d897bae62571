"""Socket-interface choice for ranks that span hosts: from the launcher's environment and what
the host sees (interfaces, the route to MASTER_ADDR) to the variables set, or one error line."""
import pytest

from app.launch.interfaces import (Interface, InterfaceError, Network, choose, describe_choice,
                                   nccl_default_is_loopback, observe, select_socket_interfaces,
                                   spans_hosts)

LO = Interface("lo", ("127.0.0.1",))
VETH0 = Interface("veth0", ("10.77.0.1",))
VETH1 = Interface("veth1", ("10.77.0.2",))
ETH0 = Interface("eth0", ("192.0.2.2",))
TWO_NODES = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.77.0.1"}


def network(route_source, *interfaces, master="10.77.0.1", master_ip="10.77.0.1", problem=""):
    return Network(master, master_ip, route_source, tuple(interfaces), problem)


def test_worker_host_uses_the_interface_that_routes_to_the_master():
    choice = choose(TWO_NODES, network("10.77.0.2", LO, ETH0, VETH1), "gloo")
    assert choice.settings == {"GLOO_SOCKET_IFNAME": "veth1"}
    assert choice.spans_hosts
    assert "LOCAL_WORLD_SIZE 1 < WORLD_SIZE 2" in choice.summary
    assert "10.77.0.2" in choice.summary and "MASTER_ADDR 10.77.0.1" in choice.summary


def test_master_host_uses_the_interface_that_holds_the_master_address():
    # the kernel answers a route to one of this host's own addresses with that address
    choice = choose(TWO_NODES, network("10.77.0.1", LO, ETH0, VETH0), "gloo")
    assert choice.settings == {"GLOO_SOCKET_IFNAME": "veth0"}


def test_master_elsewhere_means_several_hosts_without_a_local_size():
    env = {"WORLD_SIZE": "4", "MASTER_ADDR": "10.77.0.1"}  # e.g. mpirun with MASTER_ADDR given
    many, why = spans_hosts(env, network("10.77.0.2", LO, VETH1))
    assert many and "not an address of this host" in why
    assert choose(env, network("10.77.0.2", LO, VETH1), "gloo").settings == {
        "GLOO_SOCKET_IFNAME": "veth1"}


def test_deepspeed_launcher_local_size_counts():
    env = {"WORLD_SIZE": "4", "LOCAL_SIZE": "2", "MASTER_ADDR": "10.77.0.1"}
    assert spans_hosts(env, network("10.77.0.1", LO, VETH0)) == (True, "LOCAL_SIZE 2 < WORLD_SIZE 4")


def test_one_host_is_left_to_the_defaults():
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "192.0.2.2"}
    choice = choose(env, network("192.0.2.2", LO, ETH0, master="192.0.2.2",
                                 master_ip="192.0.2.2"), "gloo")
    assert choice.settings == {} and not choice.spans_hosts


def test_nodes_on_one_machine_behind_a_loopback_master_are_left_to_the_defaults():
    env = {"WORLD_SIZE": "2", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    choice = choose(env, network("127.0.0.1", LO, ETH0, master="127.0.0.1",
                                 master_ip="127.0.0.1"), "gloo")
    assert choice.settings == {} and not choice.spans_hosts


def test_the_users_setting_wins():
    env = dict(TWO_NODES, GLOO_SOCKET_IFNAME="eth0")
    choice = choose(env, network(None, LO, ETH0, problem="Network is unreachable"), "gloo")
    assert choice.settings == {}
    assert "kept your GLOO_SOCKET_IFNAME=eth0" in choice.summary


def test_no_route_to_the_master_is_one_line_naming_the_fix():
    with pytest.raises(InterfaceError) as raised:
        choose(TWO_NODES, network(None, LO, Interface("eth0", ("192.0.2.2",), up=False),
                                  problem="Network is unreachable"), "gloo")
    text = str(raised.value)
    assert "\n" not in text
    assert "MASTER_ADDR 10.77.0.1" in text and "Network is unreachable" in text
    assert "lo 127.0.0.1; eth0 192.0.2.2 (down)" in text
    assert "set GLOO_SOCKET_IFNAME" in text


def test_unresolvable_master_is_named():
    net = Network("trainer-0", None, None, (LO, VETH1), "Name or service not known")
    with pytest.raises(InterfaceError, match="MASTER_ADDR trainer-0 does not resolve .*"
                                             "Name or service not known"):
        choose(dict(TWO_NODES, MASTER_ADDR="trainer-0"), net, "gloo")


def test_a_route_through_loopback_is_refused_when_ranks_span_hosts():
    # the master's address is an alias on lo: other hosts cannot be reached through it
    lo_alias = Interface("lo", ("127.0.0.1", "10.77.0.1"))
    with pytest.raises(InterfaceError, match="loopback interface lo"):
        choose(TWO_NODES, network("10.77.0.1", lo_alias), "gloo")


def test_nccl_keeps_its_own_choice_unless_that_is_loopback():
    assert not nccl_default_is_loopback([LO, VETH1])
    assert choose(TWO_NODES, network("10.77.0.2", LO, VETH1), "nccl").settings == {
        "GLOO_SOCKET_IFNAME": "veth1"}
    docker = Interface("docker0", ("172.17.0.2",))
    assert nccl_default_is_loopback([LO, docker, Interface("eth1", ("10.0.0.3",), up=False)])
    env = dict(TWO_NODES, MASTER_ADDR="172.17.0.1")
    net = network("172.17.0.2", LO, docker, master="172.17.0.1", master_ip="172.17.0.1")
    assert choose(env, net, "nccl").settings == {"GLOO_SOCKET_IFNAME": "docker0",
                                                 "NCCL_SOCKET_IFNAME": "docker0"}
    assert choose(dict(env, NCCL_SOCKET_IFNAME="ib0"), net, "nccl").settings == {
        "GLOO_SOCKET_IFNAME": "docker0"}


def test_observe_sees_the_loopback_route():
    seen = observe("127.0.0.1", 29500)
    assert seen.master_ip == "127.0.0.1" and seen.route_source == "127.0.0.1"
    assert any(i.name == "lo" and "127.0.0.1" in i.addresses for i in seen.interfaces)


def test_select_changes_nothing_for_one_process_or_one_host():
    env = {"WORLD_SIZE": "1"}
    assert select_socket_interfaces("gloo", env).settings == {} and env == {"WORLD_SIZE": "1"}
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    before = dict(env)
    assert not select_socket_interfaces("gloo", env).spans_hosts
    assert env == before


def test_dry_run_line():
    level, message = describe_choice("gloo", {})
    assert level == "ok" and message.startswith("network: one process here")
    level, message = describe_choice("gloo", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                              "MASTER_ADDR": "127.0.0.1"})
    assert (level, message) == ("ok", "network: one host (MASTER_ADDR 127.0.0.1 is a loopback "
                                      "address): collectives use the default interfaces")
