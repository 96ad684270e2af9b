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
import contextlib
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import PlaybookRun, run_playbook
from tests.sandbox import fleet
from tests.sandbox.conftest import sandbox_fleet  # noqa: F401 - the fleet fixture

pytestmark = pytest.mark.sandbox

PLAYBOOK = "tests/integration/playbooks/preflight.yml"
GPU_JSON = "/etc/sparkfleet-test/gpu.json"
CLOCK_LOCK_RECORD = "/run/sparkfleet/nvidia-clock-lock"
KV_CONFIGS = "tests/fixtures/kv_configs"
# the manifest "cuda" section of PyPI's vllm-0.23.0 aarch64 wheel, as `sparkfleet wheel cuda --json` measured it
PYPI_WHEEL_CUDA = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures/cuda/pypi-vllm-0.23.0-aarch64.json").read_text()
)
HOPPER_ONLY_CUDA = {
    "binaries": {
        "vllm/_C.abi3.so": {"sass": ["sm_90a", "sm_100"], "ptx": []},
        "vllm/_moe_C.abi3.so": {"sass": ["sm_90a"], "ptx": []},
    },
    "required": PYPI_WHEEL_CUDA["required"],
}

# The sandbox hosts have ~20 GiB of memory and tens of GiB of disk; these pass there, so that each
# test moves exactly one input out of range.
PASSING_VARS: dict[str, Any] = {
    "spark_preflight_allow_non_aarch64": True,
    "spark_preflight_required_memory_gib": 1,
    "spark_preflight_required_disk_gib": 1,
    "spark_preflight_kv_plan": {},
    # the serving port: free, or held by this host's own sparkfleet-vllm unit (both pass)
    "spark_preflight_ports": [8000],
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
        pytest.fail(f"SPARKFLEET_PREFLIGHT_HOST={chosen!r} is not a fleet host; use one of {', '.join(names)}")
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
    "wheel-without-code-for-12.1": (
        {},
        {"spark_preflight_wheel_cuda": HOPPER_ONLY_CUDA},
        [
            "the vLLM wheel has no CUDA code for compute capability 12.1",
            "vllm/_C.abi3.so has only sm_90a, sm_100; vllm/_moe_C.abi3.so has only sm_90a",
            "sparkfleet wheel build --source PATH --sha256 HEX",
        ],
    ),
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


def test_a_port_taken_by_another_process_is_named_before_anything_changes(spark: Host) -> None:
    squatter = "sparkfleet-test-squatter"
    spark.sh(f"systemd-run --unit={squatter} python3 -m http.server 8011 --bind 127.0.0.1")
    try:
        spark.sh("for i in $(seq 100); do ss -Htln 'sport = :8011' | grep -q . && exit 0; sleep 0.1; done; exit 1")
        before = spark.snapshot()
        run = play(spark.name, {**PASSING_VARS, **DRIVER_VARS, "spark_preflight_ports": [8000, 8011]}, *SKIP_INSTALL)
        assert_refused(
            run,
            spark.name,
            "port 8011 is taken by python3 (pid ",
            f"unit {squatter}.service)",
            "stop it, or serve on a free port (sparkfleet_api_port)",
        )
        assert "port 8000" not in run.output  # this host's own serving unit may hold its port
        assert spark.snapshot() == before
    finally:
        spark.sh(f"systemctl stop {squatter} || true")


def test_pypi_s_aarch64_wheel_passes_on_the_gb10_naming_the_kernels_the_driver_jit_compiles(spark: Host) -> None:
    run = play(spark.name, {**PASSING_VARS, "spark_preflight_wheel_cuda": PYPI_WHEEL_CUDA})
    assert run.returncode == 0, run.output[-3000:]
    assert "no SASS for 12.1 in vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (compute_80)" in run.output, run.output[-3000:]


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
    before = spark.snapshot()
    run = play(
        spark.name,
        {
            **PASSING_VARS,
            "preflight_with_driver": True,
            "nvidia_driver_clock_cap": {"min_mhz": 200, "max_mhz": 2400},
        },
    )
    assert_refused(
        run, spark.name, "the recorded GPU clock lock is null", '"max_mhz": 2400', "Set nvidia_driver_manage: true"
    )
    assert spark.snapshot() == before
    assert "calls" not in spark.gpu_state()  # no -lgc was run


def test_driver_manage_without_repo_url_is_refused(spark: Host) -> None:
    before = spark.snapshot()
    run = play(spark.name, {**PASSING_VARS, "preflight_with_driver": True, "nvidia_driver_manage": True})
    assert_refused(run, spark.name, "nvidia_driver_manage is true but nvidia_driver_repo_url is ''")
    assert spark.snapshot() == before


# --- nvidia_driver's install path, from a signed local stand-in of NVIDIA's repository ----------

REPO_ON_HOST = "/srv/sparkfleet-test-nvidia-repo"
# Empty packages standing in for NVIDIA's: same names, versions on the branches that matter.
STAND_IN_PACKAGES = (
    ("nvidia-driver-580-open", "580.95.05-0sparkfleet1"),
    ("nvidia-driver-580-open", "590.44.01-0sparkfleet1"),  # an upgrade the branch pin must refuse
    ("cuda-toolkit-13-0", "13.0.2-1"),
)
INSTALLED_BY_ROLE = (
    "/etc/apt/keyrings/sparkfleet-nvidia-cuda.asc",
    "/etc/apt/sources.list.d/sparkfleet-nvidia-cuda.list",
    "/etc/apt/preferences.d/sparkfleet-nvidia-driver",
)


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(argv, capture_output=True, check=False, **kwargs)
    assert result.returncode == 0, f"{argv[0]} failed: {result.stdout!r} {result.stderr!r}"
    return result


def build_signed_repo(root: Path, subdir: str) -> str:
    """A flat apt repository under root/subdir, signed with a throwaway key; returns the key's sha256.

    The key is written beside the packages as testrepo.pub, as NVIDIA publishes 3bf863cc.pub."""
    gnupg = root / "gnupg"
    gnupg.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(gnupg)}
    gpg = ["gpg", "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", ""]
    _run(
        [*gpg, "--quick-gen-key", "sparkfleet test repo <test@sparkfleet.invalid>", "ed25519", "sign", "never"], env=env
    )
    repo = root / "repo" / subdir
    repo.mkdir(parents=True)
    for name, version in STAND_IN_PACKAGES:
        package = root / "build" / f"{name}_{version}"
        (package / "DEBIAN").mkdir(parents=True)
        (package / "DEBIAN" / "control").write_text(
            f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
            "Maintainer: sparkfleet tests <test@sparkfleet.invalid>\n"
            f"Description: empty stand-in for NVIDIA's {name} (sparkfleet test double)\n"
        )
        _run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(repo / f"{name}_{version}_all.deb")])
    packages = _run(["dpkg-scanpackages", "--multiversion", "."], cwd=repo).stdout
    (repo / "Packages").write_bytes(packages)
    (repo / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    hashes = "".join(
        f" {hashlib.sha256((repo / name).read_bytes()).hexdigest()} {(repo / name).stat().st_size} {name}\n"
        for name in ("Packages", "Packages.gz")
    )
    (repo / "Release").write_text(
        "Origin: sparkfleet-test\nLabel: sparkfleet-test NVIDIA stand-in\n"
        f"Date: {formatdate(usegmt=True)}\nSHA256:\n{hashes}"
    )
    _run([*gpg, "--clearsign", "--output", str(repo / "InRelease"), str(repo / "Release")], env=env)
    _run([*gpg, "--armor", "--detach-sign", "--output", str(repo / "Release.gpg"), str(repo / "Release")], env=env)
    key = _run([*gpg, "--armor", "--export"], env=env).stdout
    (repo / "testrepo.pub").write_bytes(key)
    # gpg started an agent for this throwaway home; it would outlive the test
    with contextlib.suppress(FileNotFoundError):
        subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, capture_output=True, check=False)
    return hashlib.sha256(key).hexdigest()


