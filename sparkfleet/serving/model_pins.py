"""Pin a profile's hub models in one command: a branch or tag resolved to its full commit, no weights.

``sparkfleet weights pin PROFILE --inventory INV [--ref main]`` (``make pin PROFILE=… INVENTORY=…``)
asks the hub (``HfApi.model_info``) which commit ``--ref`` names for every model the profile serves —
target, drafter, and a built checkpoint's base and donor — and writes only those commits into the
inventory's own file ``group_vars/all/60-model-pins.yml`` as ``sparkfleet_model_revisions``, layered
over the shared ``sparkfleet_models`` (no copy of that dict). For the drafter it fetches only the
revision's ``config.json`` (a few KB, cached by revision) and prints its KV geometry, and where the
target's config is on the hub too it runs the KV planner for the profile: a drafter vLLM 0.23 would
refuse after loading the weights is refused here, before anything is written. A gated repo takes the
token as the seed cache does (``--token-file``, else HF_TOKEN); it is never printed. A model already
pinned keeps its commit (the run says when ``--ref`` has moved past it; ``--update`` moves the pin), so
re-running with nothing new prints "already pinned" and changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PINS_FILE = Path("group_vars/all/60-model-pins.yml")
PINS_VARIABLE = "sparkfleet_model_revisions"
FULL_REVISION_LENGTH = 40
BUILD_PARTS = ("base", "donor")


class PinError(Exception):
    """A model that cannot be pinned: one line naming it and the fix."""


def apply_pins(models: Mapping[str, Any], pins: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``sparkfleet_models`` with the inventory's pins over it: ``NAME`` sets NAME's revision,
    ``NAME.base`` / ``NAME.donor`` a build input's. A pin for a model that is not there is ignored
    (it is for another profile's models, or left over). Without pins the models are returned as they
    are; with pins only the pinned entries are copied (shallowly: Ansible hands its lazily templated
    containers in, which must not be deep-copied)."""
    if not pins:
        return models
    merged = dict(models or {})
    for key, revision in pins.items():
        name, _dot, part = str(key).partition(".")
        entry = merged.get(name)
        if not isinstance(entry, Mapping):
            continue
        entry = dict(entry)
        if not part:
            entry["revision"] = revision
        elif part in BUILD_PARTS and isinstance(entry.get(part), Mapping):
            entry[part] = {**entry[part], "revision": revision}
        merged[name] = entry
    return merged


@dataclass(frozen=True)
class HubModel:
    """One thing to pin: its key in sparkfleet_model_revisions, the repo, its role in the profile."""

    key: str
    repo: str
    role: str  # target | drafter | base of <name> | donor of <name>


def hub_models(resolved: Mapping[str, Any], models: Mapping[str, Any]) -> tuple[list[HubModel], list[str]]:
    """(the profile's hub models, notes on the ones with nothing to pin)."""
    found: list[HubModel] = []
    notes: list[str] = []
    for role in ("target", "drafter"):
        name = resolved.get(role)
        if not name:
            continue
        entry = models.get(name)
        if not isinstance(entry, Mapping):
            raise PinError(
                f"profile {resolved.get('name')!r} serves {role} {name!r}, which is not in sparkfleet_models: add it "
                "there (repo, or path, or build)"
            )
        if "repo" in entry:
            found.append(HubModel(name, str(entry["repo"]), role))
        elif "build" in entry:
            for part in BUILD_PARTS:
                spec = entry.get(part)
                if isinstance(spec, Mapping) and "repo" in spec:
                    found.append(HubModel(f"{name}.{part}", str(spec["repo"]), f"{part} of {name}"))
        else:
            notes.append(f"{name}: a local directory ({entry.get('path')}), nothing to pin")
    return found, notes


def _hub_error(model: HubModel, ref: str, error: Exception) -> PinError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"sparkfleet_models.{model.key.split('.')[0]}"
    if isinstance(error, GatedRepoError):
        return PinError(
            f"{model.key}: {model.repo} is gated and the hub refused this token (or none was given): accept the "
            "model's terms on the hub, then pass a token with access (HF_TOKEN, or --token-file)"
        )
    if isinstance(error, RevisionNotFoundError):
        return PinError(
            f"{model.key}: {model.repo} has no branch, tag or commit {ref!r}: give one that exists (--ref REF; "
            "the repo's page lists its branches and tags)"
        )
    if isinstance(error, RepositoryNotFoundError):
        return PinError(
            f"{model.key}: repo {model.repo!r} not found on the hub (or private without a token): fix {where}"
            f"{'.' + model.key.split('.')[1] if '.' in model.key else ''}.repo, or pass a token with access"
        )
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return PinError(f"{model.key}: the hub refused {model.repo}@{ref}: {first}")


def resolve_commit(api: Any, model: HubModel, ref: str) -> str:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = api.model_info(model.repo, revision=ref)
    except HfHubHTTPError as error:
        raise _hub_error(model, ref, error) from error
    except httpx.HTTPError as error:
        raise PinError(
            f"{model.key}: cannot reach the hub at {api.endpoint} ({error}); check HF_ENDPOINT and the network"
        ) from error
    sha = str(info.sha or "")
    if len(sha) != FULL_REVISION_LENGTH:
        raise PinError(f"{model.key}: the hub answered {model.repo}@{ref} with commit {sha!r}, not a full commit")
    return sha


