"""The vllm_service role's unit, rendered the way Ansible renders it, and the helpers the unit runs.

The unit comes from templates/sparkfleet-vllm.service.j2 with the role's defaults and vars and its one
input, the serving plan's unit (sparkfleet.serving.serving_plan over inventory/group_vars/all), through
ansible-core's own templating, as on a host. Checked here: one profile holds
the GPU (Conflicts=), the start timeout covers the 122B's first load, the memory guard's limit comes
from MemTotal, the hardening scores at most 3.0 with `systemd-analyze security --offline=yes`, and
files/bin/sparkfleet-verify-unit refuses a unit with a bad key. files/bin/sparkfleet-memory-guard is
run for real on small processes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_service"
TEMPLATES = ROOT / "templates"
BIN = ROOT / "files" / "bin"
FIRST_LOAD_S = 463  # the 122B's first load on a GB10 (reference/)
MAX_EXPOSURE = 3.0
GIB = 2**30

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (systemd >= 252)"
)


def _trusted(value: Any) -> Any:
    from ansible.template import trust_as_template

    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {key: _trusted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_trusted(item) for item in value]
    return value


# The plan's parts these tests serve in place of the inventory's own (a sandbox-like profile, no drafter).
PLAN = {
    "profile": {
        "name": "dflash",
        "summary": "test",
        "serve_args": {"max-num-seqs": 3, "enforce-eager": True},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "speculative": None,
    },
    "venv": "/opt/sparkfleet/venvs/vllm-0.23.0",
    "model_path": "/var/lib/sparkfleet/models/tiny",
    "drafter_path": "",
}
# what the host's facts give the plan (MemTotal, for vllm_service_memory_max: auto)
FACTS = {"memtotal_mb": 122_880}
# role inputs beside the unit (the secrets), as serve-unit.yml passes them
ROLE_INPUTS = ("vllm_service_api_key", "vllm_service_hf_token")


def group_vars_all() -> dict[str, Any]:
    """inventory/group_vars/all, the shared defaults every inventory links."""
    variables: dict[str, Any] = {}
    for name in ("profiles.yml", "sparkfleet.yml"):
        variables.update(yaml.safe_load((ROOT / "inventory" / "group_vars" / "all" / name).read_text()))
    return variables


def unit_spec(plan: dict[str, Any] | None = None, **inventory: Any) -> dict[str, Any]:
    """The plan's ``service`` (what serve-unit.yml hands the role as vllm_service_spec): the serving plan of
    group_vars/all with the ``inventory`` variables over it, and PLAN's parts (then ``plan``'s) in place of
    the plan's own."""
    from sparkfleet.serving import serving_plan
    from tests.unit.test_profile_models import pinned_models

    variables = {
        **group_vars_all(),
        "sparkfleet_models": pinned_models(),
        "sparkfleet_wheel_dir": "/nonexistent",
        "ansible_facts": FACTS,
        **inventory,
    }
    built = serving_plan.build(variables, "dflash")
    built.update(PLAN)
    built.update(plan or {})
    built["service"] = serving_plan.service_unit.spec(serving_plan.service_inputs(variables, built))
    return built["service"]


def role_variables(plan: dict[str, Any] | None = None, **inventory: Any) -> dict[str, Any]:
    """The role's defaults and vars (templates kept as templates) with its unit from ``unit_spec``."""
    variables: dict[str, Any] = {}
    variables.update(yaml.safe_load((ROLE / "defaults" / "main.yml").read_text()))
    variables.update(yaml.safe_load((ROLE / "vars" / "main.yml").read_text()))
    variables = _trusted(variables)
    variables.update(
        ansible_managed="Managed by a test",
        vllm_service_spec=unit_spec(plan, **{k: v for k, v in inventory.items() if k not in ROLE_INPUTS}),
        **{k: v for k, v in inventory.items() if k in ROLE_INPUTS},
    )
    return variables