def push_tree(host: str, source: Path, destination: str) -> None:
    """Copy a controller directory onto a sandbox host over the fleet's ssh."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(source, arcname=".")
    ssh = fleet.ssh_base_argv(fleet.host_from_name(host))
    _run(
        [*ssh, "--", f"rm -rf {destination} && mkdir -p {destination} && tar -xzf - -C {destination}"],
        input=archive.getvalue(),
    )


@pytest.fixture
def nvidia_repo(spark: Host, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The stand-in repository on the host, and the nvidia_driver variables that point at it.
    Afterwards: the stand-in packages purged, the role's apt files and the repository removed."""
    os_release = dict(
        line.split("=", 1) for line in spark.sh("cat /etc/os-release").replace('"', "").splitlines() if "=" in line
    )
    distribution = os_release["ID"] + os_release["VERSION_ID"].replace(".", "")
    architecture = spark.sh("uname -m").strip()
    arch_dir = {"aarch64": "sbsa"}.get(architecture, architecture)
    key_sha256 = build_signed_repo(tmp_path, f"{distribution}/{arch_dir}")
    push_tree(spark.name, tmp_path / "repo", REPO_ON_HOST)
    yield {
        "preflight_with_driver": True,
        "nvidia_driver_manage": True,
        "nvidia_driver_repo_url": f"file://{REPO_ON_HOST}",
        "nvidia_driver_repo_key_name": "testrepo.pub",
        "nvidia_driver_repo_key_sha256": key_sha256,
        "nvidia_driver_reboot": False,
    }
    names = " ".join(sorted({name for name, _ in STAND_IN_PACKAGES}))
    spark.sh(
        f"apt-get purge -y -q {names} >/dev/null 2>&1 || true; rm -f {' '.join(INSTALLED_BY_ROLE)}; "
        f"rm -rf {REPO_ON_HOST}; apt-get update -q >/dev/null"
    )


