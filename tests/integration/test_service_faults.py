"""Faults on a serving host, reported and repaired (issue 18, points 1, 4, 5 and 7).

On the fleet converged on `dflash`, one host at a time:
- a crash loop: the unit is given an argument vLLM 0.23 refuses (a runtime drop-in under /run, so the
  unit file itself is untouched); systemd restarts it until the unit's own StartLimitBurst= and then
  stops; `make health` and `make status` say "crash loop" with vLLM's own error line at once; a restart
  while another operation holds the host lock is refused naming the holder and changes nothing; once
  the cause is gone `make restart` brings the host back (reset-failed included);
- a flipped byte in a served weight file and a line appended to an installed vLLM source file: `make
  drift` names both, `make deploy` restores both files and restarts the server on them, health-gated.
Each test leaves its host serving `dflash`, as it found it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import ROOT, run_make

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

UNIT = "sparkfleet-vllm-dflash.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
DROP_IN_DIR = f"/run/systemd/system/{UNIT}.d"
BOGUS = "--sparkfleet-crash-test"
VLLM_ERROR = f"vllm: error: unrecognized arguments: {BOGUS}"
HOST_LOCK = "/usr/local/libexec/sparkfleet/sparkfleet-host-lock"
MODEL_FILE = "/var/lib/sparkfleet/models/tiny-qwen3/model.safetensors"


def sh(fleet, host: str, command: str, timeout: float = 120) -> str:  # noqa: ANN001
    result = fleet.ssh(host, command, timeout=timeout)
    assert result.returncode == 0, f"{host}: `{command}` failed: {result.stdout}{result.stderr}"
    return result.stdout.strip()


def show(fleet, host: str, *properties: str) -> dict[str, str]:  # noqa: ANN001
    out = sh(fleet, host, f"systemctl show {' '.join('-p ' + p for p in properties)} {UNIT}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def ops_status(host: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "ops", "status", "--json", "-l", host],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    return proc.returncode, json.loads(proc.stdout)


def served_state(fleet, host: str) -> dict[str, str]:  # noqa: ANN001
    """What must not move while a fault is only reported: the unit file and its process."""
    return {"unit_sha256": sh(fleet, host, f"sha256sum {UNIT_PATH}").split()[0], **show(fleet, host, "MainPID")}


def test_a_crash_loop_is_rate_limited_reported_and_recovered(converged_fleet, sandbox_fleet) -> None:  # noqa: ANN001
    host = sandbox_fleet.names[1]
    unit_sha = served_state(sandbox_fleet, host)["unit_sha256"]
    own_burst = int(show(sandbox_fleet, host, "StartLimitBurst")["StartLimitBurst"])
    assert 1 < own_burst <= 10, own_burst
    # the same ExecStart plus an argument vLLM refuses; RestartSec=1 and a burst of 2 only to keep the
    # test short (each failed start imports vLLM first, ~10 s here): the rate limit, StartLimitBurst=
    # in the unit's own StartLimitIntervalSec=, is systemd's, as on a Spark
    burst = 2
    sh(
        sandbox_fleet,
        host,
        f"mkdir -p {DROP_IN_DIR} && {{ echo '[Unit]'; echo StartLimitBurst={burst}; echo '[Service]'; "
        f"echo ExecStart=; grep '^ExecStart=' {UNIT_PATH} | sed 's/$/ {BOGUS}/'; echo RestartSec=1; }} "
        f"> {DROP_IN_DIR}/crash.conf && systemctl daemon-reload",
    )
    assert int(show(sandbox_fleet, host, "StartLimitBurst")["StartLimitBurst"]) == burst
    sandbox_fleet.ssh(host, f"systemctl restart {UNIT}", timeout=120)  # fails: the start does not take
    deadline = time.monotonic() + 300
    facts = show(sandbox_fleet, host, "ActiveState", "NRestarts", "Result")
    while facts["ActiveState"] != "failed" and time.monotonic() < deadline:
        time.sleep(3)
        facts = show(sandbox_fleet, host, "ActiveState", "NRestarts", "Result")
    assert facts["ActiveState"] == "failed", facts
    assert int(facts["NRestarts"]) == burst, f"restarted until the rate limit, then stopped: {facts}"
    journal = sh(sandbox_fleet, host, f"journalctl -u {UNIT} -n 30 --no-pager -o cat")
    assert "Start request repeated too quickly" in journal, journal

    health = run_make("health", f"LIMIT={host}", timeout=300)
    assert health.returncode != 0
    assert 'at "Fail at once on a unit that is not running"' in health.output, health.output[-3000:]
    assert f"{host}: crash loop: {UNIT} kept failing ({burst} automatic restarts)" in health.output
    assert f"last error: {VLLM_ERROR};" in health.output and f"systemctl reset-failed {UNIT}" in health.output

    rc, status = ops_status(host)
    assert rc == 1
    (outcome,) = status
    assert (outcome["ok"], outcome["row"]["unit"]) == (False, "crash-loop"), outcome
    assert f"last error: {VLLM_ERROR};" in outcome["problems"], outcome

    sh(sandbox_fleet, host, f"rm -rf {DROP_IN_DIR} && systemctl daemon-reload")
    # another operation holds the host lock: the restart is refused, naming it, and nothing moves
    holder = "sparkfleet-test-holder"
    sh(
        sandbox_fleet,
        host,
        f"systemd-run --unit sparkfleet-test-lock --collect {HOST_LOCK} --holder {holder} -- sleep 300",
    )
    sh(
        sandbox_fleet,
        host,
        f"for i in $(seq 50); do grep -q {holder} /run/lock/sparkfleet-ops.lock && exit 0; sleep 0.2; done; exit 1",
    )
    refused = run_make("restart", f"LIMIT={host}", timeout=300)
    assert refused.returncode != 0
    assert f'is held by "{holder}"' in refused.output and "running: sleep 300" in refused.output, refused.output[-3000:]
    assert show(sandbox_fleet, host, "ActiveState")["ActiveState"] == "failed", "the refused restart started nothing"
    sh(sandbox_fleet, host, "systemctl stop sparkfleet-test-lock")

    restart = run_make("restart", f"LIMIT={host}", timeout=600)
    assert restart.returncode == 0, restart.output[-3000:]
    assert show(sandbox_fleet, host, "ActiveState")["ActiveState"] == "active"
    assert served_state(sandbox_fleet, host)["unit_sha256"] == unit_sha, "the unit file was never rewritten"
    healthy = run_make("health", f"LIMIT={host}", timeout=600)
    assert healthy.returncode == 0, healthy.output[-3000:]


def test_drift_names_tampered_weights_and_venv_files_and_deploy_restores_and_reloads_them(
    converged_fleet,
    sandbox_fleet,  # noqa: ANN001
) -> None:
    host, reference = sandbox_fleet.names[0], sandbox_fleet.names[1]
    state = json.loads(sh(sandbox_fleet, host, "cat /etc/sparkfleet/state.json"))
    source = f"{state['venv']}/lib/python3.*/site-packages/vllm/envs.py"
    good = {
        "weights": sh(sandbox_fleet, reference, f"sha256sum {MODEL_FILE}").split()[0],
        "source": sh(sandbox_fleet, reference, f"sha256sum {source}").split()[0],
    }
    assert sh(sandbox_fleet, host, f"sha256sum {MODEL_FILE}").split()[0] == good["weights"]
    pid_before = show(sandbox_fleet, host, "MainPID")["MainPID"]
    flip = (
        "import sys; f = open(sys.argv[1], 'r+b'); f.seek(-100, 2); b = f.read(1); f.seek(-100, 2); "
        "f.write(bytes([b[0] ^ 1])); f.close()"
    )
    sh(sandbox_fleet, host, f"python3 -c {shlex.quote(flip)} {MODEL_FILE}")
    sh(sandbox_fleet, host, f"echo '# tampered by test_service_faults' >> {source}")
    tampered = {
        "weights": sh(sandbox_fleet, host, f"sha256sum {MODEL_FILE}").split()[0],
        "source": sh(sandbox_fleet, host, f"sha256sum {source}").split()[0],
    }
    assert tampered["weights"] != good["weights"] and tampered["source"] != good["source"]

    drift = run_make("drift", "PROFILE=dflash", f"LIMIT={host}", timeout=600)
    assert drift.returncode == 0, drift.output[-4000:]
    line = next((row for row in drift.output.splitlines() if row.split()[:2] == [host, "DRIFT"]), "")
    assert "Ship each local model directory" in line, drift.output[-3000:]
    assert "Verify the venv" in line, drift.output[-3000:]
    assert "vllm/envs.py: changed" in drift.output
    # check mode changed nothing
    assert sh(sandbox_fleet, host, f"sha256sum {MODEL_FILE}").split()[0] == tampered["weights"]
    assert sh(sandbox_fleet, host, f"sha256sum {source}").split()[0] == tampered["source"]
    assert show(sandbox_fleet, host, "MainPID")["MainPID"] == pid_before

    deploy = run_make("deploy", "PROFILE=dflash", f"LIMIT={host}", timeout=900)
    assert deploy.returncode == 0, deploy.output[-4000:]
    assert "weights of tiny-qwen3" in deploy.output and "venv files of vllm" in deploy.output, deploy.output[-4000:]
    assert sh(sandbox_fleet, host, f"sha256sum {MODEL_FILE}").split()[0] == good["weights"]
    assert sh(sandbox_fleet, host, f"sha256sum {source}").split()[0] == good["source"]
    after = show(sandbox_fleet, host, "MainPID", "ActiveState")
    assert after["ActiveState"] == "active" and after["MainPID"] != pid_before, "the server loads what was verified"
