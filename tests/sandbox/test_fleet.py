"""Tests of the sandbox fleet harness.

The tests marked ``sandbox`` run against the real fleet (root, systemd-nspawn): idempotent `up`,
strict SSH, systemd as PID 1 with hardened units, the network boundary, reboot from inside, and a
`down` that leaves nothing behind. The unmarked ones check fleet.py's pure parts (apt sources,
package lists, inventory) and need nothing.
"""

from __future__ import annotations

import errno
import re
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.sandbox import fleet
from tests.sandbox.conftest import SandboxFleet, read_inventory_hosts, run_fleet_command

# --------------------------------------------------------------------------- pure parts


def test_one_line_sources_give_the_main_archive_not_security_or_updates() -> None:
    text = textwrap.dedent(
        """\
        # a comment
        deb [arch=amd64] http://mirror.invalid/debian-security bookworm-security main
        deb http://mirror.invalid/debian/ bookworm-updates main
        deb-src http://mirror.invalid/debian bookworm main
        deb [signed-by=/usr/share/keyrings/k.gpg] http://mirror.invalid/debian bookworm main contrib
        """
    )
    picked = fleet.pick_debian_mirror(fleet.parse_one_line_sources(text, "sources.list"))
    assert (picked.uri, picked.suite, picked.signed_by) == (
        "http://mirror.invalid/debian",
        "bookworm",
        "/usr/share/keyrings/k.gpg",
    )


def test_deb822_sources_skip_disabled_stanzas_and_inline_keys() -> None:
    text = textwrap.dedent(
        """\
        Types: deb
        URIs: http://disabled.invalid/debian
        Suites: bookworm
        Components: main
        Enabled: no

        Types: deb deb-src
        URIs: http://mirror.invalid/debian
        Suites: bookworm bookworm-updates
        Components: main
        Signed-By:
         -----BEGIN PGP PUBLIC KEY BLOCK-----
         .
         -----END PGP PUBLIC KEY BLOCK-----
        """
    )
    sources = fleet.parse_deb822_sources(text, "debian.sources")
    assert [(source.uri, source.suite) for source in sources] == [
        ("http://mirror.invalid/debian", "bookworm"),
        ("http://mirror.invalid/debian", "bookworm-updates"),
    ]
    assert fleet.pick_debian_mirror(sources).signed_by is None


def test_a_machine_without_a_bookworm_main_source_gets_a_fix() -> None:
    only_security = fleet.parse_one_line_sources("deb http://x.invalid/s bookworm-security main\n", "s")
    with pytest.raises(fleet.FleetError, match="SPARKFLEET_DEBIAN_MIRROR"):
        fleet.pick_debian_mirror(only_security)


def test_package_list_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "packages.txt"
    bad.write_text("[rootfs]\nsystemd\nNot_A_Package\n[aptrepo]\ncurl\n")
    with pytest.raises(fleet.FleetError, match=r"packages.txt:3: 'Not_A_Package'"):
        fleet.read_package_sections(bad)
    bad.write_text("[rootfs]\nsystemd\n")
    with pytest.raises(fleet.FleetError, match=r"\[aptrepo\] is missing"):
        fleet.read_package_sections(bad)


def test_stamps_follow_the_package_lists() -> None:
    sections = fleet.read_package_sections()
    changed = {**sections, "aptrepo": [*sections["aptrepo"], "jq"]}
    assert fleet.rootfs_stamp(changed) == fleet.rootfs_stamp(sections)
    assert fleet.aptrepo_stamp(changed) != fleet.aptrepo_stamp(sections)
    changed_rootfs = {**sections, "rootfs": [*sections["rootfs"], "jq"]}
    assert fleet.aptrepo_stamp(changed_rootfs) != fleet.aptrepo_stamp(sections)


def test_inventory_is_the_spark_group_with_strict_ssh() -> None:
    inventory = yaml.safe_load(fleet.inventory_text([fleet.Host(1), fleet.Host(2)]))
    hosts = inventory["all"]["children"]["spark"]["hosts"]
    assert list(hosts) == ["spark-01", "spark-02"]
    assert hosts["spark-02"]["ansible_host"] == "10.213.0.12"
    assert hosts["spark-01"]["ansible_python_interpreter"] == "/usr/bin/python3"
    assert hosts["spark-01"]["sparkfleet_sandbox"] is True
    assert "StrictHostKeyChecking=yes" in hosts["spark-01"]["ansible_ssh_common_args"]
    assert f"UserKnownHostsFile={fleet.KNOWN_HOSTS}" in hosts["spark-01"]["ansible_ssh_common_args"]


def test_status_reads_the_fleet_back_from_the_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(fleet.inventory_text([fleet.Host(1), fleet.Host(3)]))
    monkeypatch.setattr(fleet, "INVENTORY_FILE", inventory)
    assert fleet.inventory_host_names() == ["spark-01", "spark-03"]


