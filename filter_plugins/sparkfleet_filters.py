"""Ansible filters over sparkfleet's serving profiles and state, and the cluster link preflight (pure: the logic is
sparkfleet.serving and sparkfleet.fleet.cluster_link)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.fleet import cluster_link as _cluster_link
from sparkfleet.fleet import doctor as _doctor
from sparkfleet.serving import cluster as _cluster
from sparkfleet.serving import profiles as _profiles
from sparkfleet.serving import serving_state as _serving_state
from sparkfleet.serving import unit_state as _unit_state


def sparkfleet_profile_names(builtin: dict[str, Any], site: dict[str, Any] | None = None) -> list[str]:
    """Sorted names of every profile the inventory knows."""
    return sorted(_profiles.all_profiles(builtin, site))


def sparkfleet_profile_errors(resolved: dict[str, Any], refused: list[dict[str, Any]] | None) -> list[str]:
    """One message per flag of the resolved profile that is known to break this model."""
    return _profiles.errors(resolved, refused)


def sparkfleet_unit_state(show: str, unit: str, journal: list[str] | None = None) -> dict[str, Any]:
    """``show_stdout | sparkfleet_unit_state(unit, journal_lines)``: {running, word, text} of a unit from
    ``systemctl show`` output and its journal lines (sparkfleet.serving.unit_state)."""
    state = _unit_state.describe(unit, _unit_state.parse_show(show), journal or [])
    return {"unit": state.unit, "running": state.running, "word": state.word, "text": state.text}


def sparkfleet_last_error(journal: list[str]) -> str:
    """``journal_lines | sparkfleet_last_error``: the journal's last line that says what went wrong."""
    return _unit_state.last_error(journal or [])


def sparkfleet_state_drift(planned: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """``plan.service.state | sparkfleet_state_drift(served)``: where the host's state.json differs from its
    plan, one line per key (sparkfleet.serving.serving_state.drift)."""
    return _serving_state.drift(planned, served)


def sparkfleet_state(slurped: dict[str, Any], where: str) -> dict[str, Any]:
    """``slurp_result | sparkfleet_state(inventory_hostname)``: the host's state.json, checked against its
    schema, with ``probe`` (host, port, url) and ``revisions`` (model, drafter); {} when there is none
    (sparkfleet.serving.serving_state)."""
    try:
        return _serving_state.from_slurp(slurped, where)
    except _serving_state.StateError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sparkfleet_unit_name(profile: str) -> str:
    """``profile_name | sparkfleet_unit_name``: the systemd unit that serves the profile."""
    return _serving_state.unit_name(profile)


def sparkfleet_doctor(
    gpu: dict[str, Any],
    system: dict[str, Any],
    needs: dict[str, Any],
    settings: dict[str, Any],
    port_holders: list[dict[str, Any]] | None = None,
    unit: str | None = None,
    hub: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``spark_gpu | sparkfleet_doctor(spark_system, needs, settings, holders, unit_show_text, hub)``: make
    doctor's checks (unit_show_text: ``systemctl show -p LoadState -p ExecStart`` output)."""
    shown = _unit_state.parse_show(unit or "")
    return _doctor.as_dicts(_doctor.checks(gpu, system, needs, settings, port_holders or [], shown, hub))


def sparkfleet_doctor_row(found: list[dict[str, Any]], host: str) -> str:
    return _doctor.row(host, found)


def sparkfleet_doctor_fixes(found: list[dict[str, Any]], host: str) -> list[str]:
    return _doctor.fixes(host, found)


def sparkfleet_doctor_row_pair(pair: tuple[list[dict[str, Any]], str]) -> str:
    """``checks_list | zip(hosts) | map('sparkfleet_doctor_row_pair')``."""
    return _doctor.row(pair[1], pair[0])


def sparkfleet_doctor_fixes_pair(pair: tuple[list[dict[str, Any]], str]) -> list[str]:
    return _doctor.fixes(pair[1], pair[0])


# The cluster link preflight (playbooks/tasks/cluster-preflight.yml collects, on each host of a cluster,
# what cluster_link.check_collected reads, then judges the run's clusters once with these).


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


def sparkfleet_serve_batches(hosts: list[str], clusters: Mapping[str, Any], serial: Any) -> dict[str, Any]:
    """``ansible_play_hosts_all | sparkfleet_serve_batches({host: its plan's cluster}, serial)``: the serving
    play's host order and batch sizes, every cluster in one batch (sparkfleet.serving.cluster.batches)."""
    try:
        return _cluster.batches(_plain(hosts), _plain(clusters or {}), _plain(serial))
    except _cluster.ClusterError as exc:
        raise AnsibleFilterError(str(exc)) from exc


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
            "sparkfleet_profile_names": sparkfleet_profile_names,
            "sparkfleet_profile_errors": sparkfleet_profile_errors,
            "sparkfleet_unit_state": sparkfleet_unit_state,
            "sparkfleet_last_error": sparkfleet_last_error,
            "sparkfleet_state": sparkfleet_state,
            "sparkfleet_state_drift": sparkfleet_state_drift,
            "sparkfleet_cluster_check": sparkfleet_cluster_check,
            "sparkfleet_cluster_summary": sparkfleet_cluster_summary,
            "sparkfleet_cluster_ping_targets": sparkfleet_cluster_ping_targets,
            "sparkfleet_serve_batches": sparkfleet_serve_batches,
            "sparkfleet_unit_name": sparkfleet_unit_name,
            "sparkfleet_doctor": sparkfleet_doctor,
            "sparkfleet_doctor_row": sparkfleet_doctor_row,
            "sparkfleet_doctor_fixes": sparkfleet_doctor_fixes,
            "sparkfleet_doctor_row_pair": sparkfleet_doctor_row_pair,
            "sparkfleet_doctor_fixes_pair": sparkfleet_doctor_fixes_pair,
        }
