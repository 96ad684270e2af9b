"""The serving unit of one profile on one host, worked out in one place.

``spec`` turns the serving plan's parts (sparkfleet.serving.serving_plan.service_inputs gathers them
with the inventory's unit settings, SETTINGS) into every value its unit file and state.json hold: the
unit's name and the units it conflicts with, the ``ExecStart=`` command line (sparkfleet-memory-guard
with its limits, then ``vllm serve``), the environment, the limit each memory enforcer applies, the
allow-list, the health URL the unit and its handlers poll, the secrets file, and the state record
(sparkfleet.serving.serving_state's schema). The plan keeps it as ``service``; the vllm_service role
takes it whole (vllm_service_spec) and its templates render its fields. Its ``errors`` are the settings
it cannot use, one line each with the fix (the role's preflight refuses them before anything changes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sparkfleet.serving import cluster, profiles, serving_state

MIB = 1024 * 1024
# vllm_service_memory_max's size suffixes (1024-based)
SIZE_UNITS = {"": 1, "K": 1024, "M": MIB, "G": 1024 * MIB, "T": 1024 * 1024 * MIB}
SIZE = re.compile(r"^([0-9]+)([KMGT]?)$")
NO_LIMIT = ("infinity", "")
ENFORCERS = ("kernel", "guard")
MEMORY_GUARD = "sparkfleet-memory-guard"
HOST_LOCK = "sparkfleet-host-lock"
# bind addresses only this host reaches (anything else needs an API key, and gets IPAddressAllow=)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# the unit starts this much after the server's own start timeout runs out (its ExecStartPost waits that long)
START_TIMEOUT_MARGIN_S = 30

# What spec() reads: the serving plan's parts (sparkfleet.serving.serving_plan.service_inputs gathers
# them), the inventory's unit settings (SETTINGS) and the host's MemTotal (memtotal_mb, from gathered facts).
INPUTS = (
    "profile",
    "other_profiles",
    "venv",
    "vllm_version",
    "patchset_id",
    "model_path",
    "drafter_path",
    "model_revisions",
    "served_model_name",
    "host",
    "port",
    "user",
    "state_dir",
    "cache_dir",
    "config_dir",
    "firewall_unit",
    "allowed_clients",
    "start_timeout",
    "extra_directives",
    "libexec_dir",
    "memory_max",
    "memory_enforcers",
    "memory_reserve_mib",
    "memory_floor_mib",
    "limit_nofile",
    "devices",
    "memtotal_mb",
    "cluster",
)
# The inventory variables behind the unit's settings (inventory/group_vars/all/sparkfleet.yml documents
# each and sets the default): input key -> variable.
SETTINGS = {
    "allowed_clients": "vllm_service_allowed_clients",
    "start_timeout": "vllm_service_start_timeout",
    "extra_directives": "vllm_service_extra_directives",
    "libexec_dir": "vllm_service_libexec_dir",
    "memory_max": "vllm_service_memory_max",
    "memory_enforcers": "vllm_service_memory_enforcers",
    "memory_reserve_mib": "vllm_service_memory_reserve_mib",
    "memory_floor_mib": "vllm_service_memory_floor_mib",
    "limit_nofile": "vllm_service_limit_nofile",
    "devices": "vllm_service_devices",
}
FIREWALL_UNIT = "sparkfleet-vllm-firewall.service"
# A cluster member's watchdog (files/bin/sparkfleet-cluster-watch): a lost member restarts the pair.
WATCH_UNIT = "sparkfleet-cluster-watch.service"
CLUSTER_WATCH = "sparkfleet-cluster-watch"
# How often each member's watch probes, after how many failures in a row it restarts the node's server,
# and how long after a (re)start it waits first. The head's probe is a completion that may queue behind
# a full batch (3 x 15 s before it gives up); a worker's waits out the head's own restart and load.
WATCH_TIMING = {
    "head": {"interval": 15, "failures": 3, "grace": 60},
    "worker": {"interval": 5, "failures": 3, "grace": 180},
}
# vLLM's API server and `vllm serve --headless` exit 0 when the engine or a worker dies: for a cluster
# member that is a failure to restart from, not a clean stop (a stop systemd asked for is never restarted).
CLUSTER_DIRECTIVES = ["RestartForceExitStatus=0"]


class SpecError(ValueError):
    """Inputs the unit cannot be built from (a missing input, not a bad setting: those are ``errors``)."""


def _digits(value: Any) -> bool:
    return not isinstance(value, bool) and bool(re.fullmatch(r"[0-9]+", str(value)))


def memory_max_bytes(memory_max: Any, memtotal_mb: Any, reserve_mib: Any) -> int:
    """vllm_service_memory_max in bytes: 0 for no limit, -1 for a value that is not a size.

    ``auto`` is MemTotal less the reserve (negative when the reserve is larger: refused by ``memory``)."""
    text = "" if memory_max is None else str(memory_max)
    if text in NO_LIMIT:
        return 0
    if text == "auto":
        reserve = int(reserve_mib) if _digits(reserve_mib) else 0
        return (int(memtotal_mb) - reserve) * MIB if memtotal_mb not in (None, "") else -1
    match = SIZE.match(text.upper())
    return int(match.group(1)) * SIZE_UNITS[match.group(2)] if match else -1


def memory(inputs: Mapping[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The limit each enforcer applies (0 = none), and what is wrong with the settings."""
    setting, reserve, floor = inputs["memory_max"], inputs["memory_reserve_mib"], inputs["memory_floor_mib"]
    enforcers = inputs["memory_enforcers"]
    max_bytes = memory_max_bytes(setting, inputs.get("memtotal_mb"), reserve)
    errors = []
    unusable = (
        max_bytes < 0  # also "auto" without MemTotal (no gathered facts)
        or (setting != "auto" and str(setting) not in NO_LIMIT and max_bytes <= 0)
        or not _digits(reserve)
        or not _digits(floor)
    )
    if unusable:
        errors.append(
            f"vllm_service_memory_max {setting} (reserve {reserve} MiB, floor {floor} MiB) is not usable: give "
            '"auto" (needs gathered facts and MemTotal above the reserve), "infinity", or a size such as 100G; '
            "the reserve and the floor are whole MiB."
        )
    if isinstance(enforcers, str) or not isinstance(enforcers, Sequence) or set(enforcers) - set(ENFORCERS):
        errors.append(
            f"vllm_service_memory_enforcers {enforcers} is not a list of kernel and guard: give [kernel, guard] "
            "(the default), [kernel], [guard] or [] (no limit enforced)."
        )
        enforcers = []
    max_bytes = max(max_bytes, 0)
    return {
        "max_bytes": max_bytes,
        "kernel_bytes": max_bytes if "kernel" in enforcers else 0,
        "guard_bytes": max_bytes if "guard" in enforcers else 0,
        "floor_bytes": (int(floor) if _digits(floor) else 0) * MIB,
    }, errors


