"""Switching profiles and rolling re-provisions on the sandbox fleet, with real failures.

Each test starts from the fleet converged on the `dflash` profile and returns it to that state.

A failure is made the way an operator would make one by mistake: a host's own serve-argument
tweak (`sparkfleet_serve_args_host` in its host_vars) asks for a context the model does not have,
so vLLM refuses to start and the host's health gate fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ROOT, run_make, run_playbook
from tests.integration.test_fleet_ops import ops

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

DFLASH = "sparkfleet-vllm-dflash.service"
BASE = "sparkfleet-vllm-base.service"
DENSE = "sparkfleet-vllm-dense.service"
BROKEN = {"max-model-len": 1_000_000}  # beyond the tiny models' max_position_embeddings


def state(fleet, host: str) -> dict:
    out = fleet.ssh(host, "cat /etc/sparkfleet/state.json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def active(fleet, host: str, unit: str) -> str:
    return fleet.ssh(host, f"systemctl is-active {unit}").stdout.strip()


def enabled(fleet, host: str, unit: str) -> str:
    return fleet.ssh(host, f"systemctl is-enabled {unit}").stdout.strip()


def main_pid(fleet, host: str, unit: str) -> str:
    return fleet.ssh(host, f"systemctl show -p MainPID --value {unit}").stdout.strip()


def test_switch_to_dense_and_back(converged_fleet, sandbox_fleet) -> None:
    host = sandbox_fleet.names[-1]
    to_dense = run_playbook("playbooks/switch.yml", "--limit", host, "-e", "sparkfleet_profile=dense")
    assert to_dense.returncode == 0, to_dense.output[-4000:]
    assert active(sandbox_fleet, host, DENSE) == "active"
    assert active(sandbox_fleet, host, DFLASH) == "inactive"  # Conflicts= stopped it
    assert enabled(sandbox_fleet, host, DFLASH) == "disabled"  # and it will not start at boot
    assert state(sandbox_fleet, host)["profile"] == "dense"
    # the dense profile's own switches reach the server
    env = sandbox_fleet.ssh(host, f"systemctl show -p Environment --value {DENSE}").stdout
    assert "VLLM_SPARKFLEET_INT8_LMHEAD=1" in env
    assert "health=ok" in to_dense.output
    # converged on dense: the operator's `make switch` again changes nothing (make drift: test_service_faults)
    again = run_make("switch", "PROFILE=dense", f"LIMIT={host}")
    assert again.returncode == 0, again.output[-4000:]
    assert again.changed() == {host: 0}

    back = run_playbook("playbooks/switch.yml", "--limit", host, "-e", "sparkfleet_profile=dflash")
    assert back.returncode == 0, back.output[-4000:]
    assert active(sandbox_fleet, host, DFLASH) == "active"
    assert active(sandbox_fleet, host, DENSE) == "inactive"
    assert enabled(sandbox_fleet, host, DENSE) == "disabled"
    assert state(sandbox_fleet, host)["profile"] == "dflash"


def test_failed_switch_rolls_back_and_says_so(converged_fleet, sandbox_fleet, inventory_with_host_vars) -> None:
    host = sandbox_fleet.names[-1]
    before = state(sandbox_fleet, host)
    inv = inventory_with_host_vars(host, {"sparkfleet_serve_args_host": BROKEN})
    failed = run_playbook("-i", inv, "playbooks/switch.yml", "--limit", host, "-e", "sparkfleet_profile=base")
    assert failed.returncode != 0
    assert "switching to profile base failed" in failed.output
    assert "ROLLED BACK to its last good state: profile dflash" in failed.output
    # the host serves its old profile again, from its old unit and wheel
    assert active(sandbox_fleet, host, DFLASH) == "active"
    assert active(sandbox_fleet, host, BASE) == "inactive"  # stopped by the rollback, its failure cleared
    # and only the old profile starts at boot (the failed one was enabled before it failed)
    assert enabled(sandbox_fleet, host, DFLASH) == "enabled"
    assert enabled(sandbox_fleet, host, BASE) == "disabled"
    after = state(sandbox_fleet, host)
    assert {k: after[k] for k in ("profile", "vllm_version", "venv", "patchset_id")} == {
        k: before[k] for k in ("profile", "vllm_version", "venv", "patchset_id")
    }
    health = run_playbook("playbooks/health.yml", "--limit", host)
    assert health.returncode == 0, health.output[-3000:]


def unit_sha(fleet, host: str, unit: str) -> str:
    out = fleet.ssh(host, f"sha256sum /etc/systemd/system/{unit}")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]


def test_a_deploy_whose_gate_fails_goes_back_to_the_last_good_unit(
    converged_fleet, sandbox_fleet, inventory_with_host_vars
) -> None:
    """`make deploy` rolls back like a switch: the new unit fails its start, the host is put back on
    the unit, weights and state of its last good deploy, and the run fails saying so."""
    host = sandbox_fleet.names[-1]
    before = {"state": state(sandbox_fleet, host), "unit": unit_sha(sandbox_fleet, host, DFLASH)}
    pid_before = main_pid(sandbox_fleet, host, DFLASH)
    inv = inventory_with_host_vars(host, {"sparkfleet_serve_args_host": BROKEN})
    failed = run_playbook("-i", inv, "site.yml", "--limit", host, "-e", "sparkfleet_profile=dflash")
    assert failed.returncode != 0
    assert "deploying profile dflash failed at" in failed.output, failed.output[-4000:]
    assert "ROLLED BACK to its last good state: profile dflash" in failed.output, failed.output[-4000:]
    # the broken unit was written and started (a real failure, not a refusal), then replaced
    assert f"last error of {DFLASH}:" in failed.output and "1000000" in failed.output, "vLLM's own refusal"
    assert unit_sha(sandbox_fleet, host, DFLASH) == before["unit"]
    after = state(sandbox_fleet, host)
    # what the host serves is its last good state; what its start took is this start's, recorded anew
    startup = after.pop("startup")
    assert after == {key: value for key, value in before["state"].items() if key != "startup"}
    invocation = sandbox_fleet.ssh(host, f"systemctl show -P InvocationID {DFLASH}").stdout.strip()
    assert startup["invocation_id"] == invocation != before["state"]["startup"]["invocation_id"], startup
    assert active(sandbox_fleet, host, DFLASH) == "active"
    assert main_pid(sandbox_fleet, host, DFLASH) not in ("", "0", pid_before), "restarted on the good unit"


def test_a_deploy_refused_by_preflight_rolls_nothing_back_and_restarts_nothing(converged_fleet, sandbox_fleet) -> None:
    """A failure before weights or unit are touched (here: the port is sshd's) is reported as such; the
    server is not restarted by a rollback it does not need."""
    host = sandbox_fleet.names[-1]
    pid_before = main_pid(sandbox_fleet, host, DFLASH)
    unit_before = unit_sha(sandbox_fleet, host, DFLASH)
    refused = run_playbook(
        "site.yml", "--limit", host, "-e", "sparkfleet_profile=dflash", "-e", "sparkfleet_api_port=22"
    )
    assert refused.returncode != 0
    assert "port 22" in refused.output and "sshd" in refused.output, refused.output[-4000:]
    assert "Nothing of the serving stack (weights, unit) was changed before it failed" in refused.output
    assert "ROLLED BACK" not in refused.output
    assert refused.changed()[host] == 0, refused.output[-3000:]
    assert main_pid(sandbox_fleet, host, DFLASH) == pid_before
    assert unit_sha(sandbox_fleet, host, DFLASH) == unit_before


def bench_prefix(inventory: str, host: str, tmp_path: Path) -> dict:
    """`make bench`'s prefix method (quick) on one host; the result it fetched."""
    results_dir = ROOT / "results" / host
    before = set(results_dir.glob("*-prefix.json")) if results_dir.is_dir() else set()
    extra = tmp_path / f"prefix-{len(before)}.json"
    extra.write_text(json.dumps({"serve_bench_methods": ["prefix"], "serve_bench_fail_on_regression": False}))
    run = run_playbook("-i", inventory, "playbooks/bench.yml", "--limit", host, "-e", f"@{extra}", timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    (new,) = sorted(set(results_dir.glob("*-prefix.json")) - before)
    return json.loads(new.read_text())


@pytest.mark.heavy  # a re-deploy with prefix caching, two benchmark runs and a restore: ~5 min on 2 cores
def test_prefix_caching_on_and_off_answer_alike(converged_fleet, sandbox_fleet, inventory_with_host_vars, tmp_path):  # noqa: ANN001
    """Issue 14: the dflash profile serves with prefix caching on. The multi-turn agent benchmark on a host,
    then on the same host redeployed with it off: with it on, warm turns take their prefix from the cache;
    with it off nothing is cached; the answers of every turn are the same both ways (greedy), and so is
    the acceptance."""
    host = sandbox_fleet.names[1]
    on = bench_prefix("inventory/sandbox", host, tmp_path)
    inv = inventory_with_host_vars(host, {"sparkfleet_serve_args_host": {"enable-prefix-caching": False}})
    only_the_unit = ("--limit", host, "-e", "sparkfleet_profile=dflash", "--tags", "vllm_service")
    redeploy = run_playbook("-i", inv, "site.yml", *only_the_unit)
    assert redeploy.returncode == 0, redeploy.output[-4000:]
    assert "--no-enable-prefix-caching" in sandbox_fleet.ssh(host, f"systemctl cat {DFLASH}").stdout
    try:
        off = bench_prefix(inv, host, tmp_path)
    finally:
        restore = run_playbook("site.yml", *only_the_unit)
        assert restore.returncode == 0, restore.output[-4000:]
    assert "--enable-prefix-caching" in sandbox_fleet.ssh(host, f"systemctl cat {DFLASH}").stdout
    f_on, f_off = on["figures"], off["figures"]
    assert f_on["prefix_cache_hits_warm"] > 0 and f_off["prefix_cache_hits_warm"] == 0, (f_on, f_off)
    assert f_on["prefix_greedy_mismatches"] == f_off["prefix_greedy_mismatches"] == 0
    answers = {
        run: [t["answer_sha256"] for t in result["details"]["turns"]] for run, result in (("on", on), ("off", off))
    }
    assert answers["on"] == answers["off"], "prefix caching changed a greedy answer"
    # the same tokens drafted and verified: acceptance within noise
    assert f_on["acceptance_length_warm"] == pytest.approx(f_off["acceptance_length_warm"], rel=0.1)
    # the warm/cold TTFT ratio is printed and recorded both ways; on the sandbox's tiny model the prefill a
    # hit saves (a few ms) is below the CPU engine's step-to-step noise, so its direction is not asserted
    for figures in (f_on, f_off):
        assert figures["prefix_ttft_warm_over_cold"] > 0 and figures["server_prefix_ttft_warm_over_cold"] > 0


def test_rolling_whose_preflight_refuses_starts_the_stopped_server_again(converged_fleet, sandbox_fleet) -> None:
    """make rolling stops a host's server before its preflight (stop-first: the preflight needs the memory and
    the port the old server holds). A preflight that then refuses has changed nothing of the serving stack, so
    nothing is rolled back, but the server it stopped is started again and health-checked: the host must not be
    left down by a run that says it changed nothing."""
    host = sandbox_fleet.names[0]
    before = state(sandbox_fleet, host)
    pid_before = main_pid(sandbox_fleet, host, DFLASH)
    unit_before = sandbox_fleet.ssh(host, f"systemctl cat {DFLASH}").stdout
    roll = run_playbook(
        "playbooks/rolling.yml",
        "--limit",
        host,
        "-e",
        "sparkfleet_profile=dflash",
        "-e",
        "spark_preflight_required_disk_gib=1000000",
    )
    assert roll.returncode != 0
    assert "spark_preflight_required_disk_gib" in roll.output, roll.output[-4000:]  # the preflight's own line
    assert "Nothing of the serving stack (weights, unit) was changed before it failed" in roll.output
    assert f"its server ({DFLASH}, profile dflash), stopped by this run, was started again" in roll.output, roll.output[
        -4000:
    ]
    assert "ROLLED BACK" not in roll.output
    # the server was stopped and is back: a new process, the same unit file and state
    assert active(sandbox_fleet, host, DFLASH) == "active"
    assert main_pid(sandbox_fleet, host, DFLASH) not in ("", "0", pid_before)
    assert sandbox_fleet.ssh(host, f"systemctl cat {DFLASH}").stdout == unit_before
    after = state(sandbox_fleet, host)
    assert {k: v for k, v in after.items() if k != "startup"} == {k: v for k, v in before.items() if k != "startup"}


def measure_quick_baselines(host: str, tmp_path: Path) -> dict[str, float]:
    """The dflash profile's quick acceptance figures measured now on `host` (what `make bench QUICK=1`
    records). They are set by the CPU's numerics: the inventory's baselines hold on the machine they
    were measured on (an AMD EPYC), an Intel machine with AMX gives others, so the test measures its own."""
    results_dir = ROOT / "results" / host
    before = set(results_dir.glob("*-decode.json")) if results_dir.is_dir() else set()
    extra = tmp_path / "baseline-vars.json"
    extra.write_text(
        json.dumps(
            {"serve_bench_quick": True, "serve_bench_methods": ["decode"], "serve_bench_fail_on_regression": False}
        )
    )
    run = run_playbook("playbooks/bench.yml", "--limit", host, "-e", f"@{extra}", timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    (new,) = sorted(set(results_dir.glob("*-decode.json")) - before)
    figures = json.loads(new.read_text())["figures"]
    baselines = {k: v for k, v in figures.items() if k.startswith("acceptance_length") and v}
    assert baselines, figures
    return baselines


def test_rolling_stops_at_the_host_that_fails_its_benchmark_gate(
    converged_fleet, sandbox_fleet, inventory_with_host_vars, owe_convergence, tmp_path: Path
) -> None:
    """The gate ends with a quick decode benchmark held to the profile's baselines_quick. The first
    host is held to the figures measured here on the fleet (it must pass); the second, the control,
    to 17 tokens per step: less the sandbox's 20 % tolerance that is 13.6, more than an acceptance
    length can be at num_speculative_tokens 12 (it must fail, and be rolled back); the third is never
    reached."""
    first, failing, untouched = sandbox_fleet.names[:3]
    pids_before = {h: main_pid(sandbox_fleet, h, DFLASH) for h in (first, failing, untouched)}
    sandbox = yaml.safe_load((ROOT / "inventory/sandbox/group_vars/all/50-sandbox.yml").read_text())
    measured = measure_quick_baselines(untouched, tmp_path)
    pids_before[untouched] = main_pid(sandbox_fleet, untouched, DFLASH)
    assert sandbox["serve_bench_tolerance_pct"] == 20
    unreachable = {key: 17.0 for key in measured}  # at most 12 drafted + 1 bonus token per step
    for host, baselines in ((first, measured), (untouched, measured), (failing, unreachable)):
        profiles_site = sandbox["sparkfleet_profiles_site"]
        profiles_site["dflash"]["baselines_quick"] = baselines
        inv = inventory_with_host_vars(host, {"sparkfleet_profiles_site": profiles_site})
    # the "new version" rolled out: one more concurrent sequence on every host
    new_version = {
        "sparkfleet_serve_args_platform": {**sandbox["sparkfleet_serve_args_platform"], "max-num-seqs": 3},
    }
    extra = tmp_path / "new-version.json"
    extra.write_text(json.dumps(new_version))
    # the first host stays on the new version until a later test asks for the converged fleet (the
    # failing host is rolled back to it by the roll itself)
    owe_convergence(first)
    roll = run_playbook("-i", inv, "playbooks/rolling.yml", "-e", "sparkfleet_rolling_serial=1", "-e", f"@{extra}")
    assert roll.returncode != 0
    # host 1: upgraded, through its gate's quick benchmark (held to the baselines), and serving
    assert active(sandbox_fleet, first, DFLASH) == "active"
    assert f"{first}: decode (quick)" in roll.output, roll.output[-4000:]
    assert "baseline acceptance_length[counting]" in roll.output
    unit = sandbox_fleet.ssh(first, f"systemctl cat {DFLASH}").stdout
    assert "--max-num-seqs 3" in unit
    # remembered as good after its gate (without the start-up record, which every start rewrites)
    last_good = json.loads(sandbox_fleet.ssh(first, "cat /etc/sparkfleet/last-good/state.json").stdout)
    assert "startup" not in last_good and "startup" in state(sandbox_fleet, first)
    assert {k: v for k, v in state(sandbox_fleet, first).items() if k != "startup"} == last_good
    # host 2: served the new unit, failed its benchmark gate on the doubled baselines, rolled back
    assert f"{failing}: decode (quick)" in roll.output, roll.output[-4000:]
    assert f"{failing} regressed beyond" in roll.output and "acceptance_length" in roll.output, roll.output[-4000:]
    assert f"{failing}: the roll to profile dflash failed at" in roll.output, roll.output[-4000:]
    assert "ROLLED BACK to its last good state: profile dflash" in roll.output
    assert active(sandbox_fleet, failing, DFLASH) == "active"
    assert "--max-num-seqs 2" in sandbox_fleet.ssh(failing, f"systemctl cat {DFLASH}").stdout
    # host 3: never reached
    assert untouched not in roll.recap or roll.recap[untouched]["changed"] == 0
    assert main_pid(sandbox_fleet, untouched, DFLASH) == pids_before[untouched]
    assert "--max-num-seqs 2" in sandbox_fleet.ssh(untouched, f"systemctl cat {DFLASH}").stdout
    # ops status sees the mixed fleet as each host records it: all three serving, healthy
    status = ops("status", "-i", "inventory/sandbox", "--json")
    rows = {entry["host"]: entry for entry in json.loads(status.stdout)}
    assert status.returncode == 0, status.stdout + status.stderr
    for host in (first, failing, untouched):
        row, recorded = rows[host]["row"], state(sandbox_fleet, host)
        assert rows[host]["ok"], rows[host]
        assert (row["profile"], row["unit"], row["health"]) == ("dflash", "active/running", "ok")
        assert row["patch_set"] == recorded["patchset_id"]
        for column, path_key in (("model", "model_path"), ("drafter", "drafter_path")):
            name = Path(recorded[path_key]).name
            assert row[column] == f"{name}@{recorded['model_revisions'][name][:12]}", (column, row, recorded)
