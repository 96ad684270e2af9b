"""Profiles are data: merging, layering, refusals, and rendering to argv and ExecStart=."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from sparkfleet.serving import profiles
from tests.unit.helpers import run_sparkfleet

ROOT = Path(__file__).resolve().parents[2]
SHARED = yaml.safe_load((ROOT / "inventory/group_vars/all/profiles.yml").read_text())


def resolve(name: str, site: dict | None = None, platform: dict | None = None) -> dict:
    return profiles.resolve(
        profiles.all_profiles(SHARED["sparkfleet_profiles_builtin"], site),
        name,
        SHARED["sparkfleet_serve_args_common"],
        SHARED["sparkfleet_env_common"],
        platform,
    )


def test_builtin_profiles_are_the_recipes() -> None:
    names = set(profiles.all_profiles(SHARED["sparkfleet_profiles_builtin"], {}))
    assert {"dflash", "dense", "base", "dflash-conc8"} <= names
    dflash = resolve("dflash")
    assert dflash["speculative"] == {
        "method": "dflash",
        "num_speculative_tokens": 12,
        "attention_backend": "FLASH_ATTN",
    }
    argv = profiles.serve_argv(dflash["serve_args"])
    # the speculative profiles serve with prefix caching (the planner judges it at deploy), base without
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert "--enable-prefix-caching" in profiles.serve_argv(resolve("dense")["serve_args"])
    assert "--no-enable-prefix-caching" in profiles.serve_argv(resolve("base")["serve_args"])
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.82"
    assert argv[argv.index("--max-model-len") + 1] == "262144"
    assert "--mamba-block-size" not in argv
    assert resolve("base")["speculative"] is None
    assert "int8-lm-head" in resolve("dense")["patches"]


def test_conc8_profile_carries_its_recipe() -> None:
    conc8 = resolve("dflash-conc8")
    argv = profiles.serve_argv(conc8["serve_args"])
    assert "--enable-prefix-caching" in argv and "--trust-remote-code" in argv
    assert "--attention-backend" not in argv  # dropped by null
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert conc8["speculative"]["num_speculative_tokens"] == 5
    assert conc8["env"]["VLLM_MARLIN_USE_ATOMIC_ADD"] == "1"
    assert profiles.errors(conc8, SHARED["sparkfleet_refused_serve_args"]) == []


def test_operator_adds_a_profile_without_touching_roles() -> None:
    site = {
        "mtp": {
            "target": "intel-int4",
            "drafter": None,
            "serve_args": {},
            "speculative": {"method": "mtp", "num_speculative_tokens": 2},
        }
    }
    mtp = resolve("mtp", site)
    assert json.loads(profiles.speculative_config(mtp, None)) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    # and changes one flag of a builtin profile
    tuned = resolve("dflash", {"dflash": {"serve_args": {"max-num-seqs": 4}}})
    assert tuned["serve_args"]["max-num-seqs"] == 4
    assert tuned["serve_args"]["max-model-len"] == 262144


def test_platform_layer_wins_and_null_drops() -> None:
    cpu = resolve("dflash", platform={"load-format": None, "enforce-eager": True, "max-model-len": 512})
    assert "load-format" not in cpu["serve_args"]
    assert cpu["serve_args"]["enforce-eager"] is True
    assert cpu["serve_args"]["max-model-len"] == 512


def test_unknown_profile_names_the_valid_ones() -> None:
    with pytest.raises(profiles.ProfileError, match=r"unknown profile 'turbo': valid profiles are base, dense"):
        resolve("turbo")


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ({"gpu-memory-utilization": 0.88}, "--gpu-memory-utilization 0.88 refused (>= 0.88)"),
        ({"gpu-memory-utilization": 0.95}, "swaps and can freeze"),
        ({"mamba-block-size": 256}, "--mamba-block-size refused"),
    ],
)
def test_flags_that_break_the_model_are_refused(args: dict, expect: str) -> None:
    bad = resolve("dflash", {"dflash": {"serve_args": args}})
    msgs = profiles.errors(bad, SHARED["sparkfleet_refused_serve_args"])
    assert len(msgs) == 1 and expect in msgs[0] and "'dflash'" in msgs[0]


def test_speculative_config_points_at_the_local_drafter() -> None:
    spec = json.loads(profiles.speculative_config(resolve("dflash"), "/var/lib/sparkfleet/models/d"))
    assert spec["model"] == "/var/lib/sparkfleet/models/d"
    assert spec["method"] == "dflash"


def test_systemd_quoting_round_trips_through_a_shell_like_split() -> None:
    argv = [
        "/v/bin/vllm",
        "serve",
        "--speculative-config",
        '{"method":"dflash","x":[1,2]}',
        "a b",
        "50%",
        "$HOME",
    ]
    line = profiles.systemd_exec_args(argv)
    assert "%%" in line and "$$HOME" in line
    # systemd's quoting of this subset agrees with POSIX double quotes once %% and $$ are undone
    back = shlex.split(line.replace("%%", "%").replace("$$", "$"))
    assert back == argv


def test_profile_check_cli_refuses_unknown_profile_in_one_line(tmp_path: Path) -> None:
    proc = run_sparkfleet("profile", "check", "turbo", "--inventory", "inventory/sandbox")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "turbo" in lines[0] and "dflash" in lines[0] and "dense" in lines[0]
    ok = run_sparkfleet("profile", "check", "dense", "--inventory", "inventory/sandbox")
    assert ok.returncode == 0, ok.stderr
