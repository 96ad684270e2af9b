"""Ansible filter: the order in which a fleet's hosts copy the weights from each other (issue 4).

``model_cache_fanout_plan(hosts, holders, first='')``: rounds of copies. The seed (the controller's
cache) sends once, to one host, and only when no host holds a verified copy yet; from then on every
host that holds a verified copy serves one host per round, so the number of holders doubles each
round (a binary tree: N hosts need ceil(log2 N) host-to-host rounds) and no host serves two copies
at once. Pure and standard library only.

    hosts:   the hosts that take part, in play order (each needs the weights or holds them)
    holders: those of ``hosts`` whose copy is already complete and verified
    first:   the host the seed sends to (``model_cache_seed_host``); '' means the first host in need

Returns a list of rounds, each a list of ``{"to": host, "from": host or None}`` (None: the seed);
hosts that hold a copy already are never sent to.
"""

from __future__ import annotations

from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # the unit tests import this file without Ansible on the path

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        """Stand-in when Ansible is not importable."""


def _host_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, str) and h for h in value):
        raise AnsibleFilterError(f"model_cache_fanout_plan: {what} must be a list of host names, got {value!r}")
    return list(value)


def model_cache_fanout_plan(hosts: Any, holders: Any, first: Any = "") -> list[list[dict[str, str | None]]]:
    """Rounds of copies that bring every host of ``hosts`` a verified copy (see the module docstring)."""
    hosts = _host_list(hosts, "hosts")
    holders = _host_list(holders, "holders")
    if len(set(hosts)) != len(hosts):
        raise AnsibleFilterError(f"model_cache_fanout_plan: hosts {hosts!r} names a host twice")
    strangers = [h for h in holders if h not in hosts]
    if strangers:
        raise AnsibleFilterError(f"model_cache_fanout_plan: holders {strangers!r} are not among the hosts {hosts!r}")
    first = first or ""
    if not isinstance(first, str) or (first and first not in hosts):
        raise AnsibleFilterError(
            f"model_cache_seed_host {first!r} is not one of this play's hosts {hosts!r}; "
            "name one of them or leave it empty"
        )
    have = [h for h in hosts if h in holders]
    need = [h for h in hosts if h not in holders]
    rounds: list[list[dict[str, str | None]]] = []
    if need and not have:
        root = first if first in need else need[0]
        rounds.append([{"to": root, "from": None}])
        need.remove(root)
        have.append(root)
    while need:
        copies = [{"to": receiver, "from": source} for source, receiver in zip(have, need, strict=False)]
        rounds.append(copies)
        del need[: len(copies)]
        have.extend(copy["to"] for copy in copies)
    return rounds


class FilterModule:
    """model_cache's filters."""

    def filters(self) -> dict[str, Any]:
        return {"model_cache_fanout_plan": model_cache_fanout_plan}
