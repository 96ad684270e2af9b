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


def test_the_plan_holds_the_whole_unit_worked_out_from_its_own_parts(tmp_path: Path) -> None:
    from sparkfleet.serving import service_unit

    variables = inventory(
        tmp_path,
        ansible_facts={"memtotal_mb": 65_536},
        sparkfleet_api_port=8123,
        vllm_service_memory_reserve_mib=4096,
        vllm_service_extra_directives={"CPUAffinity": "0-7"},
    )
    plan = serving_plan.build(variables, "dflash")
    service = plan["service"]
    assert service == service_unit.spec(serving_plan.service_inputs(variables, plan))
    # ExecStart: the guard with the inventory's limits, then vllm serve of the plan's venv, weights and API
    vllm = profiles.vllm_argv(
        plan["profile"],
        venv=plan["venv"],
        model_path=plan["model_path"],
        drafter_path=plan["drafter_path"],
        served_model_name="qwen",
        host="127.0.0.1",
        port=8123,
    )
    assert service["argv"] == [
        "/usr/local/libexec/sparkfleet/sparkfleet-memory-guard",
        str((65_536 - 4096) * 2**20),
        str(2048 * 2**20),
        "--",
        *vllm,
    ]
    assert service["unit"] == plan["unit"] and service["health_url"] == plan["api"]["health_url"]
    assert service["directives"] == ["CPUAffinity=0-7"] and service["errors"] == []
    state = service["state"]
    assert (state["profile"], state["venv"], state["model_revisions"]) == (
        "dflash",
        plan["venv"],
        plan["model_revisions"],
    )
    assert set(service["conflicts"]) == {
        f"sparkfleet-vllm-{name}.service" for name in variables["sparkfleet_profiles_builtin"] if name != "dflash"
    }


def test_unusable_unit_settings_stay_the_units_errors_not_the_plans(tmp_path: Path) -> None:
    """Plays that only read a plan (health, bench, doctor) gather no facts: memory "auto" cannot be worked
    out there, and only the vllm_service preflight, which writes the unit, refuses it."""
    plan = serving_plan.build(inventory(tmp_path), "dflash")
    assert plan["errors"] == []
    assert len(plan["service"]["errors"]) == 1 and plan["service"]["errors"][0].startswith(
        "vllm_service_memory_max auto"
    )
    with pytest.raises(
        serving_plan.PlanError, match="vllm_service_devices not set: is inventory/group_vars/all linked"
    ):
        serving_plan.build({k: v for k, v in inventory(tmp_path).items() if k != "vllm_service_devices"}, "dflash")


def test_a_tune_candidate_is_the_plan_with_its_number_of_drafted_tokens(tmp_path: Path) -> None:
    variables = inventory(tmp_path, ansible_facts={"memtotal_mb": 122_880})
    plan = serving_plan.build(variables, "dflash")
    own = plan["profile"]["speculative"]["num_speculative_tokens"]
    for n in (1, 5, own + 3):
        candidate = serving_plan.build(variables, "dflash", speculative_tokens=str(n))
        assert candidate["profile"] == profiles.with_speculative_tokens(plan["profile"], n)
        config = json.loads(
            candidate["service"]["argv"][candidate["service"]["argv"].index("--speculative-config") + 1]
        )
        assert config["num_speculative_tokens"] == n
        assert candidate["service"]["state"]["profile_spec"]["speculative"]["num_speculative_tokens"] == n
    for bad in ("many", "-2", "1.5"):
        with pytest.raises(serving_plan.PlanError, match=rf"num_speculative_tokens '{bad}' is not a whole number"):
            serving_plan.build(variables, "dflash", speculative_tokens=bad)
    with pytest.raises(profiles.ProfileError, match="does not speculate"):
        serving_plan.build(variables, "base", speculative_tokens=4)