def _by_key(item: tuple[str, Any]) -> str:
    """Keys in the order Jinja's dictsort gives (case-insensitive), so the unit reads as before."""
    return str(item[0]).lower()


def environment(env: Mapping[str, Any]) -> list[str]:
    """The unit's Environment= values: each KEY=value JSON-quoted (systemd reads C-style quoting), by key."""
    return [json.dumps(f"{key}={value}") for key, value in sorted(env.items(), key=_by_key)]


def directives(extra: Mapping[str, Any]) -> list[str]:
    """vllm_service_extra_directives as unit lines, by key: a list value gives one line per item."""
    return [
        f"{key}={one}"
        for key, value in sorted(extra.items(), key=_by_key)
        for one in (value if isinstance(value, Sequence) and not isinstance(value, str) else [value])
    ]


CLIENT = re.compile(r"^[0-9A-Fa-f:.]+(/[0-9]{1,3})?$")
DIRECTIVE_KEY = re.compile(r"^[A-Z][A-Za-z0-9]+$")


def setting_errors(allowed: Any, extra: Any) -> list[str]:
    """What is wrong with vllm_service_allowed_clients and vllm_service_extra_directives, one line each."""
    errors = []
    if isinstance(allowed, str) or not isinstance(allowed, Sequence):
        bad = [allowed]
    else:
        bad = [client for client in allowed if not CLIENT.match(str(client))]
    if bad:
        errors.append(
            f"vllm_service_allowed_clients has entries that are not IP addresses or CIDRs: {bad}; list addresses "
            "such as 10.0.0.5 or 10.0.0.0/24 (host names are not resolved)."
        )
    if not isinstance(extra, Mapping) or any(not DIRECTIVE_KEY.match(str(key)) for key in extra):
        errors.append(
            f"vllm_service_extra_directives {extra} must map systemd [Service] keys (such as CPUAffinity) to values."
        )
    return errors


