"""What a host serves, as its ``/etc/sparkfleet/state.json`` records it: the schema, and what follows.

The vllm_service role writes the file at every deploy (the keys of SCHEMA, sorted, no timestamps, so a
converged host rewrites nothing); the unit's start adds ``startup``
(files/bin/sparkfleet-record-startup); a rollback puts back the last good copy. Everything that asks
what a host serves reads it through ``from_slurp``: the health, bench, tune, serve and rollback plays
(the ``sparkfleet_state`` filter). Derived once, here: the address a
local probe uses for the bind address, the probe URL, and the revision of each served model.
"""

from __future__ import annotations

import base64
import json
from typing import Any

STATE_FILE = "state.json"

# key -> (type, required): what the vllm_service role writes. Optional: keys a record from an earlier
# sparkfleet may lack (a rollback can return to one), and the unit's last start (startup).
SCHEMA: dict[str, tuple[type, bool]] = {
    "profile": (str, True),
    "unit": (str, True),
    "model_path": (str, True),
    "served_model_name": (str, True),
    "host": (str, True),
    "port": (int, True),
    "profile_spec": (dict, False),
    "host_lock": (str, False),
    "secrets_file": (str, False),
    "vllm_version": (str, False),
    "patchset_id": (str, False),
    "venv": (str, False),
    "drafter_path": (str, False),
    "model_revisions": (dict, False),
    "startup": (dict, False),
    "cluster": (dict, False),
}

# bind addresses that mean "every address": a probe on the host itself asks loopback
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def unit_name(profile: str) -> str:
    """The systemd unit that serves ``profile``."""
    return f"sparkfleet-vllm-{profile}.service"


class StateError(ValueError):
    """A state.json that is not what the vllm_service role writes."""


def probe_host(bind: str) -> str:
    """The address a probe on the host uses for a server bound to ``bind``."""
    return "127.0.0.1" if str(bind) in WILDCARD_BINDS else str(bind)


def base_url(host: str, port: int | str) -> str:
    """``http://host:port`` for a probe on the host (IPv6 in brackets)."""
    address = probe_host(host)
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def _port(value: Any) -> Any:
    """A port as an int (older records and some templating give it as digits)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def check(state: Any, where: str) -> dict[str, Any]:
    """The state, checked against SCHEMA (port made an int); StateError names the key and the fix."""
    fix = "deploy the host again (make deploy LIMIT=<host>) to rewrite it"
    if not isinstance(state, dict):
        raise StateError(f"{where}: {STATE_FILE} holds {type(state).__name__}, not an object; {fix}")
    state = {**state, "port": _port(state.get("port"))}
    for key, (kind, required) in SCHEMA.items():
        if key not in state:
            if required:
                raise StateError(f"{where}: {STATE_FILE} has no {key!r}; {fix}")
            continue
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise StateError(f"{where}: {STATE_FILE} {key} is {value!r}, not a {kind.__name__}; {fix}")
    return state


def parse(text: str | bytes, where: str) -> dict[str, Any]:
    """A state.json's text, checked (StateError for bad JSON or a bad key)."""
    try:
        state = json.loads(text)
    except ValueError as error:
        raise StateError(f"{where}: {STATE_FILE} is not JSON ({error}); deploy the host again") from error
    return check(state, where)


def revision_of(state: dict[str, Any], path_key: str) -> str:
    """The revision of the model served from ``state[path_key]`` (its directory's name keys
    model_revisions); '' for no such model."""
    path = str(state.get(path_key) or "").rstrip("/")
    if not path:
        return ""
    return str((state.get("model_revisions") or {}).get(path.rsplit("/", 1)[-1], ""))


def view(state: dict[str, Any]) -> dict[str, Any]:
    """The state with what plays derive from it: ``probe`` (host, port, url) and ``revisions`` (model,
    drafter)."""
    return {
        **state,
        "probe": {
            "host": probe_host(state["host"]),
            "port": state["port"],
            "url": base_url(state["host"], state["port"]),
        },
        "revisions": {"model": revision_of(state, "model_path"), "drafter": revision_of(state, "drafter_path")},
    }


def from_slurp(result: dict[str, Any], where: str) -> dict[str, Any]:
    """``view`` of the state in an Ansible slurp result; {} when the file was not there (not deployed)."""
    if not isinstance(result, dict) or "content" not in result:
        return {}
    return view(parse(base64.b64decode(result["content"]), where))


# Kept by the unit's own starts (and views of the record), not planned.
UNPLANNED = ("startup", "probe", "revisions")


def drift(planned: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """Where the host's record differs from its plan's (``service.state``), one "key: served X, planned Y"
    line per key, by key (the start-up figures aside)."""
    return [
        f"{key}: served {_short(served.get(key))}, planned {_short(planned.get(key))}"
        for key in sorted(set(planned) | set(served))
        if key not in UNPLANNED and planned.get(key) != served.get(key)
    ]


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
