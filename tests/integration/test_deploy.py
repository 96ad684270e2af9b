"""The real deploy, end to end, on the 3-host sandbox fleet (issue 2's acceptance).

One deploy of the `dflash` profile; then its effects are checked on the hosts themselves, a second
run must change nothing, and check mode on the converged fleet must report nothing to change.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.integration.conftest import ROOT, run_make, run_playbook

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

UNIT = "sparkfleet-vllm-dflash.service"


@pytest.fixture(scope="module")
def deployed(converged_deploy):
    converged_deploy.converge_owed()
    return converged_deploy.run


def test_every_host_is_serving_and_summarised(deployed, sandbox_hosts, sandbox_fleet) -> None:
    for host in sandbox_hosts:
        assert deployed.recap[host]["failed"] == 0
        state = sandbox_fleet.ssh(host, f"systemctl is-active {UNIT}").stdout.strip()
        assert state == "active", f"{host}: {UNIT} is {state}"
        enabled = sandbox_fleet.ssh(host, f"systemctl is-enabled {UNIT}").stdout.strip()
        assert enabled == "enabled"
        listening = sandbox_fleet.ssh(host, "ss -Hltn 'sport = :8000'").stdout
        assert "127.0.0.1:8000" in listening, f"{host}: nothing listens on 127.0.0.1:8000: {listening!r}"
        # the summary names each host with its profile and health, and the health gate scored the
        # smoke completion with the target alone: every token was its greedy choice
        line = next((x for x in deployed.output.splitlines() if host in x and "profile=dflash" in x), "")
        assert "health=ok" in line, f"no healthy summary line for {host}"
        greedy = re.search(r"target-greedy=(\d+)/(\d+)", line)
        assert greedy and greedy.group(1) == greedy.group(2) and int(greedy.group(2)) >= 1, line
        # the unit's start recorded its figures in state.json (sparkfleet-record-startup, issue 16 point 2):
        # from this start's journal, systemd's timestamps and the memory guard
        recorded = json.loads(sandbox_fleet.ssh(host, "cat /etc/sparkfleet/state.json").stdout)["startup"]
        invocation = sandbox_fleet.ssh(host, f"systemctl show -P InvocationID {UNIT}").stdout.strip()
        assert recorded["invocation_id"] == invocation, (recorded, invocation)
        assert recorded["context_tokens"] == 1024 and recorded["kv_pool_tokens"] > 0, recorded
        # a tiny model on a fast host loads in "0.00 seconds": the figure is there, and no later than ready
        assert 0 <= recorded["weights_load_s"] < recorded["ready_s"] < 900, recorded
        assert recorded["peak_service_bytes"] > 0 and recorded["min_available_bytes"] > 0, recorded
        assert recorded["free_at_ready_bytes"] > 0, recorded


def test_hosts_install_exactly_the_hash_pinned_lock_and_refuse_a_file_it_does_not_pin(
    deployed, sandbox_hosts, sandbox_fleet
) -> None:
    """The sandbox's CPU stack goes through the same hash-checked install as a Spark's GPU stack
    (vllm_wheel_lock): the venv holds the lock's distributions at its versions and the patched vLLM,
    and the host's pip refuses a wheel whose bytes are not the ones the lock pins."""
    from sparkfleet.build import wheelhouse

    lock = wheelhouse.load_lock(wheelhouse.FLAVORS["cpu"].lock)
    host = sandbox_hosts[0]
    state = json.loads(sandbox_fleet.ssh(host, "cat /etc/sparkfleet/state.json").stdout)
    venv = state["venv"]
    requirements = sandbox_fleet.ssh(host, f"cat /opt/sparkfleet/wheels/vllm-{state['vllm_version']}.requirements.txt")
    assert requirements.returncode == 0, requirements.stderr
    pinned = wheelhouse.load_lock_text(requirements.stdout)
    assert {name: entry for name, entry in pinned.items() if name != "vllm"} == lock
    assert pinned["vllm"][0] == state["vllm_version"] and len(pinned["vllm"][1]) == 1
    listed = sandbox_fleet.ssh(host, f"{venv}/bin/python -m pip list --format=json --disable-pip-version-check")
    assert listed.returncode == 0, listed.stderr
    installed = {row["name"].lower().replace("_", "-"): row["version"] for row in json.loads(listed.stdout)}
    assert installed.pop("vllm") == state["vllm_version"]
    assert {name: installed.get(name) for name in lock} == {name: version for name, (version, _) in lock.items()}
    assert set(installed) - set(lock) <= {"pip", "setuptools"}, sorted(set(installed) - set(lock))
    # a file of the wheelhouse with one byte more: the hash check refuses it, nothing is installed
    _, dists = wheelhouse.load_metadata(wheelhouse.FLAVORS["cpu"].metadata)
    name, filename = next((n, d.filename) for n, d in sorted(dists.items()) if d.filename.endswith("-none-any.whl"))
    script = (
        "set -e; t=$(mktemp -d); trap 'rm -rf $t' EXIT; mkdir $t/links; "
        f"cp /srv/sparkfleet/wheelhouse/{filename} $t/links/ && printf x >> $t/links/{filename}; "
        f"grep -A1 '^{name}==' /opt/sparkfleet/wheels/vllm-{state['vllm_version']}.requirements.txt > $t/req.txt; "
        f"PIP_CONFIG_FILE=/dev/null {venv}/bin/python -m pip download --no-deps --no-index --find-links $t/links "
        "--require-hashes --disable-pip-version-check -d $t/out -r $t/req.txt 2>&1 || echo exit=$?"
    )
    refused = sandbox_fleet.ssh(host, f"bash -c {shlex.quote(script)}")
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stdout and "exit=1" in refused.stdout, refused.stdout


