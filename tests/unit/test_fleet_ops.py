"""sparkfleet ops without a fleet: inventory parsing, host-key policy, the host probe, status lines, exit codes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import paramiko
import pytest

from sparkfleet import cli
from sparkfleet.fleet import fleet_ops
from sparkfleet.fleet.fleet_ops import FleetHost, HostOutcome, OpsError

ROOT = Path(__file__).resolve().parents[2]
# ssh -G offers only identity files that exist: the inventory's key is a real (placeholder) file
KEY_DIR = Path(tempfile.mkdtemp(prefix="sparkfleet-ops-keys-"))
KEY = KEY_DIR / "id_ed25519"
KEY.write_text("placeholder: ssh -G only checks that the file is there\n")
KNOWN_HOSTS = "/srv/fleet/ssh/known_hosts"
SANDBOX_ARGS = (
    f"-o UserKnownHostsFile={KNOWN_HOSTS} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes "
    "-o ControlMaster=auto -o ControlPersist=60s"
)
SANDBOX_VARS = {
    "ansible_host": "10.213.0.11",
    "ansible_user": "root",
    "ansible_ssh_private_key_file": str(KEY),
    "ansible_ssh_common_args": SANDBOX_ARGS,
    "ansible_python_interpreter": "/usr/bin/python3",
    # what inventory/group_vars/all/sparkfleet.yml gives every host (ops keeps no copy of it)
    "sparkfleet_profile": "dflash",
    "sparkfleet_api_port": 8000,
    "sparkfleet_root": "/opt/sparkfleet",
    "sparkfleet_state_dir": "/var/lib/sparkfleet",
    "sparkfleet_config_dir": "/etc/sparkfleet",
    "sparkfleet_served_model_name": "qwen",
}


def sandbox_host(name: str = "spark-01", **overrides: Any) -> FleetHost:
    return fleet_ops.fleet_host_from_vars(name, {**SANDBOX_VARS, **overrides})


# ------------------------------------------------------------------------------------- inventory


def test_sandbox_host_vars_give_strict_host_keys_and_the_inventory_key() -> None:
    host = sandbox_host()
    assert host.ssh.address == "10.213.0.11"
    assert host.ssh.port == 22
    assert host.ssh.user == "root"
    assert host.ssh.key_files == (str(KEY),)
    assert host.ssh.known_hosts_files[0] == KNOWN_HOSTS
    assert host.ssh.strict_host_key_checking == "yes"
    assert host.ssh.identities_only is True
    assert host.ssh.proxy_command is None
    assert host.become is False
    assert host.fallback_unit == "sparkfleet-vllm-dflash.service"
    assert (host.config_dir, host.state_dir, host.root) == ("/etc/sparkfleet", "/var/lib/sparkfleet", "/opt/sparkfleet")


def test_ssh_config_is_resolved_as_ansibles_ssh_resolves_it(tmp_path: Path) -> None:
    # an -F config (as ~/.ssh/config would be): its HostName, Port and options apply; the inventory's own
    # user and port come first, as in the ssh command line Ansible builds, so they win
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host spark-east-*\n  HostName 192.0.2.7\n  Port 2201\n  User intruder\n"
        "  UserKnownHostsFile /k/east_known\n  StrictHostKeyChecking accept-new\n"
    )
    args = f"-F {config}"
    east = sandbox_host("spark-east-1", ansible_host="spark-east-1", ansible_ssh_common_args=args)
    assert (east.ssh.address, east.ssh.port, east.ssh.user) == ("192.0.2.7", 2201, "root")
    assert east.ssh.known_hosts_files[0] == "/k/east_known"
    assert east.ssh.strict_host_key_checking == "accept-new"
    pinned = sandbox_host("spark-east-2", ansible_host="spark-east-2", ansible_port=22, ansible_ssh_common_args=args)
    assert (pinned.ssh.address, pinned.ssh.port) == ("192.0.2.7", 22)
    # -o Key=Value in every spelling, and the ssh_config keyword's own casing
    spelled = sandbox_host(
        ansible_ssh_common_args="-oUserKnownHostsFile=/k/known -o 'stricthostkeychecking no' -p 2222",
        ansible_ssh_extra_args="-o ConnectTimeout=5",
    )
    assert spelled.ssh.known_hosts_files[0] == "/k/known"
    assert spelled.ssh.strict_host_key_checking == "no"
    assert spelled.ssh.port == 2222


def test_proxy_jump_and_proxy_command_become_the_gateway_ssh_itself_would_run(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host bastion\n  HostName 192.0.2.1\n")
    jumped = sandbox_host(ansible_ssh_common_args=f"-F {config} -o ProxyJump=ops@bastion:2200")
    assert jumped.ssh.proxy_command == f"ssh -F {config} -l ops -p 2200 -W 10.213.0.11:22 bastion"
    chained = sandbox_host(ansible_port=2022, ansible_ssh_common_args="-J first,admin@[2001:db8::1]:23")
    assert chained.ssh.proxy_command == "ssh -J first -l admin -p 23 -W 10.213.0.11:2022 2001:db8::1"
    command = sandbox_host(ansible_ssh_common_args="-o 'ProxyCommand=nc -X 5 -x proxy:1080 %h %p # %r %%'")
    assert command.ssh.proxy_command == "nc -X 5 -x proxy:1080 10.213.0.11 22 # root %"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sparkfleet_api_port": "{{ port_of_the_day }}"}, "sparkfleet_api_port is a template"),
        ({"sparkfleet_api_port": 70000}, "sparkfleet_api_port = 70000 is not a TCP port"),
        ({"ansible_port": "ssh"}, "ansible_port = 'ssh' is not a TCP port"),
        ({"ansible_ssh_common_args": "-o 'UserKnownHostsFile=/unterminated"}, "ansible_ssh_common_args .* parse"),
        ({"ansible_ssh_common_args": "-o StrictHostKeyChecking=maybe"}, "ssh refuses its options .*maybe"),
        ({"ansible_ssh_common_args": "-o NoSuchOption=1"}, "ssh refuses its options .*nosuchoption"),
        ({"ansible_become_password": {"__ansible_vault": "$ANSIBLE_VAULT;1.1;AES256"}}, "vault-encrypted"),
        ({"sparkfleet_state_dir": None}, "sparkfleet_state_dir is not set in the inventory; .* link"),
    ],
)
def test_bad_host_vars_are_refused_with_the_value_and_the_fix(overrides: dict[str, Any], message: str) -> None:
    variables = {**SANDBOX_VARS, **overrides}
    variables = {k: v for k, v in variables.items() if v is not None}
    with pytest.raises(OpsError, match=message) as error:
        fleet_ops.fleet_host_from_vars("spark-09", variables)
    assert str(error.value).startswith("spark-09")
    assert "\n" not in str(error.value)


def test_become_uses_sudo_n_or_the_password_on_stdin_never_argv() -> None:
    login = sandbox_host(ansible_user="sparkops", ansible_become=True)
    assert fleet_ops.privileged(login, "cat /x") == "sudo -n sh -c 'cat /x'"
    keyed = sandbox_host(ansible_user="sparkops", ansible_become=True, ansible_become_password="s3cr3t pw")
    assert "s3cr3t" not in repr(keyed)
    connection = FakeConnection({"unit": {}})
    fleet_ops.run_remote(connection, "cat /etc/sparkfleet/state.json", 30, keyed)
    assert connection.commands == ["sudo -S -p '' sh -c 'cat /etc/sparkfleet/state.json'"]
    assert connection.stdin == ["s3cr3t pw\n"]
    as_root = sandbox_host(ansible_become=True)
    assert fleet_ops.privileged(as_root, "cat /x") == "cat /x"


def test_group_hosts_follows_child_groups_once() -> None:
    data = {
        "all": {"children": ["spark", "ungrouped"]},
        "spark": {"hosts": ["a"], "children": ["east", "west"]},
        "east": {"hosts": ["b", "a"], "children": ["spark"]},
        "west": {"hosts": ["c"]},
    }
    assert fleet_ops.group_hosts(data, "spark") == ["a", "b", "c"]
    assert fleet_ops.group_hosts(data, "nothing") == []


def test_load_fleet_reads_the_example_inventory_through_ansible_inventory() -> None:
    hosts = fleet_ops.load_fleet(str(ROOT / "inventory/example"), None)
    assert [h.name for h in hosts] == ["spark-a1", "spark-a2", "spark-a3"]
    by_name = {h.name: h for h in hosts}
    assert by_name["spark-a3"].profile == "dense"
    assert by_name["spark-a1"].profile == "dflash"
    assert by_name["spark-a1"].ssh.user == "sparkops"
    assert by_name["spark-a1"].become is True
    assert by_name["spark-a1"].ssh.strict_host_key_checking == "yes"
    assert fleet_ops.privileged(by_name["spark-a1"], "cat /etc/x") == "sudo -n sh -c 'cat /etc/x'"

    limited = fleet_ops.load_fleet(str(ROOT / "inventory/example"), "spark-a2")
    assert [h.name for h in limited] == ["spark-a2"]
    with pytest.raises(OpsError, match="no host of 'spark'"):
        fleet_ops.load_fleet(str(ROOT / "inventory/example"), "spark-zz")
    with pytest.raises(OpsError, match="does not exist"):
        fleet_ops.load_fleet(str(ROOT / "inventory/nowhere"), None)


# ------------------------------------------------------------------------------------ connections


def test_connection_rejects_unknown_host_keys_and_loads_the_inventory_known_hosts(tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    # a syntactically valid ed25519 host key line (the key itself need not belong to anyone)
    known_hosts.write_text(
        "10.213.0.11,spark-01 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHn8WKRjAeyH+OchccPeboyhzVuvG5O3OA6IGzfxyIbP\n"
    )
    args = f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
    connection = fleet_ops.open_connection(sandbox_host(ansible_ssh_common_args=args))
    try:
        client = connection.client
        assert isinstance(client._policy, paramiko.RejectPolicy)
        assert client.get_host_keys().lookup("10.213.0.11") is not None
        assert connection.connect_kwargs["key_filename"] == [str(KEY)]
        assert connection.connect_kwargs["allow_agent"] is False
        assert (connection.user, connection.port) == ("root", 22)
        assert "user" not in connection.ssh_config, "Fabric does not read the ssh configs again: ssh -G did"
    finally:
        connection.close()
    relaxed = fleet_ops.open_connection(sandbox_host(ansible_ssh_common_args="-o StrictHostKeyChecking=accept-new"))
    assert isinstance(relaxed.client._policy, paramiko.AutoAddPolicy)
    relaxed.close()


def test_describe_exception_gives_one_line_per_failure_kind() -> None:
    host = sandbox_host()
    missing = paramiko.SSHException("Server '10.213.0.11' not found in known_hosts")
    assert "is not in /srv/fleet/ssh/known_hosts" in fleet_ops.describe_exception(missing, host)
    changed = paramiko.BadHostKeyException("10.213.0.11", _key(), _key())
    assert "CHANGED" in fleet_ops.describe_exception(changed, host)
    refused = ConnectionRefusedError(111, "Connection refused")
    assert fleet_ops.describe_exception(refused, host) == "ssh to 10.213.0.11:22 failed: Connection refused"
    assert "\n" not in fleet_ops.describe_exception(RuntimeError("two\nlines"), host)


def _key() -> paramiko.PKey:
    return paramiko.RSAKey.generate(1024)


@dataclass
class FakeResult:
    stdout: str
    stderr: str = ""
    exited: int = 0


class FakeConnection:
    """Answers the probe with a canned report; records every command."""

    def __init__(self, probe: dict[str, Any] | None, fail: int = 0) -> None:
        self.probe = probe
        self.fail = fail
        self.commands: list[str] = []
        self.stdin: list[str] = []
        self.closed = False

    def run(self, command: str, **kwargs: Any) -> FakeResult:
        self.commands.append(command)
        if kwargs.get("in_stream"):
            self.stdin.append(kwargs["in_stream"].read())
        if self.fail:
            return FakeResult("", "sudo: a password is required", self.fail)
        if "state.json" in command:
            return FakeResult(json.dumps(self.probe))
        return FakeResult("")

    def close(self) -> None:
        self.closed = True


def test_run_on_hosts_runs_in_parallel_keeps_order_and_contains_errors() -> None:
    hosts = [sandbox_host(f"spark-0{i}") for i in (1, 2, 3)]

    def slow(host: FleetHost, _connection: Any) -> HostOutcome:
        time.sleep(0.5)
        if host.name == "spark-02":
            raise paramiko.AuthenticationException("Authentication failed.")
        return HostOutcome(host.name, True, "fine")

    connections: list[FakeConnection] = []

    def connect(_host: FleetHost) -> FakeConnection:
        connections.append(FakeConnection(None))
        return connections[-1]

    started = time.monotonic()
    outcomes = fleet_ops.run_on_hosts(hosts, slow, forks=16, connect=connect)
    elapsed = time.monotonic() - started
    assert elapsed < 1.2, f"3 hosts of 0.5 s each took {elapsed:.2f} s: not parallel"
    assert [o.host for o in outcomes] == ["spark-01", "spark-02", "spark-03"]
    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].line == "error: ssh authentication as root at 10.213.0.11:22 failed (Authentication failed.)"
    assert all(c.closed for c in connections)

    started = time.monotonic()
    fleet_ops.run_on_hosts(hosts, slow, forks=1, connect=connect)
    assert time.monotonic() - started >= 1.5, "--forks 1 runs one host at a time"


def test_run_in_batches_stops_after_a_failed_batch() -> None:
    hosts = [sandbox_host(f"spark-0{i}") for i in (1, 2, 3)]
    seen: list[str] = []

    def restart(host: FleetHost, _connection: Any) -> HostOutcome:
        seen.append(host.name)
        return HostOutcome(host.name, host.name != "spark-01", "x")

    outcomes = fleet_ops.run_in_batches(hosts, restart, batch=1, forks=4, connect=lambda h: FakeConnection(None))
    assert seen == ["spark-01"]
    assert [o.line for o in outcomes[1:]] == ["skipped: an earlier batch failed"] * 2
    seen.clear()
    fleet_ops.run_in_batches(hosts, restart, batch=0, forks=4, connect=lambda h: FakeConnection(None))
    assert sorted(seen) == ["spark-01", "spark-02", "spark-03"]


# ------------------------------------------------------------------------------- the host probe


class FakeServer(BaseHTTPRequestHandler):
    models = ["qwen"]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"data": [{"id": m} for m in self.models]}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        return


@pytest.fixture
def fake_api() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


STATE = {
    "profile": "dflash",
    "unit": "sparkfleet-vllm-dflash.service",
    "vllm_version": "0.23.0+sf1abc.cpu",
    "patchset_id": "sf1-3a9c0d1e",
    "venv": "/opt/sparkfleet/venvs/vllm-0.23.0+sf1abc.cpu",
    "model_path": "/var/lib/sparkfleet/models/intel-int4",
    "drafter_path": "/var/lib/sparkfleet/models/dflash-drafter",
    "model_revisions": {
        "intel-int4": "0123456789abcdef0123456789abcdef01234567",
        "dflash-drafter": "6c7242c934a9870d7c59c05240bdbb2467cc1394",
    },
    "served_model_name": "qwen",
    "host": "127.0.0.1",
    # as sparkfleet-record-startup writes it at the unit's start
    "startup": {
        "ready_s": 183.4,
        "kv_pool_tokens": 456664,
        "max_concurrency": 1.74,
        "free_at_ready_bytes": 17_287_503_872,
    },
}


def run_probe_locally(tmp_path: Path, port: int, state: dict[str, Any] | None, bench: Any = None) -> dict[str, Any]:
    """PROBE_SCRIPT as a host runs it: this machine's python3, argv as ops passes it."""
    config_dir, state_dir = tmp_path / "etc", tmp_path / "var"
    (state_dir / "bench").mkdir(parents=True)
    config_dir.mkdir()
    if state is not None:
        (config_dir / "state.json").write_text(json.dumps({**state, "port": port}))
    if bench is not None:
        (state_dir / "bench" / "latest.json").write_text(bench if isinstance(bench, str) else json.dumps(bench))
    python = shutil.which("python3") or sys.executable
    proc = subprocess.run(
        [python, "-c", fleet_ops.PROBE_SCRIPT, str(config_dir), str(state_dir), "sparkfleet-vllm-x.service", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "http_proxy": "http://127.0.0.1:9", "no_proxy": ""},  # the probe must bypass proxies
    )
    return json.loads(proc.stdout)


