"""`sparkfleet ops` against the sandbox fleet: real SSH (Fabric over OpenSSH's own resolution of the
inventory's options, a jump host included), real systemd, real journal, real vLLM.

Read-only except on spark-03, whose unit is restarted (and left active) and benchmarked briefly. The
fleet is the converged one (every host deployed and healthy): a host that is not fails the test, it
does not skip it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# runs against the fleet after one real deploy (tests/integration/conftest.py: converged_fleet)
pytestmark = [pytest.mark.sandbox, pytest.mark.usefixtures("converged_fleet")]

ROOT = Path(__file__).resolve().parents[2]
RESTART_HOST = "spark-03"


def ops(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`sparkfleet ops ARGS` as an operator runs it, from the repo root."""
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "ops", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")},
    )
    print(f"$ sparkfleet ops {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def unit_facts(sandbox_fleet: Any, host: str, unit: str) -> dict[str, str]:
    shown = sandbox_fleet.ssh(
        host, f"systemctl show {unit} --property=LoadState,ActiveState,SubState,MainPID,InvocationID", timeout=60
    )
    assert shown.returncode == 0, f"ssh {host} systemctl show {unit}: {shown.stderr.strip()[-300:]}"
    return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)


def host_state(sandbox_fleet: Any, host: str) -> dict[str, Any] | None:
    proc = sandbox_fleet.ssh(host, "cat /etc/sparkfleet/state.json", timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def test_status_reports_every_host_as_the_host_itself_does(sandbox_fleet: Any) -> None:
    proc = ops("status", "-i", "inventory/sandbox", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the converged fleet: every host ok
    rows = {entry["host"]: entry for entry in json.loads(proc.stdout)}
    assert set(rows) == set(sandbox_fleet.names), f"ops status missed hosts: {sorted(rows)}"
    for host in sandbox_fleet.names:
        entry = rows[host]
        assert entry["ok"] and entry["problems"] == "", entry
        row = entry["row"]
        state = host_state(sandbox_fleet, host)
        assert state, f"{host} has no state.json"
        facts = unit_facts(sandbox_fleet, host, state["unit"])
        assert (facts["ActiveState"], facts["SubState"]) == ("active", "running"), facts
        assert (row["unit"], row["health"]) == ("active/running", "ok"), row
        assert row["profile"] == state["profile"]
        assert row["patch_set"] == (state["patchset_id"] or "-")
        assert row["model"].startswith(Path(state["model_path"]).name)
        # the unit's last start, as state.json recorded it
        assert row["ready"].endswith(" s") and row["kv_pool"].startswith(f"{state['startup']['kv_pool_tokens']:,} ("), (
            row
        )


def write_inventory(where: Path, inventory: dict[str, Any]) -> Path:
    """hosts.yml with the playbooks' defaults linked in, as an operator's inventory has them (ops keeps no copy)."""
    (where / "group_vars" / "all").mkdir(parents=True)
    (where / "group_vars" / "all" / "00-sparkfleet.yml").symlink_to(ROOT / "inventory/group_vars/all/sparkfleet.yml")
    path = where / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def logins_from(sandbox_fleet: Any, host: str, address: str) -> int:
    """How many SSH logins the host's sshd accepted from address (its journal)."""
    journal = sandbox_fleet.ssh(host, "journalctl --no-pager -o cat --since=-30min", timeout=60).stdout
    return sum(f"Accepted publickey for root from {address} " in line for line in journal.splitlines())


def test_a_host_behind_a_jump_host_is_reached_by_ansible_and_ops_alike(sandbox_fleet: Any, tmp_path: Path) -> None:
    # spark-02 reached only through spark-01: ProxyJump in ansible_ssh_common_args and the jump host's
    # settings in an -F ssh config, as an operator's ~/.ssh/config would hold them
    generated = yaml.safe_load((ROOT / "inventory/sandbox/hosts.yml").read_text())
    hosts = generated["all"]["children"]["spark"]["hosts"]
    jump, target = sandbox_fleet.names[0], sandbox_fleet.names[1]
    variables = dict(hosts[target])
    known_hosts = variables["ansible_ssh_common_args"].split("UserKnownHostsFile=")[1].split()[0]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host sandbox-jump\n  HostName {hosts[jump]['ansible_host']}\n  User root\n"
        f"  IdentityFile {variables['ansible_ssh_private_key_file']}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {known_hosts}\n  StrictHostKeyChecking yes\n"
    )
    variables["ansible_ssh_common_args"] += f" -F {config} -o ProxyJump=sandbox-jump"
    path = write_inventory(tmp_path, {"all": {"children": {"spark": {"hosts": {target: variables}}}}})
    jump_address = str(hosts[jump]["ansible_host"])
    before = logins_from(sandbox_fleet, target, jump_address)

    # Ansible, with a control socket of its own (the fleet's open ones go direct)
    pinged = subprocess.run(
        [str(Path(sys.executable).with_name("ansible")), "-i", str(path), target, "-m", "ansible.builtin.ping"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path)},
    )
    assert pinged.returncode == 0 and "ping: pong" in pinged.stdout, pinged.stdout + pinged.stderr  # YAML results
    after_ansible = logins_from(sandbox_fleet, target, jump_address)
    assert after_ansible > before, "Ansible's login did not come through the jump host"

    proc = ops("status", "-i", str(path), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (entry,) = json.loads(proc.stdout)
    assert (entry["host"], entry["ok"], entry["row"]["health"]) == (target, True, "ok"), entry
    assert logins_from(sandbox_fleet, target, jump_address) > after_ansible, "ops' login did not come through the jump"


def test_an_unknown_or_changed_host_key_is_refused(sandbox_fleet: Any, tmp_path: Path) -> None:
    generated = yaml.safe_load((ROOT / "inventory/sandbox/hosts.yml").read_text())
    hosts = generated["all"]["children"]["spark"]["hosts"]
    first, second = sandbox_fleet.names[0], sandbox_fleet.names[1]
    variables = dict(hosts[first])
    real_known_hosts = Path(variables["ansible_ssh_common_args"].split("UserKnownHostsFile=")[1].split()[0])

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    # the second host's key filed under the first host's address: a changed key
    address = str(variables["ansible_host"])
    other_key = [line for line in real_known_hosts.read_text().splitlines() if second in line.split()[0].split(",")]
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"{address} {' '.join(other_key[0].split()[1:])}\n")
    inventory = {"all": {"children": {"spark": {"hosts": {}}}}}
    for name, known_hosts in (("unknown-key", empty), ("changed-key", wrong)):
        inventory["all"]["children"]["spark"]["hosts"][name] = {
            **variables,
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes",
        }
    path = write_inventory(tmp_path, inventory)

    proc = ops("status", "-i", str(path))
    assert proc.returncode == 1
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert f"host key of {address}:22 is not in {empty}" in lines["unknown-key"]
    assert "CHANGED" in lines["changed-key"]
    assert empty.read_text() == "", "a refused key is not added to known_hosts"


