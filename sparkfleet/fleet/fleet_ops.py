"""Ad-hoc fleet operations over SSH (Fabric): ``sparkfleet ops status|logs|restart|bench``.

The hosts, their SSH settings and their sparkfleet variables come from the same inventory the
playbooks use (``ansible-inventory -i INVENTORY --list``), and each host's SSH is resolved the way
Ansible's ssh connection resolves it: OpenSSH itself (``ssh -G``) reads the host's ``ansible_port``,
``ansible_user``, key and ``ansible_ssh_common_args``/``ansible_ssh_extra_args`` (``-F`` configs and
``~/.ssh/config`` included), so a ``Host`` block, ``ProxyJump`` or ``ProxyCommand`` that Ansible
honours reaches ops too. An unknown or changed host key is refused unless the resolved
``StrictHostKeyChecking`` says otherwise. Root work goes through ``sudo`` where the inventory says
``ansible_become``: ``-n`` without a password, else the password from ``ansible_become_password``,
``--become-password-file`` or ``-K``, fed on stdin (never in argv).

Each host's work runs in its own thread (``--forks``, default 16) and opens its own connection; the
result is printed in inventory order once every host has answered::

    sparkfleet ops status [-i inventory/sandbox] [-l spark-01,spark-02] [--json]
    sparkfleet ops logs --lines 50
    sparkfleet ops restart -l spark-03 [--batch 1]
    sparkfleet ops bench [--max-requests 2 --max-tokens-scale 0.25] [--out results]

What a host serves is read from ``/etc/sparkfleet/state.json`` (written by the vllm_service role);
health is probed from the host itself (the API binds to loopback) with the host's own python3, so
nothing but sshd and python3 is needed there. ``restart`` is ``systemctl restart`` under the host's
lock: the unit's own start gate (``ExecStartPost=sparkfleet-wait-healthy``) decides whether it came
back, as for every deploy. ``bench`` copies the benchmark clients (``sparkfleet.hostlib.bench``) to
``<sparkfleet_root>/lib`` and runs them with the service venv's Python (they import httpx and
prometheus_client, which vLLM brings); the result lands in ``<sparkfleet_state_dir>/bench/``
(``latest.json`` is what ``status`` shows) and a copy comes back to ``--out``.

Exit codes: 0 every host is fine, 1 at least one host failed (each says why on its own line),
2 bad input (inventory, arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import getpass
import io
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sparkfleet.serving import cluster, serving_state, startup, unit_state

DEFAULT_INVENTORY = "inventory/sandbox"
DEFAULT_HOST_PATTERN = "spark"  # the group the playbooks target (sparkfleet_hosts defaults to it)
DEFAULT_FORKS = 16
CONNECT_TIMEOUT_S = 15
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# What `ops bench` copies to a host: the bench clients and their prompt sets (run with the service venv's Python).
BENCH_PAYLOAD_GLOBS = ("__init__.py", "hostlib/__init__.py", "hostlib/bench/*.py", "hostlib/data/workloads/*.json")

# Ansible's own defaults for its connection variables. sparkfleet's variables have no copy here: ops
# reads them from the inventory as the playbooks do (its group_vars/all links the repo's defaults).
ANSIBLE_DEFAULTS: dict[str, Any] = {"ansible_python_interpreter": "/usr/bin/python3", "ansible_become_user": "root"}
SPARKFLEET_DEFAULTS_FILE = "inventory/group_vars/all/sparkfleet.yml"

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


class OpsError(Exception):
    """Bad input (inventory, arguments): one line naming the value and the fix."""


class HostFailure(Exception):
    """One host's operation failed; the message is the one line printed for it."""


# ------------------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class SSHSettings:
    """How to reach a host: OpenSSH's resolution (``ssh -G``) of the options Ansible passes for it."""

    address: str  # the resolved HostName
    port: int
    user: str | None
    key_files: tuple[str, ...]  # the identity files ssh would offer that exist
    known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str  # "yes" | "accept-new" | "no"
    identities_only: bool
    proxy_command: str | None = None  # ProxyCommand, or ProxyJump as `ssh -W`, every token expanded


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
    become_password: str | None = field(default=None, repr=False)

    @property
    def fallback_unit(self) -> str:
        """The unit of the inventory's profile, for hosts without a state.json yet."""
        return serving_state.unit_name(self.profile)


