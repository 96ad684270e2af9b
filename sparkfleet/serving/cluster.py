"""One model served across several Sparks: a cluster's part of a host's serving plan (issue 17).

A cluster is an inventory group. Its members set ``sparkfleet_cluster: <the group's name>`` and each
its own ``sparkfleet_cluster_address`` (its IPv4 address on the cluster link); the cluster's settings
(``sparkfleet_cluster_interface``, ``_mtu``, ``_rdma``, ``_port``, ``_max_clock_skew_s``,
``_ib_hca``) are the same on every member. Put them in ``group_vars/<group>.yml`` (or host_vars):
variables written in the inventory file's group ``vars:`` lose to ``group_vars/all``. The first member
of the group is the head (rank 0), the others are workers, in the group's order.

A profile that serves across a cluster says how it splits the model: ``cluster: {parallel: tensor}``
or ``{parallel: pipeline}``. Its serve arguments then get the cluster's size as tensor (or pipeline)
parallel size and vLLM's multi-node flags (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``; ``--headless`` on a worker: vLLM 0.23's multiprocessing runtime, docs/cluster.md
says why not Ray), and the unit's environment the link's variables (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``, ``VLLM_HOST_IP``, and ``NCCL_IB_HCA`` when the inventory sets it). Such a
profile on a host outside a cluster, or a cluster that cannot form (one member, a member without an
address, two with one address), is one line naming it and the fix. A single-node profile on a
cluster's host serves that host alone (the cluster part is then ``{}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from ipaddress import IPv4Address
from typing import Any

# The inventory variables a cluster's part reads (besides inventory_hostname), with their defaults.
DEFAULTS: dict[str, Any] = {
    "sparkfleet_cluster": "",
    "sparkfleet_cluster_interface": "",
    "sparkfleet_cluster_mtu": 9000,
    "sparkfleet_cluster_rdma": True,
    "sparkfleet_cluster_port": 29501,
    "sparkfleet_cluster_max_clock_skew_s": 1.0,
    "sparkfleet_cluster_ib_hca": "",
}
# {member: its sparkfleet_cluster_address} in the group's order: the sparkfleet_plan lookup reads it
# from the inventory's groups and hostvars (members_from).
MEMBERS = "sparkfleet_cluster_members"
VARIABLES = (*DEFAULTS, MEMBERS, "inventory_hostname")
PARALLEL = {"tensor": "tensor-parallel-size", "pipeline": "pipeline-parallel-size"}
# Flags the cluster sets; a profile setting them would be a second value.
OWNED_FLAGS = {
    "nnodes": "the cluster's size (its inventory group)",
    "node-rank": "the host's place in its cluster group",
    "master-addr": "the head's sparkfleet_cluster_address",
    "master-port": "sparkfleet_cluster_port",
    "headless": "the host's place in its cluster group (every member but the head)",
}
DOC = "docs/cluster.md"


class ClusterError(ValueError):
    """A cluster that cannot form; the message names the host, the variable and the fix."""


def profile_problems(where: str, value: Any) -> list[str]:
    """The profile key ``cluster``: ``{parallel: tensor|pipeline}``."""
    if not isinstance(value, Mapping):
        return [f"{where} must be a mapping such as {{parallel: tensor}}, got {value!r}"]
    found = [f"{where}.{key}: not a cluster key: the only one is parallel" for key in value if key != "parallel"]
    if value.get("parallel") not in PARALLEL:
        found.append(f"{where}.parallel must be tensor or pipeline, got {value.get('parallel')!r}")
    return found


def members_from(
    groups: Mapping[str, Any], hostvars: Mapping[str, Any], name: str, template: Callable[[Any], Any]
) -> dict[str, Any]:
    """{member: its sparkfleet_cluster_address} of cluster group ``name``, in the group's order."""
    if name not in groups:
        raise ClusterError(
            f"sparkfleet_cluster {name!r} is not a group of this inventory: name the group that holds the "
            f"cluster's hosts ({DOC})"
        )
    return {
        str(host): template(hostvars[host].get("sparkfleet_cluster_address", "")) if host in hostvars else ""
        for host in groups[name]
    }


