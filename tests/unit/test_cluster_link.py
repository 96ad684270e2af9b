"""sparkfleet.fleet.cluster_link: the two-Spark link preflight (issue 17 point 2).

The command outputs under tests/fixtures/cluster/ are written to the documented formats of
ibdev2netdev and iproute2 (see the README there); each fault scenario holds only what differs from
the healthy pair. Every refusal is asserted as the exact line an operator reads.
"""

from __future__ import annotations

import dataclasses
import json
from ipaddress import IPv4Interface
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.fleet import cluster_link as cl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cluster"
HOSTS = ("spark-a", "spark-b")
OUTPUTS = ("ibdev2netdev.txt", "ip-d-j-link.json", "ip-d-link.txt", "ip-j-addr.json")
SCENARIOS = ("healthy", "mtu-1500", "link-down", "wrong-hca")
IFACE = "enp1s0f0np0"


def output(scenario: str, host: str, name: str) -> str:
    """A scenario's own output for the host, else the healthy pair's."""
    path = FIXTURES / scenario / host / name
    if not path.exists():
        path = FIXTURES / "healthy" / host / name
    return path.read_text(encoding="utf-8")


def facts(scenario: str) -> dict[str, dict[str, Any]]:
    healthy = yaml.safe_load((FIXTURES / "healthy" / "facts.yaml").read_text(encoding="utf-8"))
    nodes = {host: dict(values) for host, values in healthy["nodes"].items()}
    override = FIXTURES / scenario / "facts.yaml"
    if scenario != "healthy" and override.exists():
        for host, values in yaml.safe_load(override.read_text(encoding="utf-8"))["nodes"].items():
            nodes[host].update(values)
    return nodes


def node(scenario: str, host: str) -> cl.NodeFacts:
    known = facts(scenario)[host]
    return cl.node_facts(
        host,
        ip_link=output(scenario, host, "ip-d-j-link.json"),
        ip_addr=output(scenario, host, "ip-j-addr.json"),
        ibdev2netdev=output(scenario, host, "ibdev2netdev.txt"),
        env=known["env"],
        wheel=known["wheel"],
        patch_set=known["patch_set"],
        revisions=known["revisions"],
        profile=known["profile"],
        clock=cl.ClockReading(**known["clock"]),
        reached=known["reached"],
    )


def pair(scenario: str = "healthy") -> list[cl.NodeFacts]:
    return [node(scenario, host) for host in HOSTS]


def with_env(facts_: cl.NodeFacts, **env: str | None) -> cl.NodeFacts:
    merged = dict(facts_.env)
    for key, value in env.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return dataclasses.replace(facts_, env=merged)


def check(nodes: list[cl.NodeFacts], **kwargs: Any) -> list[str]:
    return cl.check_cluster(nodes, IFACE, **kwargs)


# --- the fixtures themselves ---------------------------------------------------------------------


def test_the_fixture_set_is_what_the_readme_describes() -> None:
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    for scenario in SCENARIOS:
        assert (FIXTURES / scenario).is_dir(), scenario
        assert f"`{scenario}/`" in readme, f"README.md does not describe {scenario}/"
    for host in HOSTS:
        for name in OUTPUTS:
            assert (FIXTURES / "healthy" / host / name).is_file(), f"healthy/{host}/{name}"
    assert "/work/" not in readme and "/tmp/" not in readme


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("host", HOSTS)
def test_every_fixture_parses(scenario: str, host: str) -> None:
    links = cl.parse_ip_link(output(scenario, host, "ip-d-j-link.json"))
    assert {"lo", "enP7s7", "enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1"} == set(links)
    assert all(link.mtu > 0 and link.operstate for link in links.values())
    rdma = cl.parse_ibdev2netdev(output(scenario, host, "ibdev2netdev.txt"))
    assert [(port.device, port.port, port.netdev) for port in rdma] == [
        ("roceP2p1s0f0", 1, "enP2p1s0f0np0"),
        ("roceP2p1s0f1", 1, "enP2p1s0f1np1"),
        ("rocep1s0f0", 1, "enp1s0f0np0"),
        ("rocep1s0f1", 1, "enp1s0f1np1"),
    ]
    addresses = cl.parse_ip_addr(output(scenario, host, "ip-j-addr.json"))
    assert set(addresses) == set(links), "ip addr and ip link list the same interfaces"
    assert addresses["lo"] == (IPv4Interface("127.0.0.1/8"),)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("host", HOSTS)
