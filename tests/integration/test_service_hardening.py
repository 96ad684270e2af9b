"""The serving unit's guards, on one sandbox host (issue 5: validation, memory guard, hardening, exposure).

Runs after test_deploy.py has converged the fleet with the `dflash` profile and uses only the last host
of the fleet. Each test drives the real deploy playbook against that host with a variable changed
(`--tags vllm_service`, so only the serving role runs) and checks the effect on the host: a unit with a
bad key never goes live, the hardened unit scores <= 3.0 and still serves, the API refuses to bind beyond
loopback without a key and, with a key and an allow-list, answers only keyed requests from listed
clients, and an over-subscribed start fails the unit for good, once through the memory guard alone and
once through the kernel's MemoryMax= alone, while the host stays up.
The host is put back into its converged `dflash` state at the end (a full deploy limited to it).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

from tests.integration.conftest import ROOT, run_playbook

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

UNIT = "sparkfleet-vllm-dflash.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
FIREWALL_UNIT = "sparkfleet-vllm-firewall.service"
PORT = 8000
API_KEY = "sandbox-test-key-5"
MAX_EXPOSURE = 3.0

# GET url with an optional bearer key; prints the HTTP status, or "timeout"/"refused".
HTTP_STATUS_SCRIPT = """
import socket, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1])
if len(sys.argv) > 2:
    request.add_header("Authorization", "Bearer " + sys.argv[2])
try:
    print(urllib.request.urlopen(request, timeout=4).status)
except urllib.error.HTTPError as error:
    print(error.code)
except (TimeoutError, socket.timeout):
    print("timeout")
except urllib.error.URLError as error:
    print("timeout" if isinstance(error.reason, (TimeoutError, socket.timeout)) else "refused")
"""


def deploy(host: str, *extra: str, tags: str | None = "vllm_service"):
    """The deploy playbook limited to host (only the serving role unless tags is None)."""
    args = ["site.yml", "-e", "sparkfleet_profile=dflash", "--limit", host, *extra]
    if tags:
        args += ["--tags", tags]
    return run_playbook(*args, timeout=900)


class Host:
    """One sandbox host, through the fleet's SSH helper."""

    def __init__(self, fleet, name: str) -> None:
        self.fleet = fleet
        self.name = name
        self.address = fleet.hosts[name]

    def sh(self, command: str, timeout: float = 120) -> str:
        result = self.fleet.ssh(self.name, command, timeout=timeout)
        assert result.returncode == 0, f"{self.name}: `{command}` failed: {result.stdout}{result.stderr}"
        return result.stdout.strip()

    def show(self, *properties: str) -> dict[str, str]:
        flags = " ".join(f"-p {p}" for p in properties)
        lines = self.sh(f"systemctl show {flags} {UNIT}").splitlines()
        return dict(line.split("=", 1) for line in lines)

    def unit_identity(self) -> dict[str, str]:
        """What must not move when a change is refused: the unit file, its process, its start time."""
        return {
            "sha256": self.sh(f"sha256sum {UNIT_PATH}").split()[0],
            **self.show("MainPID", "ActiveState", "ActiveEnterTimestamp"),
        }


