"""The cluster link preflight as a play (issue 17 point 2): what playbooks/tasks/cluster-preflight.yml collects
on each host of a cluster, judged whole by sparkfleet.fleet.cluster_link.check_collected (the filter
sparkfleet_cluster_check).

check_collected is fed the recorded two-Spark outputs under tests/fixtures/cluster/ in the shape the play
builds; the task file itself runs through ansible-playbook on this machine, its hosts local: two of them
share this machine's network stack, so a real run can show refusals (the same address on both, an MTU, a
clock bound, a member left out) but not a pass; a pass of the link is the fixtures' part, and the run's
summary is shown for a host in no cluster.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.fleet import cluster_link as cl
from sparkfleet.serving import cluster
from tests.unit.helpers import ROOT, local_host, needs_ansible_playbook, run, run_playbook, write_play
from tests.unit.test_cluster_link import output

FIXTURES = ROOT / "tests" / "fixtures" / "cluster"
HOSTS = ("spark-a", "spark-b")
IFACE = "enp1s0f0np0"
ADDRESSES = {"spark-a": "192.168.100.10", "spark-b": "192.168.100.11"}
STACK = ("env", "wheel", "patch_set", "revisions", "profile")


def facts(scenario: str) -> dict[str, dict[str, Any]]:
    nodes = yaml.safe_load((FIXTURES / "healthy" / "facts.yaml").read_text(encoding="utf-8"))["nodes"]
    override = FIXTURES / scenario / "facts.yaml"
    if scenario != "healthy" and override.exists():
        for host, values in yaml.safe_load(override.read_text(encoding="utf-8"))["nodes"].items():
            nodes[host].update(values)
    return nodes


def cluster_part(host: str, members: dict[str, str], name: str = "pair", **settings: Any) -> dict[str, Any]:
    """sparkfleet_plan.cluster for ``host`` of the cluster ``members`` ({host: address}, head first)."""
    defaults = {"interface": IFACE, "mtu": 9000, "rdma": True, "max_clock_skew_s": 1.0, "port": 29501}
    return cluster.layout(name, host, members, **{**defaults, **settings})


def collected(scenario: str = "healthy", hosts: tuple[str, ...] = HOSTS, **settings: Any) -> dict[str, dict[str, Any]]:
    """What the play would collect on ``hosts`` of the recorded pair: the plan's parts, the outputs, the
    clock as {before, node, after} around the recorded reading, the ping answers."""
    known = facts(scenario)
    found = {}
    for host in hosts:
        node = known[host]
        clock = node["clock"]
        found[host] = {
            "cluster": cluster_part(host, ADDRESSES, **settings),
            **{key: node[key] for key in STACK},
            "ip_link": output(scenario, host, "ip-d-j-link.json"),
            "ip_addr": output(scenario, host, "ip-j-addr.json"),
            "ibdev2netdev": output(scenario, host, "ibdev2netdev.txt"),
            "clock": {
                "before": clock["controller_s"] - clock["uncertainty_s"],
                "node": str(clock["node_s"]),
                "after": clock["controller_s"] + clock["uncertainty_s"],
            },
            "reached": node["reached"],
        }
    return found


def result(stdout: str = "", rc: int = 0, stderr: str = "", msg: str = "") -> dict[str, Any]:
    """A registered command result as Ansible hands it to a filter."""
    return {"rc": rc, "stdout": stdout, "stderr": stderr, "msg": msg, "changed": False, "failed": False}


# --- check_collected on the recorded pair ---------------------------------------------------------


def test_the_healthy_pair_passes_and_says_so() -> None:
    assert cl.check_collected(collected()) == []
    assert cl.collected_summary(collected()) == ["cluster pair: link preflight passed (2 nodes on enp1s0f0np0)"]


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        (
            "mtu-1500",
            [
                "spark-b: enp1s0f0np0 has MTU 1500 and enP2p1s0f0np0 has MTU 1500, the cluster link needs 9000: "
                "set mtu: 9000 for enp1s0f0np0 and enP2p1s0f0np0 in netplan and re-run"
            ],
        ),
        (
            "link-down",
            [
                f"{host}: enp1s0f0np0 has no carrier (state DOWN): check the QSFP cable between the two CX7 ports "
                "and that the peer's port is up, then re-run"
                for host in HOSTS
            ],
        ),
        (
            "wrong-hca",
            [
                "spark-b: NCCL_IB_HCA='rocep1s0f1,roceP2p1s0f1' selects rocep1s0f1 (enp1s0f1np1), "
                "roceP2p1s0f1 (enP2p1s0f1np1), but enp1s0f0np0's port is rocep1s0f0 (enp1s0f0np0), "
                "roceP2p1s0f0 (enP2p1s0f0np0): set NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0 and re-run"
            ],
        ),
    ],
)
def test_each_recorded_fault_is_refused_with_check_cluster_s_lines(scenario: str, expected: list[str]) -> None:
    assert cl.check_collected(collected(scenario)) == expected


def test_registered_results_read_as_their_stdout() -> None:
    """The play hands the commands' registered results, not their stdout: the same verdicts."""
    for scenario in ("healthy", "mtu-1500"):
        plain = collected(scenario)
        registered = {
            host: {**data, **{key: result(data[key]) for key in ("ip_link", "ip_addr", "ibdev2netdev")}}
            for host, data in plain.items()
        }
        assert cl.check_collected(registered) == cl.check_collected(plain)