def test_probe_reads_state_health_models_and_last_bench(tmp_path: Path, fake_api: int) -> None:
    bench = {"kind": "decode", "profile": "dflash", "figures": {"decode_tok_s_median": 81.23, "e2e_tok_s": 50}}
    probe = run_probe_locally(tmp_path, fake_api, STATE, bench)
    assert probe["state"]["patchset_id"] == "sf1-3a9c0d1e"
    assert probe["unit_name"] == "sparkfleet-vllm-dflash.service"
    assert probe["health"]["status"] == 200
    assert probe["base_url"] == f"http://127.0.0.1:{fake_api}"
    # this controller has no systemd as PID 1: give the row a loaded, active unit as a host would report
    probe["unit"] = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
    ok, row, problems = fleet_ops.status_row(sandbox_host(), probe)
    assert (ok, problems) == (True, [])
    assert row == {
        "host": "spark-01",
        "profile": "dflash",
        "unit": "active/running",
        "health": "ok",
        "patch_set": "sf1-3a9c0d1e",
        "model": "intel-int4@0123456789ab",
        "drafter": "dflash-drafter@6c7242c934a9",
        "ready": "183 s",
        "kv_pool": "456,664 (1.74x)",
        "free_at_ready": "16.1 GiB",
        "bench_tok_s": "81.2 decode",
    }