def http_status(fleet, from_host: str | None, url: str, key: str | None = None) -> str:
    """HTTP status of GET url from a sandbox host, or from the controller when from_host is None."""
    argv = ["python3", "-c", HTTP_STATUS_SCRIPT, url, *([key] if key else [])]
    if from_host is None:
        import subprocess

        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    return fleet.ssh(from_host, shlex.join(argv), timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def host(sandbox_fleet) -> Iterator[Host]:
    """The fleet's last host, serving dflash; converged again with a full deploy afterwards."""
    name = sandbox_fleet.names[-1]
    target = Host(sandbox_fleet, name)
    if target.fleet.ssh(name, f"systemctl is-active {UNIT}").stdout.strip() != "active":
        converge = deploy(name, tags=None)
        assert converge.returncode == 0, converge.output[-4000:]
    yield target
    # a fresh start count: these tests start the unit a few times within StartLimitIntervalSec
    target.sh(f"systemctl reset-failed {UNIT} || true")
    restore = deploy(name, tags=None)
    assert restore.returncode == 0, restore.output[-4000:]
    assert target.sh(f"systemctl is-active {UNIT}") == "active"
    assert f"127.0.0.1:{PORT}" in target.sh(f"ss -Hltn 'sport = :{PORT}'")
    assert "sparkfleet_vllm" not in target.sh("nft list tables 2>/dev/null || true")
    assert target.sh(f"systemctl is-enabled {FIREWALL_UNIT} 2>/dev/null || true") in ("", "not-found")


def test_a_unit_with_a_bad_key_never_goes_live(host: Host) -> None:
    before = host.unit_identity()
    assert before["ActiveState"] == "active"
    bad = deploy(host.name, "-e", json.dumps({"vllm_service_extra_directives": {"NoSuchKey": "1"}}))
    assert bad.returncode != 0
    # systemd-analyze verify exits 0 here and only warns on stderr; the validate step reads it
    assert "Unknown key 'NoSuchKey' in section [Service]" in bad.output
    assert "Write the unit" in bad.output
    assert host.unit_identity() == before


def test_the_hardened_unit_scores_at_most_3_and_serves(host: Host) -> None:
    report = host.sh(f"LC_ALL=C SYSTEMD_COLORS=0 systemd-analyze security --offline=yes --no-pager {UNIT_PATH}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", report)
    assert match, report[-2000:]
    assert float(match.group(1)) <= MAX_EXPOSURE, report
    # the hardening is in force on the running server, not only written down
    pid = host.show("MainPID")["MainPID"]
    status = host.sh(f"cat /proc/{pid}/status")
    fields = dict(re.findall(r"^(\w+):\s+(.*)$", status, re.MULTILINE))
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert host.sh(f"stat -c %U /proc/{pid}") == "vllm"
    # ...and it still serves under it (the completion is the real model's)
    request = json.dumps({"model": "qwen", "prompt": "1 2 3", "max_tokens": 4, "temperature": 0})
    script = (
        "import sys,urllib.request;"
        f"r=urllib.request.Request('http://127.0.0.1:{PORT}/v1/completions',data=sys.argv[1].encode(),"
        "headers={'Content-Type':'application/json'});"
        "print(urllib.request.urlopen(r,timeout=60).read().decode())"
    )
    body = host.sh(f"python3 -c {shlex.quote(script)} {shlex.quote(request)}")
    assert json.loads(body)["usage"]["completion_tokens"] >= 1


def test_binding_beyond_loopback_without_a_key_is_refused(host: Host) -> None:
    before = host.unit_identity()
    refused = deploy(host.name, "-e", "sparkfleet_api_host=0.0.0.0")
    assert refused.returncode != 0
    assert "sparkfleet_api_host 0.0.0.0 is reachable beyond this host but sparkfleet_api_key is empty" in (
        " ".join(refused.output.split())
    )
    assert refused.recap[host.name]["changed"] == 0
    assert host.unit_identity() == before
    assert f"127.0.0.1:{PORT}" in host.sh(f"ss -Hltn 'sport = :{PORT}'")


def test_beyond_loopback_only_keyed_requests_get_in(host: Host, sandbox_fleet, tmp_path) -> None:
    other = next(name for name in sandbox_fleet.names if name != host.name)
    exposed = deploy(host.name, "-e", json.dumps({"sparkfleet_api_host": "0.0.0.0", "sparkfleet_api_key": API_KEY}))
    assert exposed.returncode == 0, exposed.output[-4000:]
    assert f"0.0.0.0:{PORT}" in host.sh(f"ss -Hltn 'sport = :{PORT}'")
    url = f"http://{host.address}:{PORT}/v1/models"
    assert http_status(sandbox_fleet, None, url) == "401"
    assert http_status(sandbox_fleet, None, url, "not-the-key") == "401"
    assert http_status(sandbox_fleet, None, url, API_KEY) == "200"
    assert http_status(sandbox_fleet, other, url, API_KEY) == "200"
    # the health gate sends the key with every check (as `make health` does): it must leave no trace,
    # not even in Ansible's most verbose output
    secret_vars = tmp_path / "secret-vars.json"  # as Vault would hand it over: not on the command line
    secret_vars.write_text(json.dumps({"sparkfleet_api_key": API_KEY}), encoding="utf-8")
    secret_vars.chmod(0o600)
    checked = run_playbook("playbooks/health.yml", "-vvv", "--limit", host.name, "-e", f"@{secret_vars}", timeout=600)
    assert checked.returncode == 0, checked.output[-4000:]
    # a keyed server is benchmarked with its key (read on the host from the root-only secrets file), by
    # every method: the two sparkfleet clients and vllm bench serve (the key in its environment)
    results = ROOT / "results" / host.name
    before = set(results.glob("*.json")) if results.is_dir() else set()
    bench_vars = {
        "serve_bench_quick": True,
        "serve_bench_methods": ["decode", "e2e", "serving"],
        "serve_bench_fail_on_regression": False,
        "serve_bench_serving_concurrencies": [2],  # the key is what is tested here, not the sweep
    }
    bench = run_playbook(
        "playbooks/bench.yml", "-vvv", "--limit", host.name, "-e", f"@{secret_vars}", "-e", json.dumps(bench_vars)
    )
    assert bench.returncode == 0, bench.output[-4000:]
    new = {json.loads(p.read_text())["kind"]: json.loads(p.read_text()) for p in set(results.glob("*.json")) - before}
    assert set(new) == {"decode", "e2e", "serving"}, sorted(new)
    assert new["decode"]["figures"]["decode_tok_s_median"] > 0 and new["e2e"]["figures"]["e2e_tok_s"] > 0
    assert (new["serving"]["figures"]["serving_completed"], new["serving"]["figures"]["serving_failed"]) == (8, 0)
    # the quick benchmark of `make quick-bench` (sparkfleet ops bench) and the rolling gate, keyed
    quick = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "ops", "bench", "-l", host.name, "--workloads", "prose",
         "--max-requests", "1", "--max-tokens-scale", "0.05", "--ignore-eos", "--out", str(tmp_path / "quick")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert quick.returncode == 0, quick.stdout + quick.stderr
    assert len(list((tmp_path / "quick" / host.name).glob("*-decode.json"))) == 1, quick.stdout
    # the gate holds the host to acceptance figures measured here (the inventory's are another CPU's)
    sandbox = yaml.safe_load((ROOT / "inventory/sandbox/group_vars/all/50-sandbox.yml").read_text())
    profiles_site = sandbox["sparkfleet_profiles_site"]
    measured = {k: v for k, v in new["decode"]["figures"].items() if k.startswith("acceptance_length") and v}
    assert measured, new["decode"]["figures"]
    profiles_site["dflash"]["baselines_quick"] = measured
    gate_vars = tmp_path / "gate-vars.json"
    gate_vars.write_text(json.dumps({"sparkfleet_profiles_site": profiles_site}), encoding="utf-8")
    # (without the stop-first stop: the unit is unchanged, and what is tested here is the gate with the key,
    # not a restart; the rolling tests stop first)
    rolled = run_playbook(
        "playbooks/rolling.yml", "--limit", host.name, "-e", "sparkfleet_profile=dflash",
        "-e", "sparkfleet_api_host=0.0.0.0", "-e", f"@{secret_vars}", "-e", f"@{gate_vars}",
        "-e", "sparkfleet_serve_stop_first=false", timeout=900,
    )  # fmt: skip
    assert rolled.returncode == 0, rolled.output[-4000:]
    assert f"{host.name}: decode (quick)" in rolled.output, rolled.output[-4000:]
    # the report of everything fetched
    report = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "report", "--results", str(ROOT / "results"), "--out",
         str(tmp_path / "report" / "report.md")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"## {host.name} / dflash" in (tmp_path / "report" / "report.md").read_text()
    for written in (tmp_path / "report").rglob("*"):
        assert not written.is_file() or API_KEY.encode() not in written.read_bytes(), written
    # what a deploy would change, in check mode with the key (make drift): it runs, and shows no key
    # (the last-good copy of the unit, kept only by full deploys, may differ after the --tags deploy)
    drift = run_playbook(
        "site.yml", "--check", "--diff", "-vvv", "--limit", host.name, "-e", "sparkfleet_profile=dflash",
        "-e", "sparkfleet_api_host=0.0.0.0", "-e", f"@{secret_vars}",
    )  # fmt: skip
    assert drift.returncode == 0, drift.output[-4000:]
    # ops status reaches the keyed /v1/models (the probe reads the key on the host, as root)
    status = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "ops", "status", "--json", "-l", host.name],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)[0]["row"]["health"] == "ok"
    # the secret is only in the root-owned 0600 env file systemd reads: not in the world-readable
    # unit, the journal (modules log their arguments there unless told not to), the process table,
    # Ansible's output, or any other file of the host's state and temporary directories
    assert API_KEY not in host.sh(f"cat {UNIT_PATH}")
    assert host.sh("stat -c '%a %U %G' /etc/sparkfleet/vllm-dflash.env") == "600 root root"
    outputs = (exposed.output, checked.output, bench.output, drift.output, status.stdout, status.stderr)
    for output in (*outputs, quick.stdout, quick.stderr, rolled.output, report.stdout, report.stderr):
        assert API_KEY not in output
    for fetched in results.rglob("*"):  # the results fetched to the controller
        assert not fetched.is_file() or API_KEY.encode() not in fetched.read_bytes(), fetched
    assert host.sh(f"journalctl --no-pager -o cat | grep -c -F {API_KEY} || true") == "0"
    # every process's argv (the key hex-encoded in this probe's own, so that it does not count itself)
    argv_probe = "\n".join(
        [
            f"import os; k = bytes.fromhex({API_KEY.encode().hex()!r}); n = 0",
            "for p in filter(str.isdigit, os.listdir('/proc')):",
            "    try: n += k in open(f'/proc/{p}/cmdline', 'rb').read()",
            "    except OSError: pass",
            "print(n)",
        ]
    )
    assert host.sh(f"python3 -c {shlex.quote(argv_probe)}") == "0"
    holders = host.sh(f"grep -rlF {API_KEY} /etc /var/lib/sparkfleet /run /tmp /var/tmp 2>/dev/null || true").split()
    assert holders == ["/etc/sparkfleet/vllm-dflash.env"], holders