@functools.cache
def _load_plugins() -> None:
    """ansible's plugin loader with the repo's filters (once per process)."""
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader([str(ROOT / "filter_plugins")])


def template_text(text: str, plan: dict[str, Any] | None = None, **inventory: Any) -> Any:
    """text templated by ansible-core with role_variables(plan, **inventory)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    _load_plugins()
    templar = Templar(loader=DataLoader(), variables=role_variables(plan, **inventory))
    return templar.template(trust_as_template(text))


def render(template: str, plan: dict[str, Any] | None = None, **inventory: Any) -> str:
    """templates/<template> rendered with role_variables(plan, **inventory)."""
    return template_text((TEMPLATES / template).read_text(), plan, **inventory)


def expression(name: str, plan: dict[str, Any] | None = None, **inventory: Any) -> Any:
    """One of the role's variables, resolved."""
    return template_text("{{ " + name + " }}", plan, **inventory)


def directives(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(key + "=")]


def exposure(unit_text: str, tmp_path: Path) -> float:
    """`systemd-analyze security --offline=yes` overall exposure of a unit file."""
    path = tmp_path / "sparkfleet-vllm-dflash.service"
    path.write_text(unit_text)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LC_ALL": "C", "SYSTEMD_COLORS": "0"},
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, f"no exposure level in:\n{out.stdout}\n{out.stderr}"
    return float(match.group(1))


def test_only_one_profile_holds_the_gpu() -> None:
    unit = render("sparkfleet-vllm.service.j2")
    others = sorted(set(group_vars_all()["sparkfleet_profiles_builtin"]) - {"dflash"})
    assert len(others) >= 2
    assert sorted(directives(unit, "Conflicts")) == sorted(f"sparkfleet-vllm-{n}.service" for n in others)