def fetch_config(model: HubModel, sha: str, cache_dir: Path, endpoint: str | None, token: str | None) -> dict:
    """The revision's config.json only (cached under cache_dir by revision)."""
    return json.loads(config_path(model, sha, cache_dir, endpoint, token).read_text(encoding="utf-8"))


def config_path(model: HubModel, sha: str, cache_dir: Path, endpoint: str | None, token: str | None) -> Path:
    """Where the revision's config.json is on the controller, fetched (alone) if it is not cached yet."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        path = hf_hub_download(
            model.repo, "config.json", revision=sha, cache_dir=str(cache_dir), endpoint=endpoint, token=token
        )
    except HfHubHTTPError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PinError(
            f"{model.key}: {model.repo}@{sha[:12]} has no readable config.json ({first}); a gated repo needs a "
            "token with access (HF_TOKEN, or --token-file)"
        ) from error
    return Path(path)


def drafter_geometry(config: Mapping[str, Any]) -> str:
    from sparkfleet.serving import kv_page_plan

    drafter = kv_page_plan.read_drafter(dict(config))
    attention = drafter.attention
    window = drafter.sliding_window if drafter.sliding_window else "none"
    return (
        f"{attention.num_kv_heads} KV heads, head dim {attention.head_size}, {attention.num_layers} layers, "
        f"sliding window {window}"
    )


def pinned_revision(models: Mapping[str, Any], key: str) -> str | None:
    """The full commit ``key`` (NAME or NAME.base/.donor) is pinned at in ``models``, else None."""
    name, _dot, part = key.partition(".")
    entry = models.get(name) or {}
    spec = entry.get(part) if part else entry
    revision = spec.get("revision") if isinstance(spec, Mapping) else None
    if (
        isinstance(revision, str)
        and len(revision) == FULL_REVISION_LENGTH
        and all(c in "0123456789abcdef" for c in revision)
    ):
        return revision
    return None


def read_pins(inventory: Path) -> dict[str, str]:
    path = inventory / PINS_FILE
    if not path.is_file():
        return {}
    from sparkfleet.serving.profiles import load_yaml

    data = load_yaml(path) or {}
    pins = data.get(PINS_VARIABLE) if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in (pins or {}).items()}


def write_pins(inventory: Path, pins: Mapping[str, str]) -> Path:
    path = inventory / PINS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        "---\n# Written by `sparkfleet weights pin` (make pin): the commit each hub model is served at, layered\n"
        "# over the shared sparkfleet_models. Re-run make pin to move them; edit by hand if you must.\n"
        + yaml.safe_dump({PINS_VARIABLE: dict(sorted(pins.items()))}, sort_keys=False, default_flow_style=False)
    )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _read_token(token_file: Path | None) -> str | None:
    if token_file is None:
        return None  # huggingface_hub reads HF_TOKEN itself
    try:
        return token_file.read_text().strip() or None
    except OSError as error:
        raise PinError(f"{token_file}: cannot read the token file ({error.strerror})") from error


def pin(
    inventory: Path,
    profile: str,
    ref: str,
    endpoint: str | None,
    token: str | None,
    cache_dir: Path,
    out: Any = None,
    update: bool = False,
) -> int:
    """Resolve, check and write the pins; 0 when pinned (or already), raises PinError otherwise."""
    out = out or sys.stdout
    from huggingface_hub import HfApi

    from sparkfleet.serving import kv_page_plan, profiles

    gv = profiles.inventory_profiles(inventory)
    resolved = profiles.resolve_from(gv, profile)
    current = read_pins(inventory)
    models = apply_pins(gv.get("sparkfleet_models") or {}, gv.get(PINS_VARIABLE))
    wanted, notes = hub_models(resolved, models)
    for note in notes:
        print(f"pin: {note}", file=out)
    if not wanted:
        print(f"pin: profile {profile!r} serves no hub model: nothing to pin", file=out)
        return 0
    api = HfApi(endpoint=endpoint, token=token)
    at_ref = {model.key: resolve_commit(api, model, ref) for model in wanted}
    commits: dict[str, str] = {}
    lines: dict[str, str] = {}
    for model in wanted:
        pinned = pinned_revision(models, model.key)
        if pinned and not update:
            commits[model.key] = pinned
            moved = "" if pinned == at_ref[model.key] else f"; {ref} is now {at_ref[model.key]} (--update moves it)"
            lines[model.key] = f"pin: {model.key} ({model.role}): {model.repo} kept at {pinned}{moved}"
        else:
            commits[model.key] = at_ref[model.key]
            was = f" (was {pinned})" if pinned and pinned != at_ref[model.key] else ""
            lines[model.key] = f"pin: {model.key} ({model.role}): {model.repo} {ref} -> {at_ref[model.key]}{was}"
    configs: dict[str, dict] = {}
    for model in wanted:
        if model.role in ("target", "drafter"):
            configs[model.role] = fetch_config(model, commits[model.key], cache_dir, endpoint, token)
    for model in wanted:
        line = lines[model.key]
        if model.role == "drafter":
            line += f"; KV geometry: {drafter_geometry(configs['drafter'])}"
        print(line, file=out)
    if "target" in configs and "drafter" in configs:
        spec = resolved.get("speculative") or {}
        result = kv_page_plan.plan(
            configs["target"],
            configs["drafter"],
            int(spec.get("num_speculative_tokens", 0) or 0),
            "kv-page-size-unify" in (resolved.get("patches") or []),
            drafter_label=f"{resolved['drafter']}@{commits[resolved['drafter']][:12]}",
            platform="cuda",
            **kv_page_plan.serving_options(resolved.get("serve_args")),
        )
        if not result.ok:
            raise PinError(
                f"profile {profile!r}: vLLM 0.23 would refuse this drafter after loading the weights "
                f"({result.failure_stage}: {result.reason}); pin another drafter revision (--ref) or change the "
                "profile's num_speculative_tokens; nothing was written"
            )
        print(f"pin: KV plan for {profile}: {result.reason}", file=out)
    # only what the shared layer does not already say goes into the inventory's file
    shared = gv.get("sparkfleet_models") or {}
    new = dict(current)
    new.update({key: sha for key, sha in commits.items() if key in current or pinned_revision(shared, key) != sha})
    if new == current:
        print(f"pin: {inventory}: already pinned, nothing changed", file=out)
        return 0
    path = write_pins(inventory, new)
    print(f"pin: wrote {len(commits)} revision(s) to {path}", file=out)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return pin(
            Path(args.inventory),
            args.profile,
            args.ref,
            args.endpoint,
            _read_token(args.token_file),
            Path(args.cache_dir),
            update=args.update,
        )
    except PinError as error:
        print(f"sparkfleet: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # profile errors (unknown profile, bad YAML) are one line too
        from sparkfleet.serving.kv_page_plan import KVPlanInputError
        from sparkfleet.serving.profiles import ProfileError

        if isinstance(error, ProfileError | KVPlanInputError):
            print(f"sparkfleet: {error}", file=sys.stderr)
            return 2
        raise


def run_config(args: argparse.Namespace) -> int:
    try:
        if len(args.revision) != FULL_REVISION_LENGTH:
            raise PinError(f"{args.repo}: revision {args.revision!r} is not a full 40-hex commit: pin it (make pin)")
        model = HubModel(args.repo, args.repo, "model")
        print(config_path(model, args.revision, Path(args.cache_dir), args.endpoint, _read_token(args.token_file)))
    except PinError as error:
        print(f"sparkfleet: {error}", file=sys.stderr)
        return 2
    return 0


def run_reach(args: argparse.Namespace) -> int:
    """One JSON line: whether the controller reaches the hub (any HTTP answer about the repo counts)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=args.endpoint)
    try:
        api.model_info(args.repo, revision=args.revision)
        answer = {"ok": True, "value": f"{api.endpoint} answers ({args.repo}@{args.revision[:12]} found)"}
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", "?")
        answer = {"ok": True, "value": f"{api.endpoint} answers (HTTP {status} for {args.repo})"}
    except (httpx.HTTPError, OSError) as error:
        answer = {"ok": False, "value": f"{api.endpoint} unreachable ({type(error).__name__}: {error})"}
    print(json.dumps(answer))
    return 0