def test_the_text_and_json_forms_of_ip_link_agree(scenario: str, host: str) -> None:
    from_json = cl.parse_ip_link_json(output(scenario, host, "ip-d-j-link.json"))
    from_text = cl.parse_ip_link_text(output(scenario, host, "ip-d-link.txt"))
    assert from_text == from_json
    assert cl.parse_ip_link(output(scenario, host, "ip-d-link.txt")) == from_json  # dispatch on the form


def test_compact_json_as_ip_prints_it_without_p_parses_the_same() -> None:
    pretty = output("healthy", "spark-a", "ip-d-j-link.json")
    compact = json.dumps(json.loads(pretty), separators=(",", ":"))
    assert cl.parse_ip_link(compact) == cl.parse_ip_link(pretty)


def test_healthy_fixture_facts() -> None:
    a = node("healthy", "spark-a")
    assert a.links[IFACE] == cl.Link(IFACE, ("BROADCAST", "MULTICAST", "UP", "LOWER_UP"), 9000, "UP")
    assert a.links[IFACE].admin_up and a.links[IFACE].carrier
    assert a.ipv4[IFACE] == (IPv4Interface("192.168.100.10/24"),)
    assert a.ipv4["enP2p1s0f0np0"] == (IPv4Interface("192.168.101.10/24"),)
    assert a.ipv4["enp1s0f1np1"] == ()
    down = node("link-down", "spark-b").links[IFACE]
    assert down.admin_up and not down.carrier and down.operstate == "DOWN"
    assert node("mtu-1500", "spark-b").links[IFACE].mtu == 1500


# --- parsers on the documented examples and on bad input -----------------------------------------

NVIDIA_IBDEV2NETDEV = """\
roceP2p1s0f0 port 1 ==> enP2p1s0f0np0 (Down)
roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)
rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)
rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)
"""

NVIDIA_IP_ADDR_TEXT = """\
4: enp1s0f1np1: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP group default qlen 1000
    link/ether 3c:6d:66:cc:b3:b7 brd ff:ff:ff:ff:ff:ff
    inet 192.168.100.10/24 brd 192.168.100.255 scope global noprefixroute enp1s0f1np1
      valid_lft forever preferred_lft forever
    inet6 fe80::3e6d:66ff:fecc:b3b7/64 scope link
      valid_lft forever preferred_lft forever
"""


def test_ibdev2netdev_reads_nvidia_s_documented_example() -> None:
    ports = cl.parse_ibdev2netdev(NVIDIA_IBDEV2NETDEV)
    assert ports[1] == cl.RdmaPort("roceP2p1s0f1", 1, "enP2p1s0f1np1", "Up")
    assert [port.state for port in ports] == ["Down", "Up", "Down", "Up"]
    assert cl.parse_ibdev2netdev("\n") == ()


@pytest.mark.parametrize(
    "line",
    [
        "0000:01:00.0 rocep1s0f0 (MT4129 - NA) fw 28.45.1200 port 1 (ACTIVE) ==> enp1s0f0np0 (Up)",
        "mlx5_0 port 1 <===> ib0",
        "rocep1s0f0 port one ==> enp1s0f0np0 (Up)",
    ],
)
def test_ibdev2netdev_refuses_other_formats_naming_the_line(line: str) -> None:
    with pytest.raises(cl.ClusterLinkError) as caught:
        cl.parse_ibdev2netdev(NVIDIA_IBDEV2NETDEV + line + "\n", source="spark-a ibdev2netdev")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("spark-a ibdev2netdev line 5 is not '<device> port <n> ==> <netdev> (<state>)'")
    assert repr(line) in message
    assert "without -v" in message