def part(variables: Mapping[str, Any], resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The plan's ``cluster`` for this host and resolved profile: {} for a single-node profile."""
    settings = {key: variables.get(key, default) for key, default in DEFAULTS.items()}
    name = str(settings["sparkfleet_cluster"] or "")
    host = str(variables.get("inventory_hostname", "?"))
    profile = str(resolved.get("name", "?"))
    if not resolved.get("cluster"):
        return {}
    if not name:
        raise ClusterError(
            f"profile {profile!r} serves one model across a cluster, but {host} is in none: deploy it to the "
            f"hosts of a cluster group (sparkfleet_cluster; {DOC}), or pick a single-node profile for {host}"
        )
    members = dict(variables.get(MEMBERS) or {})
    if host not in members:
        raise ClusterError(f"{host} sets sparkfleet_cluster {name!r} but is not in that group: add it ({DOC})")
    if len(members) < 2:
        raise ClusterError(f"cluster {name!r} has one member ({host}): a cluster needs two or more ({DOC})")
    interface = str(settings["sparkfleet_cluster_interface"] or "")
    if not interface:
        raise ClusterError(
            f"cluster {name!r}: sparkfleet_cluster_interface is not set: name its link, e.g. enp1s0f0np0"
        )
    seen: dict[str, str] = {}
    for member, address in members.items():
        try:
            IPv4Address(str(address))
        except ValueError:
            raise ClusterError(
                f"cluster {name!r}: {member}'s sparkfleet_cluster_address {address!r} is not an IPv4 address: "
                f"give its address on {interface}"
            ) from None
        if str(address) in seen:
            raise ClusterError(
                f"cluster {name!r}: {seen[str(address)]} and {member} both have sparkfleet_cluster_address "
                f"{address}: give each member its own"
            )
        seen[str(address)] = member
    port = settings["sparkfleet_cluster_port"]
    if not str(port).isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(
            f"cluster {name!r}: sparkfleet_cluster_port {port!r} is not a TCP port: give one such as 29501"
        )
    return layout(
        name,
        host,
        {member: str(address) for member, address in members.items()},
        interface=interface,
        mtu=int(settings["sparkfleet_cluster_mtu"]),
        rdma=bool(settings["sparkfleet_cluster_rdma"]),
        max_clock_skew_s=float(settings["sparkfleet_cluster_max_clock_skew_s"]),
        ib_hca=str(settings["sparkfleet_cluster_ib_hca"] or ""),
        port=int(port),
        parallel=str(resolved["cluster"]["parallel"]),
    )


def layout(name: str, host: str, members: Mapping[str, str], **settings: Any) -> dict[str, Any]:
    """The cluster part of ``host`` in cluster ``name`` of ``members`` ({host: address}, the head first)
    with the cluster's ``settings`` (interface, mtu, rdma, max_clock_skew_s, ib_hca, port, parallel)."""
    ordered = [
        {"host": member, "address": address, "rank": rank} for rank, (member, address) in enumerate(members.items())
    ]
    rank = list(members).index(host)
    return {
        "name": name,
        **settings,
        "members": ordered,
        "head": ordered[0]["host"],
        "rank": rank,
        "role": "head" if rank == 0 else "worker",
        "size": len(ordered),
        "master_addr": ordered[0]["address"],
        "address": members[host],
    }


def apply(resolved: Mapping[str, Any], cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved profile with the cluster's parallel size and multi-node flags in its serve arguments."""
    if not cluster:
        return dict(resolved)
    serve_args = {
        **(resolved.get("serve_args") or {}),
        PARALLEL[cluster["parallel"]]: cluster["size"],
        "nnodes": cluster["size"],
        "node-rank": cluster["rank"],
        "master-addr": cluster["master_addr"],
        "master-port": cluster["port"],
    }
    if cluster["role"] == "worker":
        serve_args["headless"] = True
    return {**resolved, "serve_args": serve_args}


def env(cluster: Mapping[str, Any]) -> dict[str, str]:
    """The link's variables for the node's vLLM (docs/cluster.md, "The environment of the serving unit")."""
    if not cluster:
        return {}
    out = {
        "GLOO_SOCKET_IFNAME": cluster["interface"],
        "NCCL_SOCKET_IFNAME": cluster["interface"],
        "VLLM_HOST_IP": cluster["address"],
    }
    if cluster["ib_hca"]:
        out["NCCL_IB_HCA"] = cluster["ib_hca"]
    return out


def _batch_size(value: Any, total: int) -> int:
    """One entry of Ansible's ``serial`` as a host count (its own rule: a percentage of every host of the
    play rounded down, at least 1; 0 or less is every remaining host)."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            return int(int(text[:-1]) / 100.0 * total) or 1
        return int(text)
    except ValueError:
        raise ClusterError(
            f"batch size {value!r} is not a number of hosts: give one such as 1 or a percentage such as 25%"
        ) from None


def batches(hosts: Sequence[str], clusters: Mapping[str, Any], serial: Any) -> dict[str, Any]:
    """The serving play's host order and batch sizes when a cluster changes whole.

    ``hosts``: the play's hosts in order; ``clusters``: {host: its plan's cluster part} ({} or absent for
    a single-node profile); ``serial``: the requested batch size (a count, a percentage, or a list of them,
    as Ansible's ``serial``). A cluster's members move next to its first member in ``hosts`` and always
    share a batch: a batch that would split one grows to hold it (a line says so). Returns
    ``{"order": [...], "serial": [...], "lines": [...]}``; with no cluster of two or more members in the
    run, ``order`` is ``hosts`` and ``serial`` the request, unchanged.
    """
    hosts = [str(host) for host in hosts]
    present = set(hosts)
    units: list[tuple[str, list[str]]] = []
    placed: set[str] = set()
    for host in hosts:
        if host in placed:
            continue
        part = clusters.get(host) or {}
        members = [str(m["host"]) for m in part.get("members") or [] if str(m["host"]) in present]
        if host not in members:
            members = [host]
        members = [member for member in members if member not in placed]
        units.append((str(part.get("name") or "") if len(members) > 1 else "", members))
        placed.update(members)
    requested = list(serial) if isinstance(serial, list | tuple) else [serial]
    sizes = [_batch_size(value, len(hosts)) for value in requested or [0]]
    if not any(name for name, _ in units):
        return {"order": hosts, "serial": serial, "lines": []}
    order: list[str] = []
    out: list[int] = []
    lines: list[str] = []
    step = 0
    while units:
        size = sizes[min(step, len(sizes) - 1)]
        batch: list[str] = []
        while units and (size <= 0 or not batch or len(batch) + len(units[0][1]) <= size):
            name, members = units.pop(0)
            if name and 0 < size < len(members):
                lines.append(
                    f"cluster {name} ({', '.join(members)}) changes as one batch of {len(members)} "
                    f"(batch size {requested[min(step, len(requested) - 1)]})"
                )
            batch += members
        order += batch
        out.append(len(batch))
        step += 1
    return {"order": order, "serial": out, "lines": lines}
