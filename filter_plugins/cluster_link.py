"""Ansible filters over the cluster link preflight (pure; the logic is sparkfleet.fleet.cluster_link).

playbooks/tasks/cluster-preflight.yml collects, on each host of a cluster, what
``cluster_link.check_collected`` reads (its comment block says what each host's dict holds), then judges
the run's clusters once with these filters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.fleet import cluster_link as _cluster_link


def sparkfleet_cluster_check(collected: Mapping[str, Any]) -> list[str]:
    """``{host: collected facts} | sparkfleet_cluster_check``: one line per refusal over every cluster of
    the run (empty: every cluster's link may carry it); hosts in no cluster are refused nothing."""
    try:
        return _cluster_link.check_collected(_plain(collected))
    except _cluster_link.ClusterLinkError as exc:
        raise AnsibleFilterError(f"sparkfleet_cluster_check: {exc}") from exc


def sparkfleet_cluster_summary(collected: Mapping[str, Any]) -> list[str]:
    """``{host: collected facts} | sparkfleet_cluster_summary``: "cluster <name>: link preflight passed (N
    nodes on <interface>)" per cluster, then the hosts in none; for a run sparkfleet_cluster_check passed."""
    try:
        return _cluster_link.collected_summary(_plain(collected))
    except (_cluster_link.ClusterLinkError, KeyError, TypeError) as exc:
        raise AnsibleFilterError(f"sparkfleet_cluster_summary: {exc}") from exc


def sparkfleet_cluster_ping_targets(cluster: Mapping[str, Any], host: str, ip_addrs: Mapping[str, Any]) -> list[str]:
    """``sparkfleet_plan.cluster | sparkfleet_cluster_ping_targets(inventory_hostname, {member: ip addr result})``:
    the addresses the host pings out of the cluster interface (each other member's planned address and
    the IPv4 addresses it lists on the interface); [] for a host in no cluster."""
    if not cluster:
        return []
    if not isinstance(cluster, Mapping) or not isinstance(ip_addrs, Mapping):
        raise AnsibleFilterError(
            f"sparkfleet_cluster_ping_targets: wants a plan's cluster and {{member: ip addr result}}, got "
            f"{type(cluster).__name__} and {type(ip_addrs).__name__}"
        )
    try:
        return _cluster_link.ping_targets(str(host), _plain(cluster), _plain(ip_addrs))
    except _cluster_link.ClusterLinkError as exc:
        raise AnsibleFilterError(f"sparkfleet_cluster_ping_targets: {exc}") from exc


def _plain(value: Any) -> Any:
    """Ansible's tagged or lazy containers and strings as plain dicts, lists and str."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str(value)
    return value


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "sparkfleet_cluster_check": sparkfleet_cluster_check,
            "sparkfleet_cluster_summary": sparkfleet_cluster_summary,
            "sparkfleet_cluster_ping_targets": sparkfleet_cluster_ping_targets,
        }
