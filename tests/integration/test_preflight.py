"""spark_preflight and nvidia_driver on the sandbox fleet (issue 7's acceptance).

The sandbox's nvidia-smi test double (tests/sandbox/nvidia-smi) reports a GB10 on driver 580 unless
/etc/sparkfleet-test/gpu.json on the host says otherwise; each test writes that file on one host
(the fleet's second unless $SPARKFLEET_PREFLIGHT_HOST names one) and removes it afterwards.

Every refusal is checked three ways: the play fails, the message names the value and the fix, and
a snapshot of the host (files under /etc, /opt, /var/lib/sparkfleet, /run/sparkfleet, apt and dpkg
state, installed packages, systemd unit files) is identical before and after. The playbook runs
nvidia_driver with nvidia_driver_manage: true and a clock cap after the preflight, so a preflight
that let a bad host through would change it; test_snapshot_sees_the_driver_role_change shows that
the snapshot does see those changes.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import PlaybookRun, run_playbook
from tests.sandbox.conftest import sandbox_fleet  # noqa: F401 - the fleet fixture

pytestmark = pytest.mark.sandbox

PLAYBOOK = "tests/integration/playbooks/preflight.yml"
GPU_JSON = "/etc/sparkfleet-test/gpu.json"
CLOCK_LOCK_RECORD = "/run/sparkfleet/nvidia-clock-lock"
KV_CONFIGS = "tests/fixtures/kv_configs"

# The sandbox hosts have ~20 GiB of memory and tens of GiB of disk; these pass there, so that each
# test moves exactly one input out of range.
PASSING_VARS: dict[str, Any] = {
    "spark_preflight_allow_non_aarch64": True,
    "spark_preflight_required_memory_gib": 1,
    "spark_preflight_required_disk_gib": 1,
    "spark_preflight_kv_plan": {},
}
# After the preflight: nvidia_driver managing the GPU settings (the install phase is skipped with
# --skip-tags; the sandbox has no NVIDIA repository). Repo values only satisfy its input check.
DRIVER_VARS: dict[str, Any] = {
    "preflight_with_driver": True,
    "nvidia_driver_manage": True,
    "nvidia_driver_repo_url": "file:///srv/sparkfleet/no-nvidia-repo",
    "nvidia_driver_repo_key_sha256": "0" * 64,
    "nvidia_driver_clock_cap": {"min_mhz": 200, "max_mhz": 2400},
}
SKIP_INSTALL = ("--skip-tags", "nvidia_driver_install")

SNAPSHOT = r"""
find /etc /opt /usr/local /var/lib/sparkfleet /run/sparkfleet /var/lib/apt /var/lib/dpkg \
     /etc/systemd /usr/lib/systemd/system -xdev -path /etc/sparkfleet-test -prune \
     -o -printf '%y %m %u %g %s %T@ %p\n' 2>/dev/null | sort