def test_a_member_missing_from_the_run_refuses_its_cluster_naming_it() -> None:
    assert cl.check_collected(collected(hosts=("spark-a",))) == [
        "cluster pair: no link facts from spark-b (not in this run: a --limit left it out, it was unreachable or "
        "it failed an earlier task): check the whole cluster at once (make cluster-check with no LIMIT that splits "
        "it) and re-run"
    ]
    # the head missing: the worker's plan names it
    assert cl.check_collected(collected(hosts=("spark-b",)))[0].startswith("cluster pair: no link facts from spark-a")


def test_without_rdma_neither_nccl_ib_hca_nor_ibdev2netdev_is_needed() -> None:
    assert cl.check_collected(collected("wrong-hca", rdma=False)) == []
    without = collected("healthy", rdma=False)
    for data in without.values():
        del data["ibdev2netdev"]
    assert cl.check_collected(without) == []
    # with RDMA the output is needed, and a failed ibdev2netdev is named with its fixes
    with_rdma = collected()
    with_rdma["spark-b"]["ibdev2netdev"] = result(rc=2, msg="Error executing command.")
    assert cl.check_collected(with_rdma) == [
        "spark-b: ibdev2netdev failed (rc 2: Error executing command.): install it (DGX OS ships it; mlnx-tools "
        "elsewhere), or set sparkfleet_cluster_rdma: false for a link without RDMA, and re-run"
    ]


def test_hosts_in_no_cluster_are_refused_nothing_and_named_in_the_summary() -> None:
    found = {**collected(), "spark-c": {"cluster": {}, "profile": "dflash"}}
    assert cl.check_collected(found) == []
    assert cl.collected_summary(found) == [
        "cluster pair: link preflight passed (2 nodes on enp1s0f0np0)",
        "in no cluster (their plans serve them alone), nothing to check: spark-c",
    ]
    assert cl.check_collected({"spark-c": {"cluster": {}, "profile": "dflash"}}) == []


def test_two_clusters_are_judged_each_on_its_own() -> None:
    second = {"spark-c": "192.168.100.12", "spark-d": "192.168.100.13"}
    found = collected("mtu-1500")
    for host in second:
        twin = "spark-a" if host == "spark-c" else "spark-b"
        data = collected("healthy")[twin]
        data["cluster"] = cluster_part(host, second, name="pair2", interface="enp1s0f1np1")
        found[host] = data
    problems = cl.check_collected(found)
    assert problems[0].startswith("spark-b: enp1s0f0np0 has MTU 1500")
    assert problems[1:] and all("enp1s0f1np1" in line for line in problems[1:])  # pair2's link: port f1, uncabled