def test_exec_start_serves_the_profile_with_its_drafter_under_the_guard() -> None:
    speculative = {"method": "dflash", "num_speculative_tokens": 7, "attention_backend": None}
    profile = {**PLAN["profile"], "speculative": speculative}
    unit = render(
        "sparkfleet-vllm.service.j2",
        {"profile": profile, "drafter_path": "/var/lib/sparkfleet/models/my drafter"},
        sparkfleet_api_port=8123,
    )
    (exec_start,) = directives(unit, "ExecStart")
    argv = shlex.split(exec_start)
    guard = argv.index("--")
    assert argv[0].endswith("/sparkfleet-memory-guard") and argv[guard + 1 :][:3] == [
        "/opt/sparkfleet/venvs/vllm-0.23.0/bin/vllm",
        "serve",
        "/var/lib/sparkfleet/models/tiny",
    ]
    flags = argv[guard + 4 :]
    assert flags[flags.index("--port") + 1] == "8123" and flags[flags.index("--max-num-seqs") + 1] == "3"
    assert "--enforce-eager" in flags
    spec = json.loads(flags[flags.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "num_speculative_tokens": 7, "model": "/var/lib/sparkfleet/models/my drafter"}
    environment = dict(line.strip('"').split("=", 1) for line in directives(unit, "Environment"))
    assert environment["VLLM_CPU_KVCACHE_SPACE"] == "1" and environment["SPARKFLEET_PROFILE"] == "dflash"
    assert environment["HF_HUB_OFFLINE"] == "1" and environment["TRITON_CACHE_DIR"].endswith("/cache/triton")
    plain = render("sparkfleet-vllm.service.j2")
    assert "--speculative-config" not in directives(plain, "ExecStart")[0]


def test_the_start_timeout_covers_the_first_load_and_the_health_wait() -> None:
    unit = render("sparkfleet-vllm.service.j2")
    start_timeout = int(group_vars_all()["vllm_service_start_timeout"])
    assert start_timeout > FIRST_LOAD_S
    (timeout_start,) = directives(unit, "TimeoutStartSec")
    assert int(timeout_start) > start_timeout
    post, record = directives(unit, "ExecStartPost")
    assert post.endswith(f"/health {start_timeout} $MAINPID") and "sparkfleet-wait-healthy" in post
    # then, as root and never failing the start, the start-up figures go into state.json
    assert record.startswith("-+/") and record.endswith(
        "/sparkfleet-record-startup sparkfleet-vllm-dflash.service /etc/sparkfleet/state.json"
    ), record


@pytest.mark.parametrize(
    ("memory_max", "expected_bytes"),
    [
        ("auto", (122_880 - 8192) * 2**20),
        ("100G", 100 * GIB),
        ("512m", 512 * 2**20),
        ("1073741824", GIB),
        ("infinity", 0),
    ],
)
def test_the_memory_limit_reaches_the_cgroup_and_the_guard(memory_max: str, expected_bytes: int) -> None:
    unit = render("sparkfleet-vllm.service.j2", vllm_service_memory_max=memory_max)
    (exec_start,) = directives(unit, "ExecStart")
    guard, limit, floor, separator, vllm = exec_start.split()[:5]
    assert guard.endswith("/sparkfleet-memory-guard") and separator == "--" and vllm.endswith("/bin/vllm")
    assert int(limit) == expected_bytes
    assert int(floor) == 2048 * 2**20
    assert directives(unit, "MemoryMax") == ([str(expected_bytes)] if expected_bytes else [])
    assert directives(unit, "OOMPolicy") == ["stop"]
    assert directives(unit, "RestartPreventExitStatus") == ["137"]


def test_auto_leaves_the_configured_reserve() -> None:
    limit = expression(
        "vllm_service_spec.memory.max_bytes",
        ansible_facts={"memtotal_mb": 24_105},
        vllm_service_memory_reserve_mib=4096,
    )
    assert int(limit) == (24_105 - 4096) * 2**20


@pytest.mark.parametrize(
    "settings",
    [
        {"vllm_service_memory_max": "lots"},
        {"vllm_service_memory_max": "12 GB"},
        {"vllm_service_memory_max": "-5G"},
        {"vllm_service_memory_max": "1.5G"},
        {"vllm_service_memory_max": "0"},
        {"vllm_service_memory_reserve_mib": 200_000},  # auto: MemTotal below the reserve
        {"vllm_service_memory_reserve_mib": "8G"},
        {"vllm_service_memory_floor_mib": -1},
        {"ansible_facts": {}},  # auto without gathered facts
    ],
)
def test_an_unusable_memory_setting_is_one_line_for_preflight(settings: dict[str, Any]) -> None:
    errors = expression("vllm_service_spec.errors", **settings)
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"vllm_service_memory_max {settings.get('vllm_service_memory_max', 'auto')} ")
    assert 'give "auto"' in errors[0]


@pytest.mark.parametrize("enforcers", ["kernel", ["kernel", "cgroup"], [None]])
def test_unknown_memory_enforcers_are_refused(enforcers: Any) -> None:
    errors = expression("vllm_service_spec.errors", vllm_service_memory_enforcers=enforcers)
    assert errors == [
        f"vllm_service_memory_enforcers {enforcers} is not a list of kernel and guard: give [kernel, guard] "
        "(the default), [kernel], [guard] or [] (no limit enforced)."
    ]


def test_good_memory_settings_have_no_errors() -> None:
    for settings in ({}, {"vllm_service_memory_max": "infinity"}, {"vllm_service_memory_enforcers": []}):
        assert expression("vllm_service_spec.errors", **settings) == []


def test_hardening_directives_are_there() -> None:
    unit = render("sparkfleet-vllm.service.j2")
    for line in (
        "User=vllm",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/sparkfleet/cache",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/nvidia0 rw",
        "DeviceAllow=/dev/nvidia-uvm rw",
        "IPAddressDeny=any",
        "IPAddressAllow=localhost",
        "SystemCallFilter=@system-service",
    ):
        assert line in unit.splitlines(), f"{line} missing"
    no_gpu = render("sparkfleet-vllm.service.j2", vllm_service_devices=[])
    assert "PrivateDevices=yes" in no_gpu.splitlines() and "DevicePolicy=closed" not in no_gpu


