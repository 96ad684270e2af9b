"""sparkfleet.serving.service_unit: the serving unit's values worked out in one place (the vllm_service
role renders them; tests/unit/test_unit_template.py checks the rendered unit)."""

from __future__ import annotations

import shlex
from typing import Any

import pytest

from sparkfleet.serving import service_unit, serving_state

PROFILE = {
    "name": "dflash",
    "serve_args": {"max-num-seqs": 3},
    "env": {"VLLM_CPU_KVCACHE_SPACE": 1},
    "speculative": {"method": "dflash", "num_speculative_tokens": 12},
}


def inputs(**overrides: Any) -> dict[str, Any]:
    values = {
        "profile": PROFILE,
        "other_profiles": ["base", "dense", "dflash"],
        "venv": "/opt/sparkfleet/venvs/vllm-0.23.0",
        "vllm_version": "0.23.0",
        "patchset_id": "sfabc",
        "model_path": "/var/lib/sparkfleet/models/tiny",
        "drafter_path": "/var/lib/sparkfleet/models/tiny-dflash",
        "model_revisions": {"tiny": "a" * 40},
        "served_model_name": "qwen",
        "host": "127.0.0.1",
        "port": 8000,
        "allowed_clients": [],
        "firewall_unit": "sparkfleet-vllm-firewall.service",
        "start_timeout": 900,
        "extra_directives": {},
        "cache_dir": "/var/lib/sparkfleet/cache",
        "config_dir": "/etc/sparkfleet",
        "libexec_dir": "/usr/local/libexec/sparkfleet",
        "memory_max": "auto",
        "memory_enforcers": ["kernel", "guard"],
        "memory_reserve_mib": 8192,
        "memory_floor_mib": 2048,
        "memtotal_mb": 122_880,
        "user": "vllm",
        "state_dir": "/var/lib/sparkfleet",
        "limit_nofile": 65536,
        "devices": ["/dev/nvidia0"],
    }
    values.update(overrides)
    return values


def test_exec_start_is_the_guard_then_vllm_and_quotes_back_to_the_argv() -> None:
    spec = service_unit.spec(inputs())
    limit = (122_880 - 8192) * 2**20
    assert spec["argv"][:4] == [
        "/usr/local/libexec/sparkfleet/sparkfleet-memory-guard",
        str(limit),
        str(2048 * 2**20),
        "--",
    ]
    assert spec["argv"][4:7] == [
        "/opt/sparkfleet/venvs/vllm-0.23.0/bin/vllm",
        "serve",
        "/var/lib/sparkfleet/models/tiny",
    ]
    # systemd splits ExecStart= like a shell for these (no $, %, or backslashes in them)
    assert shlex.split(spec["exec_start"]) == spec["argv"]
    assert '"model":"/var/lib/sparkfleet/models/tiny-dflash"' in spec["argv"][-1]
    assert spec["memory"] == {
        "max_bytes": limit,
        "kernel_bytes": limit,
        "guard_bytes": limit,
        "floor_bytes": 2048 * 2**20,
    }


def test_the_state_record_passes_its_schema_and_names_the_unit() -> None:
    spec = service_unit.spec(inputs())
    state = serving_state.check(spec["state"], "test")
    assert state["unit"] == spec["unit"] == "sparkfleet-vllm-dflash.service"
    assert state["secrets_file"] == spec["env_file"] == "/etc/sparkfleet/vllm-dflash.env"
    assert state["host_lock"] == "/usr/local/libexec/sparkfleet/sparkfleet-host-lock"
    assert spec["conflicts"] == ["sparkfleet-vllm-base.service", "sparkfleet-vllm-dense.service"]


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000/health"),
        ("0.0.0.0", "http://127.0.0.1:8000/health"),
        ("::1", "http://[::1]:8000/health"),  # an IPv6 literal in a URL needs its brackets
    ],
)
def test_the_health_url_is_a_url_for_every_bind_address(host: str, url: str) -> None:
    assert service_unit.spec(inputs(host=host))["health_url"] == url


def test_an_exposed_port_lets_in_only_the_allowed_clients_behind_the_firewall() -> None:
    spec = service_unit.spec(inputs(host="0.0.0.0", allowed_clients=["10.0.0.5", "fd00::/64"]))
    assert spec["exposed"] and spec["requires"] == ["sparkfleet-vllm-firewall.service"]
    assert spec["ip_address_allow"] == ["localhost", "10.0.0.5 fd00::/64"]
    open_port = service_unit.spec(inputs(host="0.0.0.0"))
    assert open_port["requires"] == [] and open_port["ip_address_allow"] == ["localhost", "any"]
    assert service_unit.spec(inputs())["ip_address_allow"] == ["localhost"]


def test_extra_directives_and_environment_come_in_the_order_the_unit_always_had() -> None:
    spec = service_unit.spec(inputs(extra_directives={"cpuWeight": 5, "CPUQuota": "50%", "Nice": [1, 2]}))
    assert spec["directives"] == ["CPUQuota=50%", "cpuWeight=5", "Nice=1", "Nice=2"]
    keys = [value.strip('"').split("=", 1)[0] for value in spec["environment"]]
    assert keys == sorted(keys, key=str.lower) and '"VLLM_CPU_KVCACHE_SPACE=1"' in spec["environment"]


def test_a_missing_input_is_one_line_naming_it() -> None:
    values = inputs()
    del values["libexec_dir"], values["port"]
    with pytest.raises(
        service_unit.SpecError,
        match="the serving unit needs port, libexec_dir: build it with sparkfleet.serving.serving_plan",
    ):
        service_unit.spec(values)


@pytest.mark.parametrize(
    ("settings", "start"),
    [
        ({"allowed_clients": ["10.0.0.5", "spark-02.lan"]}, "vllm_service_allowed_clients has entries that are not IP"),
        ({"allowed_clients": "10.0.0.5"}, "vllm_service_allowed_clients has entries that are not IP"),
        ({"extra_directives": ["CPUAffinity=0-3"]}, "vllm_service_extra_directives ['CPUAffinity=0-3'] must map"),
        ({"extra_directives": {"cpu affinity": "0-3"}}, "vllm_service_extra_directives {'cpu affinity': '0-3'} must"),
    ],
)
def test_a_bad_allow_list_or_directive_is_one_line_for_preflight(settings: dict[str, Any], start: str) -> None:
    spec = service_unit.spec(inputs(host="0.0.0.0", **settings))
    assert len(spec["errors"]) == 1 and spec["errors"][0].startswith(start) and "\n" not in spec["errors"][0]
    assert service_unit.spec(inputs(host="0.0.0.0", allowed_clients=["10.0.0.5"]))["errors"] == []