def test_an_unreadable_output_or_a_failed_command_is_a_line_naming_the_host() -> None:
    found = collected()
    found["spark-b"]["ip_link"] = "garbage\n"
    found["spark-a"]["ip_addr"] = result(rc=1, stderr="Cannot open netlink socket: Permission denied\n")
    assert cl.check_collected(found) == [
        "spark-a: ip -j addr show failed (rc 1: Cannot open netlink socket: Permission denied): run ip -j addr "
        "show on spark-a to see why, and re-run",
        "spark-b: ip -d link show printed no link ('<n>: <name>: <flags> mtu <mtu> ...' lines; got 'garbage'): "
        "run ip -d -j link show and pass its output",
    ]


def test_members_whose_plans_disagree_are_refused_before_the_link() -> None:
    found = collected()
    found["spark-b"]["cluster"] = cluster_part("spark-b", ADDRESSES, interface="enp1s0f1np1", mtu=1500)
    assert cl.check_collected(found) == [
        "cluster pair: spark-b's plan has interface 'enp1s0f1np1', mtu 1500 but spark-a's has 'enp1s0f0np0', "
        "9000: set sparkfleet_cluster_interface and sparkfleet_cluster_mtu once for the cluster "
        "(group_vars/pair.yml) and re-run"
    ]
    found = collected()
    found["spark-b"]["cluster"] = cluster_part("spark-b", {**ADDRESSES, "spark-b": "192.168.100.99"})
    assert cl.check_collected(found) == [
        "cluster pair: spark-b's plan has the members spark-a (192.168.100.10), spark-b (192.168.100.99) but "
        "spark-a's has spark-a (192.168.100.10), spark-b (192.168.100.11): plan every member from the same "
        "inventory (the group pair, each member's sparkfleet_cluster_address) and re-run"
    ]


def test_a_cluster_of_one_is_a_line_not_a_traceback() -> None:
    alone = collected(hosts=("spark-a",))
    alone["spark-a"]["cluster"] = cluster_part("spark-a", {"spark-a": ADDRESSES["spark-a"]})
    assert cl.check_collected(alone) == [
        "cluster pair has one member (spark-a): a cluster needs two or more: add the other Sparks to the group "
        "pair and re-run"
    ]


def test_a_bad_setting_check_cluster_refuses_is_a_line_naming_the_cluster() -> None:
    assert cl.check_collected(collected(mtu=0)) == [
        "cluster pair: mtu must be a positive number of bytes, got 0: pass e.g. 9000"
    ]


# --- the clock and the pings as the play registers them -------------------------------------------


def readings(*pairs: tuple[float, float]) -> dict[str, Any]:
    """The clock loop's registered result: one "sparkfleet-clock <controller> <node>" line per reading."""
    return {"results": [result(f"sparkfleet-clock {controller} {node}\n") for controller, node in pairs]}


def test_two_readings_put_the_first_node_time_between_both_controller_times() -> None:
    reading = cl._clock("spark-a", readings((100.0, 105.55), (100.2, 105.8)))
    assert reading.node_s == 105.55
    assert reading.controller_s == pytest.approx(100.1) and reading.uncertainty_s == pytest.approx(0.1)
    found = collected()
    found["spark-a"]["clock"] = readings((1000.0, 1000.02), (1000.04, 1000.06))
    found["spark-b"]["clock"] = readings((1000.0, 1002.52), (1000.04, 1002.56))
    assert cl.check_collected(found) == [
        "spark-a and spark-b clocks differ by 2.500 s (±0.040 s), more than 1 s: turn on NTP on every node "
        "(timedatectl set-ntp true; chronyc tracking shows the offset) and re-run"
    ]


