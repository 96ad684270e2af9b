"""Ad-hoc fleet operations over SSH (Fabric): ``sparkfleet ops status|logs|restart|bench``.

The hosts, their SSH settings and their sparkfleet variables come from the same inventory the
playbooks use (``ansible-inventory -i INVENTORY --list``), so ops reaches a host exactly as Ansible
does: the same user, key, port and known_hosts file, and an unknown or changed host key is refused
(``StrictHostKeyChecking`` from ``ansible_ssh_common_args``; no ``~/.ssh/config`` is read).

Each host's work runs in its own thread (``--forks``, default 16) and opens its own connection; the
result is printed in inventory order once every host has answered::

    sparkfleet ops status [-i inventory/sandbox] [-l spark-01,spark-02] [--json]
    sparkfleet ops logs --lines 50
    sparkfleet ops restart -l spark-03 [--batch 1] [--timeout 900]
    sparkfleet ops bench [--max-requests 2 --max-tokens-scale 0.25] [--out results]

What a host serves is read from ``/etc/sparkfleet/state.json`` (written by the vllm_service role);
health is probed from the host itself (the API binds to loopback) with the host's own python3, so
nothing but sshd and python3 is needed there. ``bench`` copies the benchmark clients
(``sparkfleet.bench``) to ``<sparkfleet_root>/lib`` and runs them with the service venv's Python
(they import httpx and prometheus_client, which vLLM brings); the result lands in
``<sparkfleet_state_dir>/bench/`` (``latest.json`` is what ``status`` shows) and a copy comes back
to ``--out``.

Exit codes: 0 every host is fine, 1 at least one host failed (each says why on its own line),
2 bad input (inventory, arguments).
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sparkfleet import startup, unit_state

DEFAULT_INVENTORY = "inventory/sandbox"
DEFAULT_HOST_PATTERN = "spark"  # the group the playbooks target (sparkfleet_hosts defaults to it)
DEFAULT_FORKS = 16
CONNECT_TIMEOUT_S = 15
PACKAGE_DIR = Path(__file__).resolve().parent
# What `ops bench` copies to a host: the bench clients and their prompt sets (run with the service venv's Python).
BENCH_PAYLOAD_GLOBS = ("__init__.py", "bench/*.py", "data/workloads/*.json")

# Inventory variables and their defaults (inventory/group_vars/all/sparkfleet.yml).
DEFAULTS: dict[str, Any] = {
    "sparkfleet_profile": "dflash",
    "sparkfleet_root": "/opt/sparkfleet",
    "sparkfleet_state_dir": "/var/lib/sparkfleet",
    "sparkfleet_config_dir": "/etc/sparkfleet",
    "sparkfleet_api_port": 8000,
    "sparkfleet_served_model_name": "qwen",
    "ansible_python_interpreter": "/usr/bin/python3",
}

# Runs on the host with its python3 (standard library only): what it serves, its unit, health, last bench.
# argv: config_dir state_dir fallback_unit fallback_port
PROBE_SCRIPT = r"""
import json, os, subprocess, sys, urllib.error, urllib.request
config_dir, state_dir, fallback_unit, fallback_port = sys.argv[1:5]
report = {"state": None, "state_error": None, "unit": {}, "health": None, "models": None,
          "bench": None, "bench_error": None}
try:
    with open(os.path.join(config_dir, "state.json"), encoding="utf-8") as handle:
        report["state"] = json.load(handle)
except FileNotFoundError:
    pass
except (OSError, ValueError) as exc:
    report["state_error"] = str(exc)