def watch(
    member: Mapping[str, Any], unit: str, libexec: str, host: str, port: int, model: str, env_file: str
) -> dict[str, Any]:
    """A cluster member's watchdog unit ({} outside a cluster): the head sends one-token completions
    through every stage, a worker connects to the head's master port; a lost member restarts the node's
    server (files/bin/sparkfleet-cluster-watch)."""
    if not member:
        return {}
    argv = [f"{libexec}/{CLUSTER_WATCH}", "--unit", unit, "--role", str(member["role"])]
    if member["role"] == "head":
        argv += ["--url", serving_state.base_url(host, port), "--model", model, "--key-file", env_file]
    else:
        argv += ["--master", f"{member['master_addr']}:{member['port']}"]
    argv += [f"--{key}={value}" for key, value in WATCH_TIMING[str(member["role"])].items()]
    return {
        "unit": WATCH_UNIT,
        "role": str(member["role"]),
        "cluster": str(member["name"]),
        "argv": argv,
        "exec_start": profiles.systemd_exec_args(argv),
    }


def spec(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the unit file and state.json of ``inputs['profile']`` hold (the module docstring)."""
    missing = [key for key in INPUTS if key not in inputs and key not in ("memtotal_mb", "cluster")]
    if missing:
        raise SpecError(f"the serving unit needs {', '.join(missing)}: build it with sparkfleet.serving.serving_plan")
    profile = inputs["profile"]
    name = str(profile["name"])
    limits, errors = memory(inputs)
    libexec = str(inputs["libexec_dir"])
    drafter_path = str(inputs["drafter_path"] or "")
    vllm = profiles.vllm_argv(
        profile,
        venv=inputs["venv"],
        model_path=inputs["model_path"],
        drafter_path=drafter_path,
        served_model_name=inputs["served_model_name"],
        host=inputs["host"],
        port=inputs["port"],
    )
    argv = [f"{libexec}/{MEMORY_GUARD}", str(limits["guard_bytes"]), str(limits["floor_bytes"]), "--", *vllm]
    unit = serving_state.unit_name(name)
    member = dict(inputs.get("cluster") or {})
    env = {
        **profiles.service_env(profile, cache_dir=inputs["cache_dir"], patchset_id=str(inputs["patchset_id"])),
        **cluster.env(member),
    }
    env_file = f"{inputs['config_dir']}/vllm-{name}.env"
    port = int(inputs["port"])
    state = {
        "profile": name,
        # the resolved profile, so a rollback can re-render this exact unit
        "profile_spec": dict(profile),
        "unit": unit,
        # what every restart of the unit goes through (ops restart reads it from here)
        "host_lock": f"{libexec}/{HOST_LOCK}",
        # root's 0600 file with the API key (VLLM_API_KEY=): bench clients and ops status read the key there
        "secrets_file": env_file,
        "vllm_version": str(inputs["vllm_version"]),
        "patchset_id": str(inputs["patchset_id"]),
        "venv": str(inputs["venv"]),
        "model_path": str(inputs["model_path"]),
        "drafter_path": drafter_path,
        "model_revisions": dict(inputs["model_revisions"] or {}),
        "served_model_name": str(inputs["served_model_name"]),
        "host": str(inputs["host"]),
        "port": port,
    }
    if member:
        # which cluster this node serves in, and as what (health and ops read it)
        state["cluster"] = {
            "name": member["name"],
            "role": member["role"],
            "rank": member["rank"],
            "head": member["head"],
            "members": [entry["host"] for entry in member["members"]],
        }
    serving_state.check(state, f"the {name} unit's state")
    errors += setting_errors(inputs["allowed_clients"] or [], inputs["extra_directives"] or {})
    clients = inputs["allowed_clients"] or []
    allowed = (
        [str(client) for client in clients] if isinstance(clients, Sequence) and not isinstance(clients, str) else []
    )
    extra = inputs["extra_directives"] if isinstance(inputs["extra_directives"], Mapping) else {}
    exposed = str(inputs["host"]) not in LOOPBACK
    config_dir = str(inputs["config_dir"])
    return {
        "profile": name,
        "summary": str(profile.get("summary") or ""),
        "served_model_name": str(inputs["served_model_name"]),
        "vllm_version": str(inputs["vllm_version"]),
        "patchset_id": str(inputs["patchset_id"]),
        "host": str(inputs["host"]),
        "port": port,
        "user": str(inputs["user"]),
        "state_dir": str(inputs["state_dir"]),
        "cache_dir": str(inputs["cache_dir"]),
        "config_dir": config_dir,
        "libexec_dir": libexec,
        "state_file": f"{config_dir}/state.json",
        "start_timeout": int(inputs["start_timeout"]),
        "limit_nofile": inputs["limit_nofile"],
        "devices": [str(device) for device in inputs["devices"] or []],
        "allowed_clients": allowed,
        # the nftables allow-list's two families
        "allowed_v4": [client for client in allowed if ":" not in client],
        "allowed_v6": [client for client in allowed if ":" in client],
        "firewall_unit": str(inputs["firewall_unit"]),
        "firewall_file": f"{config_dir}/vllm-firewall.nft",
        "extra_directives": extra,
        "unit": unit,
        "conflicts": [serving_state.unit_name(str(other)) for other in inputs["other_profiles"] if other != name],
        # the port is open beyond loopback only with the nftables allow-list in place
        "requires": [str(inputs["firewall_unit"])] if allowed else [],
        "exposed": exposed,
        "allowed_from": "loopback and the allowed clients" if allowed else "loopback",
        "ip_address_allow": ["localhost"]
        + ([" ".join(allowed) or "any"] if exposed else [])
        # the cluster's members reach each other on the link (vLLM's master port, Gloo and NCCL sockets)
        + ([" ".join(entry["address"] for entry in member["members"])] if member else []),
        "directives": directives(extra or {}) + (CLUSTER_DIRECTIVES if member else []),
        "timeout_start_s": int(inputs["start_timeout"]) + START_TIMEOUT_MARGIN_S,
        "argv": argv,
        "exec_start": profiles.systemd_exec_args(argv),
        "env": env,
        "environment": environment(env),
        "env_file": env_file,
        "memory": limits,
        "probe_host": serving_state.probe_host(inputs["host"]),
        # a cluster's worker serves no API: nothing to poll (the head's health covers the pair)
        "health_url": ""
        if member.get("role") == "worker"
        else f"{serving_state.base_url(inputs['host'], port)}/health",
        "cluster": member,
        "watch_unit": WATCH_UNIT,
        "watch": watch(member, unit, libexec, inputs["host"], port, str(inputs["served_model_name"]), env_file),
        "state": state,
        "errors": errors,
    }