def test_ip_link_text_reads_the_header_of_nvidia_s_ip_addr_example() -> None:
    assert cl.parse_ip_link_text(NVIDIA_IP_ADDR_TEXT) == {
        "enp1s0f1np1": cl.Link("enp1s0f1np1", ("BROADCAST", "MULTICAST", "UP", "LOWER_UP"), 1500, "UP")
    }


def test_ip_link_text_reads_a_link_without_state_and_a_veth_peer_name() -> None:
    text = "7: sfv-b@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue master br0 state UP mode DEFAULT\n"
    assert cl.parse_ip_link_text(text)["sfv-b"].operstate == "UP"
    bare = cl.parse_ip_link_text("3: dummy0: <BROADCAST,NOARP> mtu 1500\n")
    assert bare["dummy0"] == cl.Link("dummy0", ("BROADCAST", "NOARP"), 1500, "UNKNOWN")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "ip -d link show printed no link"),
        ("garbage\n", "ip -d link show printed no link"),
        ("[{]", "ip -d -j link show is not JSON"),
        ('{"ifname": "x"}', "ip -d -j link show is not a JSON list of links"),
        ('[{"ifname": "x", "flags": [], "operstate": "UP"}]', "ip -d -j link show: link 'x' has no mtu"),
    ],
)
def test_ip_link_refuses_what_it_cannot_read(text: str, expected: str) -> None:
    with pytest.raises(cl.ClusterLinkError, match="^" + expected):
        cl.parse_ip_link(text)


def test_ip_addr_refuses_text_output_and_bad_addresses() -> None:
    with pytest.raises(cl.ClusterLinkError, match="^ip -j addr show is not JSON.*run ip -j addr show"):
        cl.parse_ip_addr(NVIDIA_IP_ADDR_TEXT)
    bad = '[{"ifname": "e", "addr_info": [{"family": "inet", "local": "300.1.1.1", "prefixlen": 24}]}]'
    with pytest.raises(cl.ClusterLinkError, match="^ip -j addr show: e has a bad IPv4 address '300.1.1.1/24'"):
        cl.parse_ip_addr(bad)


def test_ip_addr_keeps_ipv4_only_in_listed_order() -> None:
    text = json.dumps(
        [
            {
                "ifname": "e",
                "addr_info": [
                    {"family": "inet6", "local": "fe80::1", "prefixlen": 64},
                    {"family": "inet", "local": "192.168.100.10", "prefixlen": 24},
                    {"family": "inet", "local": "169.254.35.62", "prefixlen": 16},
                ],
            }
        ]
    )
    assert cl.parse_ip_addr(text) == {"e": (IPv4Interface("192.168.100.10/24"), IPv4Interface("169.254.35.62/16"))}