def test_a_reading_through_ssh_with_a_terminal_ends_its_line_in_crlf() -> None:
    """raw over ssh (a pty) gives "...\r\n": the reading is the same (the sandbox pair showed it)."""
    crlf = {"results": [result(f"sparkfleet-clock {c} {n}\r\n") for c, n in ((100.0, 105.55), (100.2, 105.8))]}
    reading = cl._clock("spark-a", crlf)
    assert (reading.node_s, reading.uncertainty_s) == (105.55, pytest.approx(0.1))


@pytest.mark.parametrize(
    ("clock", "problem"),
    [
        (
            {"results": [result("Tue Jan  6 10:00:00 UTC 2026\n"), result("x")]},
            "spark-a: the clock reading printed 'Tue Jan  6 10:00:00 UTC 2026', not 'sparkfleet-clock <controller> "
            "<node>': use GNU date (coreutils) and re-run",
        ),
        (
            {"results": [result(rc=127, stderr="sh: 1: date: not found\n"), result()]},
            "spark-a: date +%s.%N failed (rc 127: sh: 1: date: not found): run date +%s.%N on spark-a to see why, "
            "and re-run",
        ),
        (
            {"before": 10.0, "node": "5.0", "after": 9.0},
            "spark-a: the controller's clock went back while reading spark-a's (10.0 then 9.0): re-run",
        ),
    ],
)
def test_a_clock_that_cannot_be_read_is_a_line(clock: dict[str, Any], problem: str) -> None:
    found = collected()
    found["spark-a"]["clock"] = clock
    assert cl.check_collected(found) == [problem]


def test_the_ping_loop_s_results_say_who_answered_and_whether_ping_ran() -> None:
    found = collected()
    for host, data in found.items():
        del data["reached"]
        data["pings"] = [{**result("1 received"), "item": address} for address in facts("healthy")[host]["reached"]]
    assert cl.check_collected(found) == []
    found["spark-a"]["pings"] = [{**result("0 received", rc=1), "item": "192.168.100.11"}]
    assert cl.check_collected(found) == [
        "spark-a: no ping answer from spark-b's 192.168.100.11 on enp1s0f0np0: check that both addresses are in "
        "one subnet and that nothing filters the link, then re-run"
    ]
    found["spark-a"]["pings"] = [{**result(rc=2, msg="Error executing command."), "item": "192.168.100.11"}]
    assert cl.check_collected(found)[0] == (
        "spark-a: ping did not run (Error executing command.), so no peer could answer it: install iputils-ping on "
        "spark-a and re-run"
    )


def test_ping_targets_are_each_peer_s_planned_address_and_those_it_lists_on_the_interface() -> None:
    plan = cluster_part("spark-a", ADDRESSES)
    ip_addrs = {host: result(output("healthy", host, "ip-j-addr.json")) for host in HOSTS}
    assert cl.ping_targets("spark-a", plan, ip_addrs) == ["192.168.100.11"]
    assert cl.ping_targets("spark-b", cluster_part("spark-b", ADDRESSES), ip_addrs) == ["192.168.100.10"]
    # a second address on the peer's interface is pinged too; a peer not in the run gives its planned one
    extra = output("healthy", "spark-b", "ip-j-addr.json").replace(
        '"local": "192.168.100.11"', '"local": "169.254.7.2"'
    )
    assert cl.ping_targets("spark-a", plan, {"spark-b": extra}) == ["192.168.100.11", "169.254.7.2"]
    assert cl.ping_targets("spark-a", plan, {}) == ["192.168.100.11"]
    assert cl.ping_targets("spark-a", plan, {"spark-b": result(rc=1)}) == ["192.168.100.11"]