def test_probe_of_an_undeployed_host_says_so(tmp_path: Path) -> None:
    probe = run_probe_locally(tmp_path, 9, None)  # port 9 (discard): nothing listens
    assert probe["state"] is None
    assert probe["unit_name"] == "sparkfleet-vllm-x.service"
    assert probe["health"]["status"] is None
    probe["unit"] = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead"}
    ok, row, problems = fleet_ops.status_row(sandbox_host(), probe)
    assert ok is False
    assert row["profile"] == "(dflash)" and row["unit"] == "not-found" and row["bench_tok_s"] == "-"
    assert row["health"].startswith("down (")
    assert "no /etc/sparkfleet/state.json (not deployed)" in problems


def test_a_state_that_breaks_the_schema_is_a_problem_naming_the_key(tmp_path: Path, fake_api: int) -> None:
    probe = run_probe_locally(tmp_path, fake_api, {key: value for key, value in STATE.items() if key != "unit"})
    probe["unit"] = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
    ok, row, problems = fleet_ops.status_row(sandbox_host(), probe)
    assert ok is False and row["profile"] == "(dflash)"
    assert "spark-01:/etc/sparkfleet: state.json has no 'unit'; deploy the host again" in problems[0]


def test_probe_reports_a_broken_bench_file_and_a_wrong_served_model(tmp_path: Path, fake_api: int) -> None:
    FakeServer.models = ["other"]
    try:
        probe = run_probe_locally(tmp_path, fake_api, STATE, bench="{not json")
    finally:
        FakeServer.models = ["qwen"]
    assert probe["bench"] is None and probe["bench_error"]
    probe["unit"] = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
    ok, row, _ = fleet_ops.status_row(sandbox_host(), probe)
    assert ok is False
    assert row["health"] == "serves other, not qwen"
    assert row["bench_tok_s"] == "-"