# --- NCCL's and Gloo's interface-name rules ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "name", "port", "selected"),
    [
        # a plain entry is a prefix
        ("enp1s0f0np0", "enp1s0f0np0", -1, True),
        ("enp1s0f0", "enp1s0f0np0", -1, True),
        ("enp1s0f0", "enp1s0f1np1", -1, False),
        ("en", "enP7s7", -1, True),
        ("enp", "enP2p1s0f0np0", -1, False),  # case matters: strncmp
        # '=' makes every entry of the list exact
        ("=enp1s0f0np0", "enp1s0f0np0", -1, True),
        ("=enp1s0f0", "enp1s0f0np0", -1, False),
        ("=eth0,eth1", "eth1", -1, True),
        ("=eth0,eth1", "eth10", -1, False),
        # '^' excludes, and '^=' excludes exact names
        ("^docker", "docker0", -1, False),
        ("^docker", "enp1s0f0np0", -1, True),
        ("^lo,docker", "lo", -1, False),
        ("^=docker0", "docker0", -1, False),
        ("^=docker0", "docker01", -1, True),
        # only the first character is special: '=^x' is an exact match of '^x'
        ("=^x", "^x", -1, True),
        ("=^x", "x", -1, False),
        # a second '=' is part of the name
        ("=a,=b", "b", -1, False),
        ("=a,=b", "=b", -1, True),
        # comma lists, empty entries skipped
        ("rocep1s0f0,roceP2p1s0f0", "roceP2p1s0f0", 1, True),
        ("rocep1s0f0,,roceP2p1s0f0", "roceP2p1s0f0", 1, True),
        ("rocep1s0f0,roceP2p1s0f0", "rocep1s0f1", 1, False),
        # ':port' narrows to one port; NCCL 2.23+'s ':port:rail:plane' tail is ignored here
        ("rocep1s0f0:1", "rocep1s0f0", 1, True),
        ("rocep1s0f0:2", "rocep1s0f0", 1, False),
        ("rocep1s0f0:1:0:0", "rocep1s0f0", 1, True),
        ("rocep1s0f0:", "rocep1s0f0", 2, True),  # an empty port means any port
        ("=rocep1s0f0:1", "rocep1s0f0", 1, True),
        ("^rocep1s0f1,roceP2p1s0f1", "rocep1s0f0", 1, True),
        ("^rocep1s0f1,roceP2p1s0f1", "roceP2p1s0f1", 1, False),
        # an interface has no port: any ':port' matches it (NCCL passes -1)
        ("enp1s0f0np0:1", "enp1s0f0np0", -1, True),
        # an empty list matches everything, and '^' of an empty list nothing
        ("", "anything", -1, True),
        ("^", "anything", -1, False),
    ],
)
def test_nccl_matching_follows_nccl_s_own_rules(value: str, name: str, port: int, selected: bool) -> None:
    assert cl.nccl_selects(value, name, port) is selected


def test_nccl_list_parse() -> None:
    assert cl.parse_nccl_list("^=a:1,b") == cl.NcclList(exclude=True, exact=True, entries=(("a", 1), ("b", -1)))
    assert cl.parse_nccl_list("=:1,x") == cl.NcclList(exclude=False, exact=True, entries=(("x", -1),))


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("enp1s0f0np0", ("enp1s0f0np0",)),
        ("enp1s0f0np0,enP2p1s0f0np0", ("enp1s0f0np0", "enP2p1s0f0np0")),
        ("=enp1s0f0np0", ("=enp1s0f0np0",)),  # Gloo has no NCCL syntax: this names an interface '=enp1s0f0np0'
        ("e", ()),  # PyTorch ignores a value of one character
        ("", ()),
    ],
)
def test_gloo_names_are_exact_interface_names(value: str, names: tuple[str, ...]) -> None:
    assert cl.gloo_interfaces(value) == names


def test_the_halves_of_a_cx7_port_are_the_same_function_on_both_pci_domains() -> None:
    netdevs = ["enP7s7", "enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1"]
    assert cl.port_halves("enp1s0f0np0", netdevs) == ("enp1s0f0np0", "enP2p1s0f0np0")
    assert cl.port_halves("enP2p1s0f1np1", netdevs) == ("enp1s0f1np1", "enP2p1s0f1np1")
    assert cl.port_halves("enP7s7", netdevs) == ("enP7s7",)
    assert cl.port_halves("eth0", netdevs) == ("eth0",)


# --- the pair, healthy and with each recorded fault ----------------------------------------------


def test_a_healthy_pair_has_no_problems() -> None:
    assert check(pair()) == []


def test_mtu_1500_on_one_node_is_one_refusal_naming_host_interfaces_and_value() -> None:
    assert check(pair("mtu-1500")) == [
        "spark-b: enp1s0f0np0 has MTU 1500 and enP2p1s0f0np0 has MTU 1500, the cluster link needs 9000: "
        "set mtu: 9000 for enp1s0f0np0 and enP2p1s0f0np0 in netplan and re-run"
    ]


