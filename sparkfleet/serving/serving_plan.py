"""What one host serves, computed once per host per run: its serving plan.

Built on the controller from the host's inventory variables (``build``), by the ``sparkfleet_plan``
lookup at the start of every play that serves or reads a profile (playbooks/tasks/resolve-profile.yml:
deploy, switch, rolling, tune, health, bench, drift), which keeps it as the host fact
``sparkfleet_plan``. Every later step reads its parts: the preflight (disk and memory needs, the KV
check's models), model_cache (``model_cache``), vllm_wheel (the wheel manifest), vllm_service
(``service``: the whole unit), the health gate and the benchmark (``api``, ``profile``), the rollback
(``unit``).

Keys: ``profile`` (resolved, sparkfleet.serving.profiles.resolve_from), ``unit``, ``errors`` (flags known to
break the model, and models missing or not pinned; a play refuses the host when there is one),
``models`` (sparkfleet_models with the inventory's pins over them), ``target`` and ``drafter`` (their
entries; {} for none), ``drafter_key``, ``model_cache`` (model_cache's list), ``models_dir``,
``model_path`` and ``drafter_path`` (on the host), ``model_revisions`` ({name: revision}, 'local' for
a model without one), ``wheel_manifest`` (its path on the controller) and ``wheel`` (its content; {}
before `make wheel`), ``venv``, ``vllm_version``, ``patchset_id``, ``disk_gib`` (the weights' size),
``api`` (``api`` below: where the server listens and how a probe on the host reaches it), and
``service``: the unit as sparkfleet.serving.service_unit.spec works it out from these parts, the
inventory's unit settings and the host's MemTotal (its ExecStart argv, environment, memory limits,
allow-list, health URL and the state.json record; its ``errors`` are unusable unit settings, which
the vllm_service role's preflight refuses). A profile travels from the inventory to ``ExecStart=``
through three files: the inventory's group_vars, this module (with the profiles and service_unit
modules it calls) and the unit template, which renders ``service``'s fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparkfleet.serving import cluster, model_pins, profiles, service_unit, serving_state

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
    "sparkfleet_config_dir",
    "sparkfleet_service_user",
    *service_unit.SETTINGS.values(),
    # the host's MemTotal, when the play gathered facts (vllm_service_memory_max: auto)
    "ansible_facts",
    # a cluster's (sparkfleet.serving.cluster); the lookup adds its members' addresses
    *cluster.VARIABLES,
)


class PlanError(ValueError):
    """Inventory variables a plan cannot be built from."""


def from_lookup(
    lookup: str,
    terms: list[Any],
    variables: Mapping[str, Any] | None,
    names: tuple[str, ...],
    template: Callable[[Any], Any],
    build: Callable[..., Any],
    **options: Any,
) -> list[Any]:
    """What the sparkfleet_plan and sparkfleet_profile lookups do: one profile name, the variables in
    ``names`` templated (``template``: the lookup's templar), ``build`` over them with the lookup's
    ``options``. Raises PlanError or profiles.ProfileError with one line."""
    if len(terms) != 1:
        raise PlanError(f"{lookup} takes one profile name, got {terms!r}")
    known = {name: template(variables[name]) for name in names if name in (variables or {})}
    if "sparkfleet_profiles_builtin" not in known:
        raise PlanError("sparkfleet_profiles_builtin is not defined: is inventory/group_vars/all linked?")
    if known.get("sparkfleet_cluster") and cluster.MEMBERS in names and variables:
        try:
            known[cluster.MEMBERS] = cluster.members_from(
                variables.get("groups") or {},
                variables.get("hostvars") or {},
                str(known["sparkfleet_cluster"]),
                template,
            )
        except cluster.ClusterError as error:
            raise PlanError(str(error)) from error
    return [build(known, str(terms[0]), **options)]


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


def memtotal_mb(variables: Mapping[str, Any]) -> Any:
    """The host's MemTotal in MB from its gathered facts; None when the play gathered none."""
    facts = variables.get("ansible_facts")
    return facts.get("memtotal_mb") if isinstance(facts, Mapping) else None


def service_inputs(variables: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """What sparkfleet.serving.service_unit.spec reads: the plan's parts, the inventory's unit settings
    (service_unit.SETTINGS) and the host's MemTotal."""
    missing = [name for name in service_unit.SETTINGS.values() if name not in variables]
    missing += [name for name in ("sparkfleet_config_dir", "sparkfleet_service_user") if not variables.get(name)]
    if missing:
        raise PlanError(f"{', '.join(missing)} not set: is inventory/group_vars/all linked into this inventory?")
    names = profiles.all_profiles(variables["sparkfleet_profiles_builtin"], variables.get("sparkfleet_profiles_site"))
    api_ = plan["api"]
    return {
        "profile": plan["profile"],
        "other_profiles": sorted(names),
        "venv": plan["venv"],
        "vllm_version": plan["vllm_version"],
        "patchset_id": plan["patchset_id"],
        "model_path": plan["model_path"],
        "drafter_path": plan["drafter_path"],
        "model_revisions": plan["model_revisions"],
        "served_model_name": api_["served_model_name"],
        "host": api_["host"],
        "port": api_["port"],
        "user": variables["sparkfleet_service_user"],
        "state_dir": variables["sparkfleet_state_dir"],
        "cache_dir": f"{variables['sparkfleet_state_dir']}/cache",
        "config_dir": variables["sparkfleet_config_dir"],
        "firewall_unit": service_unit.FIREWALL_UNIT,
        **{key: variables[name] for key, name in service_unit.SETTINGS.items()},
        "memtotal_mb": memtotal_mb(variables),
        "cluster": plan.get("cluster") or {},
    }


def build(variables: Mapping[str, Any], name: str, speculative_tokens: Any = None) -> dict[str, Any]:
    """The serving plan of profile ``name`` with the inventory ``variables`` of one host; with
    ``speculative_tokens``, the profile drafting that many tokens (make tune's candidates).

    Raises profiles.ProfileError for an unknown profile or a bad layer, PlanError for a missing setting."""
    for key in ("sparkfleet_state_dir", "sparkfleet_root", "sparkfleet_wheel_dir", "sparkfleet_vllm_flavor"):
        if not variables.get(key):
            raise PlanError(f"{key} is not set: is inventory/group_vars/all linked into this inventory?")
    resolved = profiles.resolve_from(variables, name)
    if speculative_tokens not in (None, ""):
        if not str(speculative_tokens).isdigit():
            raise PlanError(f"num_speculative_tokens {speculative_tokens!r} is not a whole number: give one such as 8")
        resolved = profiles.with_speculative_tokens(resolved, int(speculative_tokens))
    try:
        cluster_part = cluster.part(variables, resolved)
    except cluster.ClusterError as error:
        raise PlanError(str(error)) from error
    resolved = cluster.apply(resolved, cluster_part)
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
    plan = {
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
        "cluster": cluster_part,
    }
    try:
        plan["service"] = service_unit.spec(service_inputs(variables, plan))
    except (service_unit.SpecError, serving_state.StateError) as error:
        raise PlanError(str(error)) from error
    return plan
