"""The schema of a serving profile and of the serve-argument layers under it.

Every key of every layer is checked: the profile's own keys, its ``speculative`` config (against
vLLM 0.23's SpeculativeConfig fields), its ``serve_args`` and each layer of flags over it (against
vLLM 0.23's own serve parser, read into sparkfleet/serving/data by sparkfleet.serving.vllm_schema), its ``env``, its
``patches`` (against the patch series), ``health``, ``baselines`` and ``reference_startup``. An unknown
key is refused with the nearest valid one; each problem is one line that names the profile, the key
path and the fix.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from sparkfleet.build import wheel_build
from sparkfleet.serving import cluster, startup, vllm_schema

# Flags sparkfleet renders itself from other settings; a profile setting them would be a second value.
OWNED_FLAGS = {
    "model": "the profile's target (a key of sparkfleet_models)",
    "served-model-name": "sparkfleet_served_model_name",
    "host": "sparkfleet_api_host",
    "port": "sparkfleet_api_port",
    "api-key": "sparkfleet_api_key (kept out of argv; Ansible Vault)",
    "speculative-config": "the profile's speculative: mapping (and drafter:)",
    **cluster.OWNED_FLAGS,
}
# SpeculativeConfig fields sparkfleet fills in.
OWNED_SPECULATIVE = {"model": "the profile's drafter (a key of sparkfleet_models)"}

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER = (int, float)


def _nearest(key: str, valid: list[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(sorted(valid))}"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, NUMBER) and not isinstance(value, bool)


@functools.cache
def patch_names() -> list[str]:
    """The patch names a profile may list: the main series' patches without their NNNN- prefix."""
    series = wheel_build.load_series(wheel_build.DEFAULT_MAIN_SERIES)
    return [re.sub(r"^\d{4}-", "", patch.name) for patch in series.patches]


def _of_mapping(check: Callable[[str, Mapping[str, Any]], list[str]]) -> Callable[[str, Any], list[str]]:
    """``check`` for a value that must be a mapping: anything else is its one problem."""

    @functools.wraps(check)
    def checked(where: str, value: Any) -> list[str]:
        if not isinstance(value, Mapping):
            return [f"{where} must be a mapping, got {_type_name(value)} {value!r}"]
        return check(where, value)

    return checked


@_of_mapping
def serve_arg_problems(where: str, args: Any) -> list[str]:
    """Problems of one layer of serve arguments ({flag: value}); ``where`` names the layer."""
    flags = vllm_schema.load()["serve_flags"]
    found: list[str] = []
    for flag, value in args.items():
        flag = str(flag)
        at = f"{where}.{flag}"
        if flag.startswith("--") or "_" in flag:
            found.append(
                f"{at}: write the flag as vLLM's long option without dashes, e.g. {flag.lstrip('-').replace('_', '-')}"
            )
            continue
        if flag in OWNED_FLAGS:
            found.append(f"{at}: sparkfleet sets --{flag} itself: use {OWNED_FLAGS[flag]}")
            continue
        if flag not in flags:
            found.append(f"{at}: not a `vllm serve` flag of vLLM {vllm_schema.VLLM_VERSION}: {_nearest(flag, flags)}")
            continue
        if value is None:
            continue  # drops the flag a lower layer set
        spec = flags[flag]
        kind = spec["kind"]
        if kind == "bool":
            if not isinstance(value, bool):
                found.append(f"{at}: --{flag} is on/off: write true, false or null, not {value!r}")
        elif kind == "true":
            if value is not True:
                found.append(f"{at}: --{flag} has no --no-{flag}: write true, or null to leave it off, not {value!r}")
        elif isinstance(value, bool):
            found.append(f"{at}: --{flag} takes a value ({spec['type']}), not {value!r}")
        elif kind == "list" and isinstance(value, list):
            continue
        elif isinstance(value, (Mapping, list)) and spec["type"] != "json":
            found.append(f"{at}: --{flag} takes one {spec['type']}, not a {_type_name(value)}")
        elif spec["type"] == "int" and not (
            isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit())
        ):
            found.append(f"{at}: --{flag} takes an integer, not {value!r}")
        elif spec["type"] == "float" and not _parses_float(value):  # bools and containers were refused above
            found.append(f"{at}: --{flag} takes a number, not {value!r}")
        elif "choices" in spec and str(value) not in spec["choices"]:
            found.append(f"{at}: {value!r} is not one of {', '.join(spec['choices'])}")
    return found