@needs_systemd_analyze
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"vllm_service_devices": []},
        {
            "sparkfleet_api_host": "0.0.0.0",
            "vllm_service_api_key": "k",
            "vllm_service_allowed_clients": ["10.1.0.0/24"],
        },
        {"sparkfleet_api_host": "0.0.0.0", "vllm_service_api_key": "k"},
    ],
    ids=["gpu-loopback", "no-devices", "exposed-allow-list", "exposed-open"],
)
def test_exposure_score_is_at_most_3(overrides: dict[str, Any], tmp_path: Path) -> None:
    score = exposure(render("sparkfleet-vllm.service.j2", **overrides), tmp_path)
    assert score <= MAX_EXPOSURE, f"exposure {score} > {MAX_EXPOSURE} with {overrides}"


@needs_systemd_analyze
def test_the_score_check_can_fail(tmp_path: Path) -> None:
    bare = "[Service]\nExecStart=/bin/true\n"
    assert exposure(bare, tmp_path) > MAX_EXPOSURE


def test_binding_beyond_loopback_opens_only_the_allow_list() -> None:
    listed = render(
        "sparkfleet-vllm.service.j2",
        sparkfleet_api_host="0.0.0.0",
        vllm_service_allowed_clients=["10.1.0.0/24", "fd00::5"],
    )
    assert directives(listed, "IPAddressAllow") == ["localhost", "10.1.0.0/24 fd00::5"]
    assert "Requires=sparkfleet-vllm-firewall.service" in listed.splitlines()
    assert "--host 0.0.0.0" in directives(listed, "ExecStart")[0]
    loopback = render("sparkfleet-vllm.service.j2")
    assert directives(loopback, "IPAddressAllow") == ["localhost"]
    assert "sparkfleet-vllm-firewall" not in loopback


def test_the_allow_list_ruleset_splits_ipv4_and_ipv6() -> None:
    ruleset = render(
        "sparkfleet-vllm-firewall.nft.j2",
        sparkfleet_api_port=8123,
        vllm_service_allowed_clients=["10.1.0.7", "fd00::/64"],
    )
    assert "tcp dport 8123 ip saddr { 10.1.0.7 } accept" in ruleset
    assert "tcp dport 8123 ip6 saddr { fd00::/64 } accept" in ruleset
    assert ruleset.index("accept") < ruleset.index("counter drop")


def test_extra_directives_render_and_repeat() -> None:
    unit = render(
        "sparkfleet-vllm.service.j2",
        vllm_service_extra_directives={"CPUAffinity": "0-7", "Environment": ["A=1", "B=2"]},
    )
    assert "CPUAffinity=0-7" in unit.splitlines()
    assert {"A=1", "B=2"} <= set(directives(unit, "Environment"))


@pytest.fixture
def libexec(tmp_path: Path) -> Path:
    """A libexec dir holding the unit's helpers, so `systemd-analyze verify` finds its binaries."""
    directory = tmp_path / "libexec"
    directory.mkdir()
    for helper in ("sparkfleet-memory-guard", "sparkfleet-wait-healthy", "sparkfleet-record-startup"):
        shutil.copy2(BIN / helper, directory / helper)
    return directory