def test_the_allow_list_drops_unlisted_clients(host: Host, sandbox_fleet) -> None:
    cap_net_admin = 1 << 12
    bounding = int(host.sh("awk '/^CapBnd/ {print $2}' /proc/1/status"), 16)
    if not bounding & cap_net_admin:
        pytest.skip(
            f"{host.name} lacks CAP_NET_ADMIN (CapBnd {bounding:#x}), so nftables cannot load rules there: "
            "boot the sandbox hosts with systemd-nspawn --capability=CAP_NET_ADMIN (each has its own netns)"
        )
    controller = host.sh("echo $SSH_CONNECTION").split()[0]
    outsider = next(name for name in sandbox_fleet.names if name != host.name)
    listed = deploy(
        host.name,
        "-e",
        json.dumps(
            {
                "sparkfleet_api_host": "0.0.0.0",
                "sparkfleet_api_key": API_KEY,
                "vllm_service_allowed_clients": [controller],
            }
        ),
    )
    assert listed.returncode == 0, listed.output[-4000:]
    assert host.sh(f"systemctl is-active {FIREWALL_UNIT}") == "active"
    url = f"http://{host.address}:{PORT}/v1/models"
    assert http_status(sandbox_fleet, None, url, API_KEY) == "200"
    # another host is not on the list: its packets are dropped, key or not
    assert http_status(sandbox_fleet, outsider, url, API_KEY) == "timeout"
    ruleset = host.sh("nft list table inet sparkfleet_vllm")
    dropped = re.search(r"counter packets (\d+) bytes \d+ drop", ruleset)
    assert dropped and int(dropped.group(1)) >= 1, ruleset


