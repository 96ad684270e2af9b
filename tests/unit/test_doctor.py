"""make doctor (playbooks/doctor.yml, sparkfleet/fleet/doctor.py) on this machine: the nvidia-smi test double
on PATH, the hub stand-in for the controller's reach, a real listener on the serving port. One row per
host, each check pass or fail with its fix; the run fails on a failed check and changes nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sparkfleet.fleet import doctor
from tests.hub.server import HubDouble
from tests.unit.helpers import (
    ROOT,
    ansible_env,
    link_shared_group_vars,
    local_host,
    needs_ansible_playbook,
    run_playbook,
)

TARGET_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
GB10 = {
    "present": True,
    "name": "NVIDIA GB10",
    "compute_cap": "12.1",
    "driver_version": "580.95.05",
    "driver_branch": "580",
    "cuda_version": "13.0",
    "usable_memory_gib": 119.7,
    "persistence_mode": "Enabled",
    "clock_lock": None,
}
SYSTEM = {
    "architecture": "aarch64",
    "memory_total_gib": 119.7,
    "disk_free_gib": 500.0,
    "cache_used_gib": 0.0,
    "swap_total_gib": 0.0,
}
SETTINGS = {
    "allow_non_aarch64": False,
    "gpu_names": ["NVIDIA GB10"],
    "compute_capability": "12.1",
    "driver_branches": {"580": {"allowed": True}, "590": {"allowed": False, "reason": "590 breaks vLLM 0.23"}},
    "min_cuda_version": "13.0",
    "port_owner_units": r"^sparkfleet-vllm-[a-z0-9][a-z0-9-]*\.service$",
    "clock_cap": None,
    "persistence_mode": True,
}
NEEDS = {"memory_gib": 100, "disk_gib": 75, "port": 8000, "profile": "dflash", "unit": "sparkfleet-vllm-dflash.service"}


def by_name(found: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in found}


def test_a_gb10_that_has_what_the_profile_needs_passes_every_check() -> None:
    found = doctor.checks(
        GB10, SYSTEM, NEEDS, SETTINGS, [], {"LoadState": "loaded", "ExecStart": "x sparkfleet-memory-guard y"}
    )
    assert all(c.ok for c in found), [c for c in found if not c.ok]
    assert doctor.row("spark-01", found).startswith("spark-01  PASS  arch aarch64 ok | gpu NVIDIA GB10 cc 12.1 ok")
    assert doctor.fixes("spark-01", found) == []


@pytest.mark.parametrize(
    ("gpu", "system", "unit", "holders", "check", "says"),
    [
        ({**GB10, "driver_branch": "590", "driver_version": "590.1"}, SYSTEM, None, [], "driver", "590 breaks vLLM"),
        ({**GB10, "name": "NVIDIA H100", "compute_cap": "9.0"}, SYSTEM, None, [], "gpu", "compute capability 12.1"),
        ({**GB10, "cuda_version": "12.8"}, SYSTEM, None, [], "cuda", "must support CUDA 13.0"),
        ({**GB10, "persistence_mode": "Disabled"}, SYSTEM, None, [], "persistence", "nvidia-smi -pm 1"),
        ({**GB10, "usable_memory_gib": 60.0}, SYSTEM, None, [], "memory", "needs 100 GiB usable memory"),
        (GB10, {**SYSTEM, "disk_free_gib": 40.0}, None, [], "disk", "free 35.0 GiB more"),
        (GB10, {**SYSTEM, "architecture": "x86_64"}, None, [], "arch", "remove this host"),
        (GB10, SYSTEM, {"LoadState": "loaded", "ExecStart": "vllm serve"}, [], "memory guard", "deploy again"),
        (GB10, SYSTEM, None, [{"port": 8000, "pid": 42, "comm": "nginx", "unit": "nginx.service"}], "port",
         "stop nginx (pid 42, nginx.service)"),
        ({"present": False, "error": "nvidia-smi not found"}, SYSTEM, None, [], "gpu", "install the NVIDIA driver"),
    ],
)  # fmt: skip
def test_each_failure_is_named_with_its_fix(gpu, system, unit, holders, check: str, says: str) -> None:  # noqa: ANN001
    found = by_name(doctor.checks(gpu, system, NEEDS, SETTINGS, holders, unit))
    assert not found[check].ok, found[check]
    assert says in found[check].fix
    failed = [name for name, c in found.items() if not c.ok]
    assert failed == [check], failed
    (line,) = doctor.fixes("spark-01", list(found.values()))
    assert line.startswith(f"spark-01: {check}: ") and says in line


def test_the_sandbox_allowance_and_the_own_unit_on_the_port_pass() -> None:
    found = by_name(
        doctor.checks(
            GB10,
            {**SYSTEM, "architecture": "x86_64"},
            NEEDS,
            {**SETTINGS, "allow_non_aarch64": True},
            [{"port": 8000, "pid": 7, "comm": "vllm", "unit": "sparkfleet-vllm-dflash.service"}],
        )
    )
    assert found["arch"].ok and "allowed" in found["arch"].value
    assert found["port"].ok and found["port"].value == "8000 held by sparkfleet-vllm-dflash.service"


@pytest.fixture()
def hub() -> Iterator[HubDouble]:
    with HubDouble() as double:
        double.add_revision(TARGET_REPO, {"config.json": b"{}"})
        yield double


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_doctor(tmp_path: Path, hub: HubDouble, site: dict, gpu: dict | None = None) -> subprocess.CompletedProcess[str]:
    inv = link_shared_group_vars(tmp_path / "inventory", {"model_cache_hub_endpoint": hub.endpoint, **site})
    host = local_host(ansible_become=False, sparkfleet_state_dir=str(tmp_path / "state"))
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"spark": {"hosts": {"spark-x": host}}}}}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(ROOT / "tests/sandbox/nvidia-smi")
    # this machine's systemd is not the host's: a unit that is not installed yet, as on a fresh Spark
    (bin_dir / "systemctl").write_text("#!/bin/sh\nprintf 'LoadState=not-found\\nExecStart=\\n'\n")
    (bin_dir / "systemctl").chmod(0o755)
    gpu_json = tmp_path / "gpu.json"
    gpu_json.write_text(json.dumps(gpu or {}))
    env = ansible_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SPARKFLEET_TEST_GPU_JSON=str(gpu_json))
    return run_playbook(inv / "hosts.yml", ROOT / "playbooks/doctor.yml", env=env)


@needs_ansible_playbook
def test_make_doctor_prints_a_row_per_host_and_fails_naming_the_fixes(tmp_path: Path, hub: HubDouble) -> None:
    port = free_port()
    base = {"spark_preflight_allow_non_aarch64": True, "sparkfleet_api_port": port}
    small = {
        "sparkfleet_profile": "small",
        "sparkfleet_profiles_site": {
            "small": {
                "summary": "needs little",
                "target": "intel-int4",
                "drafter": None,
                "required_memory_gib": 1,
                "serve_args": {},
            }
        },
        "sparkfleet_models": {"intel-int4": {"repo": TARGET_REPO, "revision": "", "size_gib": 0.001}},
    }
    good = run_doctor(tmp_path / "good", hub, {**base, **small})
    assert good.returncode == 0, good.stdout[-4000:]
    assert "spark-x  PASS  arch " in good.stdout and "| hub " in good.stdout and "answers" in good.stdout
    assert "changed=0" in good.stdout

    with socket.socket() as squatter:  # a real listener on the serving port
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        bad = run_doctor(
            tmp_path / "bad", hub, {**base, "sparkfleet_profile": "dflash"}, gpu={"driver_version": "590.44.01"}
        )
    assert bad.returncode != 0
    assert "spark-x  FAIL  " in bad.stdout, bad.stdout[-4000:]
    assert "spark-x: driver: 590.44.01 (branch 590)" in bad.stdout
    me = Path("/proc/self/comm").read_text().strip()  # the listener is this test's own process
    assert f"spark-x: port: {port} held by {me} (pid {os.getpid()}" in bad.stdout, bad.stdout[-3000:]
    assert "changed=0" in bad.stdout
    assert not (tmp_path / "bad" / "state").exists(), "the doctor creates nothing on the host"