def verify_unit(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    candidate = tmp_path / "candidate"
    candidate.write_text(unit_text)
    return subprocess.run(
        [str(BIN / "sparkfleet-verify-unit"), str(candidate), "sparkfleet-vllm-dflash.service"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LC_ALL": "C"},
    )


@needs_systemd_analyze
def test_verify_accepts_the_rendered_unit(libexec: Path, tmp_path: Path) -> None:
    result = verify_unit(render("sparkfleet-vllm.service.j2", vllm_service_libexec_dir=str(libexec)), tmp_path)
    assert result.returncode == 0, result.stderr


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"NoSuchKey": "1"}, "Unknown key 'NoSuchKey'"),
        ({"MemoryHigh": "lots"}, "Invalid memory limit 'lots'"),
    ],
)
def test_verify_refuses_a_bad_key_or_value(extra: dict[str, str], message: str, libexec: Path, tmp_path: Path) -> None:
    # systemd-analyze verify exits 0 on both and only warns on stderr: the helper must still refuse
    unit = render(
        "sparkfleet-vllm.service.j2", vllm_service_libexec_dir=str(libexec), vllm_service_extra_directives=extra
    )
    result = verify_unit(unit, tmp_path)
    assert result.returncode != 0
    assert message in result.stderr


GUARD = [sys.executable, str(BIN / "sparkfleet-memory-guard")]