@pytest.mark.parametrize(
    ("health", "models", "expected"),
    [
        ({"status": 503}, None, "/health http 503"),
        ({"status": None, "error": "[Errno 111] Connection refused"}, None, "down (Connection refused)"),
        ({"status": 200}, {"status": 401, "body": ""}, "/v1/models http 401"),
        ({"status": 200}, {"status": 200, "body": "<html>"}, "/v1/models not JSON"),
    ],
)
def test_health_summary(health: dict, models: dict | None, expected: str) -> None:
    assert fleet_ops.health_summary({"health": health, "models": models}, "qwen") == (False, expected)


def test_bench_figure_prefers_decode_then_e2e() -> None:
    assert fleet_ops.bench_figure(None) == "-"
    assert fleet_ops.bench_figure({"figures": {"e2e_tok_s": 53.71}}) == "53.7 e2e"
    assert fleet_ops.bench_figure({"figures": {"decode_tok_s_median": float("nan"), "e2e_tok_s": 1}}) == "1.0 e2e"
    assert fleet_ops.bench_figure({"figures": {"decode_tok_s_median": None}}) == "-"


def test_format_table_aligns_columns() -> None:
    lines = fleet_ops.format_table([{"a": "x", "b": "long value"}, {"a": "longer", "b": "y"}], ("a", "b"))
    assert lines == ["A       B", "x       long value", "longer  y"]


