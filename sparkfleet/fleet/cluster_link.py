"""The link preflight for serving one model on two (or more) Sparks over the CX7 link (issue 17).

Before a multi-node unit starts, every node must agree on the link and on what it serves:

- the cluster interface exists, is UP and has carrier, with the MTU the link needs (9000) on it and
  on the other half of the same QSFP port (a GB10 shows each CX7 port as two PCIe x4 functions on
  two PCI domains: ``enp1s0f0np0`` and ``enP2p1s0f0np0`` are one port; see ``port_halves``);
- each node has its own IPv4 address on it and every node answered every other's ping on it;
- ``NCCL_SOCKET_IFNAME`` selects that interface and nothing else under NCCL's own matching rules,
  ``GLOO_SOCKET_IFNAME`` names exactly it (PyTorch's rule: a comma list of exact names),
  ``NCCL_IB_HCA`` selects exactly the RDMA devices ``ibdev2netdev`` maps to the halves of the port,
  and ``VLLM_HOST_IP`` is the node's address on it (vLLM otherwise advertises the address of the
  default route, the management network);
- the same vLLM wheel, patch set, weights revisions and profile, and clocks within a bound.

``check_cluster`` returns one line per refusal, naming the host, the interface or variable, the
value and the fix; an empty list means the pair may start. The parsers read the outputs of
``ibdev2netdev``, ``ip -d -j link show`` (or its text form) and ``ip -j addr show`` and raise
``ClusterLinkError`` with the line or value they could not read. ``check_collected`` judges every
cluster from what the play ``playbooks/tasks/cluster-preflight.yml`` collected on its hosts (their
plans and the raw outputs), one line per refusal as well. Pure, standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Interface
from itertools import combinations
from typing import Any


class ClusterLinkError(ValueError):
    """An output that cannot be read, or a bad call; the message names the value and the fix."""


# --- ip link ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One network interface as ``ip link`` shows it."""

    name: str
    flags: tuple[str, ...]
    mtu: int
    operstate: str

    @property
    def admin_up(self) -> bool:
        """Brought up (IFF_UP): ``ip link set NAME up`` or the network renderer did it."""
        return "UP" in self.flags

    @property
    def carrier(self) -> bool:
        """The lower layer is up: a cable and a live peer port (IFF_LOWER_UP)."""
        return "LOWER_UP" in self.flags

    @property
    def running(self) -> bool:
        return self.admin_up and self.carrier and self.operstate in ("UP", "UNKNOWN")