def journal_cursor(host: Host) -> str:
    return host.sh("journalctl -n 0 --show-cursor -q | sed -n 's/^-- cursor: //p'")


def starved_start(host: Host, enforcers: list[str]) -> tuple[str, dict[str, str], str]:
    """Deploy a 1 GiB limit (far below the CPU server's ~4.5 GB RSS) enforced by `enforcers` alone:
    (the unit as written, its state after the start, its journal since the deploy began)."""
    host.sh(f"systemctl reset-failed {UNIT} || true")
    cursor = journal_cursor(host)
    starved = deploy(
        host.name, "-e", "vllm_service_memory_max=1G", "-e", json.dumps({"vllm_service_memory_enforcers": enforcers})
    )
    assert starved.returncode != 0
    unit = host.sh(f"systemctl cat {UNIT}")
    state = host.show("ActiveState", "Result", "ExecMainStatus", "NRestarts")
    journal = host.sh(f"journalctl -u {UNIT} --after-cursor {shlex.quote(cursor)} --no-pager -o cat")
    return unit, state, journal


def assert_the_host_stays_up(host: Host) -> None:
    assert host.sh("systemctl is-system-running || true") in ("running", "degraded")
    failed = host.sh("systemctl list-units --failed --plain --no-legend --no-pager").split()
    assert [unit for unit in failed if unit.endswith(".service")] == [UNIT]
    available_kib = int(host.sh("awk '/MemAvailable/ {print $2}' /proc/meminfo"))
    assert available_kib > 2**20, f"{available_kib} KiB available"