def test_a_completion_over_http_returns_text(deployed, sandbox_hosts, sandbox_fleet) -> None:
    request = json.dumps({"model": "qwen", "prompt": "1 2 3 4", "max_tokens": 8, "temperature": 0})
    script = (
        "import json,sys,urllib.request;"
        "r=urllib.request.Request('http://127.0.0.1:8000/v1/completions',data=sys.argv[1].encode(),"
        "headers={'Content-Type':'application/json'});"
        "print(urllib.request.urlopen(r,timeout=60).read().decode())"
    )
    texts = {}
    for host in sandbox_hosts:
        out = sandbox_fleet.ssh(host, f"python3 -c {shlex.quote(script)} {shlex.quote(request)}")
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["usage"]["completion_tokens"] >= 1
        texts[host] = body["choices"][0]["text"]
        assert texts[host], f"{host}: empty completion"
    # same model, same weights, temperature 0: every host answers the same
    assert len(set(texts.values())) == 1, texts


def test_the_service_runs_unprivileged_and_hardened(deployed, sandbox_hosts, sandbox_fleet) -> None:
    host = sandbox_hosts[0]
    user = sandbox_fleet.ssh(host, f"systemctl show -p User --value {UNIT}").stdout.strip()
    assert user == "vllm"
    pid = sandbox_fleet.ssh(host, f"systemctl show -p MainPID --value {UNIT}").stdout.strip()
    assert pid.isdigit() and pid != "0", f"{host}: MainPID {pid!r}"
    owner = sandbox_fleet.ssh(host, f"stat -c %u /proc/{pid}")
    vllm_uid = sandbox_fleet.ssh(host, "id -u vllm")
    assert owner.returncode == 0 and vllm_uid.returncode == 0, owner.stderr + vllm_uid.stderr
    # the main process runs as the service user, whose uid is not root's
    assert owner.stdout.strip() == vllm_uid.stdout.strip() != "0"
    env_mode = sandbox_fleet.ssh(host, "stat -c '%a %U' /etc/sparkfleet/vllm-dflash.env").stdout.strip()
    assert env_mode == "600 root"  # systemd reads it as root; the service user can neither read nor change it
    props = sandbox_fleet.ssh(host, f"systemctl show -p NoNewPrivileges -p ProtectSystem -p Restart {UNIT}").stdout
    assert "NoNewPrivileges=yes" in props and "ProtectSystem=strict" in props and "Restart=on-failure" in props
    environment = sandbox_fleet.ssh(host, f"systemctl show -p Environment --value {UNIT}").stdout
    assert "SPARKFLEET_PATCHSET=" in environment
    # served from the verified local cache: the hub is never asked at run time
    assert "HF_HUB_OFFLINE=1" in environment.split()
    # no token in the unit, its environment or its env file (the hub fetch is the controller's)
    unit_and_env = sandbox_fleet.ssh(host, f"systemctl cat {UNIT}; cat /etc/sparkfleet/vllm-dflash.env").stdout
    assert "HF_TOKEN" not in unit_and_env and "HUGGING_FACE_HUB_TOKEN" not in unit_and_env