@pytest.mark.parametrize(
    ("found", "message"),
    [
        (["spark-a"], "collected must be a mapping of host to its collected facts"),
        ({"spark-a": {"profile": "dense"}}, "collected['spark-a'] must be a mapping with a cluster mapping"),
        ({"spark-a": {"cluster": {"name": "pair"}}}, "spark-a's plan's cluster lacks interface, mtu, rdma"),
    ],
)
def test_a_malformed_collection_raises(found: Any, message: str) -> None:
    with pytest.raises(cl.ClusterLinkError, match="^" + re.escape(message)):
        cl.check_collected(found)
    partial = collected()
    del partial["spark-b"]["clock"]
    with pytest.raises(cl.ClusterLinkError, match=r"^collected\['spark-b'\] lacks clock"):
        cl.check_collected(partial)


def test_check_cluster_keeps_its_defaults_and_rdma_false_skips_the_hca_check_alone() -> None:
    nodes = [
        cl.node_facts(
            host,
            ip_link=output("wrong-hca", host, "ip-d-j-link.json"),
            ip_addr=output("wrong-hca", host, "ip-j-addr.json"),
            **{key: facts("wrong-hca")[host][key] for key in STACK},
            clock=cl.ClockReading(**facts("wrong-hca")[host]["clock"]),
            reached=facts("wrong-hca")[host]["reached"],
        )
        for host in HOSTS
    ]  # no ibdev2netdev output: none is needed without RDMA
    assert cl.check_cluster(nodes, IFACE, rdma=False) == []
    assert cl.check_cluster(nodes, IFACE)[0].startswith("spark-a: ibdev2netdev maps no RDMA device")


# --- the filters ----------------------------------------------------------------------------------