def _parses_float(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def speculative_problems(where: str, spec: Any) -> list[str]:
    return [] if spec is None else _speculative_problems(where, spec)


@_of_mapping
def _speculative_problems(where: str, spec: Mapping[str, Any]) -> list[str]:
    fields = vllm_schema.load()["speculative"]
    valid = {name for name, field in fields.items() if not field.get("internal")} - set(OWNED_SPECULATIVE)
    found: list[str] = []
    for key, value in spec.items():
        at = f"{where}.{key}"
        if key in OWNED_SPECULATIVE:
            found.append(f"{at}: sparkfleet sets it: use {OWNED_SPECULATIVE[key]}")
            continue
        if key not in valid:
            found.append(
                f"{at}: not a speculative-config key of vLLM {vllm_schema.VLLM_VERSION}: {_nearest(key, valid)}"
            )
            continue
        if value is None:
            continue
        field = fields[key]
        types = set(field["types"])
        ok = (
            (isinstance(value, bool) and "bool" in types)
            or (not isinstance(value, bool) and isinstance(value, int) and "int" in types)
            or (isinstance(value, float) and "float" in types)
            or (isinstance(value, str) and "str" in types)
            or (isinstance(value, list) and "list" in types)
            or (isinstance(value, Mapping) and "object" in types)
        )
        if not ok:
            found.append(f"{at}: takes {' or '.join(sorted(types - {'null'}))}, not {_type_name(value)} {value!r}")
        elif "choices" in field and str(value) not in field["choices"]:
            found.append(f"{at}: {value!r} is not one of {', '.join(field['choices'])}")
        else:
            for bound, test, text in (("gt", lambda v, b: v > b, ">"), ("ge", lambda v, b: v >= b, ">=")):
                if bound in field and _is_number(value) and not test(value, field[bound]):
                    found.append(f"{at}: must be {text} {field[bound]}, got {value!r}")
    if "method" not in spec:
        found.append(f"{where}: needs method (e.g. dflash)")
    return found


@_of_mapping
def _numbers(where: str, value: Any) -> list[str]:
    return [f"{where}.{k}: must be a number, got {v!r}" for k, v in value.items() if not _is_number(v)]


HEALTH_KEYS = ["min_acceptance_length", "tool_call_expect_name"]


@_of_mapping
def _health(where: str, value: Any) -> list[str]:
    found = []
    for key, item in value.items():
        at = f"{where}.{key}"
        if key == "min_acceptance_length":
            if not _is_number(item) or item < 0:
                found.append(f"{at}: must be a number >= 0 (0 turns the check off), got {item!r}")
        elif key == "tool_call_expect_name":
            if not isinstance(item, str):
                found.append(f"{at}: must be a tool name or '' (no tool-call check), got {item!r}")
        else:
            found.append(f"{at}: not a health key: {_nearest(key, HEALTH_KEYS)}")
    return found


@_of_mapping
def env_problems(where: str, value: Any) -> list[str]:
    found = []
    for key, item in value.items():
        if not ENV_NAME.fullmatch(str(key)):
            found.append(f"{where}.{key}: not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        elif isinstance(item, (Mapping, list)):
            found.append(f"{where}.{key}: must be a string, number or null, got a {_type_name(item)}")
    return found


def _patches(where: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        return [f"{where} must be a list of patch names, got {_type_name(value)} {value!r}"]
    names = patch_names()
    return [
        f"{where}: {item!r} is not a patch of the vllm-{vllm_schema.VLLM_VERSION} series: {_nearest(str(item), names)}"
        for item in value
        if item not in names
    ]


def _text(where: str, value: Any, nullable: bool = False) -> list[str]:
    if isinstance(value, str) and value or (nullable and value in (None, "")):
        return []
    return [f"{where} must be {'a model key or null' if nullable else 'a non-empty string'}, got {value!r}"]


def _memory(where: str, value: Any) -> list[str]:
    if _is_number(value) and value > 0:
        return []
    return [f"{where} must be a number of GiB > 0, got {value!r}"]


PROFILE_KEYS = {
    "summary": lambda w, v: _text(w, v),
    "target": lambda w, v: _text(w, v),
    "drafter": lambda w, v: _text(w, v, nullable=True),
    "speculative": speculative_problems,
    "serve_args": serve_arg_problems,
    "env": env_problems,
    "patches": _patches,
    "required_memory_gib": _memory,
    "health": _health,
    "baselines": _numbers,
    "baselines_quick": _numbers,
    "reference_startup": startup.reference_problems,
    "cluster": cluster.profile_problems,
}


def profile_problems(name: str, spec: Mapping[str, Any]) -> list[str]:
    """One line per problem of profile ``name`` (its own keys; not the layers over it)."""
    found = []
    for key, value in spec.items():
        where = f"profile {name!r}: {key}"
        check = PROFILE_KEYS.get(key)
        if check is None:
            found.append(f"{where}: not a profile key: {_nearest(str(key), PROFILE_KEYS)}")
        else:
            found += check(where, value)
    return found