def test_logs_show_the_last_journal_lines_of_each_unit(sandbox_fleet: Any) -> None:
    deployed = list(sandbox_fleet.names)
    for host in deployed:
        assert unit_facts(sandbox_fleet, host, "sparkfleet-vllm-dflash.service")["LoadState"] == "loaded", host
    proc = ops("logs", "-i", "inventory/sandbox", "-l", ",".join(deployed), "--lines", "4")
    assert proc.returncode == 0, proc.stderr
    for host in deployed:
        journal = [line for line in proc.stdout.splitlines() if line.startswith(f"{host} | ")]
        assert 1 <= len(journal) <= 4, f"{host}: {journal}"
        assert any(line.startswith(host) and "ok" in line and "line(s)" in line for line in proc.stdout.splitlines())
    assert "ops logs:" in proc.stderr


def healthy_deployed(sandbox_fleet: Any, host: str, need_state: bool) -> tuple[dict[str, Any], str]:
    """state.json and unit of host, which the converged fleet has active and healthy (else the test fails)."""
    assert host in sandbox_fleet.names, f"the sandbox fleet has no {host}"
    state = host_state(sandbox_fleet, host) or {}
    assert state or not need_state, f"{host} has no /etc/sparkfleet/state.json"
    unit = state.get("unit", "sparkfleet-vllm-dflash.service")
    facts = unit_facts(sandbox_fleet, host, unit)
    assert facts.get("ActiveState") == "active", f"{unit} on {host} is {facts.get('ActiveState')}, not active"
    port = state.get("port", 8000)
    health = sandbox_fleet.ssh(
        host,
        f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/health').status)\"",
        timeout=30,
    )
    assert health.stdout.strip() == "200", f"{host} is not healthy: {health.stdout.strip() or health.stderr[-200:]}"
    return state, unit


def test_restart_restarts_the_unit_and_its_start_gate_waits_for_health(sandbox_fleet: Any) -> None:
    _state, unit = healthy_deployed(sandbox_fleet, RESTART_HOST, need_state=False)
    before = unit_facts(sandbox_fleet, RESTART_HOST, unit)

    # a loaded 2-core machine can take minutes to bring vLLM up; ~40 s when quiet
    proc = ops("restart", "-i", "inventory/sandbox", "-l", RESTART_HOST, "--timeout", "600", timeout=700)

    after = unit_facts(sandbox_fleet, RESTART_HOST, unit)
    assert after["ActiveState"] == "active", f"{unit} must be left active: {after}"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"restarted {unit}; healthy after" in proc.stdout
    assert after["InvocationID"] != before["InvocationID"], "the unit was not restarted"
    status = json.loads(ops("status", "-i", "inventory/sandbox", "-l", RESTART_HOST, "--json").stdout)
    assert status[0]["row"]["health"] == "ok"


def test_bench_runs_on_the_host_and_status_shows_it(sandbox_fleet: Any, tmp_path: Path) -> None:
    state, _unit = healthy_deployed(sandbox_fleet, RESTART_HOST, need_state=True)
    out = tmp_path / "results"
    proc = ops(
        "bench",
        "-i",
        "inventory/sandbox",
        "-l",
        RESTART_HOST,
        "--workloads",
        "prose",
        "--max-requests",
        "1",
        "--max-tokens-scale",
        "0.05",
        "--ignore-eos",
        "--out",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    copies = list((out / RESTART_HOST).glob("*-decode.json"))
    assert len(copies) == 1, proc.stdout
    result = json.loads(copies[0].read_text())
    assert result["host"] == RESTART_HOST and result["profile"] == state["profile"]
    assert result["patch_set"] == (state["patchset_id"] or None)
    latest = json.loads(sandbox_fleet.ssh(RESTART_HOST, "cat /var/lib/sparkfleet/bench/latest.json").stdout)
    assert latest == result, "latest.json on the host is the run just made"
    median = result["figures"]["decode_tok_s_median"]
    assert median > 0
    status = json.loads(ops("status", "-i", "inventory/sandbox", "-l", RESTART_HOST, "--json").stdout)
    assert status[0]["row"]["bench_tok_s"].startswith(f"{median:.1f} decode")