def test_the_guard_kills_a_process_tree_over_its_limit() -> None:
    # a parent and a child holding 64 MiB each: 100 MiB is crossed only by the tree, not by one process
    hog = (
        "import subprocess,sys,time;"
        "subprocess.Popen([sys.executable,'-c','import time; b=bytearray(64*2**20); time.sleep(60)']);"
        "b=bytearray(64*2**20); time.sleep(60)"
    )
    started = time.monotonic()
    result = subprocess.run(
        [*GUARD, str(100 * 2**20), "0", "--", sys.executable, "-c", hog],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 137, result.stdout + result.stderr
    assert "reached the limit 0.10 GiB: killed 2 processes" in result.stdout
    assert time.monotonic() - started < 30


def test_the_guard_stops_the_service_when_the_host_runs_low() -> None:
    # a floor above any real MemAvailable stands in for a host running out
    result = subprocess.run(
        [*GUARD, "0", str(2**62), "--", "sleep", "30"], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 137
    assert "host MemAvailable" in result.stdout and "fell below the floor" in result.stdout


def test_the_guard_is_transparent_otherwise() -> None:
    assert subprocess.run([*GUARD, str(GIB), "0", "--", "sh", "-c", "exit 3"], check=False).returncode == 3
    sleeper = subprocess.Popen([*GUARD, str(GIB), "0", "--", "sleep", "30"], stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout is not None and "memory guard: pid" in sleeper.stdout.readline()
    sleeper.send_signal(signal.SIGTERM)
    # the command got the SIGTERM and the guard died of it too, as systemd expects of a clean stop
    assert sleeper.wait(timeout=10) == -signal.SIGTERM


def test_a_server_that_quits_on_its_own_fails_the_unit() -> None:
    # vLLM's API server exits 0 when its engine core dies: for a server that is a failure, with a reason
    quit_early = subprocess.run(
        [*GUARD, str(GIB), "0", "--", "sh", "-c", "exit 0"], capture_output=True, text=True, timeout=30, check=False
    )
    assert quit_early.returncode == 70, quit_early.stdout + quit_early.stderr
    assert "the server exited 0 although nothing asked it to stop" in quit_early.stdout
    assert "exiting 70 so that the unit restarts" in quit_early.stdout


def stop_under_the_guard(on_sigterm: str) -> tuple[int, str]:
    """Start a server under the guard that runs on_sigterm when it gets SIGTERM, stop it as systemd would,
    and return the guard's exit status and what it printed after the stop."""
    server = (
        f"import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: {on_sigterm});"
        "print('up', flush=True); time.sleep(30)"
    )
    guard = subprocess.Popen(
        [*GUARD, str(GIB), "0", "--", sys.executable, "-c", server], stdout=subprocess.PIPE, text=True
    )
    assert guard.stdout is not None and "memory guard: pid" in guard.stdout.readline()
    assert guard.stdout.readline().strip() == "up"
    guard.send_signal(signal.SIGTERM)
    return guard.wait(timeout=10), guard.stdout.read()


def test_a_clean_stop_that_ends_in_exit_0_stays_clean() -> None:
    # a server that catches SIGTERM and exits 0 (vLLM's does): asked to stop, so the guard exits 0 too
    status, printed = stop_under_the_guard("sys.exit(0)")
    assert status == 0
    assert "although nothing asked it to stop" not in printed


def test_a_requested_stop_that_ends_in_an_error_is_a_stop() -> None:
    # vLLM 0.23's shutdown can raise (psutil.ZombieProcess) and exit 1 after the stop systemd asked for:
    # the unit must end "inactive", not "failed", or the next switch's checks see a crashed unit
    status, printed = stop_under_the_guard("sys.exit(1)")
    assert status == 0, printed
    assert "the server exited 1 while stopping (asked to by signal 15); it has stopped: exiting 0" in printed
    # not asked to stop, an error stays an error
    crashed = subprocess.run(
        [*GUARD, str(GIB), "0", "--", "sh", "-c", "exit 1"], capture_output=True, text=True, timeout=30, check=False
    )
    assert crashed.returncode == 1, crashed.stdout + crashed.stderr


def test_the_guard_refuses_a_bad_limit() -> None:
    result = subprocess.run([*GUARD, "12G", "0", "--", "true"], capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "LIMIT_BYTES '12G' is not a whole number of bytes" in result.stderr


def test_argument_specs_document_every_default() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, value in defaults.items():
        if not options[name].get("required"):
            assert options[name].get("default") == value, name


def _nft_check(ruleset: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`nft --check` of a ruleset inside a fresh, empty network namespace (nothing is loaded)."""
    path = tmp_path / "vllm-firewall.nft"
    path.write_text(ruleset)
    return subprocess.run(
        ["unshare", "--net", "nft", "--check", "--file", str(path)], capture_output=True, text=True, check=False
    )


@pytest.mark.skipif(
    shutil.which("nft") is None or shutil.which("unshare") is None or os.geteuid() != 0,
    reason="needs nft, unshare and root (a private network namespace)",
)
def test_nft_accepts_the_allow_list_ruleset_and_refuses_a_bad_address(tmp_path: Path) -> None:
    good = render(
        "sparkfleet-vllm-firewall.nft.j2", vllm_service_allowed_clients=["10.1.0.7", "10.2.0.0/16", "fd00::/64"]
    )
    result = _nft_check(good, tmp_path)
    if "Operation not permitted" in result.stderr:
        pytest.skip(f"no netlink here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    bad = render("sparkfleet-vllm-firewall.nft.j2", vllm_service_allowed_clients=["10.1.0.300"])
    refused = _nft_check(bad, tmp_path)
    assert refused.returncode != 0 and "10.1.0.300" in refused.stderr


def test_the_templates_render_the_plans_unit_and_compute_nothing() -> None:
    """Every value of the unit, its env file and its firewall comes from the plan's unit (vllm_service_spec)
    or the secrets beside it: the templates name no other variable and use no filter but ``comment``."""
    from jinja2 import Environment, nodes

    allowed = {"vllm_service_spec", "ansible_managed", "vllm_service_api_key", "vllm_service_hf_token"}
    for name in (
        "sparkfleet-vllm.service.j2",
        "sparkfleet-vllm.env.j2",
        "sparkfleet-vllm-firewall.nft.j2",
        "sparkfleet-vllm-firewall.service.j2",
    ):
        tree = Environment().parse((TEMPLATES / name).read_text())
        loop_vars = {node.name for node in tree.find_all(nodes.Name) if node.ctx == "store"}
        names = {node.name for node in tree.find_all(nodes.Name) if node.ctx == "load"} - loop_vars
        assert names <= allowed, f"{name} reads {sorted(names - allowed)}"
        filters = {node.name for node in tree.find_all(nodes.Filter)}
        assert filters <= {"comment", "join"}, f"{name} computes with {sorted(filters)}"
        assert not list(tree.find_all(nodes.Call)), f"{name} calls a function"