def installed_version(spark: Host, package: str) -> str:
    return spark.sh(f"dpkg-query -W -f '${{Version}}' {package} 2>/dev/null || true").strip()


def test_driver_install_check_mode_then_converge_then_idempotent(spark: Host, nvidia_repo: dict[str, Any]) -> None:
    variables = {**PASSING_VARS, **nvidia_repo}
    before = spark.snapshot()
    checked = play(spark.name, variables, "--check", "--diff")
    assert checked.returncode == 0, checked.output[-3000:]
    assert checked.recap[spark.name]["changed"] >= 3  # key, pin, repository, packages
    assert "would install nvidia-driver-580-open, cuda-toolkit-13-0" in checked.output
    assert spark.snapshot() == before  # check mode made nothing

    first = play(spark.name, variables)
    assert first.returncode == 0, first.output[-3000:]
    # the branch pin holds the driver on R580 although the repository offers a 590 build
    assert installed_version(spark, "nvidia-driver-580-open") == "580.95.05-0sparkfleet1"
    assert installed_version(spark, "cuda-toolkit-13-0") == "13.0.2-1"
    for path in INSTALLED_BY_ROLE:
        spark.sh(f"test -s {path}")
    assert "driver packages changed and nvidia_driver_reboot is false" in first.output

    second = play(spark.name, variables)
    assert second.returncode == 0, second.output[-3000:]
    assert second.recap[spark.name]["changed"] == 0, second.output[-3000:]


def test_driver_install_refuses_a_key_with_the_wrong_sha256(spark: Host, nvidia_repo: dict[str, Any]) -> None:
    before = spark.snapshot()
    run = play(spark.name, {**PASSING_VARS, **nvidia_repo, "nvidia_driver_repo_key_sha256": "1" * 64})
    assert run.returncode != 0
    # get_url names the checksum it wanted and the one the file has; the key is not kept
    assert "checksum" in run.output.lower() and "1" * 64 in run.output, run.output[-3000:]
    assert installed_version(spark, "nvidia-driver-580-open") == ""
    assert spark.snapshot() == before


def test_driver_install_reboots_through_the_handler(spark: Host, nvidia_repo: dict[str, Any]) -> None:
    """A driver install with nvidia_driver_reboot reboots the host through the handler, waits for it and
    verifies the freshly booted host. In the sandbox the host is a container: /run is fresh and its
    systemd-nspawn has a new pid after the reboot (boot_id is the machine's, shared)."""
    host = fleet.host_from_name(spark.name)
    spark.sh("touch /run/sparkfleet-reboot-marker")
    nspawn_before = fleet.nspawn_pid(host)
    run = play(spark.name, {**PASSING_VARS, **nvidia_repo, "nvidia_driver_reboot": True})
    assert run.returncode == 0, run.output[-3000:]
    assert "RUNNING HANDLER [nvidia_driver : Reboot for the NVIDIA driver]" in run.output
    assert fleet.nspawn_pid(host) not in (None, nspawn_before), "the host did not boot again"
    assert spark.fleet.ssh(spark.name, "test -e /run/sparkfleet-reboot-marker").returncode == 1
    assert run.output.index("Reboot for the NVIDIA driver") < run.output.rindex("Assert the driver branch")