def filters() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("sparkfleet_filters", ROOT / "filter_plugins/sparkfleet_filters.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def test_the_filters_wrap_the_functions_and_refuse_bad_input() -> None:
    from ansible.errors import AnsibleFilterError

    found = filters()
    assert found["sparkfleet_cluster_check"](collected("mtu-1500")) == cl.check_collected(collected("mtu-1500"))
    assert found["sparkfleet_cluster_summary"](collected()) == cl.collected_summary(collected())
    plan = cluster_part("spark-a", ADDRESSES)
    assert found["sparkfleet_cluster_ping_targets"](plan, "spark-a", {}) == ["192.168.100.11"]
    assert found["sparkfleet_cluster_ping_targets"]({}, "spark-c", {}) == []
    with pytest.raises(AnsibleFilterError, match="^sparkfleet_cluster_check: collected must be a mapping"):
        found["sparkfleet_cluster_check"](["spark-a"])
    with pytest.raises(AnsibleFilterError, match="^sparkfleet_cluster_ping_targets: spark-a's plan's cluster lacks"):
        found["sparkfleet_cluster_ping_targets"]({"name": "pair"}, "spark-a", {})


# --- the task file through ansible-playbook on this machine ---------------------------------------

LO_MEMBERS = {"spark-a": "127.0.0.1", "spark-b": "127.0.0.2"}


def lo_plan(host: str, **settings: Any) -> dict[str, Any]:
    """A host's sparkfleet_plan in a cluster 'lopair' on lo (no RDMA), as resolve-profile.yml will plan it."""
    if host not in LO_MEMBERS:
        return {"cluster": {}, "profile": {"name": "dflash"}}
    settings = {"interface": "lo", "mtu": 65536, "rdma": False, **settings}
    cluster = cluster_part(host, LO_MEMBERS, name="lopair", **settings)
    env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": LO_MEMBERS[host]}
    return {
        "cluster": cluster,
        "service": {"env": env},
        "vllm_version": "0.23.0+sf3c5e0a9d71",
        "patchset_id": "sf3c5e0a9d71",
        "model_revisions": {"Qwen/Qwen3-0.6B": "c1899de289a04d12100db370d81485cdf75e47ca"},
        "profile": {"name": "dense-tp2"},
    }


def run_preflight(tmp_path: Path, *extra: str, **settings: Any) -> subprocess.CompletedProcess[str]:
    """The task file on spark-a and spark-b (cluster lopair on lo) and spark-c (in no cluster), all this
    machine; each host's sparkfleet_plan set by the play (``settings`` over lopair's)."""
    hosts = {host: local_host(test_plan=lo_plan(host, **settings)) for host in ("spark-a", "spark-b", "spark-c")}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    tasks = [
        {"name": "Plan what the host serves", "ansible.builtin.set_fact": {"sparkfleet_plan": "{{ test_plan }}"}},
        {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/cluster-preflight.yml")},
    ]
    return run_playbook(inventory, write_play(tmp_path / "play.yml", tasks), *extra, timeout=60)


def refusals(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of the failed judge's message (the YAML callback prints it as a block)."""
    lines = proc.stdout.splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith("fatal: ["))
    message = next(number for number in range(start, len(lines)) if lines[number].strip().startswith("msg:"))
    head = lines[message].strip().removeprefix("msg:").strip()
    if head not in ("|-", "|"):
        return [yaml.safe_load(head)]  # one line, quoted where YAML needs it
    found = []
    for line in lines[message + 1 :]:
        if not line.startswith(" " * 8):
            break
        found.append(line.strip())
    return found


def without_ping(problems: list[str]) -> list[str]:
    """``problems`` less the line each host gives where ping is not installed on this machine (none where it is)."""
    missing = re.compile(r"^(spark-[ab]): ping did not run \(.+\), so no peer could answer it: install iputils-ping")
    hosts = [match[1] for line in problems if (match := missing.match(line))]
    assert hosts == ([] if shutil.which("ping") else ["spark-a", "spark-b"]), problems
    return [line for line in problems if not missing.match(line)]


SAME_ADDRESS = "spark-a and spark-b both have 127.0.0.1 on lo: give each node its own address in netplan and re-run"
HOST_IP = "spark-b: VLLM_HOST_IP=127.0.0.2 is not an address of lo (127.0.0.1): set VLLM_HOST_IP=127.0.0.1 and re-run"
CLOCKS = re.compile(
    r"^spark-a and spark-b clocks differ by \d+\.\d{3} s \(±(?P<within>\d+\.\d{3}) s\), more than 1e-09 s: turn on "
    r"NTP on every node \(timedatectl set-ntp true; chronyc tracking shows the offset\) and re-run$"
)


@needs_ansible_playbook
def test_a_real_run_refuses_what_two_hosts_on_one_machine_share(tmp_path: Path) -> None:
    """Both members read this machine: lo (MTU 65536, up) passes the link checks, its one address is on both
    nodes, spark-b's VLLM_HOST_IP is not on lo, and no skew passes a bound of 1 ns; spark-c, in no
    cluster, is refused nothing."""
    proc = run_preflight(tmp_path, max_clock_skew_s=1e-9)
    assert proc.returncode != 0, proc.stdout
    problems = without_ping(refusals(proc))
    assert problems[:2] == [HOST_IP, SAME_ADDRESS], proc.stdout
    assert len(problems) == 3 and (clock := CLOCKS.match(problems[2])), problems
    assert float(clock["within"]) < 1.0, "the clock's window is one round trip on each node, not a play's task"
    assert "spark-c" not in "\n".join(problems)
    rdma = proc.stdout.split("TASK [Read the RDMA ports]", 1)[1].split("TASK [", 1)[0]
    assert "skipping: [spark-a]" in rdma and "ok: [" not in rdma, "no ibdev2netdev on a cluster without RDMA"


@needs_ansible_playbook
def test_the_cluster_s_mtu_is_checked_under_check_mode_too(tmp_path: Path) -> None:
    proc = run_preflight(tmp_path, "--check", mtu=9000)
    assert proc.returncode != 0, proc.stdout
    assert without_ping(refusals(proc)) == [
        "spark-a: lo has MTU 65536, the cluster link needs 9000: set mtu: 9000 for lo in netplan and re-run",
        "spark-b: lo has MTU 65536, the cluster link needs 9000: set mtu: 9000 for lo in netplan and re-run",
        HOST_IP,
        SAME_ADDRESS,
    ]


@needs_ansible_playbook
def test_a_run_limited_to_part_of_a_cluster_is_refused_naming_who_is_left_out(tmp_path: Path) -> None:
    proc = run_preflight(tmp_path, "--limit", "spark-a,spark-c")
    assert proc.returncode != 0, proc.stdout
    assert refusals(proc) == [
        "cluster lopair: no link facts from spark-b (not in this run: a --limit left it out, it was unreachable "
        "or it failed an earlier task): check the whole cluster at once (make cluster-check with no LIMIT that "
        "splits it) and re-run"
    ]


@needs_ansible_playbook
def test_a_run_without_a_cluster_passes_and_says_there_was_nothing_to_check(tmp_path: Path) -> None:
    proc = run_preflight(tmp_path, "--limit", "spark-c")
    assert proc.returncode == 0, proc.stdout
    assert "in no cluster (their plans serve them alone), nothing to check: spark-c" in proc.stdout
    assert "ok=" in proc.stdout and "failed=0" in proc.stdout


@needs_ansible_playbook
def test_the_playbook_parses_and_make_cluster_check_runs_it(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"spark": {"hosts": {"spark-a": local_host()}}}))
    syntax = run_playbook(inventory, ROOT / "playbooks/cluster-check.yml", "--syntax-check", timeout=60)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr

    def command(*args: str) -> str:
        made = run(["make", "--no-print-directory", "-n", "cluster-check", *args], timeout=60)
        assert made.returncode == 0, made.stderr
        return next(line for line in made.stdout.splitlines() if "playbooks/cluster-check.yml" in line)

    # each host's own profile unless PROFILE is on the command line
    assert command("INVENTORY=inventory/x").split() == [
        ".venv/bin/ansible-playbook", "-i", "'inventory/x'", "playbooks/cluster-check.yml"
    ]  # fmt: skip
    named = command("PROFILE=dense", "LIMIT=a,b")
    assert "--limit 'a,b'" in named and named.endswith("playbooks/cluster-check.yml -e sparkfleet_profile='dense'")