def test_second_run_changes_nothing(deployed, sandbox_hosts) -> None:
    again = run_playbook("site.yml", "-e", "sparkfleet_profile=dflash")
    assert again.returncode == 0, again.output[-4000:]
    assert {h: again.recap[h]["changed"] for h in sandbox_hosts} == dict.fromkeys(sandbox_hosts, 0)
    # the weights step ends with one line per host: its models, files, bytes, verified
    models = ROOT / "build" / "models"
    files = [f for name in ("tiny-qwen3", "tiny-qwen3-dflash") for f in (models / name).rglob("*") if f.is_file()]
    expected = f"2 local models, {len(files)} files, "
    for host in sandbox_hosts:
        assert any(
            f"model_cache {host}: {expected}" in line
            and f"({sum(f.stat().st_size for f in files)} bytes), already in place, verified=yes" in line
            for line in again.output.splitlines()
        ), f"no weights summary for {host}"


def test_check_mode_on_a_converged_fleet_reports_nothing(deployed, sandbox_hosts) -> None:
    check = run_playbook("site.yml", "-e", "sparkfleet_profile=dflash", "--check", "--diff")
    assert check.returncode == 0, check.output[-4000:]
    assert {h: check.recap[h]["changed"] for h in sandbox_hosts} == dict.fromkeys(sandbox_hosts, 0)


# What a read-only run must leave as it was on a host (vLLM's own cache under the state dir moves by itself).
TREE = (
    "find /etc /opt/sparkfleet /usr/local /var/lib/sparkfleet -xdev -path /var/lib/sparkfleet/cache -prune "
    "-o -printf '%y %m %u %s %T@ %p\\n' 2>/dev/null | sort"
)


def test_doctor_passes_on_the_converged_fleet_and_changes_nothing(deployed, sandbox_hosts, sandbox_fleet) -> None:
    trees = {host: sandbox_fleet.ssh(host, TREE, timeout=120).stdout for host in sandbox_hosts}
    pids = {h: sandbox_fleet.ssh(h, f"systemctl show -p MainPID --value {UNIT}").stdout for h in sandbox_hosts}
    doctor = run_make("doctor", "PROFILE=dflash", timeout=300)
    assert doctor.returncode == 0, doctor.output[-4000:]
    for host in sandbox_hosts:
        # the row is the debug task's msg (YAML results: quoted where it holds ": ")
        row = next((line for line in doctor.output.splitlines() if re.match(rf"\s*msg: ['\"]?{host}  ", line)), "")
        assert f"{host}  PASS  arch x86_64 (allowed: spark_preflight_allow_non_aarch64) ok" in row, row
        for cell in ("gpu NVIDIA GB10 cc 12.1 ok", "driver 580.95.05 (branch 580) ok", "memory guard on ok"):
            assert cell in row, (cell, row)
        assert f"port 8000 held by {UNIT} ok" in row, row
        assert doctor.recap[host]["changed"] == 0
        assert sandbox_fleet.ssh(host, TREE, timeout=120).stdout == trees[host], f"{host}: the doctor changed files"
        assert sandbox_fleet.ssh(host, f"systemctl show -p MainPID --value {UNIT}").stdout == pids[host]


def test_unknown_profile_fails_before_any_host_is_touched(deployed, sandbox_hosts, sandbox_fleet) -> None:
    before = sandbox_fleet.ssh(sandbox_hosts[0], f"systemctl show -p ActiveEnterTimestamp --value {UNIT}").stdout
    bad = run_playbook("site.yml", "-e", "sparkfleet_profile=turbo")
    assert bad.returncode != 0
    assert "unknown profile 'turbo': valid profiles are" in bad.output
    assert not any(h in bad.recap for h in sandbox_hosts), "a host was contacted"
    after = sandbox_fleet.ssh(sandbox_hosts[0], f"systemctl show -p ActiveEnterTimestamp --value {UNIT}").stdout
    assert before == after
