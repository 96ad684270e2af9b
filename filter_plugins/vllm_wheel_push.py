"""Ansible filter: the controller's wheels a host lacks or holds different, which vllm_wheel's push sends
(the logic is sparkfleet.build.wheelhouse.push_plan).

``src_find.files | vllm_wheel_push_plan(host_find.files, owner, group, mode)``: ``[{path, size}, ...]``
in the order of the paths ignoring case, the wheels whose name the host lacks or holds with another
checksum, mode, owner or group than ``copy`` sets.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.build import wheelhouse as _wheelhouse


def vllm_wheel_push_plan(
    source_files: list[dict[str, Any]], host_files: list[dict[str, Any]], owner: str, group: str, mode: str
) -> list[dict[str, Any]]:
    """The wheels to push, each ``{"path": <controller path>, "size": <bytes>}``."""
    try:
        return _wheelhouse.push_plan(source_files, host_files, owner, group, mode)
    except ValueError as exc:
        raise AnsibleFilterError(f"vllm_wheel_push_plan: {exc}") from exc


class FilterModule:
    """vllm_wheel's wheelhouse push plan."""

    def filters(self) -> dict[str, Any]:
        return {"vllm_wheel_push_plan": vllm_wheel_push_plan}