def _literal(host: str, variables: dict[str, Any], name: str, default: Any = None) -> Any:
    value = variables.get(name, default)
    if isinstance(value, str) and "{{" in value:
        raise OpsError(
            f"{host}: {name} is a template ({value!r}); ops reads `ansible-inventory --list`, which does not "
            f"render templates: give {name} a literal value in the inventory"
        )
    if isinstance(value, dict) and "__ansible_vault" in value:
        raise OpsError(
            f"{host}: {name} is vault-encrypted, which `ansible-inventory --list` does not decrypt for ops; "
            "pass the value another way (for a become password: --become-password-file FILE or -K)"
        )
    return value


def _required(host: str, variables: dict[str, Any], name: str) -> Any:
    if name not in variables:
        raise OpsError(
            f"{host}: {name} is not set in the inventory; ops reads the playbooks' variables: link the "
            f"inventory's group_vars/all/00-sparkfleet.yml to {SPARKFLEET_DEFAULTS_FILE} (as inventory/example does)"
        )
    return _literal(host, variables, name)


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


def ssh_binary() -> str:
    found = shutil.which("ssh")
    if not found:
        raise OpsError("no ssh client on PATH: install openssh-client (Ansible's ssh connection needs it too)")
    return found


def ssh_words(host: str, variables: dict[str, Any]) -> list[str]:
    """The ssh options Ansible's ssh connection passes for this host, in its order: port, key and user
    first, then ``ansible_ssh_common_args`` and ``ansible_ssh_extra_args`` (for OpenSSH the first value
    of an option wins, so the inventory's port and user beat a ``-o Port=`` in the arguments)."""
    words: list[str] = []
    port = _literal(host, variables, "ansible_port") or _literal(host, variables, "ansible_ssh_port")
    if port:
        words += ["-o", f"Port={_as_port(host, 'ansible_port', port)}"]
    key = _literal(host, variables, "ansible_ssh_private_key_file") or _literal(
        host, variables, "ansible_private_key_file"
    )
    if key:
        words += ["-o", f"IdentityFile={Path(str(key)).expanduser()}"]
    user = _literal(host, variables, "ansible_user") or _literal(host, variables, "ansible_ssh_user")
    if user:
        words += ["-o", f"User={user}"]
    for name in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        text = str(_literal(host, variables, name) or "")
        try:
            words += shlex.split(text)
        except ValueError as exc:
            raise OpsError(f"{host}: {name} {text!r} does not parse ({exc}); quote it as a shell would") from exc
    return words


def parse_ssh_config_dump(text: str) -> dict[str, list[str]]:
    """``ssh -G`` output: lower-case keyword -> its values in order (IdentityFile and the like repeat)."""
    resolved: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            resolved.setdefault(key.lower(), []).append(value.strip())
    return resolved


def expand_ssh_tokens(text: str, hostname: str, port: int, user: str | None, original: str) -> str:
    """ssh_config(5)'s %h %p %r %n %% in a ProxyCommand (paramiko runs it as is)."""
    values = {"h": hostname, "p": str(port), "r": user or "", "n": original, "%": "%"}
    return re.sub(r"%(.)", lambda m: values.get(m.group(1), m.group(0)), text)


def jump_command(jumps: str, hostname: str, port: int, passthrough: Sequence[str]) -> str:
    """ProxyJump as the ``ssh -W`` command OpenSSH itself runs for it: the last jump carries the
    stream, earlier ones stay a ``-J`` chain; ``-F`` configs are passed on, as ssh passes them."""
    *earlier, last = [hop.strip() for hop in jumps.split(",") if hop.strip()]
    target = f"[{hostname}]:{port}" if ":" in hostname else f"{hostname}:{port}"
    hop = last.removeprefix("ssh://")
    user, _, rest = hop.rpartition("@")
    name, jump_port = rest, ""
    if rest.startswith("["):
        name, _, tail = rest[1:].partition("]")
        jump_port = tail.removeprefix(":")
    elif rest.count(":") == 1:
        name, _, jump_port = rest.partition(":")
    argv = ["ssh", *passthrough]
    if earlier:
        argv += ["-J", ",".join(earlier)]
    if user:
        argv += ["-l", user]
    if jump_port:
        argv += ["-p", jump_port]
    return shlex.join([*argv, "-W", target, name])


