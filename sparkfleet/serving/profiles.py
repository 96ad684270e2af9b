"""Serving profiles: merge, resolve, check, and render them into a `vllm serve` command line.

A profile is data (``inventory/group_vars/all/profiles.yml``). The same functions back the Ansible
filters in ``filter_plugins/sparkfleet_filters.py`` and the ``sparkfleet profile`` command, which the
Makefile uses to refuse an unknown PROFILE before anything runs.

Layering of serve arguments, later wins: ``sparkfleet_serve_args_common`` (the recipe's defaults)
→ the profile's ``serve_args`` → ``sparkfleet_serve_args_platform`` (e.g. the sandbox's CPU flags)
→ ``sparkfleet_serve_args_host`` (one host's own tweaks, from its host_vars).
A ``None`` value drops a flag that a lower layer set. Last, ``sparkfleet_tuned.<profile>`` (what
`make tune` measured best on this host, in its host_vars) sets the speculative
``num_speculative_tokens``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from sparkfleet.serving import profile_schema

PROFILE_KEYS_REQUIRED = ("target", "serve_args")


class ProfileError(ValueError):
    """A profile is unknown or invalid; the message is one line that names the value and the fix."""


def plain(value: Any) -> Any:
    """A deep copy made of plain dicts and lists.

    Ansible 2.19 hands filters lazy containers that template a value on every access; a
    ``copy.deepcopy`` of one copies its templating context too and took ~18 s per profile on the
    sandbox. Reading each value once into plain containers is the copy, and it is cheap.
    """
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge: dicts merge key by key, anything else in ``over`` replaces ``base``."""
    out: dict[str, Any] = plain(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = plain(value)
    return out


def all_profiles(builtin: Mapping[str, Any], site: Mapping[str, Any] | None) -> dict[str, Any]:
    """The built-in profiles with the inventory's additions; a site value of null removes a profile."""
    merged = merge(builtin, site or {})
    return {name: spec for name, spec in merged.items() if spec is not None}


def get_profile(profiles: Mapping[str, Any], name: str) -> dict[str, Any]:
    if name not in profiles:
        valid = ", ".join(sorted(profiles))
        raise ProfileError(
            f"unknown profile {name!r}: valid profiles are {valid} "
            "(add your own under sparkfleet_profiles_site in your inventory)"
        )
    spec = profiles[name]
    if not isinstance(spec, Mapping):
        raise ProfileError(f"profile {name!r} must be a mapping, got {type(spec).__name__}")
    missing = [key for key in PROFILE_KEYS_REQUIRED if key not in spec]
    if missing:
        raise ProfileError(f"profile {name!r} lacks {', '.join(missing)}: add it under sparkfleet_profiles_site")
    return dict(spec)


def resolve(
    profiles: Mapping[str, Any],
    name: str,
    serve_args_common: Mapping[str, Any] | None = None,
    env_common: Mapping[str, Any] | None = None,
    serve_args_platform: Mapping[str, Any] | None = None,
    env_platform: Mapping[str, Any] | None = None,
    serve_args_host: Mapping[str, Any] | None = None,
    tuned: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The profile ``name`` with its serve arguments and environment fully layered.

    Returns a copy of the profile with ``name``, ``serve_args`` (flags with ``None`` removed) and
    ``env`` (all values as strings); ``tuned`` (the host's ``sparkfleet_tuned``) sets the speculative
    ``num_speculative_tokens`` of the profile it names.
    """
    spec = get_profile(profiles, name)
    problems = profile_schema.profile_problems(name, spec)
    for layer_name, layer in (
        ("sparkfleet_serve_args_common", serve_args_common),
        ("sparkfleet_serve_args_platform", serve_args_platform),
        ("sparkfleet_serve_args_host", serve_args_host),
    ):
        problems += profile_schema.serve_arg_problems(layer_name, layer or {})
    for layer_name, layer in (("sparkfleet_env_common", env_common), ("sparkfleet_env_platform", env_platform)):
        problems += profile_schema.env_problems(layer_name, layer or {})
    problems += tuned_problems(name, spec, tuned)
    if problems:
        raise ProfileError("; ".join(problems))
    args: dict[str, Any] = {}
    for layer in (serve_args_common, spec.get("serve_args"), serve_args_platform, serve_args_host):
        args.update(layer or {})
    env: dict[str, Any] = {}
    for layer in (env_common, spec.get("env"), env_platform):
        env.update(layer or {})
    resolved = plain(spec)
    resolved["name"] = name
    resolved["serve_args"] = {flag: value for flag, value in args.items() if value is not None}
    resolved["env"] = {key: str(value) for key, value in env.items() if value is not None}
    tuning = (tuned or {}).get(name)
    if tuning:
        resolved = with_speculative_tokens(resolved, tuning["num_speculative_tokens"])
    return resolved


# The inventory variables a profile's layers come from, in resolve()'s order after the profile's name.
LAYER_VARIABLES = (
    "sparkfleet_serve_args_common",
    "sparkfleet_env_common",
    "sparkfleet_serve_args_platform",
    "sparkfleet_env_platform",
    "sparkfleet_serve_args_host",
    "sparkfleet_tuned",
)


def resolve_from(variables: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``resolve`` with every layer read from inventory ``variables`` (a host's, or group_vars/all):
    the one way a profile is resolved, by plays (the sparkfleet_profile lookup) and by the CLI."""
    profiles = all_profiles(variables["sparkfleet_profiles_builtin"], variables.get("sparkfleet_profiles_site"))
    return resolve(profiles, name, *(variables.get(layer) for layer in LAYER_VARIABLES))


def with_speculative_tokens(resolved: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The resolved profile drafting ``n`` tokens per step instead of its own number.

    Its health gate's ``min_acceptance_length`` is set for its own n; what it asks of the drafter is the
    accepted tokens per drafted position, (length - 1) / n, so that share is kept: a gate of 6.0 at n=12
    asks 3.5 at n=6 and 12 at... no more than n + 1 can be accepted in a step.
    """
    out = plain(resolved)
    speculative = out.get("speculative")
    if not isinstance(speculative, Mapping) or not speculative.get("num_speculative_tokens"):
        raise ProfileError(
            f"profile {out.get('name', '?')!r} does not speculate: it has no num_speculative_tokens to set"
        )
    own = int(speculative["num_speculative_tokens"])
    out["speculative"] = {**speculative, "num_speculative_tokens": int(n)}
    health = out.get("health")
    if isinstance(health, Mapping) and health.get("min_acceptance_length"):
        per_position = (float(health["min_acceptance_length"]) - 1.0) / own
        out["health"] = {**health, "min_acceptance_length": round(1.0 + per_position * int(n), 3)}
    return out


# The most num_speculative_tokens a tune tries or a host's sparkfleet_tuned may set: vLLM takes any
# positive n; past this a drafter's later positions accept next to nothing.
MAX_SPECULATIVE_TOKENS = 32
TUNED_HINT = (
    "re-run make tune PROFILE={name} WORKLOAD=... for this host, or delete sparkfleet_tuned.{name} from its host_vars"
)


def tuned_problems(name: str, spec: Mapping[str, Any], tuned: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with the host's ``sparkfleet_tuned`` entry for profile ``name`` (empty: fine or none)."""
    if tuned is None:
        return []
    if not isinstance(tuned, Mapping):
        return [f"sparkfleet_tuned is {tuned!r}, not a mapping of profile -> tuning: fix it in the host's host_vars"]
    tuning = tuned.get(name)
    if tuning is None:
        return []
    where = f"sparkfleet_tuned.{name}"
    hint = TUNED_HINT.format(name=name)
    if not isinstance(tuning, Mapping) or "num_speculative_tokens" not in tuning:
        return [f"{where} is {tuning!r}; it needs num_speculative_tokens: {hint}"]
    n = tuning["num_speculative_tokens"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
        return [
            f"{where}.num_speculative_tokens is {n!r}, not a whole number from 1 to {MAX_SPECULATIVE_TOKENS}: {hint}"
        ]
    if not isinstance(spec.get("speculative"), Mapping):
        return [f"{where} tunes num_speculative_tokens, but profile {name!r} does not speculate: {hint}"]
    return []


def errors(resolved: Mapping[str, Any], refused: list[Mapping[str, Any]] | None) -> list[str]:
    """Flags known to break this model, one message per hit (empty when the profile is fine)."""
    found: list[str] = []
    name = resolved.get("name", "?")
    args = resolved.get("serve_args") or {}
    for rule in refused or []:
        flag = rule["flag"]
        if flag not in args:
            continue
        value = args[flag]
        if "at_or_above" in rule:
            try:
                if float(value) < float(rule["at_or_above"]):
                    continue
            except (TypeError, ValueError):
                found.append(f"profile {name!r}: --{flag} {value!r} is not a number")
                continue
            found.append(f"profile {name!r}: --{flag} {value} refused (>= {rule['at_or_above']}): {rule['reason']}")
        else:
            found.append(f"profile {name!r}: --{flag} refused: {rule['reason']}")
    spec = resolved.get("speculative")
    if spec is not None and not resolved.get("drafter") and spec.get("method") in {"dflash", "eagle", "eagle3"}:
        found.append(f"profile {name!r}: speculative method {spec.get('method')!r} needs a drafter: set drafter")
    return found


# Keys of a sparkfleet_models entry that the model_cache role takes (the others, e.g. size_gib, are
# the preflight's); a hub revision or a build input must be a full commit.
MODEL_CACHE_KEYS = ("path", "repo", "revision", "allow_patterns", "build", "base", "donor", "error_report")
FULL_REVISION = re.compile(r"[0-9a-f]{40}")
PIN_HINT = (
    "pin it in your inventory: make pin PROFILE=<profile> INVENTORY=<inventory> resolves it from a branch, or set "
    "sparkfleet_models.{key}.revision: the full 40-hex commit (a branch, tag or short sha can move)"
)


def profile_models(resolved: Mapping[str, Any]) -> list[str]:
    """The sparkfleet_models keys a resolved profile serves: its target, then its drafter if any."""
    return [key for key in (resolved.get("target"), resolved.get("drafter")) if key]


def model_cache_entries(resolved: Mapping[str, Any], models: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The profile's models as the model_cache role takes them ({name, path} / {name, repo, revision, ...}
    / {name, build, base, donor}); models missing from ``models`` are left out (model_errors names them)."""
    entries = []
    for key in profile_models(resolved):
        entry = models.get(key)
        if not isinstance(entry, Mapping):
            continue
        entries.append({"name": key, **{k: plain(entry[k]) for k in MODEL_CACHE_KEYS if k in entry}})
    return entries


def _revision_error(name: str, what: str, revision: Any, key: str) -> str | None:
    """None for a full commit, else the refusal; ``key`` is where the pin goes under sparkfleet_models."""
    if isinstance(revision, str) and FULL_REVISION.fullmatch(revision):
        return None
    return f"model {name!r}: {what} revision {revision if revision else '(empty)'!r} is not a full 40-hex commit: " + (
        PIN_HINT.format(key=key)
    )


def model_errors(resolved: Mapping[str, Any], models: Mapping[str, Any]) -> list[str]:
    """One message per model of the profile that cannot be fetched as pinned (empty when all are)."""
    found: list[str] = []
    profile = resolved.get("name", "?")
    for key in profile_models(resolved):
        entry = models.get(key)
        if not isinstance(entry, Mapping):
            found.append(
                f"profile {profile!r} serves model {key!r}, which is not in sparkfleet_models: add it there "
                "(path, or repo and revision, or build)"
            )
            continue
        kinds = [kind for kind in ("path", "repo", "build") if kind in entry]
        if len(kinds) != 1:
            found.append(
                f"model {key!r}: give exactly one of path (a local directory), repo and revision (a hub repo) or "
                f"build (a checkpoint built on the seed), not {kinds or 'none'}"
            )
        elif kinds == ["repo"]:
            error = _revision_error(key, str(entry["repo"]), entry.get("revision"), key)
            if error:
                found.append(error)
        elif kinds == ["build"]:
            for part in ("base", "donor"):
                spec = entry.get(part)
                if spec is None and part == "donor":
                    continue
                if not isinstance(spec, Mapping) or "repo" not in spec:
                    found.append(f"model {key!r}: build needs {part}: {{repo, revision}}")
                    continue
                error = _revision_error(key, f"{part} {spec['repo']}", spec.get("revision"), f"{key}.{part}")
                if error:
                    found.append(error)
    share = memory_share_error(resolved, models)
    return found + ([share] if share else [])


def parallel_nodes(serve_args: Mapping[str, Any]) -> int:
    """How many GPUs (one per Spark) the profile's weights are split over: tensor x pipeline parallel size."""
    nodes = 1
    for flag in ("tensor-parallel-size", "pipeline-parallel-size"):
        value = serve_args.get(flag)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            nodes *= value
    return nodes


def memory_share_error(resolved: Mapping[str, Any], models: Mapping[str, Any]) -> str | None:
    """A profile whose ``required_memory_gib`` is below one node's share of its weights (the models'
    ``size_gib`` split over its tensor x pipeline parallel size) would pass the memory preflight on a
    host that cannot hold them: say so, naming the share."""
    required = resolved.get("required_memory_gib")
    if not isinstance(required, int | float) or isinstance(required, bool):
        return None
    sizes = {}
    for key in profile_models(resolved):
        entry = models.get(key)
        size = entry.get("size_gib") if isinstance(entry, Mapping) else None
        if isinstance(size, int | float) and not isinstance(size, bool):
            sizes[key] = size
    nodes = parallel_nodes(resolved.get("serve_args") or {})
    share = sum(sizes.values()) / nodes
    if required >= share:
        return None
    weights = " + ".join(f"{key} {size:g} GiB" for key, size in sizes.items())
    split = f" split over {nodes} nodes (tensor x pipeline parallel size)" if nodes > 1 else ""
    return (
        f"profile {resolved.get('name', '?')!r}: required_memory_gib {required:g} is below one node's share of its "
        f"weights, {share:.1f} GiB ({weights}{split}): raise required_memory_gib to at least {math.ceil(share)}"
    )


def serve_argv(serve_args: Mapping[str, Any]) -> list[str]:
    """Render serve arguments into argv: True → --flag, False → --no-flag, else --flag value."""
    argv: list[str] = []
    for flag, value in serve_args.items():
        if value is None:
            continue
        opt = f"--{flag}"
        if value is True:
            argv.append(opt)
        elif value is False:
            argv.append(f"--no-{flag}")
        elif isinstance(value, (dict, list)):
            argv += [opt, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        else:
            argv += [opt, str(value)]
    return argv


_SYSTEMD_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,+@")


def systemd_quote(arg: str) -> str:
    """Quote one argument for a unit file's ExecStart= line (systemd.syntax: quotes, backslash
    escapes, and %-specifiers doubled; `$` doubled so it is not an environment expansion)."""
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if escaped and set(escaped) <= _SYSTEMD_PLAIN:
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_exec_args(argv: list[str]) -> str:
    """An argv list as one ExecStart= value."""
    return " ".join(systemd_quote(str(arg)) for arg in argv)


def speculative_config(resolved: Mapping[str, Any], drafter_path: str | None) -> str | None:
    """The JSON for ``--speculative-config``, with the drafter's local path, or None."""
    spec = resolved.get("speculative")
    if not spec:
        return None
    config = {key: value for key, value in spec.items() if value is not None}
    if drafter_path:
        config["model"] = drafter_path
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


def vllm_argv(
    resolved: Mapping[str, Any],
    *,
    venv: str,
    model_path: str,
    drafter_path: str | None,
    served_model_name: str,
    host: str,
    port: int | str,
) -> list[str]:
    """The `vllm serve` command line the unit runs for the resolved profile (under the memory guard)."""
    spec = speculative_config(resolved, drafter_path)
    return [
        f"{venv}/bin/vllm",
        "serve",
        model_path,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        *serve_argv(resolved.get("serve_args") or {}),
        *(["--speculative-config", spec] if spec else []),
    ]


def service_env(resolved: Mapping[str, Any], *, cache_dir: str, patchset_id: str) -> dict[str, str]:
    """The unit's environment: the profile's, and over it where every cache lives and what is served.

    torch.compile's and Triton's caches default to /tmp and $HOME, which PrivateTmp= empties at every
    start and ProtectHome= hides: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR keep them where a restart
    finds them again. CUDA_CACHE_PATH does the same for the driver's JIT cache: PyPI's aarch64 wheel has
    its FA2 kernels only as sm_80 SASS + compute_80 PTX, which a GB10 compiles at first use (4 GiB, the
    driver's maximum, holds them). The server never reaches the hub (HF_HUB_OFFLINE: weights are verified
    and cached before it starts)."""
    return {
        **(resolved.get("env") or {}),
        "HF_HOME": f"{cache_dir}/hf",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": f"{cache_dir}/vllm",
        "XDG_CACHE_HOME": f"{cache_dir}/xdg",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache_dir}/inductor",
        "TRITON_CACHE_DIR": f"{cache_dir}/triton",
        "CUDA_CACHE_PATH": f"{cache_dir}/nv",
        "CUDA_CACHE_MAXSIZE": "4294967296",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "SPARKFLEET_PROFILE": str(resolved["name"]),
        "SPARKFLEET_PATCHSET": patchset_id,
    }


# -- reading an inventory the way Ansible does, for the Makefile's early check ------------------


def load_yaml(path: Path) -> Any:
    """A YAML file's data; a syntax error is one ProfileError line naming file, line and column."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ProfileError(f"{where}: YAML syntax error: {what}: fix the file (or restore it from git)") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: YAML error: {exc}".replace("\n", " ")) from None


def load_group_vars_all(inventory: Path) -> dict[str, Any]:
    """Variables of group ``all`` in an inventory directory: its group_vars/all.yml or
    group_vars/all/*.yml in name order (symlinks followed), later files replacing earlier keys."""
    gv = inventory / "group_vars"
    files: list[Path] = []
    for candidate in (gv / "all.yml", gv / "all.yaml"):
        if candidate.is_file():
            files.append(candidate)
    if (gv / "all").is_dir():
        files += sorted(p for p in (gv / "all").iterdir() if p.suffix in {".yml", ".yaml"} and p.is_file())
    merged: dict[str, Any] = {}
    for path in files:
        data = load_yaml(path) or {}
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: expected a mapping of variables")
        merged.update(data)
    return merged


def inventory_profiles(inventory: Path) -> dict[str, Any]:
    if not inventory.is_dir():
        raise ProfileError(f"inventory {str(inventory)!r} is not a directory: pass INVENTORY=inventory/<name>")
    gv = load_group_vars_all(inventory)
    if "sparkfleet_profiles_builtin" not in gv:
        raise ProfileError(
            f"inventory {str(inventory)!r} does not link the shared group_vars: "
            "ln -s ../../../group_vars/all/profiles.yml group_vars/all/00-profiles.yml (see inventory/example)"
        )
    return gv


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        gv = inventory_profiles(Path(args.inventory))
        resolved = resolve_from(gv, args.name)
    except ProfileError as exc:
        print(f"sparkfleet: {exc}", file=sys.stderr)
        return 2
    from sparkfleet.serving.model_pins import PINS_VARIABLE, apply_pins

    models = apply_pins(gv.get("sparkfleet_models") or {}, gv.get(PINS_VARIABLE))
    problems = errors(resolved, gv.get("sparkfleet_refused_serve_args")) + model_errors(resolved, models)
    for line in problems:
        print(f"sparkfleet: {line}", file=sys.stderr)
    if problems:
        return 2
    if args.vllm_python:
        # The deeper check: vLLM's own parser and SpeculativeConfig's validators, in a vLLM venv.
        spec_json = speculative_config(resolved, "/drafter" if resolved.get("drafter") else None)
        argv = ["/model", *serve_argv(resolved["serve_args"])] + (
            ["--speculative-config", spec_json] if spec_json else []
        )
        root = str(Path(__file__).resolve().parents[2])
        proc = subprocess.run(
            [args.vllm_python, "-m", "sparkfleet.serving.vllm_schema", "--argv", "--", *argv],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in proc.stderr.splitlines() if line.startswith("sparkfleet: ")]
        for line in lines:
            print(f"{line} (profile {args.name!r})", file=sys.stderr)
        if proc.returncode != 0:
            if not lines:
                print(
                    f"sparkfleet: {args.vllm_python} could not check the argv (exit {proc.returncode}): "
                    f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}",
                    file=sys.stderr,
                )
            return 2
    if args.show:
        print(yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    try:
        gv = inventory_profiles(Path(args.inventory))
    except ProfileError as exc:
        print(f"sparkfleet: {exc}", file=sys.stderr)
        return 2
    profiles = all_profiles(gv["sparkfleet_profiles_builtin"], gv.get("sparkfleet_profiles_site"))
    width = max(len(n) for n in profiles)
    for name, spec in profiles.items():
        print(f"{name:<{width}}  {spec.get('summary', '')}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="list and check serving profiles of an inventory")
    sub = parser.add_subparsers(dest="profile_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="refuse an unknown or invalid profile (exit 2, one line)")
    check.add_argument("name")
    check.add_argument("--inventory", default="inventory/sandbox")
    check.add_argument("--show", action="store_true", help="print the resolved profile")
    check.add_argument(
        "--vllm-python",
        metavar="PYTHON",
        help="also parse the rendered argv with vLLM's own parser, with this vLLM venv's python (loads no weights)",
    )
    check.set_defaults(func=_cmd_check)
    lst = sub.add_parser("list", help="the profiles an inventory knows")
    lst.add_argument("--inventory", default="inventory/sandbox")
    lst.set_defaults(func=_cmd_list)