def test_an_unplugged_cable_is_refused_on_each_node() -> None:
    assert check(pair("link-down")) == [
        "spark-a: enp1s0f0np0 has no carrier (state DOWN): check the QSFP cable between the two CX7 ports "
        "and that the peer's port is up, then re-run",
        "spark-b: enp1s0f0np0 has no carrier (state DOWN): check the QSFP cable between the two CX7 ports "
        "and that the peer's port is up, then re-run",
    ]


def test_nccl_ib_hca_for_the_other_port_is_one_refusal_naming_both_sets() -> None:
    assert check(pair("wrong-hca")) == [
        "spark-b: NCCL_IB_HCA='rocep1s0f1,roceP2p1s0f1' selects rocep1s0f1 (enp1s0f1np1), "
        "roceP2p1s0f1 (enP2p1s0f1np1), but enp1s0f0np0's port is rocep1s0f0 (enp1s0f0np0), "
        "roceP2p1s0f0 (enP2p1s0f0np0): set NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0 and re-run"
    ]


def test_the_mtu_asked_for_is_the_one_checked() -> None:
    problems = check(pair(), mtu=4200)
    assert len(problems) == 2
    assert problems[0].startswith("spark-a: enp1s0f0np0 has MTU 9000 and enP2p1s0f0np0 has MTU 9000, the cluster")


def test_an_interface_brought_down_by_hand_is_administratively_down() -> None:
    a, b = pair()
    down = dataclasses.replace(b.links[IFACE], flags=("BROADCAST", "MULTICAST"), operstate="DOWN")
    b = dataclasses.replace(b, links={**b.links, IFACE: down})
    assert check([a, b]) == [
        "spark-b: enp1s0f0np0 is administratively down (state DOWN): bring it up (netplan apply, "
        "or ip link set enp1s0f0np0 up) and re-run"
    ]


def test_a_missing_interface_names_the_ones_there() -> None:
    problems = cl.check_cluster(pair(), "enp9s0f0np0")
    assert problems[0] == (
        "spark-a: enp9s0f0np0 does not exist (ip link lists lo, enP7s7, enp1s0f0np0, enp1s0f1np1, enP2p1s0f0np0, "
        "enP2p1s0f1np1): set the cluster interface to the CX7 port ibdev2netdev shows (Up) and re-run"
    )
    assert len(problems) == 2, "the checks that need the interface are left out while it does not exist"
    assert problems[1].startswith("spark-b: enp9s0f0np0 does not exist")


def test_an_interface_in_another_state_is_named() -> None:
    a, b = pair()
    b = dataclasses.replace(b, links={**b.links, IFACE: dataclasses.replace(b.links[IFACE], operstate="DORMANT")})
    assert check([a, b]) == [
        "spark-b: enp1s0f0np0 is DORMANT, not UP: bring the link up (ip link show enp1s0f0np0 says why) and re-run"
    ]


def test_no_address_on_the_interface() -> None:
    a, b = pair()
    b = dataclasses.replace(b, ipv4={**b.ipv4, IFACE: ()})
    assert check([a, b]) == [
        "spark-b: enp1s0f0np0 has no IPv4 address: give it a static one in netplan (the same subnet on every "
        "node, one address each) and re-run"
    ]


def test_the_same_address_on_two_nodes() -> None:
    a, b = pair()
    b = dataclasses.replace(b, ipv4={**b.ipv4, IFACE: a.ipv4[IFACE]}, reached=frozenset({"192.168.100.10"}))
    b = with_env(b, VLLM_HOST_IP="192.168.100.10")
    assert check([a, b]) == [
        "spark-a and spark-b both have 192.168.100.10 on enp1s0f0np0: give each node its own address in netplan "
        "and re-run"
    ]


def test_a_peer_address_that_did_not_answer() -> None:
    a, b = pair()
    a = dataclasses.replace(a, reached=frozenset())
    assert check([a, b]) == [
        "spark-a: no ping answer from spark-b's 192.168.100.11 on enp1s0f0np0: check that both addresses are in "
        "one subnet and that nothing filters the link, then re-run"
    ]