def test_the_memory_guard_alone_stops_an_over_subscribed_start_for_good(host: Host) -> None:
    unit, state, journal = starved_start(host, ["guard"])
    assert "MemoryMax=" not in unit and "sparkfleet-memory-guard 1073741824 " in unit, unit
    assert (state["ActiveState"], state["Result"], state["ExecMainStatus"]) == ("failed", "exit-code", "137"), state
    assert state["NRestarts"] == "0", "restarted into the same over-subscription"
    assert re.search(r"memory guard: service memory \S+ GiB .* reached the limit 1\.00 GiB: killed", journal), journal
    assert_the_host_stays_up(host)


def memory_cgroup_writable(host: Host) -> str:
    """Empty when systemd on the host can enforce MemoryMax=, else why not."""
    probe = host.sh(
        "if [ -f /sys/fs/cgroup/cgroup.controllers ]; then "
        "grep -qw memory /sys/fs/cgroup/cgroup.controllers && echo v2 || echo v2-without-memory; "
        "elif [ -d /sys/fs/cgroup/memory ]; then "
        "[ -w /sys/fs/cgroup/memory ] && echo v1 || echo v1-read-only; else echo none; fi"
    )
    return {
        "v2": "",
        "v1": "",
        "v2-without-memory": "the host's cgroup v2 hierarchy has no memory controller",
        "v1-read-only": "the host's cgroup v1 memory hierarchy is mounted read-only (a container on cgroup v1)",
        "none": "the host has no memory cgroup",
    }[probe]


def test_the_kernel_limit_alone_stops_an_over_subscribed_start_for_good(host: Host) -> None:
    why = memory_cgroup_writable(host)
    if why:
        pytest.skip(f"the kernel cannot enforce MemoryMax= on this sandbox host: {why}")
    unit, state, journal = starved_start(host, ["kernel"])
    assert "MemoryMax=1073741824" in unit and "sparkfleet-memory-guard 0 " in unit, unit
    assert (state["ActiveState"], state["Result"]) == ("failed", "oom-kill"), state
    assert state["NRestarts"] == "0", "restarted into the same over-subscription"
    assert "killed by the OOM killer" in journal, journal
    assert "memory guard:" not in journal, "the guard had no limit to enforce"
    assert_the_host_stays_up(host)
