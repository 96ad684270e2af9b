"""The profile schema is vLLM 0.23's own: the recorded flags and SpeculativeConfig fields are what
the installed vLLM gives, and the deeper check parses a rendered argv with vLLM's parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkfleet.serving import profiles, vllm_schema

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def test_the_recorded_schema_is_what_the_installed_vllm_gives() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet.serving.vllm_schema", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["/m", "--max-num-seqs", "four"], ["max-num-seqs", "four"]),
        (["/m", "--max-num-seqz", "4"], ["unrecognized arguments", "--max-num-seqz"]),
        (["/m", "--kv-cache-dtype", "fp9"], ["kv-cache-dtype", "fp9"]),
        (["/m", "--speculative-config", '{"method":"dflsh","num_speculative_tokens":3}'], ["method='dflsh'"]),
        (
            ["/m", "--speculative-config", '{"method":"dflash","num_speculative_tokens":0}'],
            ["num_speculative_tokens=0", "greater than 0"],
        ),
        (
            ["/m", "--speculative-config", '{"method":"dflash","attention_backend":"FLASH_ATT"}'],
            ["attention_backend", "FLASH_ATT"],
        ),
        (
            ["/m", "--speculative-config", '{"method":"dflash","num_speculative_token":3}'],
            ["'num_speculative_token' is not a SpeculativeConfig field"],
        ),
    ],
    ids=["int-text", "unknown-flag", "bad-choice", "bad-method", "zero-tokens", "bad-backend", "unknown-field"],
)
def test_vllm_s_own_parser_refuses_what_the_schema_refuses(argv: list[str], words: list[str]) -> None:
    problems = vllm_schema.check_argv(argv)
    assert len(problems) == 1, problems
    for word in words:
        assert word in problems[0], problems[0]


def yaml_load(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_every_shipped_profile_parses_with_vllm_s_own_parser() -> None:
    import yaml

    shared = yaml.safe_load((ROOT / "inventory/group_vars/all/profiles.yml").read_text())
    example = yaml.safe_load((ROOT / "inventory/example/group_vars/all/50-site.yml").read_text())
    every = profiles.all_profiles(shared["sparkfleet_profiles_builtin"], example["sparkfleet_profiles_site"])
    for name in every:
        resolved = profiles.resolve(
            every, name, shared["sparkfleet_serve_args_common"], shared["sparkfleet_env_common"]
        )
        spec = profiles.speculative_config(resolved, "/drafter" if resolved.get("drafter") else None)
        argv = ["/model", *profiles.serve_argv(resolved["serve_args"])] + (
            ["--speculative-config", spec] if spec else []
        )
        assert vllm_schema.check_argv(argv) == [], name


def test_every_cluster_profile_parses_with_vllm_s_own_parser_on_head_and_worker() -> None:
    """vLLM 0.23's serve parser takes what a cluster adds: the parallel size, --nnodes, --node-rank,
    --master-addr, --master-port and the worker's --headless (sparkfleet.serving.cluster)."""
    from sparkfleet.serving import serving_plan
    from tests.unit.test_cluster_plan import variables

    shared = yaml_load(ROOT / "inventory/group_vars/all/profiles.yml")
    names = [name for name, spec in shared["sparkfleet_profiles_builtin"].items() if spec.get("cluster")]
    assert names
    for name in names:
        for host in ("spark-a", "spark-b"):
            argv = serving_plan.build(variables(host), name)["service"]["argv"]
            assert "--nnodes" in argv and vllm_schema.check_argv(argv[argv.index("serve") + 1 :]) == [], (name, host)


def test_profile_check_cli_runs_the_deeper_check_with_a_vllm_python(tmp_path: Path) -> None:
    from tests.unit.test_profile_models import site_inventory

    # max-num-batched-tokens parses later, in vLLM's own parser: the controller schema lets text through
    inventory = site_inventory(
        tmp_path,
        {
            "sparkfleet_models": {"m": {"path": "/m"}, "d": {"path": "/d"}},
            "sparkfleet_profiles_site": {
                "dflash": {"target": "m", "drafter": "d", "serve_args": {"max-num-batched-tokens": "lots"}}
            },
        },
    )

    def check(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sparkfleet", "profile", "check", "dflash", "--inventory", str(inventory), *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )

    assert check().returncode == 0
    deep = check("--vllm-python", sys.executable)
    assert deep.returncode == 2
    (line,) = deep.stderr.strip().splitlines()
    assert "max-num-batched-tokens" in line and "lots" in line and "(profile 'dflash')" in line, line
