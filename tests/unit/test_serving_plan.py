"""sparkfleet.serving.serving_plan: what one host serves, computed once from its inventory variables (the
sparkfleet_plan lookup runs it at the start of every serving play; test_profile_models drives the lookup
through ansible-playbook)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.serving import profiles, serving_plan
from tests.unit.test_profile_models import pinned_models

ROOT = Path(__file__).resolve().parents[2]


def inventory(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """group_vars/all as a host sees it, with pinned models and this test's wheel directory."""
    variables: dict[str, Any] = {}
    for name in ("profiles.yml", "sparkfleet.yml"):
        variables.update(yaml.safe_load((ROOT / "inventory/group_vars/all" / name).read_text()))
    variables.update(sparkfleet_models=pinned_models(), sparkfleet_wheel_dir=str(tmp_path / "wheels"))
    variables.update(overrides)
    return variables


def test_a_speculative_profile_plans_its_unit_models_paths_and_revisions(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    manifest = {"version": "0.23.0+sf1abc", "patchset_id": "sf1-abc", "cuda": "13.0"}
    (tmp_path / "wheels" / "gpu-current.json").write_text(json.dumps(manifest))
    variables = inventory(tmp_path, sparkfleet_tuned={"dflash": {"num_speculative_tokens": 9}})
    plan = serving_plan.build(variables, "dflash")
    resolved = profiles.resolve_from(variables, "dflash")
    assert plan["profile"] == resolved and resolved["speculative"]["num_speculative_tokens"] == 9
    assert plan["unit"] == "sparkfleet-vllm-dflash.service" and plan["errors"] == []
    target, drafter = resolved["target"], resolved["drafter"]
    models = pinned_models()
    assert plan["target"] == models[target] and plan["drafter"] == models[drafter] and plan["drafter_key"] == drafter
    assert plan["model_path"] == f"/var/lib/sparkfleet/models/{target}"
    assert plan["drafter_path"] == f"/var/lib/sparkfleet/models/{drafter}"
    assert plan["model_revisions"] == {target: models[target]["revision"], drafter: models[drafter]["revision"]}
    assert plan["model_cache"] == profiles.model_cache_entries(resolved, models)
    assert plan["wheel"] == manifest and plan["venv"] == "/opt/sparkfleet/venvs/vllm-0.23.0+sf1abc"
    assert (plan["vllm_version"], plan["patchset_id"]) == ("0.23.0+sf1abc", "sf1-abc")
    assert plan["disk_gib"] == pytest.approx(models[target]["size_gib"] + models[drafter]["size_gib"])


def test_a_profile_without_drafter_and_before_make_wheel(tmp_path: Path) -> None:
    plan = serving_plan.build(inventory(tmp_path), "base")
    assert plan["drafter"] == {} and plan["drafter_key"] == "" and plan["drafter_path"] == ""
    assert list(plan["model_revisions"]) == [plan["profile"]["target"]]
    assert plan["wheel"] == {} and plan["venv"] == "/opt/sparkfleet/venvs/vllm-unknown"
    assert plan["vllm_version"] == "" and plan["wheel_manifest"] == f"{tmp_path}/wheels/gpu-current.json"


def test_unpinned_weights_are_errors_the_play_refuses(tmp_path: Path) -> None:
    plan = serving_plan.build(inventory(tmp_path, sparkfleet_models={}), "dense")
    assert plan["errors"] and all("model" in error for error in plan["errors"])


def test_bad_input_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(profiles.ProfileError, match="unknown profile 'turbo': valid profiles are"):
        serving_plan.build(inventory(tmp_path), "turbo")
    with pytest.raises(serving_plan.PlanError, match="sparkfleet_state_dir is not set"):
        serving_plan.build(inventory(tmp_path, sparkfleet_state_dir=""), "dense")
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "gpu-current.json").write_text("{broken")
    with pytest.raises(serving_plan.PlanError, match=r"gpu-current.json is not JSON .*run make wheel again"):
        serving_plan.build(inventory(tmp_path), "dense")


@pytest.mark.parametrize(
    ("bind", "port", "probe", "url"),
    [
        ("127.0.0.1", 8000, "127.0.0.1", "http://127.0.0.1:8000"),
        ("0.0.0.0", "8123", "127.0.0.1", "http://127.0.0.1:8123"),
        ("::", 8000, "127.0.0.1", "http://127.0.0.1:8000"),
        ("fd00::5", 9000, "fd00::5", "http://[fd00::5]:9000"),
    ],
)
def test_the_plan_says_where_a_probe_on_the_host_reaches_the_api(
    tmp_path: Path, bind: str, port: Any, probe: str, url: str
) -> None:
    api = serving_plan.build(inventory(tmp_path, sparkfleet_api_host=bind, sparkfleet_api_port=port), "dense")["api"]
    assert api == {
        "host": bind,
        "port": int(port),
        "served_model_name": "qwen",
        "probe_host": probe,
        "url": url,
        "health_url": f"{url}/health",
        "auth": {},
    }


def test_the_plan_names_how_a_client_authenticates_but_never_holds_the_key(tmp_path: Path) -> None:
    secret = "sk-plan-test-0123456789"
    plan = serving_plan.build(inventory(tmp_path, sparkfleet_api_key=secret), "dflash")
    assert plan["api"]["auth"] == {"header": "Authorization", "scheme": "Bearer", "key": "sparkfleet_api_key"}
    assert secret not in json.dumps(plan)


@pytest.mark.parametrize("port", ["http", "0", "70000", "-1"])
def test_a_bad_api_port_is_one_line_naming_it(tmp_path: Path, port: str) -> None:
    with pytest.raises(serving_plan.PlanError, match=rf"sparkfleet_api_port '{port}' is not a TCP port: give a number"):
        serving_plan.build(inventory(tmp_path, sparkfleet_api_port=port), "dense")


def test_both_lookups_take_one_profile_name_and_need_the_shared_group_vars(tmp_path: Path) -> None:
    def fail(**_: Any) -> None:
        raise AssertionError("build must not run")

    for terms in ([], ["dense", "base"]):
        with pytest.raises(serving_plan.PlanError, match=r"sparkfleet_plan takes one profile name, got \["):
            serving_plan.from_lookup("sparkfleet_plan", terms, {}, serving_plan.VARIABLES, str, fail)
    with pytest.raises(serving_plan.PlanError, match="sparkfleet_profiles_builtin is not defined: is inventory/group_"):
        serving_plan.from_lookup("sparkfleet_profile", ["dense"], None, serving_plan.VARIABLES, str, fail)
    variables = inventory(tmp_path)
    (plan,) = serving_plan.from_lookup(
        "sparkfleet_plan",
        ["dense"],
        {**variables, "unrelated": 1},
        serving_plan.VARIABLES,
        lambda v: v,
        serving_plan.build,
    )
    assert plan == serving_plan.build(variables, "dense")