def test_unknown_host_names_are_refused() -> None:
    with pytest.raises(fleet.FleetError, match="spark-01 ... spark-40"):
        fleet.host_from_name("spark-1")


# --------------------------------------------------------------------------- the real fleet


def nspawn_pids(sandbox: SandboxFleet) -> dict[str, int | None]:
    return {name: fleet.nspawn_pid(fleet.host_from_name(name)) for name in sandbox.names}


@pytest.mark.sandbox
def test_up_is_idempotent(sandbox_fleet: SandboxFleet) -> None:
    before = nspawn_pids(sandbox_fleet)
    assert all(before.values()), before
    result = run_fleet_command("up", "--hosts", str(len(sandbox_fleet.hosts)))
    assert result.returncode == 0, result.stderr
    assert f"up: nothing to do, {len(sandbox_fleet.hosts)} hosts already running" in result.stdout
    assert nspawn_pids(sandbox_fleet) == before


@pytest.mark.sandbox
def test_ssh_is_real_and_host_keys_are_checked_strictly(sandbox_fleet: SandboxFleet, tmp_path: Path) -> None:
    for name in sandbox_fleet.names:
        result = sandbox_fleet.ssh(name, "hostname")
        assert (result.returncode, result.stdout.strip()) == (0, name), result.stderr
    first = fleet.host_from_name(sandbox_fleet.names[0])
    # The same connection with an empty known_hosts is refused: no trust on first use.
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    refused = subprocess.run(
        [*fleet.ssh_base_argv(first, known_hosts=empty), "true"], capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 255
    assert "Host key verification failed" in refused.stderr
    # Another host's key under this host's address is refused too.
    other_key = fleet.host_public_key(fleet.Host(first.index + 1))
    if other_key:
        wrong = tmp_path / "wrong_known_hosts"
        wrong.write_text(f"{first.address} {other_key}\n")
        mismatched = subprocess.run(
            [*fleet.ssh_base_argv(first, known_hosts=wrong), "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert mismatched.returncode == 255
        assert "HOST IDENTIFICATION HAS CHANGED" in mismatched.stderr


@pytest.mark.sandbox
def test_ansible_reaches_every_host_through_the_generated_inventory(sandbox_fleet: SandboxFleet) -> None:
    ansible = Path(sys.executable).with_name("ansible")
    if not ansible.exists():
        pytest.skip(f"no ansible next to {sys.executable} (run with the controller venv)")
    result = subprocess.run(
        [str(ansible), "-i", str(sandbox_fleet.inventory_path), "spark", "-m", "ansible.builtin.ping"],
        cwd=fleet.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in sandbox_fleet.names:
        assert re.search(rf"^{name} \| SUCCESS", result.stdout, flags=re.MULTILINE), result.stdout


HARDENED_PROBE_UNIT = """\
[Unit]
Description=sandbox fleet test: a hardened unit starts

[Service]
Type=oneshot
User=daemon
ProtectSystem=strict
NoNewPrivileges=yes
PrivateTmp=yes
StateDirectory=sf-probe
ExecStart=/bin/sh -c '{ id -un; grep NoNewPrivs /proc/self/status; \\
    touch /etc/sf-probe 2>&1 || echo etc-ro; } > /var/lib/sf-probe/report'
"""


@pytest.mark.sandbox
def test_systemd_is_pid_1_and_starts_a_hardened_unit(sandbox_fleet: SandboxFleet) -> None:
    for name in sandbox_fleet.names:
        result = sandbox_fleet.ssh(name, "cat /proc/1/comm; systemctl is-system-running")
        assert result.stdout.split() == ["systemd", "running"], (name, result.stdout, result.stderr)
    host = sandbox_fleet.names[0]
    command = (
        f"cat > /etc/systemd/system/sf-probe.service <<'EOF'\n{HARDENED_PROBE_UNIT}EOF\n"
        "systemctl daemon-reload && systemctl start sf-probe.service && cat /var/lib/sf-probe/report; "
        "rc=$?; test ! -e /etc/sf-probe || echo etc-written; "
        "systemctl reset-failed sf-probe.service 2>/dev/null; "
        "rm -f /etc/systemd/system/sf-probe.service; systemctl daemon-reload; "
        "rm -rf /var/lib/sf-probe; exit $rc"
    )
    result = sandbox_fleet.ssh(host, command)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "daemon"
    assert lines[1].split() == ["NoNewPrivs:", "1"]
    assert "Read-only file system" in lines[2] and lines[-1] == "etc-ro"
    assert "etc-written" not in result.stdout


def default_gateway_of_this_machine() -> str | None:
    """The controller's IPv4 default gateway (a real address the hosts must not reach)."""
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000" and fields[2] != "00000000":
            return socket.inet_ntoa(struct.pack("<L", int(fields[2], 16)))
    return None


CONNECT_PROBE = (
    "python3 -c 'import socket,sys\n"
    "try:\n"
    "    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
    '    print(s.recv(64).decode(errors="replace").strip() or "connected")\n'
    "except OSError as e:\n"
    '    print("errno", e.errno)\' '
)


@pytest.mark.sandbox
def test_hosts_reach_each_other_but_not_the_outside(sandbox_fleet: SandboxFleet) -> None:
    if len(sandbox_fleet.names) < 2:
        pytest.skip("needs two hosts (SPARKFLEET_SANDBOX_HOSTS>=2)")
    first, second = sandbox_fleet.names[:2]
    peer = sandbox_fleet.ssh(first, CONNECT_PROBE + f"{sandbox_fleet.hosts[second]} 22")
    assert peer.stdout.startswith("SSH-2.0-"), (peer.stdout, peer.stderr)
    routes = sandbox_fleet.ssh(first, "ip -4 route show default")
    assert (routes.returncode, routes.stdout.strip()) == (0, "")
    outside = ["1.1.1.1"] + [gateway for gateway in [default_gateway_of_this_machine()] if gateway]
    for address in outside:
        result = sandbox_fleet.ssh(first, CONNECT_PROBE + f"{address} 443")
        assert result.stdout.strip() == f"errno {errno.ENETUNREACH}", (address, result.stdout, result.stderr)


@pytest.mark.sandbox
def test_reboot_from_inside_brings_the_host_back(sandbox_fleet: SandboxFleet) -> None:
    name = sandbox_fleet.names[-1]
    host = fleet.host_from_name(name)
    supervisor_before, nspawn_before = fleet.supervisor_pid(host), fleet.nspawn_pid(host)
    marker = sandbox_fleet.ssh(name, "touch /run/sf-reboot-marker && test -e /run/sf-reboot-marker")
    assert marker.returncode == 0, marker.stderr
    sandbox_fleet.ssh(name, "systemctl reboot", timeout=30)  # the connection may drop: no rc check
    deadline = time.monotonic() + 60
    while fleet.nspawn_pid(host) in (None, nspawn_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fleet.nspawn_pid(host) not in (None, nspawn_before), "the container was not started again"
    state = None
    while time.monotonic() < deadline:
        state = sandbox_fleet.ssh(name, "systemctl is-system-running --wait", timeout=60).stdout.strip()
        if state in ("running", "degraded"):
            break
        time.sleep(0.2)
    assert state == "running"
    after = sandbox_fleet.ssh(name, "test -e /run/sf-reboot-marker && echo still-there || echo fresh-boot")
    assert after.stdout.strip() == "fresh-boot"
    assert fleet.supervisor_pid(host) == supervisor_before
    assert "the container rebooted (exit 133)" in host.console_log.read_text(errors="replace")


def leftovers() -> dict[str, list[str]]:
    """Everything of the fleet that is still on this machine."""
    links = fleet.list_links()
    return {
        "mounts": fleet.mounts_under(fleet.SANDBOX_DIR) + fleet.mounts_under(Path("/run/netns")),
        "netns": [name for name in fleet.list_netns() if name.startswith(fleet.NETNS_PREFIX)],
        "links": [name for name in links if name == fleet.BRIDGE or name.startswith(fleet.VETH_PREFIX)],
        "processes": [" ".join(fleet.process_cmdline(pid))[:80] for pid in fleet.fleet_processes()],
        "nspawn runtime": [str(path) for path in fleet.NSPAWN_RUNTIME_DIR.glob("propagate/spark-*")],
        "cgroups": [
            str(hierarchy / fleet.CGROUP_GROUP)
            for hierarchy in fleet.systemd_cgroup_hierarchies()
            if (hierarchy / fleet.CGROUP_GROUP).exists()
        ],
    }


@pytest.mark.sandbox
def test_down_leaves_nothing_behind_and_up_restores_the_same_hosts(sandbox_fleet: SandboxFleet) -> None:
    known_hosts_before = fleet.KNOWN_HOSTS.read_text()
    result = run_fleet_command("down")
    assert result.returncode == 0, result.stderr
    assert "down: fleet stopped" in result.stdout
    assert not any(leftovers().values()), leftovers()
    again = run_fleet_command("down")
    assert (again.returncode, again.stdout.strip().splitlines()[-1]) == (0, "down: nothing to stop")
    # up again for whatever runs next; the upper layers survived, so the host keys did too
    up = run_fleet_command("up", "--hosts", str(len(sandbox_fleet.hosts)))
    assert up.returncode == 0, up.stderr
    restored = SandboxFleet(read_inventory_hosts(fleet.INVENTORY_FILE), fleet.INVENTORY_FILE)
    assert restored.hosts == sandbox_fleet.hosts
    assert fleet.KNOWN_HOSTS.read_text() == known_hosts_before
    for name in restored.names:
        assert restored.ssh(name, "true").returncode == 0