def add_parser(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "pin", help="resolve a profile's hub models from a branch or tag to full commits into the inventory"
    )
    parser.add_argument("profile", help="the serving profile whose models to pin, e.g. dflash")
    parser.add_argument("--inventory", required=True, help="the inventory directory (its own file is written)")
    parser.add_argument("--ref", default="main", help="branch, tag or commit to resolve (default main)")
    parser.add_argument("--update", action="store_true", help="move models already pinned to --ref's commit too")
    parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None, help="hub URL (HF_ENDPOINT)")
    parser.add_argument("--token-file", type=Path, help="read a hub token from this (private) file (else HF_TOKEN)")
    parser.add_argument(
        "--cache-dir", default="build/hub-configs", help="where the pinned config.json files are cached"
    )
    parser.set_defaults(func=run)

    config = actions.add_parser(
        "config", help="fetch only a pinned revision's config.json to the controller (cached); print its path"
    )
    config.add_argument("--repo", required=True)
    config.add_argument("--revision", required=True, help="a full 40-hex commit")
    config.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None, help="hub URL (HF_ENDPOINT)")
    config.add_argument("--token-file", type=Path, help="read a hub token from this (private) file (else HF_TOKEN)")
    config.add_argument("--cache-dir", default="build/hub-configs", help="where config.json files are cached")
    config.set_defaults(func=run_config)

    reach = actions.add_parser("reach", help="say (JSON) whether this machine reaches the hub, for make doctor")
    reach.add_argument("--repo", required=True)
    reach.add_argument("--revision", default="main")
    reach.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None, help="hub URL (HF_ENDPOINT)")
    reach.set_defaults(func=run_reach)
