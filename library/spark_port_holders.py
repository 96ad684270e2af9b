#!/usr/bin/python
"""Ansible module ``spark_port_holders``: which processes listen on the given TCP ports, and which
systemd unit each one runs in.

Read-only, and it needs no tools on the host: listening sockets come from ``/proc/net/tcp`` and
``/proc/net/tcp6``, a socket's process from the ``socket:[inode]`` links under ``/proc/PID/fd``,
its name from ``/proc/PID/comm`` and its unit from ``/proc/PID/cgroup``. The parsing functions
are pure and take a proc root, so the unit tests run them on a recorded tree.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: spark_port_holders
short_description: The processes (and their systemd units) listening on TCP ports
description:
  - Reads C(/proc/net/tcp), C(/proc/net/tcp6) and C(/proc/PID/{fd,comm,cgroup}); runs nothing.
  - Reports every listener on each of O(ports), so a preflight can refuse a port taken by another
    process before a serving unit is touched.
options:
  ports:
    description: TCP ports to look at.
    type: list
    elements: int
    required: true
author: sparkfleet
"""

RETURN = r"""
holders:
  description: One entry per (port, process) listening; pid is null when the socket's process is not visible.
  type: list
  elements: dict
  returned: always
  sample: [{"port": 8000, "pid": 4242, "comm": "python3", "unit": "squatter.service"}]
"""

LISTEN = "0A"
UNIT = re.compile(r"/([^/]+\.(?:service|scope))(?:/|$)")


def listening_inodes(proc: Path, ports: set[int]) -> dict[int, int]:
    """{socket inode: port} for sockets in LISTEN state on one of ``ports``."""
    found: dict[int, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if port in ports:
                found[int(fields[9])] = port
    return found


def unit_of(cgroup_text: str) -> str | None:
    """The innermost systemd unit (.service or .scope) in a /proc/PID/cgroup text."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        units = UNIT.findall(path)
        if units:
            return units[-1]
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def port_holders(proc: Path, ports: list[int]) -> list[dict[str, Any]]:
    inodes = listening_inodes(proc, set(ports))
    holders: list[dict[str, Any]] = []
    seen: set[int] = set()
    for entry in sorted(proc.iterdir(), key=lambda p: p.name) if inodes else []:
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            match = re.fullmatch(r"socket:\[(\d+)\]", target)
            if not match or int(match[1]) not in inodes:
                continue
            inode = int(match[1])
            seen.add(inode)
            holder = {
                "port": inodes[inode],
                "pid": int(entry.name),
                "comm": _read(entry / "comm").strip() or "?",
                "unit": unit_of(_read(entry / "cgroup")) or "",
            }
            if holder not in holders:
                holders.append(holder)
    for inode, port in inodes.items():
        if inode not in seen:  # a listener whose process this host does not show (another namespace)
            holders.append({"port": port, "pid": None, "comm": "?", "unit": ""})
    return holders


def main() -> None:
    module = AnsibleModule(
        argument_spec={"ports": {"type": "list", "elements": "int", "required": True}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, holders=port_holders(Path("/proc"), module.params["ports"]))


if __name__ == "__main__":
    main()