state = report["state"] if isinstance(report["state"], dict) else {}
unit = state.get("unit") or fallback_unit
report["unit_name"] = unit
env = dict(os.environ, LC_ALL="C", SYSTEMD_PAGER="", SYSTEMD_COLORS="0")
try:
    shown = subprocess.run(
        ["systemctl", "show", unit, "--property=LoadState,ActiveState,SubState,Result,NRestarts,ExecMainStatus"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, env=env, timeout=30)
    report["unit"] = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    if shown.returncode:
        report["unit"]["error"] = shown.stderr.strip() or "systemctl show exited %d" % shown.returncode
except (OSError, subprocess.SubprocessError) as exc:
    report["unit"] = {"error": str(exc)}
report["journal"] = []
if report["unit"].get("ActiveState") != "active" and not report["unit"].get("error"):
    try:
        report["journal"] = subprocess.run(
            ["journalctl", "--no-pager", "-o", "cat", "-n", "80", "-u", unit],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True, env=env,
            timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
host = str(state.get("host") or "127.0.0.1")
if host in ("0.0.0.0", "::", ""):
    host = "127.0.0.1"
base = "http://%s:%s" % ("[%s]" % host if ":" in host else host, state.get("port") or fallback_port)
report["base_url"] = base
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
headers = {}
try:  # a keyed server guards /v1: the key is in the unit's root-only secrets file, read here as root
    with open(state.get("secrets_file") or "/nonexistent", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VLLM_API_KEY=") and line.strip()[13:]:
                headers["Authorization"] = "Bearer " + line.strip()[13:]
except OSError:
    pass
def get(path):
    try:
        with opener.open(urllib.request.Request(base + path, headers=headers), timeout=10) as response:
            return {"status": response.status, "body": response.read(65536).decode("utf-8", "replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": ""}
    except (OSError, ValueError) as exc:
        return {"status": None, "error": str(getattr(exc, "reason", exc))}
report["health"] = get("/health")
if report["health"]["status"] == 200:
    report["models"] = get("/v1/models")
try:
    with open(os.path.join(state_dir, "bench", "latest.json"), encoding="utf-8") as handle:
        report["bench"] = json.load(handle)
except FileNotFoundError:
    pass
except (OSError, ValueError) as exc:
    report["bench_error"] = str(exc)
print(json.dumps(report))
"""

# Waits on the host until GET <base_url>/health answers 200. argv: base_url timeout_s
WAIT_HEALTH_SCRIPT = r"""
import json, sys, time, urllib.error, urllib.request
base, timeout = sys.argv[1], float(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
start = time.monotonic()
last = "no answer yet"
while True:
    try:
        with opener.open(base + "/health", timeout=10) as response:
            if response.status == 200:
                print(json.dumps({"healthy": True, "waited_s": time.monotonic() - start}))
                sys.exit(0)
            last = "http %d" % response.status
    except urllib.error.HTTPError as exc:
        last = "http %d" % exc.code
    except (OSError, ValueError) as exc:
        last = str(getattr(exc, "reason", exc))
    if time.monotonic() - start >= timeout:
        print(json.dumps({"healthy": False, "waited_s": time.monotonic() - start, "last": last}))
        sys.exit(1)
    time.sleep(2)
"""


class OpsError(Exception):
    """Bad input (inventory, arguments): one line naming the value and the fix."""


class HostFailure(Exception):
    """One host's operation failed; the message is the one line printed for it."""


# ------------------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class SSHSettings:
    """How to reach a host, as Ansible's ssh connection plugin would."""

    address: str
    port: int
    user: str | None
    key_files: tuple[str, ...]
    known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str  # "yes" | "accept-new" | "no"
    identities_only: bool
    proxy_command: str | None = None


@dataclass(frozen=True)
class FleetHost:
    """One inventory host and the sparkfleet variables ops needs."""

    name: str
    ssh: SSHSettings
    become: bool
    python: str
    profile: str
    root: str
    state_dir: str
    config_dir: str
    api_port: int
    served_model_name: str

    @property
    def fallback_unit(self) -> str:
        """The unit of the inventory's profile, for hosts without a state.json yet."""
        return f"sparkfleet-vllm-{self.profile}.service"


def parse_ssh_args(text: str) -> dict[str, str]:
    """OpenSSH ``-o Key=Value`` options (and ``-i``/``-p``/``-l``) of an ``ansible_ssh_*_args`` string.

    Keys are lower-cased as ssh_config(5) treats them; ``-i`` may repeat (joined with newlines).
    """
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise OpsError(f"ssh arguments {text!r} do not parse ({exc}); quote them as a shell would") from exc
    options: dict[str, str] = {}
    flag_keys = {"-i": "identityfile", "-p": "port", "-l": "user"}
    index = 0
    while index < len(words):
        word = words[index]
        value: str | None = None
        key: str | None = None
        if word == "-o" or word in flag_keys:
            if index + 1 >= len(words):
                raise OpsError(f"ssh arguments {text!r}: {word} needs a value")
            value = words[index + 1]
            index += 2
        elif word.startswith("-o") or word[:2] in flag_keys:
            value = word[2:]
            word = word[:2]
            index += 1
        else:
            index += 1
            continue
        if word == "-o":
            option, sep, rest = value.partition("=")
            if not sep:
                option, _, rest = value.partition(" ")
            key, value = option.strip().lower(), rest.strip()
        else:
            key = flag_keys[word]
        if key == "identityfile" and key in options:
            options[key] += "\n" + value
        else:
            options[key] = value
    return options


def _literal(host: str, variables: dict[str, Any], name: str) -> Any:
    value = variables.get(name, DEFAULTS.get(name))
    if isinstance(value, str) and "{{" in value:
        raise OpsError(
            f"{host}: {name} is a template ({value!r}); ops reads `ansible-inventory --list`, which does not "
            f"render templates: give {name} a literal value in the inventory"
        )
    return value


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _as_port(host: str, name: str, value: Any) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = 0
    if not 0 < port < 65536:
        raise OpsError(f"{host}: {name} = {value!r} is not a TCP port (1-65535)")
    return port


def fleet_host_from_vars(name: str, variables: dict[str, Any]) -> FleetHost:
    """A FleetHost from one host's ``_meta.hostvars`` entry, checked."""
    options: dict[str, str] = {}
    for args_var in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        options.update(parse_ssh_args(str(_literal(name, variables, args_var) or "")))
    if "proxyjump" in options:
        raise OpsError(
            f"{name}: ProxyJump in ansible_ssh_common_args is not supported by ops; "
            "use -o ProxyCommand='ssh -W %h:%p JUMPHOST' instead"
        )
    address = str(_literal(name, variables, "ansible_host") or options.get("hostname") or name)
    port = _as_port(name, "ansible_port", _literal(name, variables, "ansible_port") or options.get("port") or 22)
    user = _literal(name, variables, "ansible_user") or options.get("user")
    key_files: list[str] = []
    key_var = _literal(name, variables, "ansible_ssh_private_key_file") or _literal(
        name, variables, "ansible_private_key_file"
    )
    if key_var:
        key_files.append(str(Path(str(key_var)).expanduser()))
    if options.get("identityfile"):
        key_files.extend(str(Path(p).expanduser()) for p in options["identityfile"].split("\n"))
    known_hosts = tuple(str(Path(p).expanduser()) for p in options.get("userknownhostsfile", "").split() if p)
    strict = options.get("stricthostkeychecking", "yes").lower()
    strict = {"true": "yes", "ask": "yes", "false": "no", "off": "no"}.get(strict, strict)
    if strict not in ("yes", "accept-new", "no"):
        raise OpsError(f"{name}: StrictHostKeyChecking={strict!r} is not yes, accept-new or no")
    return FleetHost(
        name=name,
        ssh=SSHSettings(
            address=address,
            port=port,
            user=str(user) if user else None,
            key_files=tuple(key_files),
            known_hosts_files=known_hosts,
            strict_host_key_checking=strict,
            identities_only=options.get("identitiesonly", "no").lower() == "yes",
            proxy_command=options.get("proxycommand"),
        ),
        become=_as_bool(_literal(name, variables, "ansible_become") or False)
        and str(_literal(name, variables, "ansible_become_user") or "root") == "root",
        python=str(_literal(name, variables, "ansible_python_interpreter")),
        profile=str(_literal(name, variables, "sparkfleet_profile")),
        root=str(_literal(name, variables, "sparkfleet_root")),
        state_dir=str(_literal(name, variables, "sparkfleet_state_dir")),
        config_dir=str(_literal(name, variables, "sparkfleet_config_dir")),
        api_port=_as_port(name, "sparkfleet_api_port", _literal(name, variables, "sparkfleet_api_port")),
        served_model_name=str(_literal(name, variables, "sparkfleet_served_model_name")),
    )


def group_hosts(inventory: dict[str, Any], group: str, seen: set[str] | None = None) -> list[str]:
    """Hosts of ``group`` and its child groups in ``ansible-inventory --list`` output, in order."""
    seen = set() if seen is None else seen
    if group in seen:
        return []
    seen.add(group)
    entry = inventory.get(group) or {}
    hosts = list(entry.get("hosts", []))
    for child in entry.get("children", []):
        hosts.extend(h for h in group_hosts(inventory, child, seen) if h not in hosts)
    return hosts


def ansible_inventory_command() -> str:
    """ansible-inventory next to this Python (the controller venv), else on PATH."""
    beside = Path(sys.executable).with_name("ansible-inventory")
    if beside.exists():
        return str(beside)
    found = shutil.which("ansible-inventory")
    if not found:
        raise OpsError("ansible-inventory not found: run `make venv` and use .venv/bin/sparkfleet")
    return found


def fleet_hosts_from_inventory(data: dict[str, Any], pattern: str = DEFAULT_HOST_PATTERN) -> list[FleetHost]:
    """FleetHosts of the group ``pattern`` (or a single host of that name) in ``ansible-inventory --list`` data."""
    hostvars = data.get("_meta", {}).get("hostvars", {})
    if pattern in data:
        names = group_hosts(data, pattern)
    elif pattern in hostvars:
        names = [pattern]
    else:
        names = []
    return [fleet_host_from_vars(name, hostvars.get(name, {})) for name in names]


def load_fleet(inventory: str, limit: str | None, pattern: str = DEFAULT_HOST_PATTERN) -> list[FleetHost]:
    """The hosts ops works on: ``ansible-inventory -i INVENTORY --list [--limit LIMIT]``, group ``pattern``."""
    if not Path(inventory).exists():
        raise OpsError(
            f"inventory {inventory!r} does not exist; pass -i inventory/<name> (make sandbox-up writes the sandbox's)"
        )
    command = [ansible_inventory_command(), "-i", inventory, "--list"]
    if limit:
        command += ["--limit", limit]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OpsError(f"`{shlex.join(command)}` failed: {detail}")
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise OpsError(f"`{shlex.join(command)}` printed no JSON ({exc})") from exc
    hosts = fleet_hosts_from_inventory(data, pattern)
    if not hosts:
        where = f" matching --limit {limit!r}" if limit else ""
        raise OpsError(f"no host of {pattern!r} in {inventory}{where}; check -i, -l and --hosts")
    return hosts


# ------------------------------------------------------------------------------------ connections


def open_connection(host: FleetHost) -> Any:
    """A Fabric Connection that checks the host key against the inventory's known_hosts file(s).

    Fabric itself auto-adds unknown keys and reads ~/.ssh/config; ops does neither: the inventory
    is the only source, as for Ansible with ``StrictHostKeyChecking=yes``.
    """
    import paramiko
    from fabric import Config, Connection

    settings = host.ssh
    connect_kwargs: dict[str, Any] = {
        "allow_agent": not settings.identities_only,
        "look_for_keys": not settings.key_files,
    }
    if settings.key_files:
        connect_kwargs["key_filename"] = list(settings.key_files)
    connection = Connection(
        settings.address,
        user=settings.user,
        port=settings.port,
        config=Config(ssh_config=paramiko.SSHConfig()),
        gateway=settings.proxy_command,
        connect_timeout=CONNECT_TIMEOUT_S,
        connect_kwargs=connect_kwargs,
    )
    client = connection.client
    if settings.known_hosts_files:
        for path in settings.known_hosts_files:
            if Path(path).is_file():
                client.load_host_keys(path)
    else:
        client.load_system_host_keys()
    policies = {
        "yes": paramiko.RejectPolicy(),
        "accept-new": paramiko.AutoAddPolicy(),
        "no": paramiko.WarningPolicy(),
    }
    client.set_missing_host_key_policy(policies[settings.strict_host_key_checking])
    return connection


def describe_exception(exc: BaseException, host: FleetHost) -> str:
    """One line for a connection or command error (never a traceback)."""
    import paramiko
    from invoke.exceptions import CommandTimedOut

    address = f"{host.ssh.address}:{host.ssh.port}"
    if isinstance(exc, HostFailure):
        return str(exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        return f"host key of {address} CHANGED (does not match known_hosts); refusing to connect"
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        files = ", ".join(host.ssh.known_hosts_files) or "~/.ssh/known_hosts"
        return f"host key of {address} is not in {files}; add it (ssh-keyscan) or fix UserKnownHostsFile"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"ssh authentication as {host.ssh.user or 'the current user'} at {address} failed ({exc})"
    if isinstance(exc, CommandTimedOut):
        return f"command timed out after {exc.timeout} s"
    if isinstance(exc, socket.timeout | TimeoutError):
        return f"ssh to {address} timed out"
    if isinstance(exc, OSError):
        return f"ssh to {address} failed: {exc.strerror or exc}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else 'no detail'}"


@dataclass
class HostOutcome:
    """What one host's operation produced."""

    host: str
    ok: bool
    line: str  # the one line printed for the host
    data: dict[str, Any] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)  # extra lines (logs)


HostOperation = Callable[[FleetHost, Any], HostOutcome]


def run_on_hosts(
    hosts: Sequence[FleetHost],
    operation: HostOperation,
    forks: int = DEFAULT_FORKS,
    connect: Callable[[FleetHost], Any] = open_connection,
    progress: bool = False,
) -> list[HostOutcome]:
    """Run ``operation(host, connection)`` on every host, ``forks`` at a time; results in host order.

    Any error of one host becomes a failed outcome with a one-line reason; the others go on. With
    ``progress``, a line on stderr as each host finishes (restart and bench take minutes).
    """

    started = time.monotonic()

    def one(host: FleetHost) -> HostOutcome:
        connection = None
        try:
            connection = connect(host)
            outcome = operation(host, connection)
        except Exception as exc:  # noqa: BLE001 - the per-host boundary: report, never a traceback
            outcome = HostOutcome(host.name, False, f"error: {describe_exception(exc, host)}")
        finally:
            if connection is not None:
                connection.close()
        if progress:
            mark = "done" if outcome.ok else "FAILED"
            print(f"  {host.name}: {mark} after {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        return outcome

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


def privileged(host: FleetHost, command: str) -> str:
    """``command`` run as root: as is for root logins, else through ``sudo -n`` (ansible_become)."""
    if host.ssh.user == "root" or not host.become:
        return command
    return f"sudo -n sh -c {shlex.quote(command)}"


def run_remote(connection: Any, command: str, timeout: float) -> Any:
    """Run a command; a non-zero exit raises HostFailure with its last line of stderr."""
    result = connection.run(command, hide=True, warn=True, in_stream=False, timeout=timeout)
    if result.exited != 0:
        lines = [line for line in (result.stderr + result.stdout).strip().splitlines() if line.strip()]
        raise HostFailure(f"`{command[:60]}…` exited {result.exited}: {lines[-1] if lines else 'no output'}")
    return result


def python_command(host: FleetHost, script: str, *argv: str | int) -> str:
    return shlex.join([host.python, "-c", script, *(str(a) for a in argv)])


def probe_host(host: FleetHost, connection: Any, timeout: float = 60) -> dict[str, Any]:
    """Run PROBE_SCRIPT on the host (as root where needed: state.json is root:vllm 0640)."""
    command = python_command(host, PROBE_SCRIPT, host.config_dir, host.state_dir, host.fallback_unit, host.api_port)
    result = run_remote(connection, privileged(host, command), timeout)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as exc:
        raise HostFailure(f"the probe printed no JSON: {result.stdout.strip()[:80]!r}") from exc


# ----------------------------------------------------------------------------------------- status


def short_revision(revision: Any) -> str:
    text = str(revision or "")
    if len(text) == 40 and all(c in "0123456789abcdef" for c in text):
        return text[:12]
    return text or "-"


def served_revisions(state: dict[str, Any]) -> tuple[str, str]:
    """(model, drafter) as ``name@revision`` from state.json; a path's last part names its model."""
    revisions = state.get("model_revisions") or {}

    def one(path_key: str) -> str:
        path = str(state.get(path_key) or "")
        if not path:
            return "-"
        name = PurePosixPath(path).name
        return f"{name}@{short_revision(revisions.get(name))}" if name in revisions else name

    return one("model_path"), one("drafter_path")


def bench_figure(result: dict[str, Any] | None) -> str:
    """The last benchmark's tok/s for the status line: decode median, else e2e; '-' when absent."""
    if not isinstance(result, dict):
        return "-"
    figures = result.get("figures") or {}
    for name, label in (("decode_tok_s_median", "decode"), ("e2e_tok_s", "e2e"), ("serving_output_tok_s", "serving")):
        value = figures.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
            return f"{value:.1f} {label}"
    return "-"


def health_summary(probe: dict[str, Any], served_name: str) -> tuple[bool, str]:
    """(healthy, text) from the probe's /health and /v1/models answers."""
    health = probe.get("health") or {}
    status = health.get("status")
    if status is None:
        reason = re.sub(r"^\[Errno \d+\] ", "", str(health.get("error") or "no answer"))
        return False, f"down ({reason})"
    if status != 200:
        return False, f"/health http {status}"
    models = probe.get("models") or {}
    if models.get("status") != 200:
        return False, f"/v1/models http {models.get('status') or models.get('error')}"
    try:
        ids = [m.get("id") for m in json.loads(models.get("body") or "{}").get("data", [])]
    except (json.JSONDecodeError, AttributeError):
        return False, "/v1/models not JSON"
    if served_name not in ids:
        return False, f"serves {','.join(map(str, ids)) or 'nothing'}, not {served_name}"
    return True, "ok"


STATUS_COLUMNS = (
    "host", "profile", "unit", "health", "patch_set", "model", "drafter", "ready", "kv_pool", "free_at_ready",
    "bench_tok_s",
)  # fmt: skip


def status_row(host: FleetHost, probe: dict[str, Any]) -> tuple[bool, dict[str, str], list[str]]:
    """(ok, row, problems) for one host's probe."""
    state = probe.get("state") if isinstance(probe.get("state"), dict) else {}
    problems: list[str] = []
    if probe.get("state_error"):
        problems.append(f"state.json unreadable: {probe['state_error']}")
    elif not state:
        problems.append(f"no {host.config_dir}/state.json (not deployed)")
    unit = probe.get("unit") or {}
    load, active, sub = unit.get("LoadState", "?"), unit.get("ActiveState", "?"), unit.get("SubState", "?")
    if unit.get("error"):
        unit_text = "error"
        problems.append(f"systemctl: {unit['error']}")
    elif load != "loaded":
        unit_text = load
        problems.append(f"unit {probe.get('unit_name')} {load}")
    else:
        described = unit_state.describe(str(probe.get("unit_name")), unit, probe.get("journal") or [])
        unit_text = f"{active}/{sub}" if described.word in ("running", "starting", "unknown") else described.word
        if not described.running:
            problems.append(described.text)
    served_name = str(state.get("served_model_name") or host.served_model_name)
    healthy, health_text = health_summary(probe, served_name)
    model, drafter = served_revisions(state)
    row = {
        "host": host.name,
        "profile": str(state.get("profile") or f"({host.profile})"),
        "unit": unit_text,
        "health": health_text,
        "patch_set": str(state.get("patchset_id") or "-"),
        "model": model,
        "drafter": drafter,
        # the unit's last start (state.json's "startup"): time to /health, KV pool (max concurrency), free memory
        **startup.status_cells(state.get("startup")),
        "bench_tok_s": bench_figure(probe.get("bench")),
    }
    bench = probe.get("bench")
    if (
        isinstance(bench, dict)
        and bench.get("profile")
        and state.get("profile")
        and bench["profile"] != state["profile"]
    ):
        row["bench_tok_s"] += f" ({bench['profile']})"
    if not healthy:
        problems.append(f"health {health_text}")
    return healthy and not problems, row, problems


def status_operation(host: FleetHost, connection: Any) -> HostOutcome:
    probe = probe_host(host, connection)
    ok, row, problems = status_row(host, probe)
    return HostOutcome(host.name, ok, "; ".join(problems), data={"row": row, "probe": probe})


def format_table(rows: Iterable[dict[str, str]], columns: Sequence[str]) -> list[str]:
    """Aligned lines, a header first; the last column is not padded."""
    rows = list(rows)
    widths = {c: max([len(c)] + [len(r.get(c, "")) for r in rows]) for c in columns}
    lines = []
    for cells in [{c: c.upper().replace("_", "-") for c in columns}, *rows]:
        parts = [cells.get(c, "").ljust(widths[c]) for c in columns[:-1]] + [cells.get(columns[-1], "")]
        lines.append("  ".join(parts).rstrip())
    return lines


def print_status(outcomes: Sequence[HostOutcome], as_json: bool) -> None:
    if as_json:
        payload = [
            {"host": o.host, "ok": o.ok, "problems": o.line, **({"row": o.data["row"]} if "row" in o.data else {})}
            for o in outcomes
        ]
        print(json.dumps(payload, indent=2))
        return
    lines = format_table([o.data["row"] for o in outcomes if "row" in o.data], STATUS_COLUMNS)
    width = max([len(o.host) for o in outcomes] + [len("HOST")])
    print(lines[0] if len(lines) > 1 else "HOST")
    body = iter(lines[1:])
    for outcome in outcomes:
        # a host that could not be probed prints its error instead of the columns
        print(next(body) if "row" in outcome.data else f"{outcome.host.ljust(width)}  {outcome.line}")
    problems = [o for o in outcomes if not o.ok and "row" in o.data]
    for outcome in problems:
        print(f"{outcome.host}: {outcome.line}", file=sys.stderr)


# ------------------------------------------------------------------------------------------- logs


def unit_of(host: FleetHost, connection: Any) -> tuple[str, dict[str, Any]]:
    """The host's unit (from state.json, else the inventory's profile) and the probe it came from."""
    probe = probe_host(host, connection)
    return str(probe.get("unit_name") or host.fallback_unit), probe


def logs_operation(lines: int, since: str | None) -> HostOperation:
    def operation(host: FleetHost, connection: Any) -> HostOutcome:
        unit, probe = unit_of(host, connection)
        if (probe.get("unit") or {}).get("LoadState") not in ("loaded", None):
            return HostOutcome(host.name, False, f"unit {unit} is {probe['unit']['LoadState']} (not deployed?)")
        command = ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-iso"]
        if since:
            command += ["--since", since]
        result = run_remote(connection, privileged(host, "LC_ALL=C " + shlex.join(command)), timeout=60)
        text = [line for line in result.stdout.splitlines() if line.strip()]
        return HostOutcome(host.name, True, f"{unit}: {len(text)} line(s)", output=text)

    return operation


# ---------------------------------------------------------------------------------------- restart


def restart_command(unit: str, host_lock: str | None) -> str:
    """The shell command that restarts unit on a host: under its host lock (sparkfleet-host-lock, which
    refuses while another operation restarts the host, naming it) where the deploy installed one, and
    after ``systemctl reset-failed`` (a unit systemd stopped restarting refuses a plain start)."""
    restart = f"systemctl reset-failed {shlex.quote(unit)} 2>/dev/null; exec systemctl restart {shlex.quote(unit)}"
    if not host_lock:
        return f"sh -c {shlex.quote(restart)}"
    holder = f"{getpass.getuser()}@{socket.gethostname()} sparkfleet ops restart"
    return shlex.join([host_lock, "--holder", holder, "--", "/bin/sh", "-c", restart])


def restart_operation(timeout: float) -> HostOperation:
    def operation(host: FleetHost, connection: Any) -> HostOutcome:
        unit, probe = unit_of(host, connection)
        load = (probe.get("unit") or {}).get("LoadState")
        if load != "loaded":
            return HostOutcome(host.name, False, f"unit {unit} is {load or 'unknown'}; deploy the host first")
        started = time.monotonic()
        state = probe.get("state") if isinstance(probe.get("state"), dict) else {}
        run_remote(connection, privileged(host, restart_command(unit, state.get("host_lock"))), timeout=timeout + 30)
        base_url = str(probe.get("base_url") or f"http://127.0.0.1:{host.api_port}")
        remaining = max(5.0, timeout - (time.monotonic() - started))
        result = connection.run(
            python_command(host, WAIT_HEALTH_SCRIPT, base_url, f"{remaining:.0f}"),
            hide=True,
            warn=True,
            in_stream=False,
            timeout=remaining + 30,
        )
        try:
            waited = json.loads(result.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            waited = {"healthy": False, "last": (result.stderr.strip().splitlines() or ["no output"])[-1]}
        total = time.monotonic() - started
        if not waited.get("healthy"):
            return HostOutcome(
                host.name, False, f"restarted {unit}; not healthy after {total:.0f} s ({waited.get('last')})"
            )
        return HostOutcome(host.name, True, f"restarted {unit}; healthy after {total:.1f} s", data={"seconds": total})

    return operation


def run_in_batches(
    hosts: Sequence[FleetHost], operation: HostOperation, batch: int, forks: int, connect: Callable[[FleetHost], Any]
) -> list[HostOutcome]:
    """Batches of ``batch`` hosts (0 = all at once); a failed batch stops the rest (they are reported skipped)."""
    size = len(hosts) if batch <= 0 else batch
    outcomes: list[HostOutcome] = []
    for start in range(0, len(hosts), size):
        group = hosts[start : start + size]
        if outcomes and not all(o.ok for o in outcomes):
            outcomes.extend(HostOutcome(h.name, False, "skipped: an earlier batch failed") for h in group)
            continue
        names = ", ".join(h.name for h in group)
        print(f"batch {start // size + 1}: {names}", file=sys.stderr, flush=True)
        outcomes.extend(run_on_hosts(group, operation, forks, connect, progress=True))
    return outcomes


# ------------------------------------------------------------------------------------------ bench


def bench_payload(package_dir: Path = PACKAGE_DIR) -> list[tuple[Path, str]]:
    """(local file, path relative to the lib dir) of the sparkfleet files the bench clients need."""
    files = []
    for pattern in BENCH_PAYLOAD_GLOBS:
        for path in sorted(package_dir.glob(pattern)):
            files.append((path, f"sparkfleet/{path.relative_to(package_dir).as_posix()}"))
    if not any(rel == "sparkfleet/bench/__init__.py" for _, rel in files):
        raise OpsError(f"no sparkfleet/bench package under {package_dir}; is the checkout complete?")
    return files


def upload_bench_clients(host: FleetHost, connection: Any, lib_dir: str) -> None:
    """Copy the bench clients to ``lib_dir/sparkfleet`` (SFTP to a staging dir, then moved into place as root)."""
    staging = run_remote(connection, "mktemp -d", timeout=30).stdout.strip()
    if not staging.startswith("/"):
        raise HostFailure(f"mktemp -d printed {staging!r}")
    try:
        sftp = connection.sftp()
        made: set[str] = set()
        for local, relative in bench_payload():
            remote = PurePosixPath(staging) / relative
            for parent in reversed(remote.parents):
                if str(parent).startswith(staging + "/") and str(parent) not in made:
                    sftp.mkdir(str(parent))
                    made.add(str(parent))
            sftp.put(str(local), str(remote))
        target = PurePosixPath(lib_dir) / "sparkfleet"
        install = (
            f"mkdir -p {shlex.quote(lib_dir)} && rm -rf {shlex.quote(str(target))}.new && "
            f"cp -R {shlex.quote(staging)}/sparkfleet {shlex.quote(str(target))}.new && "
            f"chmod -R go+rX {shlex.quote(str(target))}.new && rm -rf {shlex.quote(str(target))} && "
            f"mv {shlex.quote(str(target))}.new {shlex.quote(str(target))}"
        )
        run_remote(connection, privileged(host, install), timeout=60)
    finally:
        connection.run(f"rm -rf {shlex.quote(staging)}", hide=True, warn=True, in_stream=False, timeout=30)


@dataclass(frozen=True)
class BenchOptions:
    workloads: str
    max_requests: int
    max_tokens_scale: float
    ignore_eos: bool
    timeout: float
    out_dir: Path


def bench_command(host: FleetHost, probe: dict[str, Any], options: BenchOptions, stamp: str) -> tuple[str, str]:
    """(shell command run as root on the host, remote result path) for a quick decode benchmark."""
    state = probe.get("state") or {}
    venv = str(state.get("venv") or "")
    if not venv:
        raise HostFailure(f"state.json names no service venv (deploy the host first): {host.config_dir}/state.json")
    lib_dir = f"{host.root}/lib"
    bench_dir = f"{host.state_dir}/bench"
    profile = str(state.get("profile") or host.profile)
    # the serve_bench role's naming: <UTC stamp>-<method>.json, the last one also as latest.json
    result_path = f"{bench_dir}/{stamp}-decode.json"
    revisions = state.get("model_revisions") or {}
    argv = [
        f"{venv}/bin/python",
        "-m",
        "sparkfleet.bench",
        "decode",
        "--base-url",
        str(probe.get("base_url") or f"http://127.0.0.1:{host.api_port}"),
        "--model",
        str(state.get("served_model_name") or host.served_model_name),
        "--host-label",
        host.name,
        "--profile",
        profile,
        "--workloads",
        options.workloads,
        "--max-requests",
        str(options.max_requests),
        "--max-tokens-scale",
        str(options.max_tokens_scale),
        "--out",
        result_path,
        "--state-file",
        f"{host.config_dir}/state.json",
        "--quiet",
    ]
    if state.get("patchset_id"):
        argv += ["--patch-set", str(state["patchset_id"])]
    for flag, path_key in (("--model-revision", "model_path"), ("--drafter-revision", "drafter_path")):
        name = PurePosixPath(str(state.get(path_key) or "")).name
        if name and revisions.get(name):
            argv += [flag, str(revisions[name])]
    if options.ignore_eos:
        argv.append("--ignore-eos")
    if state.get("secrets_file"):  # the key is read there, as root, never passed in argv
        argv += ["--api-key-file", str(state["secrets_file"])]
    q = shlex.quote
    command = (
        f"mkdir -p {q(bench_dir)} && cd {q(lib_dir)} && PYTHONPATH={q(lib_dir)} {shlex.join(argv)} && "
        f"cp {q(result_path)} {q(bench_dir + '/latest.json.tmp')} && "
        f"mv {q(bench_dir + '/latest.json.tmp')} {q(bench_dir + '/latest.json')}"
    )
    return command, result_path


def bench_operation(options: BenchOptions, stamp: str) -> HostOperation:
    def operation(host: FleetHost, connection: Any) -> HostOutcome:
        probe = probe_host(host, connection)
        healthy, health_text = health_summary(
            probe, str((probe.get("state") or {}).get("served_model_name") or host.served_model_name)
        )
        if not healthy:
            return HostOutcome(host.name, False, f"not benchmarked: health {health_text}")
        command, result_path = bench_command(host, probe, options, stamp)
        upload_bench_clients(host, connection, f"{host.root}/lib")
        run_remote(connection, privileged(host, command), timeout=options.timeout)
        text = run_remote(connection, privileged(host, f"cat {shlex.quote(result_path)}"), timeout=60).stdout
        try:
            result = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HostFailure(f"{result_path} is not JSON ({exc})") from exc
        local = options.out_dir / host.name / PurePosixPath(result_path).name  # as `make bench` fetches them
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text, encoding="utf-8")
        return HostOutcome(
            host.name,
            True,
            f"{bench_figure(result)} tok/s -> {result_path}; copy {local}",
            data={"result": result, "local": str(local)},
        )

    return operation


# -------------------------------------------------------------------------------------------- CLI


def print_outcomes(outcomes: Sequence[HostOutcome]) -> None:
    width = max([len(o.host) for o in outcomes] + [4])
    for outcome in outcomes:
        for line in outcome.output:
            print(f"{outcome.host.ljust(width)} | {line}")
        mark = "ok" if outcome.ok else "FAILED"
        print(f"{outcome.host.ljust(width)}  {mark:6}  {outcome.line}")


def summary_line(verb: str, outcomes: Sequence[HostOutcome], seconds: float) -> str:
    failed = [o.host for o in outcomes if not o.ok]
    tail = f"; failed: {', '.join(failed)}" if failed else ""
    return f"ops {verb}: {len(outcomes) - len(failed)}/{len(outcomes)} host(s) ok in {seconds:.1f} s{tail}"


def run_command(args: argparse.Namespace, connect: Callable[[FleetHost], Any] = open_connection) -> int:
    """Run one ``ops`` subcommand; returns the exit code (0 ok, 1 a host failed, 2 bad input)."""
    started = time.monotonic()
    try:
        if args.forks < 1:
            raise OpsError(f"--forks {args.forks}: use 1 or more")
        hosts = load_fleet(args.inventory, args.limit, args.hosts)
        if args.ops_command == "status":
            outcomes = run_on_hosts(hosts, status_operation, args.forks, connect)
            print_status(outcomes, args.json)
        elif args.ops_command == "logs":
            if args.lines < 1:
                raise OpsError(f"--lines {args.lines}: use 1 or more")
            outcomes = run_on_hosts(hosts, logs_operation(args.lines, args.since), args.forks, connect)
            print_outcomes(outcomes)
        elif args.ops_command == "restart":
            if args.timeout <= 0:
                raise OpsError(f"--timeout {args.timeout}: use a positive number of seconds")
            outcomes = run_in_batches(hosts, restart_operation(args.timeout), args.batch, args.forks, connect)
            print_outcomes(outcomes)
        elif args.ops_command == "bench":
            if args.max_requests < 1 or args.max_tokens_scale <= 0:
                raise OpsError("--max-requests must be >= 1 and --max-tokens-scale > 0")
            options = BenchOptions(
                workloads=args.workloads,
                max_requests=args.max_requests,
                max_tokens_scale=args.max_tokens_scale,
                ignore_eos=args.ignore_eos,
                timeout=args.timeout,
                out_dir=Path(args.out),
            )
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
            print(f"benchmarking {len(hosts)} host(s) in parallel ...", file=sys.stderr, flush=True)
            outcomes = run_on_hosts(hosts, bench_operation(options, stamp), args.forks, connect, progress=True)
            print_outcomes(outcomes)
        else:
            raise OpsError(f"unknown ops command {args.ops_command!r}")
    except OpsError as exc:
        print(f"sparkfleet ops: {exc}", file=sys.stderr)
        return 2
    if not (args.ops_command == "status" and args.json):
        print(summary_line(args.ops_command, outcomes, time.monotonic() - started), file=sys.stderr)
    return 0 if all(o.ok for o in outcomes) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sparkfleet ops`` (CLI contract of sparkfleet.cli)."""
    ops = subparsers.add_parser("ops", help="ad-hoc fleet operations over SSH (status, logs, restart, bench)")
    sub = ops.add_subparsers(dest="ops_command", metavar="OPS")

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "-i", "--inventory", default=DEFAULT_INVENTORY, help=f"inventory (default {DEFAULT_INVENTORY})"
        )
        parser.add_argument("-l", "--limit", help="further limit the hosts (Ansible pattern, e.g. spark-01,spark-03)")
        parser.add_argument(
            "--hosts", default=DEFAULT_HOST_PATTERN, help=f"group (or host) to work on (default {DEFAULT_HOST_PATTERN})"
        )
        parser.add_argument(
            "-f", "--forks", type=int, default=DEFAULT_FORKS, help=f"hosts at a time (default {DEFAULT_FORKS})"
        )
        parser.set_defaults(func=run_command)

    status = sub.add_parser("status", help="one line per host: profile, unit, health, patch set, revisions, last tok/s")
    common(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")

    logs = sub.add_parser("logs", help="the last journal lines of each host's unit")
    common(logs)
    logs.add_argument("-n", "--lines", type=int, default=30, help="lines per host (default 30)")
    logs.add_argument("--since", help="journalctl --since, e.g. '-10min' or '2026-06-24 10:00'")

    restart = sub.add_parser("restart", help="restart each host's unit and wait for /health")
    common(restart)
    restart.add_argument(
        "--batch",
        type=int,
        default=1,
        help="hosts restarted together; the next batch waits for their health and stops on a failure "
        "(default 1: never the whole fleet down at once; 0 = all together)",
    )
    restart.add_argument("--timeout", type=float, default=900, help="seconds per host to be healthy (default 900)")

    bench = sub.add_parser("bench", help="a quick decode benchmark on each host (latest.json, a copy in --out)")
    common(bench)
    bench.add_argument("--workloads", default="prose,code", help="decode workloads (default prose,code)")
    bench.add_argument("--max-requests", type=int, default=2, help="requests per workload (default 2)")
    bench.add_argument("--max-tokens-scale", type=float, default=0.25, help="multiply max_tokens (default 0.25)")
    bench.add_argument("--ignore-eos", action="store_true", help="generate up to max_tokens (tiny models)")
    bench.add_argument("--timeout", type=float, default=900, help="seconds per host for the benchmark (default 900)")
    bench.add_argument(
        "--out", default="results", help="controller directory; copies go to OUT/<host>/ (default results)"
    )

    ops.set_defaults(func=lambda _args: (ops.print_help(), 2)[1])