# ------------------------------------------------------------------------------ the command line


def write_inventory(tmp_path: Path) -> Path:
    inventory = tmp_path / "hosts.yml"
    hosts = {f"spark-0{i}": {**SANDBOX_VARS, "ansible_host": f"10.213.0.1{i}"} for i in (1, 2, 3)}
    inventory.write_text(json.dumps({"all": {"children": {"spark": {"hosts": hosts}}}}))
    return inventory


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser("ops").parse_args(argv)


def test_status_prints_one_aligned_line_per_host_and_fails_when_one_host_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy = {
        "state": {**STATE, "port": 8000},
        "unit_name": STATE["unit"],
        "unit": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"},
        "health": {"status": 200},
        "models": {"status": 200, "body": json.dumps({"data": [{"id": "qwen"}]})},
        "bench": {"profile": "dflash", "figures": {"decode_tok_s_median": 12.5}},
        "base_url": "http://127.0.0.1:8000",
    }
    connections = {"10.213.0.11": FakeConnection(healthy), "10.213.0.12": FakeConnection(healthy)}

    def connect(host: FleetHost) -> FakeConnection:
        if host.ssh.address == "10.213.0.13":
            raise paramiko.SSHException("Server '10.213.0.13' not found in known_hosts")
        return connections[host.ssh.address]

    code = fleet_ops.run_command(parse(["ops", "status", "-i", str(write_inventory(tmp_path))]), connect=connect)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert code == 1
    assert lines[0].split() == [
        "HOST", "PROFILE", "UNIT", "HEALTH", "PATCH-SET", "MODEL", "DRAFTER", "READY", "KV-POOL", "FREE-AT-READY",
        "BENCH-TOK-S",
    ]  # fmt: skip
    assert lines[2].split()[1:] == lines[1].split()[1:]
    assert lines[1].split()[1:] == [
        "dflash",
        "active/running",
        "ok",
        "sf1-3a9c0d1e",
        "intel-int4@0123456789ab",
        "dflash-drafter@6c7242c934a9",
        "183",
        "s",
        "456,664",
        "(1.74x)",
        "16.1",
        "GiB",
        "12.5",
        "decode",
    ]
    assert lines[1].index("active/running") == lines[0].index("UNIT"), "columns line up with the header"
    assert lines[3].startswith("spark-03  error: host key of 10.213.0.13:22 is not in /srv/fleet/ssh/known_hosts")
    assert "ops status: 2/3 host(s) ok" in err and "failed: spark-03" in err
    assert "Traceback" not in out + err
    probe_command = connections["10.213.0.11"].commands[0]
    assert probe_command.startswith("/usr/bin/python3 -c ") and probe_command.endswith(
        " /etc/sparkfleet /var/lib/sparkfleet sparkfleet-vllm-dflash.service 8000"
    )

    code = fleet_ops.run_command(
        parse(["ops", "status", "-i", str(write_inventory(tmp_path)), "-l", "spark-01:spark-02", "--json"]),
        connect=connect,
    )
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(h["host"], h["ok"], h["row"]["health"]) for h in payload] == [
        ("spark-01", True, "ok"),
        ("spark-02", True, "ok"),
    ]


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = fleet_ops.run_command(parse(["ops", "status", "-i", str(tmp_path / "missing")]))
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"sparkfleet ops: inventory {str(tmp_path / 'missing')!r} does not exist; "
        "pass -i inventory/<name> (make sandbox-up writes the sandbox's)"
    ]
    code = fleet_ops.run_command(parse(["ops", "logs", "-i", str(write_inventory(tmp_path)), "--lines", "0"]))
    assert code == 2
    assert "--lines 0: use 1 or more" in capsys.readouterr().err


