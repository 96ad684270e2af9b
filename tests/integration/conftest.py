"""Helpers for integration tests: run playbooks against the sandbox fleet and read their recap."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.sandbox.conftest import sandbox_fleet  # noqa: F401 - the fleet fixture, shared

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)"
)


@dataclass
class PlaybookRun:
    returncode: int
    output: str
    recap: dict[str, dict[str, int]]

    def changed(self) -> dict[str, int]:
        return {host: r["changed"] for host, r in self.recap.items()}


def _run_recorded(cmd: list[str], env: dict[str, str], timeout: int) -> PlaybookRun:
    """Run cmd from the repo root, echo its output for the log, and read the play recap out of it."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = proc.stdout + proc.stderr
    print(f"$ {' '.join(cmd)}\n{output[-6000:]}")
    recap = {}
    for line in output.splitlines():
        m = RECAP.match(line.strip())
        if m:
            recap[m["host"]] = {k: int(v) for k, v in m.groupdict().items() if k != "host"}
    return PlaybookRun(proc.returncode, output, recap)


def run_playbook(*args: str, env: dict[str, str] | None = None, timeout: int = 1800) -> PlaybookRun:
    """ansible-playbook from the repo root with the sandbox inventory; output is echoed for the log."""
    full_env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        **(env or {}),
    }
    return _run_recorded([str(ANSIBLE_PLAYBOOK), "-i", "inventory/sandbox", *args], full_env, timeout)


def run_make(*args: str, timeout: int = 1800) -> PlaybookRun:
    """``make ARGS`` from the repo root, as an operator types it (the Makefile's own inventory and venv)."""
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    return _run_recorded(["make", "--no-print-directory", *args], env, timeout)


@pytest.fixture(scope="session")
def sandbox_hosts(sandbox_fleet) -> list[str]:  # noqa: F811 - the fixture imported above
    return sandbox_fleet.names


@dataclass
class ConvergedDeploy:
    """The session's one full deploy, and the hosts a test left changed for the next user to converge."""

    run: PlaybookRun
    owed: set[str]

    def converge_owed(self) -> None:
        """Deploy the dflash profile again on the hosts a test left changed (owe_convergence), if any."""
        if not self.owed:
            return
        restore = run_playbook("site.yml", "--limit", ",".join(sorted(self.owed)), "-e", "sparkfleet_profile=dflash")
        assert restore.returncode == 0, restore.output[-4000:]
        self.owed.clear()


@pytest.fixture(scope="session")
def converged_deploy(sandbox_fleet) -> ConvergedDeploy:  # noqa: F811 - the fixture imported above
    """One real `site.yml` deploy of the dflash profile for the whole session."""
    run = run_playbook("site.yml", "-e", "sparkfleet_profile=dflash")
    assert run.returncode == 0, run.output[-4000:]
    assert set(run.recap) >= set(sandbox_fleet.names)
    return ConvergedDeploy(run, set())


@pytest.fixture
def converged_fleet(converged_deploy: ConvergedDeploy) -> PlaybookRun:
    """The fleet as the session's deploy left it (shared by every test that needs serving hosts). A test
    puts the fleet back as it found it, or hands the hosts it changed to ``owe_convergence``: they are
    deployed again here before the next test that asks for the converged fleet (so the session's last
    test pays for no restore nothing after it needs)."""
    converged_deploy.converge_owed()
    return converged_deploy.run


@pytest.fixture
def owe_convergence(converged_deploy: ConvergedDeploy):  # noqa: ANN201 - a callable: owe_convergence(host)
    """``owe_convergence(host)``: the test leaves ``host`` off the converged state; the next test that asks
    for ``converged_fleet`` deploys it again first."""
    return converged_deploy.owed.add


@pytest.fixture
def inventory_with_host_vars(tmp_path: Path):
    """A copy of the sandbox inventory to which a test adds host_vars (the real one stays clean)."""
    inv = tmp_path / "inventory"
    inv.mkdir()
    shutil.copy(ROOT / "inventory/sandbox/hosts.yml", inv / "hosts.yml")
    (inv / "group_vars").symlink_to(ROOT / "inventory/sandbox/group_vars")
    (inv / "host_vars").mkdir()

    def add(host: str, variables: dict) -> str:
        (inv / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump(variables))
        return str(inv)

    return add
