"""Two sandbox hosts serve one model as a real cluster (issue 17): vLLM 0.23's CPU build, its multi-node
multiprocessing runtime, pipeline parallel 2, Gloo over the hosts' own network, each node in its own
hardened unit with its watch, deployed by the same play as any profile.

The cluster is an inventory group (``sandpair``: spark-01 the head, spark-02 the worker) in a copy of
the sandbox inventory, and the profile (``tiny-pp2``: the tiny Qwen3 split in two stages) is a site
profile of that copy. Shown: the link preflight passes, the deploy serves a completion through both
stages, a refusal of a run that changes only one member, drift, ops status and make bench take the
pair as one target, a killed worker brings the pair down and back through the units and their
watches, a rolling re-provision at batch size 1 and ops restart of one member move the pair whole, a
rolling re-provision whose head's preflight refuses changes nothing of the worker, a head that cannot
start rolls both back, and the fleet goes back to ``dflash`` afterwards.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ROOT, run_make, run_playbook

pytestmark = [pytest.mark.sandbox, pytest.mark.heavy]

CLUSTER = "sandpair"
PROFILE = "tiny-pp2"
UNIT = f"sparkfleet-vllm-{PROFILE}.service"
WATCH = "sparkfleet-cluster-watch.service"


@pytest.fixture
def cluster_inventory(tmp_path: Path, sandbox_fleet) -> tuple[str, str, str]:
    """A copy of the sandbox inventory whose first two hosts form cluster ``sandpair``."""
    head, worker = sandbox_fleet.names[:2]
    inventory = tmp_path / "inventory"
    (inventory / "group_vars" / "all").mkdir(parents=True)
    hosts = yaml.safe_load((ROOT / "inventory/sandbox/hosts.yml").read_text())
    spark = hosts["all"]["children"]["spark"]["hosts"]
    for name in (head, worker):
        spark[name]["sparkfleet_cluster_address"] = spark[name]["ansible_host"]
    hosts["all"]["children"][CLUSTER] = {"hosts": {head: {}, worker: {}}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    shared = ROOT / "inventory/sandbox/group_vars/all"
    for path in shared.iterdir():
        (inventory / "group_vars" / "all" / path.name).symlink_to(path.resolve())
    site = yaml.safe_load((shared / "50-sandbox.yml").read_text())["sparkfleet_profiles_site"]
    site[PROFILE] = {
        "summary": "the tiny Qwen3 in two pipeline stages across the sandbox pair",
        "target": "tiny-qwen3",
        "drafter": None,
        "speculative": None,
        "serve_args": {},
        "env": {},
        "patches": [],
        "cluster": {"parallel": "pipeline"},
        "required_memory_gib": 8,
        "health": {"tool_call_expect_name": ""},
    }
    (inventory / "group_vars" / "all" / "60-cluster.yml").write_text(yaml.safe_dump({"sparkfleet_profiles_site": site}))
    (inventory / "group_vars" / f"{CLUSTER}.yml").write_text(
        yaml.safe_dump(
            {
                "sparkfleet_cluster": CLUSTER,
                # the sandbox hosts' one veth: MTU 1500, no RDMA
                "sparkfleet_cluster_interface": "eth0",
                "sparkfleet_cluster_mtu": 1500,
                "sparkfleet_cluster_rdma": False,
                "sparkfleet_cluster_port": 29512,
            }
        )
    )
    return str(inventory), head, worker


def sh(fleet, host: str, command: str) -> str:
    out = fleet.ssh(host, command)
    return out.stdout.strip()


def ops(*args: str) -> subprocess.CompletedProcess[str]:
    """``sparkfleet ops ARGS`` from the checkout, as make status/restart run it."""
    return subprocess.run([sys.executable, "-m", "sparkfleet", "ops", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, check=False)  # fmt: skip


def completion(fleet, head: str, timeout: int = 60) -> dict:
    """A temperature-0 completion through the head's API (both stages); {} when none came back."""
    request = json.dumps({"model": "qwen", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    script = (
        "import sys,urllib.request;"
        "r=urllib.request.Request('http://127.0.0.1:8000/v1/completions',data=sys.argv[1].encode(),"
        "headers={'Content-Type':'application/json'});"
        f"print(urllib.request.urlopen(r,timeout={timeout}).read().decode())"
    )
    out = fleet.ssh(head, f"python3 -c {shlex.quote(script)} {shlex.quote(request)}")
    try:
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except ValueError:
        return {}


def test_a_pair_serves_one_model_and_comes_back_whole_after_losing_its_worker(
    converged_fleet, sandbox_fleet, cluster_inventory
) -> None:
    inventory, head, worker = cluster_inventory
    try:
        # a run that would change only one member is refused before anything changes
        part = run_playbook("-i", inventory, "site.yml", "--limit", worker, "-e", f"sparkfleet_profile={PROFILE}")
        assert part.returncode != 0
        assert f"{worker} serves profile {PROFILE} in cluster {CLUSTER} with {head}, which this run leaves out" in (
            " ".join(part.output.split())
        )
        assert part.recap[worker]["changed"] == 0

        # the deploy runs the link preflight before anything changes: a link without the MTU it needs
        mtu = run_playbook("-i", inventory, "site.yml", "--limit", f"{head},{worker}",
                           "-e", f"sparkfleet_profile={PROFILE}", "-e", "sparkfleet_cluster_mtu=9000")  # fmt: skip
        assert mtu.returncode != 0
        for host in (head, worker):
            assert f"{host}: eth0 has MTU 1500, the cluster link needs 9000" in mtu.output, mtu.output[-3000:]
            assert mtu.recap[host]["changed"] == 0, host
            assert sh(sandbox_fleet, host, f"systemctl is-active {UNIT}") in ("inactive", "unknown"), host

        check = run_playbook("-i", inventory, "playbooks/cluster-check.yml", "--limit", f"{head},{worker}",
                             "-e", f"sparkfleet_profile={PROFILE}", timeout=600)  # fmt: skip
        assert check.returncode == 0, check.output[-4000:]
        assert f"cluster {CLUSTER}: link preflight passed (2 nodes on eth0)" in check.output

        deployed = run_playbook("-i", inventory, "site.yml", "--limit", f"{head},{worker}",
                                "-e", f"sparkfleet_profile={PROFILE}", timeout=1500)  # fmt: skip
        assert deployed.returncode == 0, deployed.output[-6000:]
        assert sh(sandbox_fleet, worker, f"systemctl is-active {UNIT}") == "active"
        assert "--headless" in sh(sandbox_fleet, worker, f"systemctl show -p ExecStart --value {UNIT}")
        for host in (head, worker):
            assert sh(sandbox_fleet, host, f"systemctl is-active {WATCH}") == "active", host
            assert json.loads(sh(sandbox_fleet, host, "cat /etc/sparkfleet/state.json"))["cluster"]["head"] == head
        answer = completion(sandbox_fleet, head)
        assert answer.get("choices"), answer
        assert answer["usage"]["completion_tokens"] >= 1

        # the pair as one target of the fleet's operations: drift, status, bench
        drift = run_make("drift", f"INVENTORY={inventory}", f"PROFILE={PROFILE}", f"LIMIT={head},{worker}", timeout=900)
        assert drift.returncode == 0, drift.output[-4000:]
        for host in (head, worker):
            assert any(line.split()[:3] == [host, "in", "sync"] for line in drift.output.splitlines()), host
        status = ops("status", "-i", inventory, "-l", worker, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        rows = {entry["host"]: entry["row"] for entry in json.loads(status.stdout)}
        assert (rows[head]["health"], rows[worker]["health"]) == ("ok", f"ok (via {head})"), rows
        assert f"{head} joins the run: it serves in cluster {CLUSTER}" in status.stderr
        bench = run_playbook("-i", inventory, "playbooks/bench.yml", "--limit", f"{head},{worker}",
                             "-e", "serve_bench_quick=true", "-e", '{"serve_bench_methods": ["decode"]}',
                             "-e", '{"serve_bench_fail_on_regression": false}', timeout=900)  # fmt: skip
        assert bench.returncode == 0, bench.output[-4000:]
        assert bench.recap[worker]["changed"] == 0
        latest = json.loads(sh(sandbox_fleet, head, "cat /var/lib/sparkfleet/bench/latest.json"))
        assert latest["profile"] == PROFILE and latest["figures"]["decode_tok_s_median"] > 0, latest

        # the worker's server dies: the pair must go down and come back whole, through the units alone
        worker_pid = sh(sandbox_fleet, worker, f"systemctl show -p MainPID --value {UNIT}")
        head_invocation = sh(sandbox_fleet, head, f"systemctl show -p InvocationID --value {UNIT}")
        killed = time.monotonic()
        sh(sandbox_fleet, worker, f"systemctl kill -s SIGKILL {UNIT}")
        served_again = None
        while time.monotonic() - killed < 420:
            time.sleep(10)
            if completion(sandbox_fleet, head, timeout=20).get("choices"):
                served_again = time.monotonic() - killed
                break
        journal = sh(sandbox_fleet, head, f"journalctl -u {WATCH} -n 20 --no-pager -o cat")
        assert served_again is not None, journal
        assert sh(sandbox_fleet, worker, f"systemctl show -p MainPID --value {UNIT}") != worker_pid
        assert sh(sandbox_fleet, head, f"systemctl show -p InvocationID --value {UNIT}") != head_invocation, journal
        assert "a cluster member is lost" in journal, journal
        print(f"served again {served_again:.0f} s after the worker was killed")

        health = run_playbook("-i", inventory, "playbooks/health.yml", "--limit", f"{head},{worker}")
        assert health.returncode == 0, health.output[-4000:]
        assert f"health=ok (via {head}, its head, which checked the pair)" in health.output

        # a rolling re-provision at batch size 1: the pair rolls as one batch, through the head's gate
        # (health, then a quick decode benchmark through both stages)
        rolled = run_playbook("-i", inventory, "playbooks/rolling.yml", "--limit", f"{head},{worker}",
                              "-e", f"sparkfleet_profile={PROFILE}", "-e", "sparkfleet_rolling_serial=1",
                              "-e", '{"serve_bench_fail_on_regression": false}', timeout=1500)  # fmt: skip
        assert rolled.returncode == 0, rolled.output[-6000:]
        flat = " ".join(rolled.output.split())
        assert f"cluster {CLUSTER} ({head}, {worker}) changes as one batch of 2 (batch size 1)" in flat
        assert rolled.output.count("PLAY [Serve the profile]") == 1, "one batch"
        assert completion(sandbox_fleet, head).get("choices")

        # ops restart naming the worker restarts the pair in one batch and waits for the head's health
        invocations = {
            h: sh(sandbox_fleet, h, f"systemctl show -p InvocationID --value {UNIT}") for h in (head, worker)
        }
        restart = ops("restart", "-i", inventory, "-l", worker, "--batch", "1")
        assert restart.returncode == 0, restart.stdout + restart.stderr
        assert f"batch 1: {head}, {worker}" in restart.stderr
        for host in (head, worker):
            assert sh(sandbox_fleet, host, f"systemctl show -p InvocationID --value {UNIT}") != invocations[host], host
        assert completion(sandbox_fleet, head).get("choices")

        # a rolling re-provision (each member stopped first) whose head's preflight refuses (its API port
        # is sshd's): the worker stops at the barrier after the preflight, before anything of its own
        # changes, and both members start again on the units they had
        units = {h: sh(sandbox_fleet, h, f"systemctl cat {UNIT}") for h in (head, worker)}
        (Path(inventory) / "host_vars").mkdir()
        (Path(inventory) / "host_vars" / f"{head}.yml").write_text(yaml.safe_dump({"sparkfleet_api_port": 22}))
        refused = run_playbook("-i", inventory, "playbooks/rolling.yml", "--limit", f"{head},{worker}",
                               "-e", f"sparkfleet_profile={PROFILE}", timeout=1500)  # fmt: skip
        assert refused.returncode != 0
        flat = " ".join(refused.output.split())
        assert f"{worker} serves in cluster {CLUSTER} with {head}, which did not pass its preflight" in flat, flat[
            -4000:
        ]
        assert "TASK [Patched vLLM wheel" not in refused.output and "TASK [vllm_wheel" not in refused.output
        for host in (head, worker):
            assert sh(sandbox_fleet, host, f"systemctl cat {UNIT}") == units[host], host
            assert sh(sandbox_fleet, host, f"systemctl is-active {UNIT}") == "active", host
        assert completion(sandbox_fleet, head).get("choices")

        # a change the head cannot start (a context beyond the model's): the head fails its gate, the
        # worker fails with it, and both return to their last good state, the pair as it served
        (Path(inventory) / "host_vars" / f"{head}.yml").write_text(
            yaml.safe_dump({"sparkfleet_serve_args_host": {"max-model-len": 1_000_000}})
        )
        failed = run_playbook("-i", inventory, "site.yml", "--limit", f"{head},{worker}",
                              "-e", f"sparkfleet_profile={PROFILE}", timeout=1500)  # fmt: skip
        assert failed.returncode != 0
        flat = " ".join(failed.output.split())
        assert f"{worker} serves in cluster {CLUSTER}, whose head {head} did not pass its health gate" in flat
        for host in (head, worker):
            assert f"{host}: deploying profile {PROFILE} failed at" in flat, host
            assert f"ROLLED BACK to its last good state: profile {PROFILE}" in flat
        answer = completion(sandbox_fleet, head)
        assert answer.get("choices"), answer
    finally:
        back = run_playbook("site.yml", "--limit", f"{head},{worker}", "-e", "sparkfleet_profile=dflash", timeout=1500)
        assert back.returncode == 0, back.output[-4000:]
        for host in (head, worker):
            assert sh(sandbox_fleet, host, f"systemctl is-active {WATCH}") in ("inactive", "unknown"), host