def test_logs_and_restart_refuse_a_host_without_the_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = {"state": None, "unit_name": "sparkfleet-vllm-dflash.service", "unit": {"LoadState": "not-found"}}
    connection = FakeConnection(missing)
    code = fleet_ops.run_command(
        parse(["ops", "restart", "-i", str(write_inventory(tmp_path)), "-l", "spark-01"]), connect=lambda h: connection
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED  unit sparkfleet-vllm-dflash.service is not-found; deploy the host first" in out
    assert not any("systemctl restart" in c for c in connection.commands), "nothing is restarted"


def test_a_failing_remote_command_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = fleet_ops.run_command(
        parse(["ops", "logs", "-i", str(write_inventory(tmp_path)), "-l", "spark-02"]),
        connect=lambda h: FakeConnection(None, fail=1),
    )
    out = capsys.readouterr().out
    assert code == 1
    assert out.strip().startswith("spark-02  FAILED  error: `/usr/bin/python3 -c")
    assert out.strip().endswith("exited 1: sudo: a password is required")


# ------------------------------------------------------------------------------------------ bench


def test_bench_command_runs_the_service_venv_with_the_hosts_identity() -> None:
    options = fleet_ops.BenchOptions("prose", 2, 0.25, True, 600, Path("results"))
    probe = {"state": {**STATE, "port": 8000}, "base_url": "http://127.0.0.1:8000"}
    command, result_path = fleet_ops.bench_command(sandbox_host(), probe, options, "20260624T100000Z")
    assert result_path == "/var/lib/sparkfleet/bench/20260624T100000Z-decode.json"
    venv_python = "/opt/sparkfleet/venvs/vllm-0.23.0+sf1abc.cpu/bin/python"
    assert f"PYTHONPATH=/opt/sparkfleet/lib {venv_python} -m sparkfleet.hostlib.bench decode" in command
    for part in (
        "--base-url http://127.0.0.1:8000",
        "--patch-set sf1-3a9c0d1e",
        "--model-revision 0123456789abcdef0123456789abcdef01234567",
        "--drafter-revision 6c7242c934a9870d7c59c05240bdbb2467cc1394",
        "--max-requests 2 --max-tokens-scale 0.25",
        "--ignore-eos",
        f"--out {result_path}",
        "mv /var/lib/sparkfleet/bench/latest.json.tmp /var/lib/sparkfleet/bench/latest.json",
    ):
        assert part in command
    with pytest.raises(fleet_ops.HostFailure, match="names no service venv"):
        fleet_ops.bench_command(sandbox_host(), {"state": {}}, options, "x")


def test_bench_payload_runs_standalone_from_the_copy(tmp_path: Path) -> None:
    """What ops copies to a host is enough for `python -m sparkfleet.hostlib.bench` under a venv's Python: the
    standard library and the packages vLLM brings (tests/unit/test_bench_portable.py), nothing of this
    checkout but the copy."""
    lib = tmp_path / "lib"
    for local, relative in fleet_ops.bench_payload():
        (lib / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, lib / relative)
    assert sorted(p.name for p in (lib / "sparkfleet").iterdir()) == ["__init__.py", "hostlib"], (
        "only the bench clients travel"
    )
    env = {"PYTHONPATH": str(lib), "PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}
    check = (
        "import sparkfleet.hostlib.bench, sparkfleet.hostlib.bench.decode; "
        "from sparkfleet.hostlib.bench.workloads import load_workload; "
        f"assert sparkfleet.hostlib.bench.__file__.startswith({str(lib)!r}), sparkfleet.hostlib.bench.__file__; "
        "print(len(load_workload('prose', 0.25, 2).requests))"
    )
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet.hostlib.bench", "decode", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "--max-requests" in proc.stdout, proc.stderr


# ------------------------------------------------------------------- benchmarks/bench_fleet_scale.py


def test_fleet_scale_dry_run_prints_the_runs_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_fleet_scale as scale

    assert scale.main(["--dry-run", "--fresh"]) == 0
    lines = capsys.readouterr().out.splitlines()
    playbooks = [line for line in lines if "ansible-playbook" in line]
    assert [line.split("--limit ")[1].split()[0] for line in playbooks] == [
        "spark-01",
        "spark-01",
        "spark-01,spark-02,spark-03",
        "spark-01,spark-02,spark-03",
    ]
    assert all(" -i inventory/sandbox site.yml " in line and "sparkfleet_profile=dflash" in line for line in playbooks)
    resets = [i for i, line in enumerate(lines) if "fleet.py down --purge" in line]
    assert resets == [lines.index(playbooks[0]) - 2, lines.index(playbooks[2]) - 2], "a purge before each provision"
    assert sum("ops status" in line for line in lines) == 2


def test_fleet_scale_refuses_to_reset_a_real_inventory() -> None:
    from benchmarks import bench_fleet_scale as scale

    with pytest.raises(SystemExit) as exit_info:
        scale.parse_args(["--fresh", "-i", "inventory/example"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        scale.parse_args(["--one", "spark-09"])


def test_fleet_scale_reads_the_recap_and_renders_ratios() -> None:
    from benchmarks import bench_fleet_scale as scale

    output = (
        "PLAY RECAP ****\n"
        "spark-01                   : ok=40   changed=0    unreachable=0    failed=0    skipped=9    rescued=0\n"
        "\nsparkfleet_timer: site.yml took 125.4 s (148 tasks)\n"
    )
    assert scale.parse_recap(output) == {
        "spark-01": {"ok": 40, "changed": 0, "unreachable": 0, "failed": 0, "skipped": 9}
    }
    assert scale.parse_timer(output) == 125.4

    def phase(name: str, kind: str, hosts: list[str], wall: float) -> dict[str, Any]:
        recap = {h: {"ok": 1, "changed": 3 if kind == "provision" else 0} for h in hosts}
        return {"name": name, "kind": kind, "hosts": hosts, "wall_s": wall, "recap": recap, "reset_before": False}

    fleet = ["spark-01", "spark-02", "spark-03"]
    measurement = {
        "schema": scale.SCHEMA,
        "environment": {
            "utc_time": "T",
            "git_commit": "abc",
            "controller": "Linux x86_64",
            "controller_cpus": 2,
            "load_average_at_start": [1.0, 1.0, 1.0],
            "inventory": "inventory/sandbox",
            "profile": "dflash",
            "ansible": "ansible-playbook [core 2.19.14]",
            "playbook": "site.yml",
            "fresh": False,
            "argv": ["--skip-ops"],
        },
        "phases": [
            phase("provision-1", "provision", ["spark-01"], 100.0),
            phase("rerun-1", "rerun", ["spark-01"], 20.0),
            phase("provision-3", "provision", fleet, 150.0),
            phase("rerun-3", "rerun", fleet, 30.0),
        ],
    }
    doc = scale.render_doc(measurement)
    assert "| provision | 100.0 | 150.0 | 1.50× | 2.00× |" in doc
    assert "| re-run | 20.0 | 30.0 | 1.50× | 2.00× |" in doc
    assert "| provision-3 | 3 | 150.0 | spark-01 3, spark-02 3, spark-03 3 | no |" in doc
    assert "found spark-01 already converged" in doc
    assert "`python benchmarks/bench_fleet_scale.py --skip-ops`" in doc


def test_fleet_scale_accounts_time_per_role_from_the_timer_json(tmp_path: Path) -> None:
    from benchmarks import bench_fleet_scale as scale

    tasks = [
        {"name": "vllm_wheel : Install", "role": "vllm_wheel", "seconds": 30.0, "last_host": "spark-02"},
        {"name": "Resolve", "role": "", "seconds": 0.5, "last_host": "spark-01"},
        {"name": "vllm_wheel : Ship", "role": "vllm_wheel", "seconds": 2.25, "last_host": "spark-01"},
        {"name": "vllm_service : Start", "role": "vllm_service", "seconds": 60.0, "last_host": "spark-03"},
    ]
    path = tmp_path / "timer.json"
    per_role = {"vllm_service": 60.0, "vllm_wheel": 32.25, "(play)": 0.5}  # as the callback writes it
    path.write_text(json.dumps({"playbook": "site.yml", "seconds": 93.0, "per_role": per_role, "tasks": tasks}) + "\n")
    per_role, slowest = scale.timer_account(path)
    assert per_role == {"vllm_service": 60.0, "vllm_wheel": 32.2, "(play)": 0.5}
    assert [t["name"] for t in slowest[:2]] == ["vllm_service : Start", "vllm_wheel : Install"]
    assert scale.timer_account(tmp_path / "missing.json") == ({}, [])


def test_a_become_password_file_reaches_sudo_hosts_only_and_a_missing_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "become"
    secret.write_text("pw from file\n")
    secret.chmod(0o600)
    args = parse(["ops", "status", "-i", "unused", "--become-password-file", str(secret)])
    sudo_host = sandbox_host("spark-01", ansible_user="sparkops", ansible_become=True)
    root_host = sandbox_host("spark-02")
    given = fleet_ops.with_become_password([sudo_host, root_host], args)
    assert [h.become_password for h in given] == ["pw from file", None]
    assert fleet_ops.privileged(given[0], "id") == "sudo -S -p '' sh -c id"

    missing = tmp_path / "nowhere"
    code = fleet_ops.run_command(
        parse(["ops", "status", "-i", str(write_inventory(tmp_path)), "--become-password-file", str(missing)]),
        connect=lambda h: FakeConnection(None),
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        f"sparkfleet ops: --become-password-file {str(missing)!r}: No such file or directory; "
        "give a readable file holding the password"
    ]


# ------------------------------------------------------------------------------------ clusters


def cluster_probe(host: str, *, worker_active: bool = True) -> dict[str, Any]:
    """spark-01 (head) and spark-02 (worker) serving dflash-tp2 as cluster ``pair``: the head answers the
    API, the worker has none (its unit is its part)."""
    role = "head" if host == "spark-01" else "worker"
    active = role == "head" or worker_active
    state = {**STATE, "profile": "dflash-tp2", "unit": "sparkfleet-vllm-dflash-tp2.service", "port": 8000,
             "cluster": {"name": "pair", "role": role, "rank": 0 if role == "head" else 1, "head": "spark-01",
                         "members": ["spark-01", "spark-02"]}}  # fmt: skip
    probe: dict[str, Any] = {
        "state": state,
        "unit_name": state["unit"],
        "unit": {"LoadState": "loaded", "ActiveState": "active" if active else "failed",
                 "SubState": "running" if active else "failed", "Result": "success" if active else "exit-code"},
        "journal": [],
        "base_url": "http://127.0.0.1:8000",
    }  # fmt: skip
    if role == "head":
        probe["health"] = {"status": 200}
        probe["models"] = {"status": 200, "body": json.dumps({"data": [{"id": "qwen"}]})}
    else:
        probe["health"] = {"error": "[Errno 111] Connection refused"}
    return probe


def cluster_connections(worker_active: bool = True) -> dict[str, FakeConnection]:
    return {
        "10.213.0.11": FakeConnection(cluster_probe("spark-01")),
        "10.213.0.12": FakeConnection(cluster_probe("spark-02", worker_active=worker_active)),
        "10.213.0.13": FakeConnection({"state": {**STATE, "port": 8000}, "unit_name": STATE["unit"],
                                       "unit": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"},
                                       "health": {"status": 200}, "base_url": "http://127.0.0.1:8000",
                                       "models": {"status": 200, "body": json.dumps({"data": [{"id": "qwen"}]})}}),
    }  # fmt: skip


def test_status_of_one_member_shows_its_cluster_whole_with_the_heads_health(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    connections = cluster_connections()
    inventory = str(write_inventory(tmp_path))
    code = fleet_ops.run_command(
        parse(["ops", "status", "-i", inventory, "-l", "spark-02", "--json"]),
        connect=lambda h: connections[h.ssh.address],
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    rows = {entry["host"]: entry for entry in json.loads(out)}
    assert list(rows) == ["spark-01", "spark-02"], "the head joins a run that names its worker"
    assert "spark-01 joins the run: it serves in cluster pair with a host the run names" in err
    assert rows["spark-01"]["row"]["health"] == "ok"
    assert rows["spark-02"]["row"]["health"] == "ok (via spark-01)"
    assert not connections["10.213.0.13"].commands, "a host in no cluster does not join"

    # the worker's server is down: the pair is not serving, and both members say why
    connections = cluster_connections(worker_active=False)
    code = fleet_ops.run_command(
        parse(["ops", "status", "-i", inventory, "--json"]), connect=lambda h: connections[h.ssh.address]
    )
    rows = {entry["host"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert code == 1
    assert (rows["spark-01"]["ok"], rows["spark-02"]["ok"], rows["spark-03"]["ok"]) == (False, False, True)
    assert "cluster pair: spark-02 is not serving" in rows["spark-01"]["problems"]
    assert "failed" in rows["spark-02"]["problems"]

    # the worker cannot be reached: the head's line names it and why
    def connect(host: FleetHost) -> FakeConnection:
        if host.name == "spark-02":
            raise paramiko.SSHException("Server '10.213.0.12' not found in known_hosts")
        return cluster_connections()[host.ssh.address]

    code = fleet_ops.run_command(parse(["ops", "status", "-i", inventory, "-l", "spark-01", "--json"]), connect=connect)
    rows = {entry["host"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert code == 1
    assert list(rows) == ["spark-01", "spark-02"]
    assert "cluster pair: spark-02 not probed (error: host key of 10.213.0.12:22" in rows["spark-01"]["problems"]


def test_a_clusters_members_restart_in_one_batch_and_a_worker_is_benchmarked_through_its_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    connections = cluster_connections()
    inventory = str(write_inventory(tmp_path))
    code = fleet_ops.run_command(
        parse(["ops", "restart", "-i", inventory, "-l", "spark-02,spark-03", "--batch", "1"]),
        connect=lambda h: connections[h.ssh.address],
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "cluster pair (spark-01, spark-02) changes as one batch of 2 (batch size 1)" in err
    batches = [line for line in err.splitlines() if line.startswith("batch ")]
    assert batches == ["batch 1: spark-01, spark-02", "batch 2: spark-03"]
    for address in connections:
        assert sum("systemctl restart" in c for c in connections[address].commands) == 1, address
    assert "sparkfleet-vllm-dflash-tp2.service" in next(
        c for c in connections["10.213.0.12"].commands if "systemctl restart" in c
    )

    worker = fleet_ops.bench_operation(fleet_ops.BenchOptions("prose", 1, 0.25, False, 60, tmp_path), "stamp")(
        sandbox_host("spark-02"), FakeConnection(cluster_probe("spark-02"))
    )
    assert (worker.ok, worker.line) == (True, "worker of pair: benchmarked through its head spark-01")

    # logs of one member: the pair's journals, each host probed once (logs read the survey's probe)
    connections = cluster_connections()
    code = fleet_ops.run_command(
        parse(["ops", "logs", "-i", inventory, "-l", "spark-02"]), connect=lambda h: connections[h.ssh.address]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for address in ("10.213.0.11", "10.213.0.12"):
        assert sum("state.json" in c for c in connections[address].commands) == 1, connections[address].commands
        assert any(c.startswith("LC_ALL=C journalctl -u sparkfleet-vllm-dflash-tp2.service") for c in
                   connections[address].commands), address  # fmt: skip
    assert not connections["10.213.0.13"].commands
