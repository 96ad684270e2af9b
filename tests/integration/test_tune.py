"""`make tune` on a sandbox host: each value of num_speculative_tokens served, health gated and
benchmarked; the best served through the deploy path and written into the host's inventory vars, which a
later deploy keeps; an interrupted tune (Ctrl-C) puts the host back on its last good unit.

Works on a copy of the sandbox inventory (the repo's stays clean) and returns the host to the
converged fleet's state (num_speculative_tokens 12).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ROOT, run_make, run_playbook

# heavy: ~9 min on a 2-core CI machine (two values served and benchmarked, a Ctrl-C, a full re-deploy)
pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

DFLASH = "sparkfleet-vllm-dflash.service"


def served_n(fleet, host: str) -> int:
    unit = fleet.ssh(host, f"cat /etc/systemd/system/{DFLASH}").stdout
    found = re.findall(r'num_speculative_tokens\\?":\s*(\d+)', unit)
    assert len(found) == 1, unit
    return int(found[0])


def state_without_startup(fleet, host: str, path: str) -> dict:
    out = fleet.ssh(host, f"cat {path}")
    assert out.returncode == 0, out.stderr
    return {k: v for k, v in json.loads(out.stdout).items() if k != "startup"}


def test_tune_serves_and_records_the_best_n_and_an_interrupted_tune_goes_back(
    converged_fleet, sandbox_fleet, inventory_with_host_vars
) -> None:
    host = sandbox_fleet.names[2]
    inv = Path(inventory_with_host_vars(host, {"sparkfleet_serve_args_host": {}}))
    vars_file = inv / "host_vars" / f"{host}.yml"
    assert served_n(sandbox_fleet, host) == 12
    results = ROOT / "results" / "tune" / host
    before = set(results.glob("*-tune-dflash-counting.json")) if results.is_dir() else set()
    try:
        tuned = run_make(
            "tune", f"INVENTORY={inv}", f"LIMIT={host}", "WORKLOAD=counting", "RANGE=4,8", "QUICK=1", timeout=900
        )
        assert tuned.returncode == 0, tuned.output[-6000:]
        # the table: one row per value, each with its honest decode figure and acceptance, the best marked
        rows = re.findall(r"\|\s+(\d+) \| ([\d.]+) \| (client|server) \| ([\d.]+) \|", tuned.output)
        assert sorted(int(n) for n, *_ in rows) == [4, 8], tuned.output[-6000:]
        (record_file,) = set(results.glob("*-tune-dflash-counting.json")) - before
        record = json.loads(record_file.read_text())
        assert (record_file.with_suffix(".png")).read_bytes().startswith(b"\x89PNG")
        measured = {row["n"]: row for row in record["rows"]}
        assert set(measured) == {4, 8} and all(row["decode_tok_s"] > 0 for row in measured.values())
        best = max(measured.values(), key=lambda row: (row["decode_tok_s"], -row["n"]))
        winner = record["winner"]["num_speculative_tokens"]
        assert winner == best["n"] and f"best: n={winner}," in tuned.output
        # each value was served by its own unit start: the decode results the rows come from say so
        for row in measured.values():
            assert row["acceptance_length"] is not None and 1.0 <= row["acceptance_length"] <= row["n"] + 1
        # written into the host's inventory vars, next to what the operator had there
        written = yaml.safe_load(vars_file.read_text())
        assert written["sparkfleet_serve_args_host"] == {}
        assert written["sparkfleet_tuned"]["dflash"]["num_speculative_tokens"] == winner
        assert written["sparkfleet_tuned"]["dflash"]["workload"] == "counting"
        # the host serves the winner, healthy, remembered as its last good state
        assert served_n(sandbox_fleet, host) == winner
        assert sandbox_fleet.ssh(host, f"systemctl is-active {DFLASH}").stdout.strip() == "active"
        good = state_without_startup(sandbox_fleet, host, "/etc/sparkfleet/last-good/state.json")
        assert state_without_startup(sandbox_fleet, host, "/etc/sparkfleet/state.json") == good
        assert good["profile_spec"]["speculative"]["num_speculative_tokens"] == winner

        # a deploy with the tuned inventory keeps it: nothing to change
        again = run_playbook(
            "-i", str(inv), "site.yml", "--limit", host, "-e", "sparkfleet_profile=dflash", "--tags", "vllm_service"
        )
        assert again.returncode == 0, again.output[-4000:]
        assert again.recap[host]["changed"] == 0, again.output[-6000:]

        # Ctrl-C while another value is served: the host goes back to the tuned unit
        other = 10 if winner != 10 else 6
        proc = subprocess.Popen(
            ["make", "--no-print-directory", "tune", f"INVENTORY={inv}", f"LIMIT={host}", "WORKLOAD=counting"]
            + [f"RANGE={other},{winner}", "QUICK=1"],
            cwd=ROOT,
            env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while served_n(sandbox_fleet, host) != other:
            assert proc.poll() is None and time.monotonic() < deadline, "the tune never served the other value"
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
        output, _ = proc.communicate(timeout=600)
        print(output[-6000:])
        assert proc.returncode != 0
        assert "make tune: stopped" in output and "make tune was interrupted" in output, output[-6000:]
        assert "ROLLED BACK to its last good state: profile dflash" in output
        assert served_n(sandbox_fleet, host) == winner
        assert sandbox_fleet.ssh(host, f"systemctl is-active {DFLASH}").stdout.strip() == "active"
        assert state_without_startup(sandbox_fleet, host, "/etc/sparkfleet/state.json") == good
        # the interrupted tune wrote nothing
        assert yaml.safe_load(vars_file.read_text())["sparkfleet_tuned"]["dflash"]["num_speculative_tokens"] == winner
        unit_file, good_unit_file = f"/etc/systemd/system/{DFLASH}", f"/etc/sparkfleet/last-good/{DFLASH}"
        assert sandbox_fleet.ssh(host, f"cmp {good_unit_file} {unit_file}").returncode == 0

        # Ctrl-C between writing the new unit file and restarting it: the old process still serves and
        # state.json is unchanged, but the next start would serve the new file; restore.yml puts it back
        tamper = sandbox_fleet.ssh(host, f"sed -E -i 's/(num_speculative_tokens[^0-9]*)[0-9]+/\\1{other}/' {unit_file}")
        assert tamper.returncode == 0 and served_n(sandbox_fleet, host) == other, tamper.stderr
        interrupted = run_playbook("-i", str(inv), "playbooks/restore.yml", "--limit", host)
        assert interrupted.returncode != 0, interrupted.output[-4000:]
        assert "its unit file is not the last good one: putting it back" in interrupted.output, interrupted.output
        assert sandbox_fleet.ssh(host, f"cmp {good_unit_file} {unit_file}").returncode == 0
        assert served_n(sandbox_fleet, host) == winner
    finally:
        # the whole deploy path, so that the last good state is the fleet's again too; its restart prints
        # a progress line (the unit's state and last journal line) every 2 s instead of 30
        restore = run_playbook(
            "site.yml", "--limit", host, "-e", "sparkfleet_profile=dflash", "-e", "vllm_service_progress_interval=2"
        )
        assert restore.returncode == 0, restore.output[-4000:]
    assert served_n(sandbox_fleet, host) == 12
    assert re.search(rf"\[{host}\] {DFLASH} activating \(start(-post)?\), \d+ s: \S", restore.output), restore.output
    assert state_without_startup(sandbox_fleet, host, "/etc/sparkfleet/last-good/state.json") == (
        state_without_startup(sandbox_fleet, host, "/etc/sparkfleet/state.json")
    )
