"""A profile's weights: what the model_cache role is handed, and the pins checked before anything changes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from sparkfleet.serving import profiles
from tests.unit.helpers import (
    ROOT,
    link_shared_group_vars,
    needs_ansible_playbook,
    run_playbook,
    run_sparkfleet,
    write_hosts,
    write_play,
)

SHARED = yaml.safe_load((ROOT / "inventory/group_vars/all/profiles.yml").read_text())
MODELS = SHARED["sparkfleet_models"]
DRAFTER_PIN = "6c7242c934a9870d7c59c05240bdbb2467cc1394"
PIN = "0123456789abcdef0123456789abcdef01234567"


def resolve(name: str) -> dict:
    return profiles.resolve(
        profiles.all_profiles(SHARED["sparkfleet_profiles_builtin"], None),
        name,
        SHARED["sparkfleet_serve_args_common"],
        SHARED["sparkfleet_env_common"],
    )


def pinned_models() -> dict:
    return {key: dict(entry, revision=entry["revision"] or PIN) for key, entry in MODELS.items()}


def test_hub_entries_reach_model_cache_with_repo_and_revision() -> None:
    entries = profiles.model_cache_entries(resolve("dense"), pinned_models())
    assert entries == [
        {"name": "hybrid-int4-fp8", "repo": MODELS["hybrid-int4-fp8"]["repo"], "revision": PIN},
        {"name": "dflash-drafter", "repo": MODELS["dflash-drafter"]["repo"], "revision": DRAFTER_PIN},
    ]
    # size_gib is the preflight's, not a model_cache option (its argument spec would refuse it)
    assert all("size_gib" not in entry for entry in entries)
    assert [e["name"] for e in profiles.model_cache_entries(resolve("base"), pinned_models())] == ["intel-int4"]


def test_build_and_local_entries_pass_through() -> None:
    models = {
        "hybrid-int4-fp8": {
            "build": "hybrid-fp8",
            "base": {"repo": "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "revision": PIN},
            "donor": {"repo": "Qwen/Qwen3.5-122B-A10B-FP8", "revision": PIN},
            "size_gib": 67,
        },
        "dflash-drafter": {"path": "/srv/models/drafter", "size_gib": 1.6},
    }
    entries = profiles.model_cache_entries(resolve("dense"), models)
    assert entries[0] == {
        "name": "hybrid-int4-fp8",
        **{k: v for k, v in models["hybrid-int4-fp8"].items() if k != "size_gib"},
    }
    assert entries[1] == {"name": "dflash-drafter", "path": "/srv/models/drafter"}
    assert profiles.model_errors(resolve("dense"), models) == []


@pytest.mark.parametrize(
    ("revision", "shown"),
    [("", "'(empty)'"), ("main", "'main'"), ("6c7242c", "'6c7242c'"), (PIN.upper(), repr(PIN.upper()))],
)
def test_a_revision_that_can_move_is_refused_with_the_fix(revision: str, shown: str) -> None:
    models = pinned_models()
    models["hybrid-int4-fp8"]["revision"] = revision
    (error,) = profiles.model_errors(resolve("dense"), models)
    assert error.startswith("model 'hybrid-int4-fp8': bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid revision " + shown)
    assert "sparkfleet_models.hybrid-int4-fp8.revision: the full 40-hex commit" in error


def test_missing_ambiguous_and_unpinned_build_models_are_named() -> None:
    dense = resolve("dense")
    models = pinned_models()
    del models["dflash-drafter"]
    assert profiles.model_errors(dense, models) == [
        "profile 'dense' serves model 'dflash-drafter', which is not in sparkfleet_models: add it there "
        "(path, or repo and revision, or build)"
    ]
    models = pinned_models()
    models["dflash-drafter"]["path"] = "/srv/drafter"
    (error,) = profiles.model_errors(dense, models)
    assert "model 'dflash-drafter': give exactly one of path" in error and "['path', 'repo']" in error
    models = pinned_models()
    models["hybrid-int4-fp8"] = {"build": "hybrid-fp8", "base": {"repo": "Intel/x", "revision": "main"}}
    (error,) = profiles.model_errors(dense, models)
    assert "base Intel/x revision 'main'" in error and "sparkfleet_models.hybrid-int4-fp8.base.revision" in error


def test_profile_check_cli_refuses_unpinned_weights_one_line_each(tmp_path: Path) -> None:
    def check(inventory: Path) -> subprocess.CompletedProcess:
        return run_sparkfleet("profile", "check", "dense", "--inventory", inventory)

    refused = check(ROOT / "inventory/example")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "'hybrid-int4-fp8'" in lines[0] and "full 40-hex commit" in lines[0]
    inventory = site_inventory(tmp_path, {"sparkfleet_models": pinned_models()})
    accepted = check(inventory)
    assert accepted.returncode == 0, accepted.stderr


def site_inventory(tmp_path: Path, site: dict, host_vars: dict | None = None) -> Path:
    """An inventory of this machine (local connection) with the shared group_vars and ``site`` over them,
    and ``host_vars`` on its one host."""
    inventory = link_shared_group_vars(tmp_path / "inventory", site)
    write_hosts(inventory, **(host_vars or {}))
    return inventory


def run_resolve(
    tmp_path: Path,
    site: dict,
    host_vars: dict | None = None,
    keep: str = "sparkfleet_plan.model_cache",
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the deploy playbooks' resolve-profile.yml on this machine; the fact ``keep`` (the model_cache
    list) lands in a file."""
    inventory = site_inventory(tmp_path, site, host_vars)
    out = tmp_path / "model_cache_models.json"
    tasks = [
        {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/resolve-profile.yml")},
        {
            "name": "Keep what model_cache gets",
            "ansible.builtin.copy": {"content": "{{ " + keep + " | to_json }}", "dest": str(out)},
        },
    ]
    play = write_play(tmp_path / "play.yml", tasks)
    return run_playbook(inventory / "hosts.yml", play, *extra, timeout=180), out


@needs_ansible_playbook
def test_a_play_resolves_the_profile_with_every_inventory_layer_of_its_host(tmp_path: Path) -> None:
    """The sparkfleet_profile lookup reads every layer (sparkfleet.serving.profiles.LAYER_VARIABLES) from the host's
    variables, extra vars included, as sparkfleet.serving.profiles.resolve_from does."""
    site = {
        "sparkfleet_profile": "dflash",
        "sparkfleet_models": pinned_models(),
        "sparkfleet_serve_args_common": {"max-num-seqs": 3},
    }
    host_vars = {
        "sparkfleet_serve_args_host": {"gpu-memory-utilization": 0.7},
        "sparkfleet_tuned": {"dflash": {"num_speculative_tokens": 9, "measured": "test"}},
    }
    extra = ("-e", '{"sparkfleet_env_platform": {"SPARKFLEET_TEST_LAYER": "extra"}}')
    proc, out = run_resolve(tmp_path / "layers", site, host_vars, keep="sparkfleet_plan.profile", extra=extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resolved = json.loads(out.read_text())
    variables = {**SHARED, **yaml.safe_load((ROOT / "inventory/group_vars/all/sparkfleet.yml").read_text())}
    variables.update(site, **host_vars, sparkfleet_env_platform={"SPARKFLEET_TEST_LAYER": "extra"})
    assert resolved == json.loads(json.dumps(profiles.resolve_from(variables, "dflash")))
    assert resolved["serve_args"]["max-num-seqs"] == 3 and resolved["serve_args"]["gpu-memory-utilization"] == 0.7
    assert resolved["speculative"]["num_speculative_tokens"] == 9
    assert resolved["env"]["SPARKFLEET_TEST_LAYER"] == "extra"

    unknown, _ = run_resolve(tmp_path / "unknown", {**site, "sparkfleet_profile": "turbo"})
    assert unknown.returncode != 0 and "unknown profile 'turbo': valid profiles are" in unknown.stdout


@needs_ansible_playbook
def test_the_play_plans_the_whole_unit_once_and_tune_plans_its_candidates_through_the_lookup(tmp_path: Path) -> None:
    """resolve-profile.yml's plan holds the unit vllm_service renders (sparkfleet_plan.service), with the
    inventory's unit settings; tune's candidates come from the same lookup with speculative_tokens."""
    site = {"sparkfleet_models": pinned_models(), "vllm_service_memory_max": "64G"}
    keep = (
        "{'service': sparkfleet_plan.service, "
        "'candidate': lookup('sparkfleet_plan', 'dflash', speculative_tokens=5).service.state.profile_spec}"
    )
    proc, out = run_resolve(tmp_path / "plan", site, keep=keep, extra=("-e", "sparkfleet_api_port=8124"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = json.loads(out.read_text())
    service = kept["service"]
    assert service["errors"] == [] and service["unit"] == "sparkfleet-vllm-dflash.service"
    assert service["memory"]["max_bytes"] == 64 * 2**30 and service["argv"][1] == str(64 * 2**30)
    assert service["argv"][service["argv"].index("--port") + 1] == "8124"
    assert kept["candidate"]["speculative"]["num_speculative_tokens"] == 5


@needs_ansible_playbook
def test_deploy_refuses_unpinned_weights_before_any_change_and_hands_pins_to_model_cache(tmp_path: Path) -> None:
    refused, out = run_resolve(tmp_path / "unpinned", {"sparkfleet_profile": "dense"})
    assert refused.returncode != 0
    assert "Refuse this host's profile if it breaks the model or its weights are not pinned" in refused.stdout
    assert "model 'hybrid-int4-fp8': bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid revision '(empty)'" in refused.stdout
    assert not out.exists(), "nothing after the refusal may run"

    accepted, out = run_resolve(
        tmp_path / "pinned", {"sparkfleet_profile": "dense", "sparkfleet_models": pinned_models()}
    )
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert json.loads(out.read_text()) == profiles.model_cache_entries(resolve("dense"), pinned_models())


@needs_ansible_playbook
@pytest.mark.parametrize("pinned", [False, True])
def test_templated_model_entries_resolve_with_and_without_pins(tmp_path: Path, pinned: bool) -> None:
    """Ansible hands the pins filter its lazily templated containers (a path built from another variable,
    as the sandbox's): they resolve with no pins file and with one."""
    site = {
        "sparkfleet_profile": "dense",
        "sparkfleet_models": {
            **pinned_models(),
            "dflash-drafter": {"path": "{{ sparkfleet_build_dir }}/models/drafter", "size_gib": 1},
            "hybrid-int4-fp8": {"repo": MODELS["hybrid-int4-fp8"]["repo"], "revision": "" if pinned else PIN},
        },
    }
    if pinned:
        site["sparkfleet_model_revisions"] = {"hybrid-int4-fp8": PIN, "dflash-drafter": "f" * 40}
    proc, out = run_resolve(tmp_path, site)
    assert proc.returncode == 0, proc.stdout[-3000:]
    entries = {e["name"]: e for e in json.loads(out.read_text())}
    assert entries["hybrid-int4-fp8"]["revision"] == PIN
    assert entries["dflash-drafter"]["path"].endswith("/build/models/drafter"), entries
    assert "{{" not in entries["dflash-drafter"]["path"]


@pytest.mark.parametrize(
    ("serve_args", "required", "message"),
    [
        # one Spark: the 67 GiB target and the 1.6 GiB drafter must fit in what the profile asks for
        ({}, 60, "required_memory_gib 60 is below one node's share of its weights, 68.6 GiB "
         "(hybrid-int4-fp8 67 GiB + dflash-drafter 1.6 GiB): raise required_memory_gib to at least 69"),
        ({}, 68.6, None),
        # two Sparks, tensor parallel: each holds half
        ({"tensor-parallel-size": 2}, 34, "34.3 GiB (hybrid-int4-fp8 67 GiB + dflash-drafter 1.6 GiB split over 2 "
         "nodes (tensor x pipeline parallel size)): raise required_memory_gib to at least 35"),
        ({"tensor-parallel-size": 2}, 35, None),
        ({"pipeline-parallel-size": 2, "tensor-parallel-size": 2}, 18, None),
        ({"pipeline-parallel-size": 2, "tensor-parallel-size": 2}, 17, "17.1 GiB"),
    ],
)  # fmt: skip
def test_required_memory_below_a_nodes_share_of_the_weights_is_refused_naming_the_share(
    serve_args: dict, required: float, message: str | None
) -> None:
    dense = resolve("dense")
    dense["serve_args"].update(serve_args)
    dense["required_memory_gib"] = required
    errors = profiles.model_errors(dense, pinned_models())
    if message is None:
        assert errors == []
    else:
        (error,) = errors
        assert error.startswith("profile 'dense': required_memory_gib ") and message in error, error


def test_every_shipped_profile_asks_for_at_least_its_weights() -> None:
    """A single-node profile holds all its weights; a cluster profile one node's share on the smallest
    cluster (two)."""
    from sparkfleet.serving import cluster

    for name in SHARED["sparkfleet_profiles_builtin"]:
        resolved = resolve(name)
        if resolved.get("cluster"):
            flag = cluster.PARALLEL[resolved["cluster"]["parallel"]]
            resolved = {**resolved, "serve_args": {**resolved["serve_args"], flag: 2}}
        assert profiles.memory_share_error(resolved, MODELS) is None, name


@needs_ansible_playbook
def test_health_and_bench_plan_the_profile_the_host_serves_and_name_what_differs(tmp_path: Path) -> None:
    """playbooks/tasks/plan-served.yml (make health, make bench): the host's state.json names the profile
    it serves; its plan is made with the host's inventory and every difference is one reported line."""
    from sparkfleet.serving import serving_plan

    config = tmp_path / "etc"
    config.mkdir()
    site = {"sparkfleet_models": pinned_models(), "sparkfleet_config_dir": str(config)}
    inventory = site_inventory(tmp_path, site)
    planned = serving_plan.build(
        {**SHARED, **yaml.safe_load((ROOT / "inventory/group_vars/all/sparkfleet.yml").read_text()), **site,
         "sparkfleet_wheel_dir": str(tmp_path / "build" / "wheels")},
        "dense",
    )["service"]["state"]  # fmt: skip
    out = tmp_path / "kept.json"
    keep = "{{ {'unit': sparkfleet_plan.unit, 'drift': __served_drift} | to_json }}"
    play = write_play(
        tmp_path / "play.yml",
        [
            {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/plan-served.yml")},
            {"ansible.builtin.copy": {"content": keep, "dest": str(out)}},
        ],
    )

    def run(state: dict) -> tuple[subprocess.CompletedProcess, dict]:
        (config / "state.json").write_text(json.dumps(state))
        out.unlink(missing_ok=True)
        proc = run_playbook(inventory / "hosts.yml", play, timeout=180)
        return proc, json.loads(out.read_text()) if out.exists() else {}

    proc, kept = run({**planned, "startup": {"ready_s": 12.0}})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        kept == {"unit": "sparkfleet-vllm-dense.service", "drift": []}
        and "spark-x serves dense as planned" in proc.stdout
    )
    proc, kept = run({**planned, "port": 8001, "venv": "/opt/sparkfleet/venvs/vllm-old"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert kept["drift"] == [
        "port: served 8001, planned 8000",
        f"venv: served /opt/sparkfleet/venvs/vllm-old, planned {planned['venv']}",
    ]
    proc, kept = run({**planned, "profile": "turbo", "unit": "sparkfleet-vllm-turbo.service"})
    assert proc.returncode != 0 and not kept
    assert "spark-x serves profile turbo, which this inventory does not define" in " ".join(proc.stdout.split())