echo '--- packages'
dpkg-query -W -f '${Package} ${Version} ${Status}\n'
echo '--- unit files'
systemctl list-unit-files --no-legend --no-pager
"""


@pytest.fixture(scope="module")
def host(sandbox_fleet) -> str:  # noqa: F811 - the fixture imported above
    """The host whose nvidia-smi these tests change: $SPARKFLEET_PREFLIGHT_HOST, else the fleet's
    second host (the fleet's own tests reboot its last one)."""
    names = sandbox_fleet.names
    chosen = os.environ.get("SPARKFLEET_PREFLIGHT_HOST") or names[min(1, len(names) - 1)]
    if chosen not in names:
        pytest.fail(
            f"SPARKFLEET_PREFLIGHT_HOST={chosen!r} is not a fleet host; use one of {', '.join(names)}"
        )
    return chosen


class Host:
    """One sandbox host as these tests drive it."""

    def __init__(self, fleet: Any, name: str) -> None:
        self.fleet = fleet
        self.name = name

    def sh(self, command: str) -> str:
        result = self.fleet.ssh(self.name, command)
        assert result.returncode == 0, f"{self.name}: {command!r} failed: {result.stdout}{result.stderr}"
        return result.stdout

    def set_gpu(self, overrides: dict[str, Any] | None) -> None:
        """Make the test double report these keys (None: its GB10 defaults)."""
        if overrides is None:
            self.sh(f"rm -f {GPU_JSON}")
            return
        encoded = base64.b64encode(json.dumps(overrides).encode()).decode()
        self.sh(f"mkdir -p {GPU_JSON.rsplit('/', 1)[0]} && echo {encoded} | base64 -d > {GPU_JSON}")

    def gpu_state(self) -> dict[str, Any]:
        """What the test double recorded (-pm, -lgc) and was told."""
        return json.loads(self.sh(f"cat {GPU_JSON} 2>/dev/null || echo '{{}}'"))

    def snapshot(self) -> str:
        return self.sh(SNAPSHOT)

    def reset(self) -> None:
        self.sh(f"rm -f {GPU_JSON} {CLOCK_LOCK_RECORD}")


@pytest.fixture
def spark(sandbox_fleet, host: str) -> Iterator[Host]:  # noqa: F811
    target = Host(sandbox_fleet, host)
    target.reset()
    yield target
    target.reset()


def play(host: str, extra: dict[str, Any], *args: str) -> PlaybookRun:
    return run_playbook(PLAYBOOK, "--limit", host, "-e", json.dumps(extra), *args, timeout=600)


def assert_refused(run: PlaybookRun, host: str, *expected: str) -> None:
    assert run.returncode != 0, f"{host} was not refused:\n{run.output[-3000:]}"
    assert run.recap[host]["failed"] == 1
    assert run.recap[host]["changed"] == 0
    for text in expected:
        assert text in run.output, f"refusal message lacks {text!r}:\n{run.output[-3000:]}"


# --- the preflight ------------------------------------------------------------------------------


def test_gb10_on_580_passes_and_changes_nothing(spark: Host) -> None:
    before = spark.snapshot()
    run = play(spark.name, PASSING_VARS)
    assert run.returncode == 0, run.output[-3000:]
    assert run.recap[spark.name]["changed"] == 0
    assert spark.snapshot() == before
    checked = play(spark.name, PASSING_VARS, "--check")
    assert checked.returncode == 0, checked.output[-3000:]


REFUSALS = {
    "driver-590": (
        {"driver_version": "590.44.01", "cuda_version": "13.1"},
        {},
        [
            "NVIDIA driver 590.44.01 (branch R590) is refused",
            "CUDA-graph capture",
            "Install an allowed branch (R580)",
        ],
    ),
    "x86-gpu": (
        {
            "name": "NVIDIA H100 80GB HBM3",
            "compute_cap": "9.0",
            "memory_total_mib": 81559,
            "memory_used_mib": 0,
        },
        {},
        ["the GPU is 'NVIDIA H100 80GB HBM3', not one of NVIDIA GB10", "Run on GB10 hosts"],
    ),
    "compute-capability": (
        {"compute_cap": "12.0"},
        {},
        ["compute capability 12.0, expected 12.1"],
    ),
    "old-cuda": (
        {"cuda_version": "12.9"},
        {},
        ["the driver supports CUDA 12.9, older than 13.0"],
    ),
    "unknown-branch": (
        {"driver_version": "575.57.08"},
        {},
        ["(branch R575) is not a validated branch", "add R575 to spark_preflight_driver_branches"],
    ),
    "no-driver": (
        {
            "fail": {
                "rc": 9,
                "message": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            }
        },
        {},
        ["no usable GPU", "exited 9", "couldn't communicate with the NVIDIA driver"],
    ),
    "low-disk": (
        None,
        {"spark_preflight_required_disk_gib": 1000000},
        [
            "less than the 1000000 GiB the profile's models need (spark_preflight_required_disk_gib)",
            "GiB free on /",
        ],
    ),
    "low-memory": (
        None,
        {"spark_preflight_required_memory_gib": 1000000},
        ["memory is less than the 1000000 GiB the profile needs (spark_preflight_required_memory_gib)"],
    ),
    "not-aarch64": (
        None,
        {"spark_preflight_allow_non_aarch64": False},
        ["is x86_64, not aarch64", "spark_preflight_allow_non_aarch64"],
    ),
    "kv-plan-drafter-bce6f76": (
        None,
        {
            "spark_preflight_kv_plan": {
                "target_config": f"{KV_CONFIGS}/qwen3_5_122b_a10b/config.json",
                "drafter_config": f"{KV_CONFIGS}/dflash_bce6f76/config.json",
                "n": 12,
                "patched": False,
            }
        },
        ["cannot share KV pages", "dflash_bce6f76", "Pin a drafter revision that unifies"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_before_anything_changes(spark: Host, case: str) -> None:
    gpu, variables, expected = REFUSALS[case]
    spark.set_gpu(gpu)
    before = spark.snapshot()
    state_before = spark.gpu_state()
    run = play(spark.name, {**PASSING_VARS, **DRIVER_VARS, **variables}, *SKIP_INSTALL)
    assert_refused(run, spark.name, *expected)
    assert "spark_preflight : Assert" in run.output.split("FAILED!")[0].rsplit("TASK [", 1)[-1]
    assert spark.snapshot() == before
    assert spark.gpu_state() == state_before  # no -pm / -lgc reached the GPU


def test_kv_plan_with_the_pinned_drafter_passes(spark: Host) -> None:
    plan = {
        "target_config": f"{KV_CONFIGS}/qwen3_5_122b_a10b/config.json",
        "drafter_config": f"{KV_CONFIGS}/dflash_6c7242c/config.json",
        "n": 12,
        "patched": False,
    }
    run = play(spark.name, {**PASSING_VARS, "spark_preflight_kv_plan": plan})
    assert run.returncode == 0, run.output[-3000:]


# --- nvidia_driver ------------------------------------------------------------------------------


def test_snapshot_sees_the_driver_role_change(spark: Host) -> None:
    """Control for the refusals: the same play on a good host does change what the snapshot covers."""
    spark.set_gpu({"persistence_mode": "Disabled"})
    before = spark.snapshot()
    run = play(spark.name, {**PASSING_VARS, **DRIVER_VARS}, *SKIP_INSTALL)
    assert run.returncode == 0, run.output[-3000:]
    assert run.recap[spark.name]["changed"] >= 3  # -pm, -lgc, the lock record
    assert spark.snapshot() != before
    assert spark.sh(f"cat {CLOCK_LOCK_RECORD}") == "200,2400\n"
    state = spark.gpu_state()
    assert state["persistence_mode"] == "Enabled"
    assert state["locked_clocks"] == [200, 2400]


def test_driver_settings_converge_idempotent_and_check_mode_reports(spark: Host) -> None:
    spark.set_gpu({"persistence_mode": "Disabled"})
    first = play(spark.name, {**PASSING_VARS, **DRIVER_VARS}, *SKIP_INSTALL)
    assert first.returncode == 0, first.output[-3000:]
    assert first.recap[spark.name]["changed"] >= 3

    second = play(spark.name, {**PASSING_VARS, **DRIVER_VARS}, *SKIP_INSTALL)
    assert second.returncode == 0, second.output[-3000:]
    assert second.recap[spark.name]["changed"] == 0, second.output[-3000:]

    # check mode with a different cap: reported as a change, not made
    calls_before = spark.gpu_state()["calls"]
    other_cap = {**DRIVER_VARS, "nvidia_driver_clock_cap": {"min_mhz": 300, "max_mhz": 2000}}
    checked = play(spark.name, {**PASSING_VARS, **other_cap}, *SKIP_INSTALL, "--check", "--diff")
    assert checked.returncode == 0, checked.output[-3000:]
    assert checked.recap[spark.name]["changed"] >= 2
    assert spark.gpu_state()["locked_clocks"] == [200, 2400]
    assert spark.gpu_state()["calls"] == calls_before
    assert spark.sh(f"cat {CLOCK_LOCK_RECORD}") == "200,2400\n"

    # dropping the cap resets the lock sparkfleet applied and removes its record
    uncapped = {**DRIVER_VARS, "nvidia_driver_clock_cap": {}}
    reset = play(spark.name, {**PASSING_VARS, **uncapped}, *SKIP_INSTALL)
    assert reset.returncode == 0, reset.output[-3000:]
    assert reset.recap[spark.name]["changed"] >= 1
    assert spark.gpu_state()["locked_clocks"] is None
    assert spark.sh(f"test -e {CLOCK_LOCK_RECORD} && echo present || echo absent").strip() == "absent"


def test_driver_verify_only_refuses_persistence_off(spark: Host) -> None:
    spark.set_gpu({"persistence_mode": "Disabled"})
    before = spark.snapshot()
    run = play(spark.name, {**PASSING_VARS, "preflight_with_driver": True})
    assert_refused(run, spark.name, "persistence mode is Disabled", "nvidia_driver_manage: true")
    assert spark.snapshot() == before
    assert "calls" not in spark.gpu_state()


def test_driver_verify_only_refuses_a_missing_cap(spark: Host) -> None:
    run = play(
        spark.name,
        {
            **PASSING_VARS,
            "preflight_with_driver": True,
            "nvidia_driver_clock_cap": {"min_mhz": 200, "max_mhz": 2400},
        },
    )
    assert_refused(run, spark.name, "the recorded GPU clock lock is null", '"max_mhz": 2400')


def test_driver_manage_without_repo_url_is_refused(spark: Host) -> None:
    before = spark.snapshot()
    run = play(spark.name, {**PASSING_VARS, "preflight_with_driver": True, "nvidia_driver_manage": True})
    assert_refused(run, spark.name, "nvidia_driver_manage is true but nvidia_driver_repo_url is ''")
    assert spark.snapshot() == before
