"""What one host serves, computed once per host per run: its serving plan.

Built on the controller from the host's inventory variables (``build``), by the ``sparkfleet_plan``
lookup at the start of the deploy, switch, rolling and tune plays (playbooks/tasks/resolve-profile.yml),
which keeps it as the host fact ``sparkfleet_plan``. Every later step reads its parts: the preflight
(disk and memory needs, the KV check's models), model_cache (``model_cache``), vllm_wheel (the wheel
manifest), vllm_service (profile, venv, model paths and revisions; the unit's command line and
environment come from them through sparkfleet.serving.profiles.vllm_argv and service_env), the health gate and
the rollback (``unit``).

Keys: ``profile`` (resolved, sparkfleet.serving.profiles.resolve_from), ``unit``, ``errors`` (flags known to
break the model, and models missing or not pinned; a play refuses the host when there is one),
``models`` (sparkfleet_models with the inventory's pins over them), ``target`` and ``drafter`` (their
entries; {} for none), ``drafter_key``, ``model_cache`` (model_cache's list), ``models_dir``,
``model_path`` and ``drafter_path`` (on the host), ``model_revisions`` ({name: revision}, 'local' for
a model without one), ``wheel_manifest`` (its path on the controller) and ``wheel`` (its content; {}
before `make wheel`), ``venv``, ``vllm_version``, ``patchset_id``, ``disk_gib`` (the weights' size),
``api`` (``api`` below: where the server listens and how a probe on the host reaches it).

The unit's own values (its ExecStart, environment, memory limits, state record) are worked out from
these parts by sparkfleet.serving.service_unit.spec, which the vllm_service role calls once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparkfleet.serving import model_pins, profiles, serving_state

# The inventory variables a plan reads besides the profile layers (profiles.LAYER_VARIABLES).
VARIABLES = (
    "sparkfleet_profiles_builtin",
    "sparkfleet_profiles_site",
    *profiles.LAYER_VARIABLES,
    "sparkfleet_models",
    model_pins.PINS_VARIABLE,
    "sparkfleet_refused_serve_args",
    "sparkfleet_state_dir",
    "sparkfleet_root",
    "sparkfleet_wheel_dir",
    "sparkfleet_vllm_flavor",
    "sparkfleet_api_host",
    "sparkfleet_api_port",
    "sparkfleet_served_model_name",
    "sparkfleet_api_key",
)


class PlanError(ValueError):
    """Inventory variables a plan cannot be built from."""


def from_lookup(
    lookup: str,
    terms: list[Any],
    variables: Mapping[str, Any] | None,
    names: tuple[str, ...],
    template: Callable[[Any], Any],
    build: Callable[[dict[str, Any], str], Any],
) -> list[Any]:
    """What the sparkfleet_plan and sparkfleet_profile lookups do: one profile name, the variables in
    ``names`` templated (``template``: the lookup's templar), ``build`` over them. Raises PlanError or
    profiles.ProfileError with one line."""
    if len(terms) != 1:
        raise PlanError(f"{lookup} takes one profile name, got {terms!r}")
    known = {name: template(variables[name]) for name in names if name in (variables or {})}
    if "sparkfleet_profiles_builtin" not in known:
        raise PlanError("sparkfleet_profiles_builtin is not defined: is inventory/group_vars/all linked?")
    return [build(known, str(terms[0]))]


def read_manifest(path: str) -> dict[str, Any]:
    """The wheel manifest `make wheel` wrote; {} when there is none yet (the wheel role says what to run)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return {}
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise PlanError(f"{path} is not JSON ({error}); run make wheel again") from error
    return manifest if isinstance(manifest, dict) else {}


def api(variables: Mapping[str, Any]) -> dict[str, Any]:
    """Where the server listens (``host``, ``port``), the model name clients ask for, the address and
    URLs a probe on the host uses, and how it authenticates: ``auth`` is the header a client sends,
    with the key's place named, never the key (``{}`` when the API has no key)."""
    for key in ("sparkfleet_api_host", "sparkfleet_api_port", "sparkfleet_served_model_name"):
        if variables.get(key) in (None, ""):
            raise PlanError(f"{key} is not set: is inventory/group_vars/all linked into this inventory?")
    host, port = str(variables["sparkfleet_api_host"]), str(variables["sparkfleet_api_port"])
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise PlanError(f"sparkfleet_api_port {port!r} is not a TCP port: give a number from 1 to 65535")
    port = int(port)
    url = serving_state.base_url(host, port)
    return {
        "host": host,
        "port": port,
        "served_model_name": str(variables["sparkfleet_served_model_name"]),
        "probe_host": serving_state.probe_host(host),
        "url": url,
        "health_url": f"{url}/health",
        "auth": {"header": "Authorization", "scheme": "Bearer", "key": "sparkfleet_api_key"}
        if variables.get("sparkfleet_api_key")
        else {},
    }


def build(variables: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The serving plan of profile ``name`` with the inventory ``variables`` of one host.

    Raises profiles.ProfileError for an unknown profile or a bad layer, PlanError for a missing setting."""
    for key in ("sparkfleet_state_dir", "sparkfleet_root", "sparkfleet_wheel_dir", "sparkfleet_vllm_flavor"):
        if not variables.get(key):
            raise PlanError(f"{key} is not set: is inventory/group_vars/all linked into this inventory?")
    resolved = profiles.resolve_from(variables, name)
    models = model_pins.apply_pins(variables.get("sparkfleet_models") or {}, variables.get(model_pins.PINS_VARIABLE))
    target_key = str(resolved["target"])
    drafter_key = str(resolved.get("drafter") or "")
    target = dict(models.get(target_key) or {})
    drafter = dict(models.get(drafter_key) or {}) if drafter_key else {}
    models_dir = f"{variables['sparkfleet_state_dir']}/models"
    manifest_path = f"{variables['sparkfleet_wheel_dir']}/{variables['sparkfleet_vllm_flavor']}-current.json"
    wheel = read_manifest(manifest_path)
    revisions = {target_key: target.get("revision", "local")}
    if drafter_key:
        revisions[drafter_key] = drafter.get("revision", "local")
    return {
        "profile": resolved,
        "unit": serving_state.unit_name(name),
        "errors": profiles.errors(resolved, variables.get("sparkfleet_refused_serve_args"))
        + profiles.model_errors(resolved, models),
        "models": models,
        "target": target,
        "drafter_key": drafter_key,
        "drafter": drafter,
        "model_cache": profiles.model_cache_entries(resolved, models),
        "models_dir": models_dir,
        "model_path": f"{models_dir}/{target_key}",
        "drafter_path": f"{models_dir}/{drafter_key}" if drafter_key else "",
        "model_revisions": revisions,
        "wheel_manifest": manifest_path,
        "wheel": wheel,
        "venv": f"{variables['sparkfleet_root']}/venvs/vllm-{wheel.get('version', 'unknown')}",
        "vllm_version": str(wheel.get("version", "")),
        "patchset_id": str(wheel.get("patchset_id", "")),
        "disk_gib": (target.get("size_gib") or 0) + (drafter.get("size_gib") or 0),
        "api": api(variables),
    }