def test_every_address_of_the_peer_must_answer() -> None:
    a, b = pair()
    b = dataclasses.replace(
        b, ipv4={**b.ipv4, IFACE: (IPv4Interface("192.168.100.11/24"), IPv4Interface("169.254.7.2/16"))}
    )
    assert check([a, b]) == [
        "spark-a: no ping answer from spark-b's 169.254.7.2 on enp1s0f0np0: check that both addresses are in "
        "one subnet and that nothing filters the link, then re-run"
    ]


# --- NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, VLLM_HOST_IP per node --------------------


def on_spark_b(**env: str | None) -> list[str]:
    """The check's problems when spark-b's environment has ``env`` (None: unset) and spark-a is healthy."""
    a, b = pair()
    return check([a, with_env(b, **env)])


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        *(("NCCL_SOCKET_IFNAME", value) for value in ("enp1s0f0np0", "=enp1s0f0np0", "enp1s0f0n", "^lo,enP,enp1s0f1")),
        # both halves of the cabled port
        ("NCCL_IB_HCA", "rocep1s0f0,roceP2p1s0f0"),
        ("NCCL_IB_HCA", "=rocep1s0f0,roceP2p1s0f0"),
        ("NCCL_IB_HCA", "=rocep1s0f0:1,roceP2p1s0f0:1"),
        ("NCCL_IB_HCA", "^rocep1s0f1,roceP2p1s0f1"),
        ("NCCL_IB_HCA", "^=rocep1s0f1,roceP2p1s0f1"),
    ],
)
def test_nccl_values_that_select_the_link_alone(variable: str, value: str) -> None:
    assert on_spark_b(**{variable: value}) == []


# values that select other devices than the link's: what each selects, by variable
SELECTS_OTHER = {
    "NCCL_SOCKET_IFNAME": {
        "en": "enP7s7, enp1s0f0np0, enp1s0f1np1, enP2p1s0f0np0, enP2p1s0f1np1",
        "^lo,docker": "enP7s7, enp1s0f0np0, enp1s0f1np1, enP2p1s0f0np0, enP2p1s0f1np1",
        "enP7s7": "enP7s7",
        "=enp1s0f0": "no interface",
        "enp1s0f0np0,enP2p1s0f0np0": "enp1s0f0np0, enP2p1s0f0np0",
    },
    "NCCL_IB_HCA": {
        "roce": "rocep1s0f0 (enp1s0f0np0), rocep1s0f1 (enp1s0f1np1), roceP2p1s0f0 (enP2p1s0f0np0), "
        "roceP2p1s0f1 (enP2p1s0f1np1)",
        "rocep1s0f": "rocep1s0f0 (enp1s0f0np0), rocep1s0f1 (enp1s0f1np1)",
        "=rocep1s0f0": "rocep1s0f0 (enp1s0f0np0)",  # half the port: half the bandwidth
        "rocep1s0f0:2,roceP2p1s0f0:2": "no RDMA device",
        "mlx5": "no RDMA device",
    },
}
# what the refusal says after "selects ...,", by variable
THE_FIX = {
    "NCCL_SOCKET_IFNAME": "not enp1s0f0np0 alone: set NCCL_SOCKET_IFNAME=enp1s0f0np0 and re-run",
    "NCCL_IB_HCA": "but enp1s0f0np0's port is rocep1s0f0 (enp1s0f0np0), roceP2p1s0f0 (enP2p1s0f0np0): "
    "set NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0 and re-run",
}


@pytest.mark.parametrize(
    ("variable", "value"), [(variable, value) for variable, values in SELECTS_OTHER.items() for value in values]
)
def test_nccl_values_that_select_other_devices_are_named_with_what_they_select(variable: str, value: str) -> None:
    selects = SELECTS_OTHER[variable][value]
    assert on_spark_b(**{variable: value}) == [f"spark-b: {variable}={value!r} selects {selects}, {THE_FIX[variable]}"]


