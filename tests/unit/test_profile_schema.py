"""Profiles have a schema: every key of every layer is checked, a typo gets the nearest valid key,
YAML errors name file, line and column, and a refused profile stops the deploy before any change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkfleet.serving import profile_schema, profiles, vllm_schema
from tests.unit.helpers import needs_ansible_playbook
from tests.unit.test_profile_models import pinned_models, run_resolve, site_inventory

ROOT = Path(__file__).resolve().parents[2]
SHARED = yaml.safe_load((ROOT / "inventory/group_vars/all/profiles.yml").read_text())
SANDBOX = yaml.safe_load((ROOT / "inventory/sandbox/group_vars/all/50-sandbox.yml").read_text())
EXAMPLE = yaml.safe_load((ROOT / "inventory/example/group_vars/all/50-site.yml").read_text())


def resolve(name: str, site: dict | None = None, **layers: dict) -> dict:
    return profiles.resolve(
        profiles.all_profiles(SHARED["sparkfleet_profiles_builtin"], site),
        name,
        layers.get("common", SHARED["sparkfleet_serve_args_common"]),
        layers.get("env_common", SHARED["sparkfleet_env_common"]),
        layers.get("platform"),
        layers.get("env_platform"),
        layers.get("host"),
    )


@pytest.mark.parametrize(
    "site",
    [{}, SANDBOX["sparkfleet_profiles_site"], EXAMPLE["sparkfleet_profiles_site"]],
    ids=["shared", "sandbox", "example"],
)
def test_every_shipped_profile_passes_the_schema(site: dict) -> None:
    platform = SANDBOX["sparkfleet_serve_args_platform"] if site is SANDBOX["sparkfleet_profiles_site"] else None
    for name in profiles.all_profiles(SHARED["sparkfleet_profiles_builtin"], site):
        resolve(name, site, platform=platform)  # raises on any problem


# (site over dflash, or a layer, the words the one line must hold)
BAD = {
    "speculative-key-typo": (
        {"speculative": {"num_speculative_token": 8}},
        ["speculative.num_speculative_token", "did you mean num_speculative_tokens?"],
    ),
    "unknown-profile-key": (
        {"serve_argz": {"max-num-seqs": 4}},
        ["serve_argz: not a profile key", "did you mean serve_args?"],
    ),
    "flag-typo": ({"serve_args": {"max-num-seq": 4}}, ["serve_args.max-num-seq", "did you mean max-num-seqs?"]),
    "flag-with-dashes": ({"serve_args": {"--max-num-seqs": 4}}, ["--max-num-seqs", "without dashes", "max-num-seqs"]),
    "flag-with-underscores": ({"serve_args": {"max_num_seqs": 4}}, ["max_num_seqs", "max-num-seqs"]),
    "on-off-flag-given-text": (
        {"serve_args": {"enable-prefix-caching": "yes"}},
        ["enable-prefix-caching", "true, false or null", "'yes'"],
    ),
    "store-true-flag-false": (
        {"serve_args": {"disable-log-stats": False}},
        ["--disable-log-stats has no --no-disable-log-stats", "null"],
    ),
    "value-flag-given-true": ({"serve_args": {"max-num-seqs": True}}, ["--max-num-seqs takes a value", "True"]),
    "int-flag-given-text": ({"serve_args": {"max-num-seqs": "four"}}, ["--max-num-seqs takes an integer", "'four'"]),
    "float-flag-given-text": (
        {"serve_args": {"gpu-memory-utilization": "most"}},
        ["--gpu-memory-utilization takes a number", "'most'"],
    ),
    "choice-not-allowed": ({"serve_args": {"kv-cache-dtype": "fp9"}}, ["'fp9' is not one of", "fp8"]),
    "scalar-flag-given-a-list": ({"serve_args": {"max-num-seqs": [1, 2]}}, ["--max-num-seqs takes one int", "list"]),
    "owned-flag-api-key": (
        {"serve_args": {"api-key": "k"}},
        ["sparkfleet sets --api-key itself", "sparkfleet_api_key"],
    ),
    "owned-flag-port": ({"serve_args": {"port": 9000}}, ["sparkfleet sets --port itself", "sparkfleet_api_port"]),
    "owned-flag-speculative-config": (
        {"serve_args": {"speculative-config": {"method": "dflash"}}},
        ["--speculative-config", "speculative:"],
    ),
    "serve-args-not-a-mapping": ({"serve_args": ["--max-num-seqs", "4"]}, ["serve_args must be a mapping", "list"]),
    "speculative-method-typo": (
        {"speculative": {"method": "dflsh"}},
        ["speculative.method", "'dflsh' is not one of", "dflash"],
    ),
    "speculative-tokens-zero": (
        {"speculative": {"num_speculative_tokens": 0}},
        ["num_speculative_tokens", "must be > 0", "0"],
    ),
    "speculative-tokens-text": (
        {"speculative": {"num_speculative_tokens": "12"}},
        ["num_speculative_tokens", "takes int", "'12'"],
    ),
    "speculative-backend-typo": (
        {"speculative": {"attention_backend": "FLASH_ATT"}},
        ["attention_backend", "'FLASH_ATT' is not one of", "FLASH_ATTN"],
    ),
    "speculative-model-set": (
        {"speculative": {"model": "/models/x"}},
        ["speculative.model", "sparkfleet sets it", "drafter"],
    ),
    "speculative-internal-field": (
        {"speculative": {"target_model_config": {}}},
        ["target_model_config", "not a speculative-config key"],
    ),
    "speculative-not-a-mapping": ({"speculative": "dflash"}, ["speculative must be a mapping", "'dflash'"]),
    "patch-typo": (
        {"patches": ["kv-page-size-unfy"]},
        ["'kv-page-size-unfy' is not a patch", "did you mean kv-page-size-unify?"],
    ),
    "patch-with-number": (
        {"patches": ["0001-kv-page-size-unify"]},
        ["'0001-kv-page-size-unify' is not a patch", "kv-page-size-unify"],
    ),
    "patches-not-a-list": ({"patches": "kv-page-size-unify"}, ["patches must be a list", "str"]),
    "health-key-typo": (
        {"health": {"min_acceptance": 2}},
        ["health.min_acceptance", "did you mean min_acceptance_length?"],
    ),
    "health-negative": ({"health": {"min_acceptance_length": -1}}, ["min_acceptance_length", ">= 0", "-1"]),
    "baseline-not-a-number": (
        {"baselines": {"decode_tok_s_median": "fast"}},
        ["baselines.decode_tok_s_median", "must be a number", "'fast'"],
    ),
    "memory-zero": ({"required_memory_gib": 0}, ["required_memory_gib", "> 0", "0"]),
    "memory-text": ({"required_memory_gib": "100G"}, ["required_memory_gib", "'100G'"]),
    "env-bad-name": ({"env": {"VLLM-FOO": "1"}}, ["env.VLLM-FOO", "not an environment variable name"]),
    "env-nested-value": ({"env": {"VLLM_FOO": {"a": 1}}}, ["env.VLLM_FOO", "must be a string"]),
    "target-empty": ({"target": ""}, ["target must be a non-empty string", "''"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_profile_key_or_value_is_refused_in_one_line_naming_it(case: str) -> None:
    over, words = BAD[case]
    with pytest.raises(profiles.ProfileError) as err:
        resolve("dflash", {"dflash": over})
    message = str(err.value)
    assert "\n" not in message and message.startswith("profile 'dflash': ")
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("layer", "value", "words"),
    [
        ("common", {"max-num-seqz": 3}, ["sparkfleet_serve_args_common.max-num-seqz", "did you mean max-num-seqs?"]),
        # a null that drops nothing is a typo too: the flag it meant stays on
        (
            "platform",
            {"attention-backnd": None},
            ["sparkfleet_serve_args_platform.attention-backnd", "did you mean attention-backend?"],
        ),
        ("host", {"enforce-eager": "1"}, ["sparkfleet_serve_args_host.enforce-eager", "true, false or null"]),
        ("env_platform", {"1BAD": "x"}, ["sparkfleet_env_platform.1BAD", "environment variable name"]),
    ],
)
def test_every_layer_over_the_profile_is_checked_and_named(layer: str, value: dict, words: list[str]) -> None:
    with pytest.raises(profiles.ProfileError) as err:
        resolve("dflash", {}, **{layer: value})
    for word in words:
        assert word in str(err.value), str(err.value)


def test_all_problems_come_together_in_one_line() -> None:
    with pytest.raises(profiles.ProfileError) as err:
        resolve("dflash", {"dflash": {"serve_argz": {}, "speculative": {"num_speculative_token": 8}}})
    message = str(err.value)
    assert "\n" not in message
    assert "serve_argz" in message and "num_speculative_token" in message


def test_the_schema_is_vllm_s_own_parser_as_recorded() -> None:
    """The flags in the JSON are vLLM 0.23's (tests/vllm checks the file against vLLM itself); spot
    checks that the recorded kinds are the ones the profiles rely on."""
    schema = vllm_schema.load()
    assert schema["vllm"] == vllm_schema.VLLM_VERSION
    flags = schema["serve_flags"]
    assert flags["enable-prefix-caching"]["kind"] == "bool"
    assert flags["max-num-seqs"] == {"kind": "value", "type": "int"}
    assert "triton" in flags["gdn-prefill-backend"]["choices"]
    spec = schema["speculative"]
    assert "dflash" in spec["method"]["choices"] and spec["num_speculative_tokens"]["gt"] == 0
    assert "FLASH_ATTN" in spec["attention_backend"]["choices"]
    assert set(profile_schema.patch_names()) >= {"kv-page-size-unify", "uniform-decode-prefill-dispatch"}


def check_cli(inventory: Path, name: str = "dflash") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparkfleet", "profile", "check", name, "--inventory", str(inventory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_profile_check_cli_refuses_a_typo_with_the_nearest_key(tmp_path: Path) -> None:
    inventory = site_inventory(
        tmp_path,
        {
            "sparkfleet_models": pinned_models(),
            "sparkfleet_profiles_site": {"dflash": {"speculative": {"num_speculative_token": 8}}},
        },
    )
    proc = check_cli(inventory)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "num_speculative_token" in line and "did you mean num_speculative_tokens?" in line


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("sparkfleet_profiles_site:\n  dflash:\n    serve_args: {max-num-seqs: 4\n  base: {}\n", ":4:"),
        ("sparkfleet_profiles_site:\n  dflash:\n\tserve_args: {}\n", ":3:"),
        ("a: [1, 2\n", ":2:"),
    ],
    ids=["unclosed-flow", "tab-indent", "unclosed-list"],
)
def test_a_yaml_error_names_file_line_and_column_in_one_line(tmp_path: Path, text: str, where: str) -> None:
    inventory = site_inventory(tmp_path, {})
    bad = inventory / "group_vars" / "all" / "60-broken.yml"
    bad.write_text(text)
    proc = check_cli(inventory)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert f"{bad}{where}" in line and "YAML syntax error" in line, line


@needs_ansible_playbook
def test_deploy_refuses_a_profile_typo_before_any_change(tmp_path: Path) -> None:
    site = {
        "sparkfleet_profile": "dflash",
        "sparkfleet_models": pinned_models(),
        "sparkfleet_profiles_site": {"dflash": {"speculative": {"num_speculative_token": 8}}},
    }
    refused, out = run_resolve(tmp_path / "typo", site)
    assert refused.returncode != 0
    assert "did you mean num_speculative_tokens?" in refused.stdout
    assert not out.exists(), "nothing after the refusal may run"
    site["sparkfleet_profiles_site"] = {"dflash": {"speculative": {"num_speculative_tokens": 8}}}
    accepted, out = run_resolve(tmp_path / "fixed", site)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert json.loads(out.read_text())  # the profile's models reach model_cache