def _json_objects(text: str, source: str, what: str, hint: str = "") -> list[dict[str, Any]]:
    """``ip -j``'s output: a JSON list of objects, or ClusterLinkError naming ``source``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterLinkError(f"{source} is not JSON ({exc.msg} at line {exc.lineno}): run {source}") from exc
    if not isinstance(data, list) or not all(isinstance(entry, dict) for entry in data):
        raise ClusterLinkError(f"{source} is not a JSON list of {what}: run {source}{hint}")
    return data


def parse_ip_link_json(text: str, source: str = "ip -d -j link show") -> dict[str, Link]:
    """``{name: Link}`` in the order ``ip`` lists them, from ``ip [-d] -j [-p] link show``."""
    data = _json_objects(text, source, "links", " (iproute2 4.13 or newer)")
    links: dict[str, Link] = {}
    for entry in data:
        name = entry.get("ifname")
        if not isinstance(name, str) or not name:
            raise ClusterLinkError(f"{source}: a link has no ifname ({_short(entry)}): run {source}")
        mtu = entry.get("mtu")
        if not isinstance(mtu, int) or isinstance(mtu, bool):
            raise ClusterLinkError(f"{source}: link {name!r} has no mtu ({_short(entry)}): run {source}")
        flags = entry.get("flags", [])
        if not isinstance(flags, list) or not all(isinstance(flag, str) for flag in flags):
            raise ClusterLinkError(f"{source}: link {name!r} has flags {flags!r}, not a list of names: run {source}")
        links[name] = Link(name, tuple(flags), mtu, str(entry.get("operstate", "UNKNOWN")))
    return links


# "3: enp1s0f0np0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 qdisc mq state UP mode DEFAULT ..."; a veth
# shows as "name@peer"; the state is absent from some kinds of link.
_LINK_LINE = re.compile(r"^\d+:\s+(?P<name>[^:@\s]+)(?:@\S+)?:\s+<(?P<flags>[^>]*)>\s+mtu\s+(?P<mtu>\d+)(?P<rest>.*)$")
_STATE = re.compile(r"\sstate\s+(\S+)")


def parse_ip_link_text(text: str, source: str = "ip -d link show") -> dict[str, Link]:
    """``{name: Link}`` from the text of ``ip [-d] link show`` (or the header lines of ``ip addr show``)."""
    links: dict[str, Link] = {}
    for line in text.splitlines():
        match = _LINK_LINE.match(line)
        if not match:
            continue  # the indented detail lines (link/ether, inet ...)
        state = _STATE.search(match["rest"])
        flags = tuple(flag for flag in match["flags"].split(",") if flag)
        links[match["name"]] = Link(match["name"], flags, int(match["mtu"]), state.group(1) if state else "UNKNOWN")
    if not links:
        raise ClusterLinkError(
            f"{source} printed no link ('<n>: <name>: <flags> mtu <mtu> ...' lines; got {_short(text)}): "
            "run ip -d -j link show and pass its output"
        )
    return links


def parse_ip_link(text: str, source: str | None = None) -> dict[str, Link]:
    """Either form of ``ip link show``: JSON when the output starts like JSON, else the text form."""
    if _looks_like_json(text):
        return parse_ip_link_json(text, source or "ip -d -j link show")
    return parse_ip_link_text(text, source or "ip -d link show")


# --- ip addr ---------------------------------------------------------------------------------------


def parse_ip_addr(text: str, source: str = "ip -j addr show") -> dict[str, tuple[IPv4Interface, ...]]:
    """``{name: (IPv4 address/prefix, ...)}`` in listed order from ``ip -j [-p] addr show``; IPv6 is left out."""
    data = _json_objects(text, source, "interfaces")
    addresses: dict[str, tuple[IPv4Interface, ...]] = {}
    for entry in data:
        name = entry.get("ifname")
        if not isinstance(name, str) or not name:
            raise ClusterLinkError(f"{source}: an interface has no ifname ({_short(entry)}): run {source}")
        found = []
        for info in entry.get("addr_info", []):
            if not isinstance(info, dict) or info.get("family") != "inet":
                continue
            value = f"{info.get('local')}/{info.get('prefixlen')}"
            try:
                found.append(IPv4Interface(value))
            except ValueError as exc:
                raise ClusterLinkError(f"{source}: {name} has a bad IPv4 address {value!r}: run {source}") from exc
        addresses[name] = tuple(found)
    return addresses


# --- ibdev2netdev ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaPort:
    """One line of ``ibdev2netdev``: an RDMA device's port and the netdev it belongs to.

    ``state`` is the netdev's carrier as the script reads it from sysfs: ``Up``, ``Down`` or ``NA``.
    """

    device: str
    port: int
    netdev: str
    state: str


# mlnx-tools' ibdev2netdev prints "<ibdev> port <n> ==> <netdev> (<Up|Down|NA>)" per port.
_IBDEV_LINE = re.compile(r"^(?P<device>\S+) port (?P<port>\d+) ==> (?P<netdev>\S+) \((?P<state>Up|Down|NA)\)$")


def parse_ibdev2netdev(text: str, source: str = "ibdev2netdev") -> tuple[RdmaPort, ...]:
    """The RDMA ports ``ibdev2netdev`` (without ``-v``) lists, in its order."""
    ports = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _IBDEV_LINE.match(line.strip())
        if not match:
            raise ClusterLinkError(
                f"{source} line {number} is not '<device> port <n> ==> <netdev> (<state>)': {line!r}; "
                "run ibdev2netdev without -v"
            )
        ports.append(RdmaPort(match["device"], int(match["port"]), match["netdev"], match["state"]))
    return tuple(ports)


# --- NCCL's and Gloo's interface lists ------------------------------------------------------------


@dataclass(frozen=True)
class NcclList:
    """A parsed NCCL_SOCKET_IFNAME / NCCL_IB_HCA value: ``(name, port)`` entries, port -1 for any."""

    exclude: bool
    exact: bool
    entries: tuple[tuple[str, int], ...]


def parse_nccl_list(value: str) -> NcclList:
    """NCCL's own parse (src/misc/utils.cc ``parseStringList``, the ``^``/``=`` handling of its callers).

    A leading ``^`` excludes, then a leading ``=`` makes every entry an exact name (``^=`` both); only
    those first characters are special. Entries are comma-separated, empty ones skipped; an entry is
    ``name[:port[:rail[:plane]]]``, and only the port matters here (empty or absent: any port).
    """
    exclude = value.startswith("^")
    rest = value[1:] if exclude else value
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    entries = []
    for entry in rest.split(","):
        name, _, tail = entry.partition(":")
        if not name:
            continue
        port_text = tail.split(":", 1)[0]
        entries.append((name, _atoi(port_text) if port_text else -1))
    return NcclList(exclude, exact, tuple(entries))


def nccl_selects(value: str, name: str, port: int = -1) -> bool:
    """Whether NCCL, given ``value``, uses interface or RDMA device ``name`` (``port``: -1 for an interface).

    An entry matches a name it prefixes (C ``strncmp`` over the entry's length, so case matters), or
    only the equal name when the list is exact; ports match when either side is -1 or both agree. An
    empty list matches everything, so ``^`` alone matches nothing (``matchIfList(...) ^ searchNot``).
    """
    parsed = parse_nccl_list(value)
    if not parsed.entries:
        matched = True
    else:
        matched = any(
            (name == entry if parsed.exact else name.startswith(entry)) and (port == -1 or want in (-1, port))
            for entry, want in parsed.entries
        )
    return matched != parsed.exclude


def gloo_interfaces(value: str) -> tuple[str, ...]:
    """The interfaces PyTorch's Gloo backend binds to for ``GLOO_SOCKET_IFNAME``: exact names, comma list.

    PyTorch ignores a value of one character or less and binds to the address the host name resolves
    to instead (``ifnameEnv && strlen(ifnameEnv) > 1``, torch/csrc/distributed/c10d/init.cpp).
    """
    if len(value) <= 1:
        return ()
    return tuple(name for name in value.split(",") if name)


def _atoi(text: str) -> int:
    """C's atoi: the leading digits (with an optional sign), 0 when there are none."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


# --- the halves of a CX7 port ---------------------------------------------------------------------

# systemd's PCI path names: en[P<domain>]p<bus>s<slot>[f<function>][n<port name>|d<dev port>].
_PCI_NAME = re.compile(r"^(?P<kind>en|ib)(?:P(?P<domain>\d+))?p(?P<bus>\d+)s(?P<slot>\d+)(?P<rest>.*)$")


def port_halves(interface: str, netdevs: Iterable[str]) -> tuple[str, ...]:
    """``interface`` and the netdevs that are the same CX7 port seen through the GB10's other PCIe link.

    The GB10 reaches its ConnectX-7 over two PCIe x4 links (Socket Direct), so each QSFP port shows as
    the same bus/slot/function on two PCI domains (NVIDIA: "enp1s0f1np1 and enP2p1s0f1np1 refer to the
    same physical port"). They are matched by systemd's path name with the domain left out; an
    interface without such a name is its own only half. Ordered by PCI domain (the ``enp…`` one first).
    """
    own = _PCI_NAME.match(interface)
    if not own:
        return (interface,)
    key = (own["kind"], own["bus"], own["slot"], own["rest"])
    halves = {interface}
    for name in netdevs:
        other = _PCI_NAME.match(name)
        if other and (other["kind"], other["bus"], other["slot"], other["rest"]) == key:
            halves.add(name)
    return tuple(sorted(halves, key=_pci_order))


def _pci_order(netdev: str) -> tuple[int, str]:
    match = _PCI_NAME.match(netdev)
    return (int(match["domain"] or 0) if match else 0, netdev)


# --- what each node reports ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClockReading:
    """A node's clock read from the controller: the node's epoch seconds, the controller's own clock at
    the middle of the exchange, and the uncertainty (half the round trip, or the tool's own bound)."""

    node_s: float
    controller_s: float
    uncertainty_s: float

    @property
    def offset_s(self) -> float:
        return self.node_s - self.controller_s


@dataclass(frozen=True)
class NodeFacts:
    """Everything the preflight needs from one node. The first node of a cluster is the head (rank 0).

    ``env`` is the environment the serving unit would give vLLM (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
    NCCL_IB_HCA, VLLM_HOST_IP); ``reached`` holds the peer addresses that answered a ping sent out of
    the cluster interface (``ping -I IFACE``).
    """

    host: str
    links: Mapping[str, Link]
    ipv4: Mapping[str, tuple[IPv4Interface, ...]]
    rdma: tuple[RdmaPort, ...]
    env: Mapping[str, str]
    wheel: str
    patch_set: str
    revisions: Mapping[str, str]
    profile: str
    clock: ClockReading
    reached: frozenset[str]


def node_facts(
    host: str,
    *,
    ip_link: str,
    ip_addr: str,
    ibdev2netdev: str = "",
    env: Mapping[str, str],
    wheel: str,
    patch_set: str,
    revisions: Mapping[str, str],
    profile: str,
    clock: ClockReading,
    reached: Iterable[str],
) -> NodeFacts:
    """``NodeFacts`` from the raw outputs of the three commands; a parse error names the host.

    ``ibdev2netdev`` may be left empty on a link without RDMA (``check_cluster(..., rdma=False)``).
    """
    link_form = "ip -d -j link show" if _looks_like_json(ip_link) else "ip -d link show"
    return NodeFacts(
        host=host,
        links=parse_ip_link(ip_link, f"{host}: {link_form}"),
        ipv4=parse_ip_addr(ip_addr, f"{host}: ip -j addr show"),
        rdma=parse_ibdev2netdev(ibdev2netdev, f"{host}: ibdev2netdev"),
        env=dict(env),
        wheel=wheel,
        patch_set=patch_set,
        revisions=dict(revisions),
        profile=profile,
        clock=clock,
        reached=frozenset(reached),
    )


# --- the checks ------------------------------------------------------------------------------------


def check_cluster(
    nodes: Sequence[NodeFacts], interface: str, mtu: int = 9000, max_clock_skew_s: float = 1.0, rdma: bool = True
) -> list[str]:
    """One line per refusal, in this order: each node's link, MTU, address and variables; addresses
    two nodes share; unanswered pings; stack differences from the head (the first node); clocks.

    A check that needs the interface is left out on a node where it does not exist, and one that needs
    the link (address, pings, VLLM_HOST_IP) where it is not running: the link's own refusal says what
    to fix first. ``rdma=False`` (a link without RDMA, e.g. the sandbox's) leaves out NCCL_IB_HCA and
    needs no ``ibdev2netdev`` output.
    """
    _check_call(nodes, interface, mtu, max_clock_skew_s)
    problems: list[str] = []
    for node in nodes:
        problems += check_node(node, interface, mtu, rdma)
    problems += check_unique_addresses(nodes, interface)
    problems += check_reachability(nodes, interface)
    problems += check_same_stack(nodes)
    problems += check_clocks(nodes, max_clock_skew_s)
    return problems


def check_node(node: NodeFacts, interface: str, mtu: int, rdma: bool = True) -> list[str]:
    """The refusals that concern one node alone (NCCL_IB_HCA only when the link has ``rdma``)."""
    link_problem = check_link(node, interface)
    problems = [link_problem] if link_problem else []
    if interface not in node.links:
        return problems
    running = node.links[interface].running
    problems += check_mtu(node, interface, mtu)
    problems += check_address(node, interface) if running else []
    problems += check_nccl_socket_ifname(node, interface)
    problems += check_gloo_socket_ifname(node, interface)
    problems += check_nccl_ib_hca(node, interface) if rdma else []
    problems += check_vllm_host_ip(node, interface) if running else []
    return problems


def check_link(node: NodeFacts, interface: str) -> str | None:
    """The interface exists, is up, has carrier and is operationally UP; else the first thing wrong."""
    link = node.links.get(interface)
    if link is None:
        return (
            f"{node.host}: {interface} does not exist (ip link lists {', '.join(node.links)}): set the cluster "
            "interface to the CX7 port ibdev2netdev shows (Up) and re-run"
        )
    if not link.admin_up:
        return (
            f"{node.host}: {interface} is administratively down (state {link.operstate}): bring it up "
            f"(netplan apply, or ip link set {interface} up) and re-run"
        )
    if not link.carrier:
        return (
            f"{node.host}: {interface} has no carrier (state {link.operstate}): check the QSFP cable between the "
            "two CX7 ports and that the peer's port is up, then re-run"
        )
    if not link.running:
        return (
            f"{node.host}: {interface} is {link.operstate}, not UP: bring the link up (ip link show {interface} "
            "says why) and re-run"
        )
    return None


def check_mtu(node: NodeFacts, interface: str, mtu: int) -> list[str]:
    """The MTU on the interface and on the other half of its port (both carry NCCL's RDMA traffic)."""
    halves = port_halves(interface, node.links)
    wrong = [name for name in halves if node.links[name].mtu != mtu]
    if not wrong:
        return []
    found = _and(f"{name} has MTU {node.links[name].mtu}" for name in wrong)
    return [
        f"{node.host}: {found}, the cluster link needs {mtu}: set mtu: {mtu} for {_and(wrong)} in netplan and re-run"
    ]


def check_address(node: NodeFacts, interface: str) -> list[str]:
    if node.ipv4.get(interface):
        return []
    return [
        f"{node.host}: {interface} has no IPv4 address: give it a static one in netplan (the same subnet on every "
        "node, one address each) and re-run"
    ]


def check_nccl_socket_ifname(node: NodeFacts, interface: str) -> list[str]:
    """NCCL_SOCKET_IFNAME must select the interface and no other the node has.

    Every interface ``ip link`` lists is a candidate, not only those running now: NCCL takes the first
    running match, so a value that also matches the management port works or not depending on the day.
    NCCL ignores a value of one character or less (``strlen(env) > 1``) and picks by itself.
    """
    value = node.env.get("NCCL_SOCKET_IFNAME", "")
    if len(value) <= 1:
        return [
            f"{node.host}: NCCL_SOCKET_IFNAME is not set, so NCCL picks an interface itself (it may take the "
            f"management port): set NCCL_SOCKET_IFNAME={interface} and re-run"
        ]
    selected = [name for name in node.links if nccl_selects(value, name)]
    if selected == [interface]:
        return []
    return [
        f"{node.host}: NCCL_SOCKET_IFNAME={value!r} selects {', '.join(selected) or 'no interface'}, not "
        f"{interface} alone: set NCCL_SOCKET_IFNAME={interface} and re-run"
    ]


def check_gloo_socket_ifname(node: NodeFacts, interface: str) -> list[str]:
    value = node.env.get("GLOO_SOCKET_IFNAME", "")
    names = gloo_interfaces(value)
    if not names:
        return [
            f"{node.host}: GLOO_SOCKET_IFNAME is not set, so Gloo binds to the address the host name resolves to: "
            f"set GLOO_SOCKET_IFNAME={interface} and re-run"
        ]
    if set(names) == {interface}:
        return []
    return [
        f"{node.host}: GLOO_SOCKET_IFNAME={value!r} names {', '.join(names)}, not {interface} alone (Gloo takes "
        f"exact interface names): set GLOO_SOCKET_IFNAME={interface} and re-run"
    ]


def check_nccl_ib_hca(node: NodeFacts, interface: str) -> list[str]:
    """NCCL_IB_HCA must select exactly the RDMA ports of the interface's port halves.

    One half carries ~100 Gbps; NCCL aggregates the two only when both are in NCCL_IB_HCA (users of
    the anchors measured ~3 GB/s bus bandwidth without the right HCAs and ~24 GB/s with them).
    """
    halves = port_halves(interface, [*node.links, *(port.netdev for port in node.rdma)])
    ordered = sorted(node.rdma, key=lambda port: (*_pci_order(port.netdev), port.device, port.port))
    wanted = [port for port in ordered if port.netdev in halves]
    if not wanted:
        return [
            f"{node.host}: ibdev2netdev maps no RDMA device to {interface} or its other half: check that the mlx5 "
            f"driver is loaded and that {interface} is a CX7 port, then re-run"
        ]
    fix = _hca_value(wanted, node.rdma)
    value = node.env.get("NCCL_IB_HCA", "")
    if not value:
        return [
            f"{node.host}: NCCL_IB_HCA is not set, so NCCL uses every active RDMA port it finds: "
            f"set NCCL_IB_HCA={fix} (the halves of {interface}'s port) and re-run"
        ]
    selected = [port for port in ordered if nccl_selects(value, port.device, port.port)]
    if selected == wanted:
        return []
    return [
        f"{node.host}: NCCL_IB_HCA={value!r} selects {_ports(selected) or 'no RDMA device'}, but {interface}'s "
        f"port is {_ports(wanted)}: set NCCL_IB_HCA={fix} and re-run"
    ]


def check_vllm_host_ip(node: NodeFacts, interface: str) -> list[str]:
    """VLLM_HOST_IP must be an address of the interface (vLLM's get_ip() falls back to the default route's)."""
    addresses = [str(address.ip) for address in node.ipv4.get(interface, ())]
    if not addresses:
        return []  # check_address refuses this node already
    value = node.env.get("VLLM_HOST_IP", "")
    if not value:
        return [
            f"{node.host}: VLLM_HOST_IP is not set, so vLLM advertises the address of its default route (the "
            f"management network): set VLLM_HOST_IP={addresses[0]} ({interface}'s address) and re-run"
        ]
    if value in addresses:
        return []
    return [
        f"{node.host}: VLLM_HOST_IP={value} is not an address of {interface} ({', '.join(addresses)}): "
        f"set VLLM_HOST_IP={addresses[0]} and re-run"
    ]


def check_unique_addresses(nodes: Sequence[NodeFacts], interface: str) -> list[str]:
    problems = []
    for first, second in combinations(nodes, 2):
        ours = {str(address.ip) for address in first.ipv4.get(interface, ())}
        for address in second.ipv4.get(interface, ()):
            if str(address.ip) in ours:
                problems.append(
                    f"{first.host} and {second.host} both have {address.ip} on {interface}: give each node its own "
                    "address in netplan and re-run"
                )
    return problems


def check_reachability(nodes: Sequence[NodeFacts], interface: str) -> list[str]:
    """Every node must have reached every address each other node has on the interface.

    Left out for a node whose link is not running or has no address (refused already), and for an
    address the pinging node holds itself (the answer would come from itself).
    """
    ready = [node for node in nodes if _link_running(node, interface) and node.ipv4.get(interface)]
    problems = []
    for node in ready:
        own = {str(address.ip) for address in node.ipv4[interface]}
        for peer in ready:
            if peer is node:
                continue
            missing = [
                str(address.ip)
                for address in peer.ipv4[interface]
                if str(address.ip) not in own and str(address.ip) not in node.reached
            ]
            if missing:
                problems.append(
                    f"{node.host}: no ping answer from {peer.host}'s {', '.join(missing)} on {interface}: check that "
                    "both addresses are in one subnet and that nothing filters the link, then re-run"
                )
    return problems


def check_same_stack(nodes: Sequence[NodeFacts]) -> list[str]:
    """Each node against the head: wheel, patch set, profile, then weights revisions by model name."""
    head, problems = nodes[0], []
    for node in nodes[1:]:
        if node.wheel != head.wheel:
            problems.append(
                f"{node.host} runs vLLM wheel {node.wheel} but {head.host} runs {head.wheel}: deploy one wheel to "
                "every node and re-run"
            )
        if node.patch_set != head.patch_set:
            problems.append(
                f"{node.host} has patch set {node.patch_set} but {head.host} has {head.patch_set}: deploy one wheel "
                "to every node and re-run"
            )
        if node.profile != head.profile:
            problems.append(
                f"{node.host} serves profile {node.profile} but {head.host} serves {head.profile}: deploy the same "
                "profile to every node and re-run"
            )
        problems += _revision_problems(head, node)
    return problems


def _revision_problems(head: NodeFacts, node: NodeFacts) -> list[str]:
    fix = "pin and fetch the same revisions on every node and re-run"
    problems = []
    for model in sorted(set(head.revisions) | set(node.revisions)):
        ours, theirs = node.revisions.get(model), head.revisions.get(model)
        if ours == theirs:
            continue
        if theirs is None:
            problems.append(f"{node.host} has weights {model} at {ours}, {head.host} has none: {fix}")
        elif ours is None:
            problems.append(f"{node.host} lacks weights {model} ({head.host} has {theirs}): {fix}")
        else:
            problems.append(f"{node.host} has weights {model} at {ours} but {head.host} at {theirs}: {fix}")
    return problems


def check_clocks(nodes: Sequence[NodeFacts], max_clock_skew_s: float) -> list[str]:
    """Refuse a pair whose skew cannot be shown to be within the bound: |Δoffset| + both uncertainties."""
    problems = []
    for first, second in combinations(nodes, 2):
        skew = abs(first.clock.offset_s - second.clock.offset_s)
        uncertainty = first.clock.uncertainty_s + second.clock.uncertainty_s
        if skew + uncertainty > max_clock_skew_s:
            problems.append(
                f"{first.host} and {second.host} clocks differ by {skew:.3f} s (±{uncertainty:.3f} s), more than "
                f"{max_clock_skew_s:g} s: turn on NTP on every node (timedatectl set-ntp true; chronyc tracking "
                "shows the offset) and re-run"
            )
    return problems


# --- what the play collects ----------------------------------------------------------------------
#
# playbooks/tasks/cluster-preflight.yml collects, per host of the run, a dict (``collected[host]``):
#
#   cluster       the host's sparkfleet_plan.cluster: {} for a host in no cluster, else name, interface,
#                 mtu, rdma, max_clock_skew_s, port, members ([{host, address, rank}], rank 0 the head), ...
#   profile       sparkfleet_plan.profile.name
# and, for a host in a cluster:
#   env           sparkfleet_plan.service.env (what the node's vLLM gets)
#   wheel, patch_set, revisions   sparkfleet_plan.vllm_version, .patchset_id, .model_revisions
#   ip_link, ip_addr, ibdev2netdev   the outputs of `ip -d -j link show`, `ip -j addr show` and
#                 `ibdev2netdev` (read only where the cluster has rdma): each the command's stdout, or its
#                 registered result (rc, stdout, stderr, msg), whose failure is a refusal naming it
#   clock         {before, node, after}: the controller's epoch seconds before and after reading the node's
#                 `date +%s.%N` (node: its stdout, or the registered result); or the registered result of
#                 two readings in a loop, each printing a line "sparkfleet-clock <controller's> <node's>":
#                 the second's controller time closes the window of the first (CLOCK_LINE)
#   reached       the peer addresses that answered a ping out of the interface; or
#   pings         the ping loop's registered results (item: the address; rc 0: it answered)

# The cluster settings every member's plan must agree on (besides its members), and the inventory
# variable behind each.
CLUSTER_SETTINGS = {
    "interface": "sparkfleet_cluster_interface",
    "mtu": "sparkfleet_cluster_mtu",
    "rdma": "sparkfleet_cluster_rdma",
    "max_clock_skew_s": "sparkfleet_cluster_max_clock_skew_s",
    "port": "sparkfleet_cluster_port",
}
_CLUSTER_KEYS = ("name", "interface", "mtu", "rdma", "max_clock_skew_s", "members")
_NODE_KEYS = ("env", "wheel", "patch_set", "revisions", "ip_link", "ip_addr", "clock")


# One clock reading: the controller's epoch seconds as the command left it, then the node's `date +%s.%N`.
CLOCK_LINE = re.compile(r"^sparkfleet-clock (?P<controller>\S+) (?P<node>\S+)\s*$", re.MULTILINE)


def check_collected(collected: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every cluster of ``collected`` ({host: what the play collected on it}) judged whole: one line per refusal.

    Hosts are grouped by their plan's cluster name and ordered by rank (the head first). A cluster is
    refused, before its link is looked at, when its members' plans disagree on its settings, when it has
    one member, or when a member is not in ``collected`` (the run left it out or lost it). A command that
    failed or printed what the parsers cannot read is a line naming the host; otherwise the lines are
    ``check_cluster``'s. Hosts in no cluster are refused nothing. A malformed ``collected`` (not what the
    play builds) raises ClusterLinkError.
    """
    problems: list[str] = []
    for name, hosts in _clusters(collected).items():
        problems += _check_one_cluster(name, hosts, collected)
    return problems


def collected_summary(collected: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What a run whose ``check_collected`` is empty says: one line per cluster, then the hosts in none."""
    lines = []
    for name, hosts in _clusters(collected).items():
        cluster = collected[hosts[0]]["cluster"]
        size = len(cluster["members"])
        lines.append(f"cluster {name}: link preflight passed ({size} nodes on {cluster['interface']})")
    alone = [host for host, data in collected.items() if not data["cluster"]]
    if alone:
        lines.append(f"in no cluster (their plans serve them alone), nothing to check: {', '.join(alone)}")
    return lines


def ping_targets(host: str, cluster: Mapping[str, Any], ip_addrs: Mapping[str, Any]) -> list[str]:
    """The addresses ``host`` pings: each other member's planned address, and every IPv4 address it has
    on the cluster interface by its ``ip -j addr show`` (``ip_addrs``: {member: output or registered
    result}; a member without one, or one that cannot be read, gives its planned address alone), in rank
    order, each once."""
    _check_cluster_part(host, cluster)
    interface = cluster["interface"]
    targets: list[str] = []
    for member in _ranked(cluster["members"]):
        if member["host"] == host:
            continue
        found = [str(member["address"])]
        try:
            text = _output(member["host"], ip_addrs.get(member["host"]), "ip -j addr show")
            found += [str(address.ip) for address in parse_ip_addr(text).get(interface, ())]
        except ClusterLinkError:
            pass  # check_collected names what is wrong with it
        targets += [address for address in dict.fromkeys(found) if address not in targets]
    return targets


def _clusters(collected: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """{cluster name: its hosts in ``collected``}, in the order ``collected`` first names each cluster."""
    if not isinstance(collected, Mapping):
        raise ClusterLinkError(f"collected must be a mapping of host to its collected facts, got {_short(collected)}")
    clusters: dict[str, list[str]] = {}
    for host, data in collected.items():
        if not isinstance(data, Mapping) or not isinstance(data.get("cluster", None), Mapping):
            raise ClusterLinkError(f"collected[{host!r}] must be a mapping with a cluster mapping, got {_short(data)}")
        if data["cluster"]:
            _check_cluster_part(host, data["cluster"])
            missing = [key for key in _NODE_KEYS if key not in data]
            if missing:
                raise ClusterLinkError(f"collected[{host!r}] lacks {', '.join(missing)}: collect them on {host}")
            clusters.setdefault(str(data["cluster"]["name"]), []).append(str(host))
    return clusters


def _check_cluster_part(host: str, cluster: Mapping[str, Any]) -> None:
    missing = [key for key in _CLUSTER_KEYS if key not in cluster]
    if missing:
        raise ClusterLinkError(f"{host}'s plan's cluster lacks {', '.join(missing)}: plan it with resolve-profile.yml")
    members = cluster["members"]
    if not isinstance(members, Sequence) or not all(
        isinstance(member, Mapping) and {"host", "address", "rank"} <= set(member) for member in members
    ):
        raise ClusterLinkError(f"{host}'s plan's cluster members must be [{{host, address, rank}}], got {members!r}")


def _ranked(members: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(members, key=lambda member: int(member["rank"]))


def _members(cluster: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(str(member["host"]), str(member["address"])) for member in _ranked(cluster["members"])]


def _listed(cluster: Mapping[str, Any]) -> str:
    return ", ".join(f"{host} ({address})" for host, address in _members(cluster))


def _check_one_cluster(name: str, hosts: Sequence[str], collected: Mapping[str, Mapping[str, Any]]) -> list[str]:
    plans = {host: collected[host]["cluster"] for host in hosts}
    # the head's plan is the reference where the head is here, else the plan of the lowest rank here
    head = next((str(m["host"]) for m in _ranked(plans[hosts[0]]["members"]) if str(m["host"]) in plans), hosts[0])
    reference = plans[head]
    members = [str(member["host"]) for member in _ranked(reference["members"])]
    problems = []
    for host in hosts:
        theirs = [str(member["host"]) for member in _ranked(plans[host]["members"])]
        if host != head and _members(plans[host]) != _members(reference):
            problems.append(
                f"cluster {name}: {host}'s plan has the members {_listed(plans[host])} but {head}'s has "
                f"{_listed(reference)}: plan every member from the same inventory (the group {name}, each "
                "member's sparkfleet_cluster_address) and re-run"
            )
        differs = [key for key in CLUSTER_SETTINGS if plans[host].get(key) != reference.get(key)]
        if host != head and differs:
            problems.append(
                f"cluster {name}: {host}'s plan has "
                + ", ".join(f"{key} {plans[host].get(key)!r}" for key in differs)
                + f" but {head}'s has "
                + ", ".join(f"{reference.get(key)!r}" for key in differs)
                + f": set {_and([CLUSTER_SETTINGS[key] for key in differs])} once for the cluster "
                f"(group_vars/{name}.yml) and re-run"
            )
        if host not in theirs:
            problems.append(
                f"cluster {name}: {host}'s plan names the cluster but not {host} among its members "
                f"({', '.join(theirs)}): put {host} in the group {name} and re-run"
            )
    if problems:
        return problems
    if len(members) < 2:
        return [
            f"cluster {name} has one member ({', '.join(members) or 'none'}): a cluster needs two or more: add the "
            f"other Sparks to the group {name} and re-run"
        ]
    absent = [member for member in members if member not in collected]
    if absent:
        return [
            f"cluster {name}: no link facts from {_and(absent)} (not in this run: a --limit left it out, it was "
            "unreachable or it failed an earlier task): check the whole cluster at once (make cluster-check with "
            "no LIMIT that splits it) and re-run"
        ]
    nodes, broken = [], []
    for member in members:
        try:
            nodes.append(_collected_node(member, collected[member], bool(reference["rdma"])))
        except ClusterLinkError as exc:
            broken.append(str(exc))
    problems = broken + [line for member in members if (line := _ping_did_not_run(member, collected[member]))]
    if broken:
        return problems
    try:
        return problems + check_cluster(
            nodes,
            str(reference["interface"]),
            mtu=reference["mtu"],
            max_clock_skew_s=reference["max_clock_skew_s"],
            rdma=bool(reference["rdma"]),
        )
    except ClusterLinkError as exc:
        return [*problems, f"cluster {name}: {exc}"]


def _collected_node(host: str, data: Mapping[str, Any], rdma: bool) -> NodeFacts:
    """NodeFacts from one host's collected data; a failed command or an unreadable output raises ClusterLinkError."""
    ip_link = _output(host, data["ip_link"], "ip -d -j link show")
    ip_addr = _output(host, data["ip_addr"], "ip -j addr show")
    ibdev2netdev = ""
    if rdma:
        ibdev2netdev = _output(
            host,
            data.get("ibdev2netdev"),
            "ibdev2netdev",
            "install it (DGX OS ships it; mlnx-tools elsewhere), or set sparkfleet_cluster_rdma: false for a link "
            "without RDMA, and re-run",
        )
    return node_facts(
        host,
        ip_link=ip_link,
        ip_addr=ip_addr,
        ibdev2netdev=ibdev2netdev,
        env={str(key): str(value) for key, value in (data["env"] or {}).items()},
        wheel=str(data["wheel"]),
        patch_set=str(data["patch_set"]),
        revisions={str(key): str(value) for key, value in (data["revisions"] or {}).items()},
        profile=str(data["profile"]),
        clock=_clock(host, data["clock"]),
        reached=_reached(data),
    )


def _output(host: str, value: Any, command: str, fix: str = "") -> str:
    """A command's stdout from either form the play passes; its failure, or no output at all, raises."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ClusterLinkError(f"{host}: {command} was not run (got {_short(value)}): run cluster-preflight.yml")
    rc = value.get("rc", 0)
    if rc != 0 or value.get("failed"):
        said = str(value.get("stderr") or value.get("msg") or value.get("stdout") or "no output").strip()
        first = said.splitlines()[0] if said else "no output"
        fix = fix or f"run {command} on {host} to see why, and re-run"
        raise ClusterLinkError(f"{host}: {command} failed (rc {rc}: {first}): {fix}")
    return str(value.get("stdout", ""))


def _clock(host: str, clock: Any) -> ClockReading:
    """The node's clock against the controller's: the middle of [before, after], half of it the uncertainty."""
    if isinstance(clock, Mapping) and "results" in clock:
        clock = _clock_from_readings(host, clock["results"])
    if not isinstance(clock, Mapping) or not {"before", "node", "after"} <= set(clock):
        raise ClusterLinkError(f"{host}: the clock reading must hold before, node and after, got {_short(clock)}")
    text = _output(host, clock["node"], "date +%s.%N")
    try:
        before, node, after = float(clock["before"]), float(text.strip()), float(clock["after"])
    except (TypeError, ValueError):
        raise ClusterLinkError(
            f"{host}: date +%s.%N printed {_short(text)}, not seconds since the epoch (or the controller's "
            f"{clock['before']!r}, {clock['after']!r} are not): use GNU date (coreutils) and re-run"
        ) from None
    if after < before:
        raise ClusterLinkError(
            f"{host}: the controller's clock went back while reading {host}'s ({before} then {after}): re-run"
        )
    return ClockReading(node_s=node, controller_s=(before + after) / 2, uncertainty_s=(after - before) / 2)


def _clock_from_readings(host: str, readings: Any) -> dict[str, str]:
    """{before, node, after} from two CLOCK_LINE readings: the first's node time between both controller times."""
    found = []
    for reading in readings if isinstance(readings, Sequence) and not isinstance(readings, str) else ():
        text = _output(host, reading, "date +%s.%N")
        match = CLOCK_LINE.search(text)
        if not match:
            raise ClusterLinkError(
                f"{host}: the clock reading printed {_short(text)}, not 'sparkfleet-clock <controller> <node>': "
                "use GNU date (coreutils) and re-run"
            )
        found.append(match)
    if len(found) < 2:
        raise ClusterLinkError(f"{host}: the clock needs two readings, got {len(found)}: run cluster-preflight.yml")
    return {"before": found[0]["controller"], "node": found[0]["node"], "after": found[1]["controller"]}


def _reached(data: Mapping[str, Any]) -> frozenset[str]:
    if "reached" in data:
        return frozenset(str(address) for address in data["reached"] or ())
    return frozenset(str(result.get("item")) for result in _pings(data) if result.get("rc") == 0)


def _pings(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    pings = data.get("pings") or []
    return [result for result in pings if isinstance(result, Mapping) and not result.get("skipped")]


def _ping_did_not_run(host: str, data: Mapping[str, Any]) -> str | None:
    """A line when ping itself could not run on the host (a ping that ran prints something, answer or not)."""
    dead = [r for r in _pings(data) if r.get("rc") != 0 and not r.get("stdout") and not r.get("stderr")]
    if not dead:
        return None
    said = str(dead[0].get("msg") or f"rc {dead[0].get('rc')}")
    return f"{host}: ping did not run ({said}), so no peer could answer it: install iputils-ping on {host} and re-run"


# --- helpers ---------------------------------------------------------------------------------------


def _check_call(nodes: Sequence[NodeFacts], interface: str, mtu: int, max_clock_skew_s: float) -> None:
    hosts = [node.host for node in nodes]
    if len(nodes) < 2:
        raise ClusterLinkError(
            f"check_cluster needs two or more nodes, got {len(nodes)} ({', '.join(hosts) or 'none'}): pass every "
            "node of the cluster, the head first"
        )
    for host in hosts:
        if hosts.count(host) > 1:
            raise ClusterLinkError(f"check_cluster got {host} twice: pass each node once, the head first")
    if not isinstance(interface, str) or not interface:
        raise ClusterLinkError(f"interface must name a network interface, got {interface!r}: pass e.g. enp1s0f0np0")
    if isinstance(mtu, bool) or not isinstance(mtu, int) or mtu <= 0:
        raise ClusterLinkError(f"mtu must be a positive number of bytes, got {mtu!r}: pass e.g. 9000")
    if not max_clock_skew_s > 0:
        raise ClusterLinkError(f"max_clock_skew_s must be positive, got {max_clock_skew_s!r}: pass e.g. 1.0")


def _looks_like_json(text: str) -> bool:
    return text.lstrip().startswith(("[", "{"))


def _link_running(node: NodeFacts, interface: str) -> bool:
    link = node.links.get(interface)
    return link is not None and link.running


def _hca_value(ports: Sequence[RdmaPort], every: Sequence[RdmaPort]) -> str:
    """An NCCL_IB_HCA value naming ``ports``: device names, with ':port' only where a device has several."""
    counts = {port.device: sum(other.device == port.device for other in every) for port in ports}
    return ",".join(port.device if counts[port.device] == 1 else f"{port.device}:{port.port}" for port in ports)


def _ports(ports: Sequence[RdmaPort]) -> str:
    return ", ".join(f"{port.device} ({port.netdev})" for port in ports)


def _and(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = text.strip().replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")