@needs_ansible_playbook
def test_in_a_play_of_batches_each_batch_is_judged_with_its_own_hosts(tmp_path: Path) -> None:
    """The serving play runs the preflight in batches (serial): hosts in no cluster pass batch by batch,
    quietly when the play asks for clusters only; a batch holding one member of a cluster is refused,
    naming the member it lacks (serve.yml puts a cluster's members in one batch)."""
    hosts = {host: local_host(test_plan=lo_plan(host)) for host in ("spark-c", "spark-d", "spark-a", "spark-b")}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}, sort_keys=False))
    tasks = [
        {"name": "Plan what the host serves", "ansible.builtin.set_fact": {"sparkfleet_plan": "{{ test_plan }}"}},
        {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/cluster-preflight.yml")},
    ]
    play = tmp_path / "play.yml"
    for quiet in (True, False):
        spec = {"hosts": "all", "gather_facts": False, "serial": 1, "tasks": tasks,
                "vars": {"__cluster_preflight_clusters_only": quiet}}  # fmt: skip
        play.write_text(yaml.safe_dump([spec], sort_keys=False))
        alone = run_playbook(inventory, play, "--limit", "spark-c,spark-d", timeout=60)
        assert alone.returncode == 0, alone.stdout + alone.stderr
        said = [f"nothing to check: {host}" in alone.stdout for host in ("spark-c", "spark-d")]
        assert said == [not quiet, not quiet], alone.stdout
    split = run_playbook(inventory, play, "--limit", "spark-a,spark-b", timeout=60)
    assert split.returncode != 0
    assert "cluster lopair: no link facts from spark-b (not in this run" in " ".join(split.stdout.split())


def run_barrier(tmp_path: Path, refusing: list[str], barrier: bool = True) -> subprocess.CompletedProcess[str]:
    """serve.yml's shape on spark-a and spark-b (cluster lopair) and spark-c (in no cluster), all this machine:
    in a block with a rescue, a stand-in preflight that refuses on the ``refusing`` hosts, the barrier
    (playbooks/tasks/cluster-preflight-barrier.yml), then a change (a file per host under tmp_path)."""
    hosts = {host: local_host(test_plan=lo_plan(host)) for host in ("spark-a", "spark-b", "spark-c")}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    steps = [
        {"ansible.builtin.set_fact": {"__serve_preflight_passed": False}},
        {
            "name": "Preflight (stand-in)",
            "ansible.builtin.fail": {"msg": "{{ inventory_hostname }}: port 8000 is taken"},
            "when": "inventory_hostname in refusing",
        },
        *([{"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/cluster-preflight-barrier.yml")}] * barrier),
        {
            "name": "Change the serving stack",
            "ansible.builtin.copy": {
                "content": "changed\n",
                "dest": f"{tmp_path}/changed-{{{{ inventory_hostname }}}}",
            },
        },
    ]
    rescue = [
        {"ansible.builtin.copy": {"content": "rescued\n", "dest": f"{tmp_path}/rescued-{{{{ inventory_hostname }}}}"}}
    ]
    tasks = [
        {"ansible.builtin.set_fact": {"sparkfleet_plan": "{{ test_plan }}"}},
        {"name": "Serve it, or roll back", "block": steps, "rescue": rescue},
    ]
    extra = tmp_path / "vars.json"
    extra.write_text(json.dumps({"refusing": refusing}))
    return run_playbook(inventory, write_play(tmp_path / "play.yml", tasks), "-e", f"@{extra}", timeout=60)