def resolve_ssh(host: str, variables: dict[str, Any]) -> SSHSettings:
    """The host's SSH as OpenSSH resolves Ansible's options for it (``ssh -G``, which reads -F configs,
    ~/.ssh/config and /etc/ssh/ssh_config exactly as the ssh Ansible runs would)."""
    original = str(_literal(host, variables, "ansible_host") or host)
    words = ssh_words(host, variables)
    command = [ssh_binary(), "-G", *words, original]
    proc = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OpsError(
            f"{host}: ssh refuses its options ({detail}); fix ansible_ssh_common_args or ansible_ssh_extra_args"
        )
    resolved = parse_ssh_config_dump(proc.stdout)

    def one(key: str, default: str = "") -> str:
        return (resolved.get(key) or [default])[0]

    hostname = one("hostname", original)
    port = _as_port(host, "Port (ssh -G)", one("port", "22"))
    user = one("user") or None
    strict = one("stricthostkeychecking", "true").lower()
    strict = {"true": "yes", "ask": "yes", "false": "no", "off": "no"}.get(strict, strict)
    if strict not in ("yes", "accept-new", "no"):
        raise OpsError(f"{host}: StrictHostKeyChecking={strict!r} is not yes, accept-new or no")
    keys = [str(Path(p).expanduser()) for p in resolved.get("identityfile", [])]
    known = [
        str(Path(p).expanduser()) for key in ("userknownhostsfile", "globalknownhostsfile") for p in one(key).split()
    ]
    proxy: str | None = None
    if one("proxycommand", "none").lower() != "none":
        proxy = expand_ssh_tokens(one("proxycommand"), hostname, port, user, original)
    elif one("proxyjump", "none").lower() != "none":
        passthrough = [w for i, w in enumerate(words) if w == "-F" or (i and words[i - 1] == "-F")]
        passthrough += [w for w in words if w.startswith("-F") and w != "-F"]
        proxy = jump_command(one("proxyjump"), hostname, port, passthrough)
    return SSHSettings(
        address=hostname,
        port=port,
        user=user,
        key_files=tuple(k for k in dict.fromkeys(keys) if Path(k).is_file()),
        known_hosts_files=tuple(k for k in dict.fromkeys(known) if k and k.lower() != "none"),
        strict_host_key_checking=strict,
        identities_only=one("identitiesonly", "no").lower() == "yes",
        proxy_command=proxy,
    )