@pytest.mark.parametrize("value", [None, "", "e"])
def test_nccl_socket_ifname_unset_or_too_short_for_nccl(value: str | None) -> None:
    a, b = pair()
    assert check([with_env(a, NCCL_SOCKET_IFNAME=value), b]) == [
        "spark-a: NCCL_SOCKET_IFNAME is not set, so NCCL picks an interface itself (it may take the management "
        "port): set NCCL_SOCKET_IFNAME=enp1s0f0np0 and re-run"
    ]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("enp1s0f0np0", None),
        (
            "enp1s0f0",
            "spark-b: GLOO_SOCKET_IFNAME='enp1s0f0' names enp1s0f0, not enp1s0f0np0 alone (Gloo takes exact "
            "interface names): set GLOO_SOCKET_IFNAME=enp1s0f0np0 and re-run",
        ),
        (
            "enp1s0f0np0,enP7s7",
            "spark-b: GLOO_SOCKET_IFNAME='enp1s0f0np0,enP7s7' names enp1s0f0np0, enP7s7, not enp1s0f0np0 alone "
            "(Gloo takes exact interface names): set GLOO_SOCKET_IFNAME=enp1s0f0np0 and re-run",
        ),
        (
            None,
            "spark-b: GLOO_SOCKET_IFNAME is not set, so Gloo binds to the address the host name resolves to: "
            "set GLOO_SOCKET_IFNAME=enp1s0f0np0 and re-run",
        ),
    ],
)
def test_gloo_socket_ifname(value: str | None, problem: str | None) -> None:
    assert on_spark_b(GLOO_SOCKET_IFNAME=value) == ([problem] if problem else [])


@pytest.mark.parametrize("value", [None, ""])
def test_nccl_ib_hca_unset(value: str | None) -> None:
    a, b = pair()
    assert check([with_env(a, NCCL_IB_HCA=value), b]) == [
        "spark-a: NCCL_IB_HCA is not set, so NCCL uses every active RDMA port it finds: "
        "set NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0 (the halves of enp1s0f0np0's port) and re-run"
    ]


def test_no_rdma_device_on_the_interface() -> None:
    a, b = pair()
    b = dataclasses.replace(b, rdma=tuple(port for port in b.rdma if port.device.startswith("rocep1s0f1")))
    assert check([a, b]) == [
        "spark-b: ibdev2netdev maps no RDMA device to enp1s0f0np0 or its other half: check that the mlx5 driver "
        "is loaded and that enp1s0f0np0 is a CX7 port, then re-run"
    ]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            None,
            "spark-b: VLLM_HOST_IP is not set, so vLLM advertises the address of its default route (the "
            "management network): set VLLM_HOST_IP=192.168.100.11 (enp1s0f0np0's address) and re-run",
        ),
        (
            "10.20.0.22",
            "spark-b: VLLM_HOST_IP=10.20.0.22 is not an address of enp1s0f0np0 (192.168.100.11): "
            "set VLLM_HOST_IP=192.168.100.11 and re-run",
        ),
    ],
)
def test_vllm_host_ip(value: str | None, problem: str) -> None:
    assert on_spark_b(VLLM_HOST_IP=value) == [problem]


# --- same stack on every node ---------------------------------------------------------------------


def test_a_different_wheel_patch_set_and_profile_are_each_named_against_the_head() -> None:
    a, b = pair()
    b = dataclasses.replace(b, wheel="0.23.0+sf0000000001", patch_set="sf0000000001", profile="dflash")
    assert check([a, b]) == [
        "spark-b runs vLLM wheel 0.23.0+sf0000000001 but spark-a runs 0.23.0+sf3c5e0a9d71: deploy one wheel to "
        "every node and re-run",
        "spark-b has patch set sf0000000001 but spark-a has sf3c5e0a9d71: deploy one wheel to every node and re-run",
        "spark-b serves profile dflash but spark-a serves dense: deploy the same profile to every node and re-run",
    ]


