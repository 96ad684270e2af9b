"""The serving unit survives what happens to real hosts (issue 5, point 8).

On the fleet converged on `dflash`: the server's engine core is killed with SIGKILL (the API server
then exits 0, which the memory guard turns into a failure) and systemd brings the unit back through
its health-gated start; a host reboots and the enabled unit serves again after the boot. (A kill of
the API server itself is a signal death the guard passes on: tests/unit/test_unit_template.py.)
Each test leaves its host serving `dflash`, as it found it.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from tests.sandbox import fleet

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

UNIT = "sparkfleet-vllm-dflash.service"
# A cold start of the tiny models on the CPU build; a reboot adds the boot itself.
START_SECONDS = 600

COMPLETION = (
    "import json,sys,urllib.request;"
    "r=urllib.request.Request('http://127.0.0.1:8000/v1/completions',data=sys.argv[1].encode(),"
    "headers={'Content-Type':'application/json'});"
    "print(urllib.request.urlopen(r,timeout=120).read().decode())"
)
HEALTH = "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8000/health',timeout=5).status)"


def unit_show(sandbox_fleet, host: str, *properties: str) -> dict[str, str]:  # noqa: ANN001
    argv = " ".join(f"-p {p}" for p in properties)
    out = sandbox_fleet.ssh(host, f"systemctl show {argv} {UNIT}", timeout=30)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def wait_serving(sandbox_fleet, host: str, not_pid: str) -> dict[str, str]:  # noqa: ANN001
    """Wait until the unit is active with a main process other than not_pid and /health answers 200."""
    deadline = time.monotonic() + START_SECONDS
    facts: dict[str, str] = {}
    while time.monotonic() < deadline:
        facts = unit_show(sandbox_fleet, host, "ActiveState", "SubState", "MainPID", "NRestarts")
        if facts.get("ActiveState") == "active" and facts.get("MainPID") not in ("", "0", not_pid):
            health = sandbox_fleet.ssh(host, f"python3 -c {shlex.quote(HEALTH)}", timeout=30)
            if health.stdout.strip() == "200":
                return facts
        if facts.get("ActiveState") == "failed":
            break
        time.sleep(2)
    journal = sandbox_fleet.ssh(host, f"journalctl -u {UNIT} -n 40 --no-pager", timeout=30).stdout
    pytest.fail(f"{host}: {UNIT} did not serve again within {START_SECONDS} s: {facts}\n{journal}")


def completes(sandbox_fleet, host: str) -> str:  # noqa: ANN001
    request = json.dumps({"model": "qwen", "prompt": "1 2 3 4", "max_tokens": 8, "temperature": 0})
    out = sandbox_fleet.ssh(host, f"python3 -c {shlex.quote(COMPLETION)} {shlex.quote(request)}", timeout=180)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["usage"]["completion_tokens"] >= 1, body
    return body["choices"][0]["text"]


def test_kill_9_the_engine_core_and_systemd_restarts_it_to_health(converged_fleet, sandbox_fleet) -> None:  # noqa: ANN001
    host = sandbox_fleet.names[0]
    before = unit_show(sandbox_fleet, host, "MainPID", "NRestarts", "ActiveState")
    assert before["ActiveState"] == "active", before
    text_before = completes(sandbox_fleet, host)
    # the engine core, as a crash, an operator's kill -9 or an OOM kill of it would end it: vLLM's
    # API server then logs EngineDeadError and exits 0, which Restart=on-failure alone would not restart
    engine = sandbox_fleet.ssh(host, "pgrep -f '^VLLM::EngineCore'", timeout=30).stdout.split()
    assert len(engine) == 1 and engine[0].isdigit(), f"{host}: engine core processes {engine}"
    killed = sandbox_fleet.ssh(host, f"kill -9 {engine[0]}", timeout=30)
    assert killed.returncode == 0, killed.stderr

    after = wait_serving(sandbox_fleet, host, not_pid=before["MainPID"])
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    journal = sandbox_fleet.ssh(host, f"journalctl -u {UNIT} --since=-15min --no-pager", timeout=30).stdout
    # why it restarted, in the journal: the guard's line and systemd's failure status
    assert "memory guard: the server exited 0 although nothing asked it to stop" in journal, journal[-3000:]
    assert "status=70/" in journal, journal[-3000:]  # systemd: Main process exited, code=exited, status=70/...
    # the same weights at temperature 0: the same answer as before the crash
    assert completes(sandbox_fleet, host) == text_before


@pytest.mark.heavy  # a host's boot and a cold start beside two serving hosts: minutes on 2 cores
def test_reboot_and_the_enabled_unit_serves_again(converged_fleet, sandbox_fleet) -> None:  # noqa: ANN001
    name = sandbox_fleet.names[1]
    host = fleet.host_from_name(name)
    before = unit_show(sandbox_fleet, name, "MainPID", "ActiveState", "UnitFileState")
    assert before["ActiveState"] == "active" and before["UnitFileState"] == "enabled", before
    text_before = completes(sandbox_fleet, name)
    marker = sandbox_fleet.ssh(name, "touch /run/sparkfleet-lifecycle-marker", timeout=30)
    assert marker.returncode == 0, marker.stderr
    nspawn_before = fleet.nspawn_pid(host)

    sandbox_fleet.ssh(name, "systemctl reboot", timeout=30)  # the connection may drop: no rc check
    deadline = time.monotonic() + 120
    while fleet.nspawn_pid(host) in (None, nspawn_before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fleet.nspawn_pid(host) not in (None, nspawn_before), f"{name} did not boot again"
    # nobody starts the unit by hand: it is enabled, so the boot starts it
    wait_serving(sandbox_fleet, name, not_pid="")
    after = unit_show(sandbox_fleet, name, "ActiveState", "UnitFileState")
    assert after == {"ActiveState": "active", "UnitFileState": "enabled"}, after
    # /run is fresh after a real boot (a container shares the machine's boot_id)
    assert sandbox_fleet.ssh(name, "test -e /run/sparkfleet-lifecycle-marker", timeout=30).returncode == 1
    assert completes(sandbox_fleet, name) == text_before