def fleet_host_from_vars(name: str, variables: dict[str, Any]) -> FleetHost:
    """A FleetHost from one host's ``_meta.hostvars`` entry, checked."""
    become_user = str(_literal(name, variables, "ansible_become_user", ANSIBLE_DEFAULTS["ansible_become_user"]))
    password = _literal(name, variables, "ansible_become_password") or _literal(name, variables, "ansible_become_pass")
    return FleetHost(
        name=name,
        ssh=resolve_ssh(name, variables),
        become=_as_bool(_literal(name, variables, "ansible_become") or False) and become_user == "root",
        python=str(
            _literal(name, variables, "ansible_python_interpreter", ANSIBLE_DEFAULTS["ansible_python_interpreter"])
        ),
        profile=str(_required(name, variables, "sparkfleet_profile")),
        root=str(_required(name, variables, "sparkfleet_root")),
        state_dir=str(_required(name, variables, "sparkfleet_state_dir")),
        config_dir=str(_required(name, variables, "sparkfleet_config_dir")),
        api_port=_as_port(name, "sparkfleet_api_port", _required(name, variables, "sparkfleet_api_port")),
        served_model_name=str(_required(name, variables, "sparkfleet_served_model_name")),
        become_password=str(password) if password else None,
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
    """A Fabric Connection with the host's resolved SSH settings (resolve_ssh), checking the host key
    against the resolved known_hosts files.

    Fabric itself auto-adds unknown keys and reads ~/.ssh/config again; ops does neither: ``ssh -G``
    already read every config Ansible's ssh would, and the host key policy is the resolved one.
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
    for path in settings.known_hosts_files:
        if Path(path).is_file():
            client.load_host_keys(path)
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
    """``command`` run as root: as is for root logins, else through sudo (ansible_become): ``-n`` without
    a become password, ``-S`` reading it from stdin with one (run_remote feeds it; never argv)."""
    if host.ssh.user == "root" or not host.become:
        return command
    if host.become_password is not None:
        return f"sudo -S -p '' sh -c {shlex.quote(command)}"
    return f"sudo -n sh -c {shlex.quote(command)}"


def run_remote(connection: Any, command: str, timeout: float, host: FleetHost | None = None) -> Any:
    """Run a command (as root via privileged() when ``host`` is given); a non-zero exit raises
    HostFailure with its last line of output."""
    shown = command
    stdin: Any = False
    if host is not None:
        command = privileged(host, command)
        if command.startswith("sudo -S "):
            stdin = io.StringIO(f"{host.become_password}\n")
    result = connection.run(command, hide=True, warn=True, in_stream=stdin, timeout=timeout)
    if result.exited != 0:
        lines = [line for line in (result.stderr + result.stdout).strip().splitlines() if line.strip()]
        raise HostFailure(f"`{shown[:60]}…` exited {result.exited}: {lines[-1] if lines else 'no output'}")
    return result


def python_command(host: FleetHost, script: str, *argv: str | int) -> str:
    return shlex.join([host.python, "-c", script, *(str(a) for a in argv)])


def probe_host(host: FleetHost, connection: Any, timeout: float = 60) -> dict[str, Any]:
    """Run PROBE_SCRIPT on the host (as root where needed: state.json is root:vllm 0640)."""
    command = python_command(host, PROBE_SCRIPT, host.config_dir, host.state_dir, host.fallback_unit, host.api_port)
    result = run_remote(connection, command, timeout, host)
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

    def one(path_key: str) -> str:
        name = PurePosixPath(str(state.get(path_key) or "")).name
        revision = serving_state.revision_of(state, path_key)
        return (f"{name}@{short_revision(revision)}" if revision else name) or "-"

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
    state: dict[str, Any] = {}
    problems: list[str] = []
    if probe.get("state_error"):
        problems.append(f"state.json unreadable: {probe['state_error']}")
    elif not probe.get("state"):
        problems.append(f"no {host.config_dir}/state.json (not deployed)")
    else:
        try:
            state = serving_state.check(probe["state"], f"{host.name}:{host.config_dir}")
        except serving_state.StateError as exc:
            problems.append(str(exc))
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
    member = served_cluster(probe)
    if member.get("role") == "worker":
        # a worker serves no API: its part is its unit; its head's health is the cluster's (whole_clusters)
        healthy, health_text = True, f"worker of {member.get('name')}"
    else:
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


# --------------------------------------------------------------------------------------- clusters
# A cluster (docs/cluster.md) serves one model on all its members: ops takes it whole. Whatever -l names,
# every member of a cluster a named host serves in joins the run (state.json's "cluster" says which),
# status judges the members together, restart restarts them in one batch, bench runs through the head.


def served_cluster(probe: dict[str, Any] | None) -> dict[str, Any]:
    """The cluster a probed host serves in (state.json's "cluster": name, role, head, members), else {}."""
    state = (probe or {}).get("state")
    member = state.get("cluster") if isinstance(state, dict) else None
    return member if isinstance(member, dict) and member.get("name") else {}


def survey(
    hosts: list[FleetHost], forks: int, connect: Callable[[FleetHost], Any], everyone: Callable[[], list[FleetHost]]
) -> tuple[list[FleetHost], list[HostOutcome], list[str]]:
    """Probe ``hosts`` (status_operation), then every member of their clusters that ``hosts`` leaves out
    (``everyone()``: the inventory's hosts without -l). Returns the hosts and their status outcomes in
    inventory order, and one line per member that joined or that the inventory lacks."""
    outcomes = run_on_hosts(hosts, status_operation, forks, connect)
    named = {host.name for host in hosts}
    wanted: dict[str, str] = {}
    for outcome in outcomes:
        member = served_cluster(outcome.data.get("probe"))
        for other in member.get("members") or []:
            if str(other) not in named:
                wanted.setdefault(str(other), str(member["name"]))
    if not wanted:
        return hosts, outcomes, []
    inventory = everyone()
    known = {host.name: host for host in inventory}
    added = [known[name] for name in wanted if name in known]
    lines = [
        f"{name} joins the run: it serves in cluster {group} with a host the run names"
        if name in known
        else f"{name} of cluster {group} is not a host of the inventory's group: it is not checked"
        for name, group in wanted.items()
    ]
    outcomes += run_on_hosts(added, status_operation, forks, connect)
    place = {host.name: index for index, host in enumerate(inventory)}
    pairs = sorted(zip([*hosts, *added], outcomes, strict=True), key=lambda pair: place.get(pair[0].name, len(place)))
    return [host for host, _ in pairs], [outcome for _, outcome in pairs], lines


def whole_clusters(outcomes: Sequence[HostOutcome]) -> list[HostOutcome]:
    """Status outcomes with each cluster judged whole: a worker's health is its head's, and a member that
    is not serving, not checked or not serving in the cluster its head names fails every member, each
    line naming it."""
    by_host = {outcome.host: outcome for outcome in outcomes}
    clusters: dict[str, list[str]] = {}
    heads: dict[str, str] = {}
    for outcome in outcomes:
        member = served_cluster(outcome.data.get("probe"))
        if member:
            clusters.setdefault(str(member["name"]), []).append(outcome.host)
            heads.setdefault(str(member["name"]), str(member.get("head")))
    judged = dict(by_host)
    for name, found in clusters.items():
        head = by_host.get(heads[name])
        listed = served_cluster(head.data.get("probe")).get("members") if head else None
        problems: dict[str, str] = {}
        for member in dict.fromkeys([heads[name], *[str(m) for m in listed or []], *found]):
            outcome = by_host.get(member)
            if outcome is None:
                problems[member] = f"{member} not checked"
            elif "probe" not in outcome.data:
                problems[member] = f"{member} not probed ({outcome.line})"
            elif served_cluster(outcome.data.get("probe")).get("name") != name:
                problems[member] = f"{member} does not serve in it"
            elif not outcome.ok:
                problems[member] = f"{member} is not serving"
        head_health = head.data["row"]["health"] if head and "row" in head.data else "not checked"
        for host in found:
            outcome = judged[host]
            data = outcome.data
            if "row" in data and host != heads[name]:
                data = {**data, "row": {**data["row"], "health": f"{head_health} (via {heads[name]})"}}
            others = [text for member, text in problems.items() if member != host]
            line = "; ".join(filter(None, [outcome.line, f"cluster {name}: {'; '.join(others)}" if others else ""]))
            judged[host] = dataclasses.replace(outcome, ok=outcome.ok and not problems, line=line, data=data)
    return [judged[outcome.host] for outcome in outcomes]


def cluster_batches(
    hosts: Sequence[FleetHost], outcomes: Sequence[HostOutcome], batch: int
) -> tuple[list[FleetHost], list[int]]:
    """``hosts`` reordered so that each cluster's members are together, and the batch sizes for
    ``run_in_batches`` that keep each cluster in one batch (sparkfleet.serving.cluster.batches); a line on
    stderr for a cluster larger than ``batch``."""
    parts = {}
    for outcome in outcomes:
        member = served_cluster(outcome.data.get("probe"))
        if member:
            parts[outcome.host] = {"name": member["name"], "members": [{"host": m} for m in member.get("members", [])]}
    planned = cluster.batches([host.name for host in hosts], parts, batch if batch > 0 else 0)
    for line in planned["lines"]:
        print(line, file=sys.stderr)
    by_name = {host.name: host for host in hosts}
    sizes = planned["serial"]
    return [by_name[name] for name in planned["order"]], sizes if isinstance(sizes, list) else [int(sizes)]


# ------------------------------------------------------------------------------------------- logs


def unit_of(
    host: FleetHost, connection: Any, probes: Mapping[str, dict[str, Any]] | None = None
) -> tuple[str, dict[str, Any]]:
    """The host's unit (from state.json, else the inventory's profile) and the probe it came from (the
    run's own probe of the host in ``probes``, else a new one)."""
    probe = (probes or {}).get(host.name) or probe_host(host, connection)
    return str(probe.get("unit_name") or host.fallback_unit), probe


def logs_operation(lines: int, since: str | None, probes: Mapping[str, dict[str, Any]] | None = None) -> HostOperation:
    def operation(host: FleetHost, connection: Any) -> HostOutcome:
        unit, probe = unit_of(host, connection, probes)
        if (probe.get("unit") or {}).get("LoadState") not in ("loaded", None):
            return HostOutcome(host.name, False, f"unit {unit} is {probe['unit']['LoadState']} (not deployed?)")
        command = ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "short-iso"]
        if since:
            command += ["--since", since]
        result = run_remote(connection, "LC_ALL=C " + shlex.join(command), 60, host)
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
        # `systemctl restart` returns once the unit's start gate (ExecStartPost=sparkfleet-wait-healthy)
        # passed, and fails when it did not: the same verdict as every deploy, no second health check
        try:
            run_remote(connection, restart_command(unit, state.get("host_lock")), timeout, host)
        except HostFailure as exc:
            _, _, problems = status_row(host, probe_host(host, connection))
            seconds = time.monotonic() - started
            return HostOutcome(
                host.name, False, "; ".join([f"restart of {unit} failed after {seconds:.0f} s: {exc}", *problems])
            )
        ok, _, problems = status_row(host, probe_host(host, connection))
        seconds = time.monotonic() - started
        if not ok:
            return HostOutcome(host.name, False, "; ".join([f"restarted {unit} in {seconds:.0f} s, but", *problems]))
        return HostOutcome(
            host.name, True, f"restarted {unit}; healthy after {seconds:.1f} s", data={"seconds": seconds}
        )

    return operation


def run_in_batches(
    hosts: Sequence[FleetHost],
    operation: HostOperation,
    batch: int | Sequence[int],
    forks: int,
    connect: Callable[[FleetHost], Any],
) -> list[HostOutcome]:
    """Batches of ``batch`` hosts (0 = all at once; a list: each batch's size, the last one repeated); a
    failed batch stops the rest (they are reported skipped)."""
    sizes = list(batch) if isinstance(batch, Sequence) else [batch]
    outcomes: list[HostOutcome] = []
    start = number = 0
    while start < len(hosts):
        size = sizes[min(number, len(sizes) - 1)]
        group = hosts[start:] if size <= 0 else hosts[start : start + size]
        start += len(group)
        number += 1
        if outcomes and not all(o.ok for o in outcomes):
            outcomes.extend(HostOutcome(h.name, False, "skipped: an earlier batch failed") for h in group)
            continue
        names = ", ".join(h.name for h in group)
        print(f"batch {number}: {names}", file=sys.stderr, flush=True)
        outcomes.extend(run_on_hosts(group, operation, forks, connect, progress=True))
    return outcomes


# ------------------------------------------------------------------------------------------ bench


def bench_payload(package_dir: Path = PACKAGE_DIR) -> list[tuple[Path, str]]:
    """(local file, path relative to the lib dir) of the sparkfleet files the bench clients need."""
    files = []
    for pattern in BENCH_PAYLOAD_GLOBS:
        for path in sorted(package_dir.glob(pattern)):
            files.append((path, f"sparkfleet/{path.relative_to(package_dir).as_posix()}"))
    if not any(rel == "sparkfleet/hostlib/bench/__init__.py" for _, rel in files):
        raise OpsError(f"no sparkfleet/hostlib/bench package under {package_dir}; is the checkout complete?")
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
        run_remote(connection, install, 60, host)
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
    argv = [
        f"{venv}/bin/python",
        "-m",
        "sparkfleet.hostlib.bench",
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
        revision = serving_state.revision_of(state, path_key)
        if revision:
            argv += [flag, revision]
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


def bench_operation(
    options: BenchOptions, stamp: str, probes: Mapping[str, dict[str, Any]] | None = None
) -> HostOperation:
    def operation(host: FleetHost, connection: Any) -> HostOutcome:
        _, probe = unit_of(host, connection, probes)
        member = served_cluster(probe)
        if member.get("role") == "worker":
            return HostOutcome(
                host.name, True, f"worker of {member['name']}: benchmarked through its head {member['head']}"
            )
        healthy, health_text = health_summary(
            probe, str((probe.get("state") or {}).get("served_model_name") or host.served_model_name)
        )
        if not healthy:
            return HostOutcome(host.name, False, f"not benchmarked: health {health_text}")
        command, result_path = bench_command(host, probe, options, stamp)
        upload_bench_clients(host, connection, f"{host.root}/lib")
        run_remote(connection, command, options.timeout, host)
        text = run_remote(connection, f"cat {shlex.quote(result_path)}", 60, host).stdout
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


def with_become_password(hosts: list[FleetHost], args: argparse.Namespace) -> list[FleetHost]:
    """The hosts, with -K's or --become-password-file's password on every one that becomes root with sudo
    (over any ansible_become_password, as ansible-playbook does)."""
    if not (args.ask_become_pass or args.become_password_file):
        return hosts
    if args.become_password_file:
        try:
            password = Path(args.become_password_file).read_text(encoding="utf-8").rstrip("\n")
        except OSError as exc:
            raise OpsError(
                f"--become-password-file {args.become_password_file!r}: {exc.strerror or exc}; "
                "give a readable file holding the password"
            ) from exc
    else:
        password = getpass.getpass("BECOME password: ")
    return [dataclasses.replace(h, become_password=password) if h.become else h for h in hosts]


def run_command(args: argparse.Namespace, connect: Callable[[FleetHost], Any] = open_connection) -> int:
    """Run one ``ops`` subcommand; returns the exit code (0 ok, 1 a host failed, 2 bad input)."""
    started = time.monotonic()
    try:
        if args.forks < 1:
            raise OpsError(f"--forks {args.forks}: use 1 or more")
        if args.ops_command == "logs" and args.lines < 1:
            raise OpsError(f"--lines {args.lines}: use 1 or more")
        if args.ops_command == "restart" and args.timeout <= 0:
            raise OpsError(f"--timeout {args.timeout}: use a positive number of seconds")
        if args.ops_command == "bench" and (args.max_requests < 1 or args.max_tokens_scale <= 0):
            raise OpsError("--max-requests must be >= 1 and --max-tokens-scale > 0")
        hosts = with_become_password(load_fleet(args.inventory, args.limit, args.hosts), args)
        password = next((host.become_password for host in hosts if host.become_password), None)

        def everyone() -> list[FleetHost]:
            return [
                dataclasses.replace(host, become_password=password) if host.become and password else host
                for host in load_fleet(args.inventory, None, args.hosts)
            ]

        # every member of a cluster a named host serves in joins the run; status judges each cluster whole
        hosts, surveyed, joined = survey(hosts, args.forks, connect, everyone)
        for line in joined:
            print(line, file=sys.stderr)
        # logs and bench read the survey's probes; restart probes each host again when its batch comes
        probes = {outcome.host: outcome.data["probe"] for outcome in surveyed if "probe" in outcome.data}
        if args.ops_command == "status":
            outcomes = whole_clusters(surveyed)
            print_status(outcomes, args.json)
        elif args.ops_command == "logs":
            outcomes = run_on_hosts(hosts, logs_operation(args.lines, args.since, probes), args.forks, connect)
            print_outcomes(outcomes)
        elif args.ops_command == "restart":
            hosts, sizes = cluster_batches(hosts, surveyed, args.batch)
            outcomes = run_in_batches(hosts, restart_operation(args.timeout), sizes, args.forks, connect)
            print_outcomes(outcomes)
        elif args.ops_command == "bench":
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
            outcomes = run_on_hosts(hosts, bench_operation(options, stamp, probes), args.forks, connect, progress=True)
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
        password = parser.add_mutually_exclusive_group()
        password.add_argument(
            "-K",
            "--ask-become-pass",
            action="store_true",
            help="ask for the sudo password of hosts with ansible_become (as ansible-playbook -K)",
        )
        password.add_argument(
            "--become-password-file",
            metavar="FILE",
            help="read the sudo password from FILE (as ansible-playbook --become-password-file)",
        )
        parser.set_defaults(func=run_command)

    status = sub.add_parser("status", help="one line per host: profile, unit, health, patch set, revisions, last tok/s")
    common(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")

    logs = sub.add_parser("logs", help="the last journal lines of each host's unit")
    common(logs)
    logs.add_argument("-n", "--lines", type=int, default=30, help="lines per host (default 30)")
    logs.add_argument("--since", help="journalctl --since, e.g. '-10min' or '2026-06-24 10:00'")

    restart = sub.add_parser("restart", help="restart each host's unit; its start gate waits for /health")
    common(restart)
    restart.add_argument(
        "--batch",
        type=int,
        default=1,
        help="hosts restarted together; the next batch waits for their health and stops on a failure "
        "(default 1: never the whole fleet down at once; 0 = all together)",
    )
    restart.add_argument(
        "--timeout",
        type=float,
        default=960,
        help="seconds to wait for each `systemctl restart`, which returns once the unit's start gate found "
        "/health up (its own TimeoutStartSec= bounds it too; default 960)",
    )

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