def test_weights_revisions_that_differ_or_are_missing() -> None:
    a, b = pair()
    drafter = "z-lab/Qwen3.5-122B-A10B-DFlash"
    target = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
    b = dataclasses.replace(
        b, revisions={target: "a" * 40, "extra/model": "b" * 40}
    )  # the drafter is missing on spark-b, a model only spark-b has
    assert check([a, b]) == [
        f"spark-b has weights {target} at {'a' * 40} but spark-a at {a.revisions[target]}: pin and fetch the same "
        "revisions on every node and re-run",
        f"spark-b has weights extra/model at {'b' * 40}, spark-a has none: pin and fetch the same revisions on "
        "every node and re-run",
        f"spark-b lacks weights {drafter} (spark-a has {a.revisions[drafter]}): pin and fetch the same revisions on "
        "every node and re-run",
    ]


# --- clocks ---------------------------------------------------------------------------------------


def clocked(facts_: cl.NodeFacts, offset_s: float, uncertainty_s: float = 0.005) -> cl.NodeFacts:
    return dataclasses.replace(facts_, clock=cl.ClockReading(1000.0 + offset_s, 1000.0, uncertainty_s))


def test_clock_offsets_are_measured_against_the_controller() -> None:
    assert cl.ClockReading(node_s=105.5, controller_s=100.0, uncertainty_s=0.1).offset_s == 5.5


def test_clocks_within_the_bound_pass_and_a_skew_beyond_it_names_both_nodes() -> None:
    a, b = pair()
    assert check([clocked(a, 0.0), clocked(b, 0.9)]) == []
    assert check([clocked(a, 0.0), clocked(b, -2.35, 0.01)]) == [
        "spark-a and spark-b clocks differ by 2.350 s (±0.015 s), more than 1 s: turn on NTP on every node "
        "(timedatectl set-ntp true; chronyc tracking shows the offset) and re-run"
    ]


def test_a_skew_the_uncertainty_cannot_rule_out_is_refused() -> None:
    a, b = pair()
    assert check([clocked(a, 0.0, 0.2), clocked(b, 0.7, 0.2)], max_clock_skew_s=1.0) == [
        "spark-a and spark-b clocks differ by 0.700 s (±0.400 s), more than 1 s: turn on NTP on every node "
        "(timedatectl set-ntp true; chronyc tracking shows the offset) and re-run"
    ]
    assert check([clocked(a, 0.0, 0.2), clocked(b, 0.7, 0.2)], max_clock_skew_s=2.0) == []


# --- more than two nodes, and bad calls -----------------------------------------------------------


def test_three_nodes_are_checked_pairwise() -> None:
    a, b = pair()
    c = dataclasses.replace(
        b,
        host="spark-c",
        ipv4={**b.ipv4, IFACE: (IPv4Interface("192.168.100.12/24"),)},
        env={**b.env, "VLLM_HOST_IP": "192.168.100.12"},
        reached=frozenset({"192.168.100.10", "192.168.100.11"}),
    )
    a = dataclasses.replace(a, reached=frozenset({"192.168.100.11", "192.168.100.12"}))
    assert check([a, b, c]) == [
        "spark-b: no ping answer from spark-c's 192.168.100.12 on enp1s0f0np0: check that both addresses are in "
        "one subnet and that nothing filters the link, then re-run"
    ]


def test_bad_calls_are_one_line_errors() -> None:
    a, b = pair()
    with pytest.raises(cl.ClusterLinkError, match=r"^check_cluster needs two or more nodes, got 1 \(spark-a\)"):
        cl.check_cluster([a], IFACE)
    with pytest.raises(cl.ClusterLinkError, match="^check_cluster got spark-a twice"):
        cl.check_cluster([a, a], IFACE)
    with pytest.raises(cl.ClusterLinkError, match="^mtu must be a positive number of bytes, got 0"):
        cl.check_cluster([a, b], IFACE, mtu=0)
    with pytest.raises(cl.ClusterLinkError, match="^max_clock_skew_s must be positive, got -1"):
        cl.check_cluster([a, b], IFACE, max_clock_skew_s=-1)
    with pytest.raises(cl.ClusterLinkError, match="^interface must name a network interface, got ''"):
        cl.check_cluster([a, b], "")