@needs_ansible_playbook
def test_a_cluster_member_changes_nothing_when_another_member_s_preflight_refused(tmp_path: Path) -> None:
    """The linear strategy runs a block to its end on every host before a failed host's rescue: without
    the barrier spark-b (spark-a's worker) would change after spark-a's preflight refused."""
    ran = run_barrier(tmp_path, ["spark-a"])
    changed = sorted(path.name for path in tmp_path.glob("changed-*"))
    rescued = sorted(path.name for path in tmp_path.glob("rescued-*"))
    assert (changed, rescued) == (["changed-spark-c"], ["rescued-spark-a", "rescued-spark-b"]), ran.stdout[-3000:]
    assert (
        "spark-b serves in cluster lopair with spark-a, which did not pass its preflight: nothing of the cluster "
        "changes in this run (fix what spark-a reported above and run again)."
    ) in " ".join(ran.stdout.split())

    for path in tmp_path.glob("*ed-spark-*"):
        path.unlink()
    ran = run_barrier(tmp_path, ["spark-b"])  # a worker's refusal holds its head back alike
    assert sorted(path.name for path in tmp_path.glob("changed-*")) == ["changed-spark-c"], ran.stdout[-3000:]
    assert "spark-a serves in cluster lopair with spark-b, which did not pass its preflight" in " ".join(
        ran.stdout.split()
    )


@needs_ansible_playbook
def test_without_a_refusal_the_barrier_lets_every_host_on(tmp_path: Path) -> None:
    ran = run_barrier(tmp_path, [])
    assert ran.returncode == 0, ran.stdout[-3000:]
    changed = sorted(path.name for path in tmp_path.glob("changed-*"))
    assert changed == ["changed-spark-a", "changed-spark-b", "changed-spark-c"]
    assert not list(tmp_path.glob("rescued-*"))
