"""pytest fixtures for tests that run against the sandbox fleet (tests/sandbox/fleet.py).

``sandbox_fleet`` (session scope) makes sure the fleet is up and yields a SandboxFleet: the hosts
parsed from the generated inventory (name -> address) and an ``ssh(host, command)`` helper. The
fleet stays up after the session (integration tests reuse it) unless SPARKFLEET_SANDBOX_TEARDOWN=1.
SPARKFLEET_SANDBOX_HOSTS sets how many hosts (default 3); a running fleet is never shrunk, since
others may be using its extra hosts. Other test directories can use the fixture with
``from tests.sandbox.conftest import sandbox_fleet  # noqa: F401`` in their own conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.sandbox import fleet

FLEET_SCRIPT = Path(fleet.__file__).resolve()


def run_fleet_command(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``fleet.py ARGUMENTS...`` as a separate process (it takes the fleet lock itself)."""
    return subprocess.run(
        [sys.executable, str(FLEET_SCRIPT), *arguments],
        check=False,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def sandbox_unavailable_reason() -> str | None:
    """Why the fleet cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the sandbox fleet needs root (mounts, network namespaces, systemd-nspawn)"
    for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh", "dpkg-scanpackages"):
        if shutil.which(tool) is None:
            return f"the sandbox fleet needs `{tool}`: {fleet.TOOL_INSTALL_HINTS.get(tool, 'install it')}"
    return None


@dataclass(frozen=True)
class SandboxFleet:
    """The running fleet as the tests see it."""

    hosts: dict[str, str]  # host name -> address, read from the generated Ansible inventory
    inventory_path: Path

    @property
    def names(self) -> list[str]:
        """Host names in order (spark-01, spark-02, ...)."""
        return sorted(self.hosts)

    def ssh(self, host: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a shell command on host over real SSH (fleet key, strict host key checking)."""
        return fleet.ssh_run(fleet.host_from_name(host), command, timeout=timeout)


def read_inventory_hosts(path: Path) -> dict[str, str]:
    """Host name -> ansible_host of the ``spark`` group of a generated inventory."""
    inventory = yaml.safe_load(path.read_text())
    hosts = inventory["all"]["children"]["spark"]["hosts"] or {}
    return {name: str(variables["ansible_host"]) for name, variables in hosts.items()}


def wanted_host_count() -> int:
    """SPARKFLEET_SANDBOX_HOSTS (default 3), checked."""
    raw = os.environ.get("SPARKFLEET_SANDBOX_HOSTS", "3")
    if not raw.isdigit() or not 1 <= int(raw) <= fleet.MAX_HOSTS:
        raise pytest.UsageError(f"SPARKFLEET_SANDBOX_HOSTS={raw!r}: use a whole number from 1 to {fleet.MAX_HOSTS}")
    return int(raw)


def ensure_fleet_up() -> SandboxFleet:
    """`fleet.py up` with at least the wanted number of hosts; fail with its output if it fails."""
    count = max(wanted_host_count(), len(fleet.running_hosts()))
    result = run_fleet_command("up", "--hosts", str(count))
    if result.returncode != 0:
        pytest.fail(f"`fleet.py up --hosts {count}` failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
    return SandboxFleet(read_inventory_hosts(fleet.INVENTORY_FILE), fleet.INVENTORY_FILE)


@pytest.fixture(scope="session")
def sandbox_fleet() -> Iterator[SandboxFleet]:
    """The sandbox fleet, up (see the module docstring)."""
    reason = sandbox_unavailable_reason()
    if reason:
        pytest.skip(reason)
    yield ensure_fleet_up()
    if os.environ.get("SPARKFLEET_SANDBOX_TEARDOWN") == "1":
        result = run_fleet_command("down")
        assert result.returncode == 0, f"`fleet.py down` failed:\n{result.stdout}\n{result.stderr}"
