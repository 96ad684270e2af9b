"""A cluster's part of the serving plan (sparkfleet.serving.cluster, issue 17): the multi-node flags, the
link's environment, the worker's headless unit and each member's watch, and every cluster that cannot
form refused in one line; through ansible-playbook, the lookup reads the members from the inventory's
group and a run that changes part of a cluster is refused before anything changes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.serving import cluster, profile_schema, profiles, serving_plan
from tests.unit.helpers import ROOT, link_shared_group_vars, needs_ansible_playbook, run_playbook, write_play
from tests.unit.test_profile_models import pinned_models

MEMBERS = {"spark-a": "192.168.100.10", "spark-b": "192.168.100.11", "spark-c": "192.168.100.12"}


def group_vars_all() -> dict[str, Any]:
    variables: dict[str, Any] = {}
    for name in ("profiles.yml", "sparkfleet.yml"):
        variables.update(yaml.safe_load((ROOT / "inventory/group_vars/all" / name).read_text()))
    return variables


def variables(host: str, members: dict[str, str] | None = None, **overrides: Any) -> dict[str, Any]:
    """What the sparkfleet_plan lookup hands build() for ``host`` of a cluster of ``members``."""
    return {
        **group_vars_all(),
        "sparkfleet_models": pinned_models(),
        "sparkfleet_wheel_dir": "/nonexistent",
        "ansible_facts": {"memtotal_mb": 122_880},
        "inventory_hostname": host,
        "sparkfleet_cluster": "pair",
        "sparkfleet_cluster_interface": "enp1s0f0np0",
        cluster.MEMBERS: dict(members if members is not None else list(MEMBERS.items())[:2]),
        **overrides,
    }


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("profile", ["dflash-tp2", "dense-tp2", "qwen3-235b-tp2"])
def test_head_and_worker_serve_one_model_with_vllms_multi_node_flags(profile: str) -> None:
    head = serving_plan.build(variables("spark-a"), profile)
    worker = serving_plan.build(variables("spark-b"), profile)
    assert head["errors"] == [] and worker["errors"] == []
    for plan, rank in ((head, 0), (worker, 1)):
        argv = plan["service"]["argv"]
        assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--nnodes") == "2"
        assert flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--master-addr") == "192.168.100.10" and flag(argv, "--master-port") == "29501"
        env = plan["service"]["env"]
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0"
        assert env["VLLM_HOST_IP"] == list(MEMBERS.values())[rank] and "NCCL_IB_HCA" not in env
        assert "RestartForceExitStatus=0" in plan["service"]["directives"]
        assert shlex.split(plan["service"]["exec_start"]) == argv
        assert plan["service"]["state"]["cluster"] == {
            "name": "pair",
            "role": ("head", "worker")[rank],
            "rank": rank,
            "head": "spark-a",
            "members": ["spark-a", "spark-b"],
        }
    assert "--headless" not in head["service"]["argv"] and "--headless" in worker["service"]["argv"]
    assert head["service"]["health_url"] == "http://127.0.0.1:8000/health" and worker["service"]["health_url"] == ""
    assert head["service"]["watch"]["argv"][1:] == [
        "--unit", head["unit"], "--role", "head", "--url", "http://127.0.0.1:8000", "--model", "qwen",
        "--key-file", f"/etc/sparkfleet/vllm-{profile}.env", "--interval=15", "--failures=3", "--grace=60",
    ]  # fmt: skip
    assert worker["service"]["watch"]["argv"][1:] == [
        "--unit", worker["unit"], "--role", "worker", "--master", "192.168.100.10:29501",
        "--interval=5", "--failures=3", "--grace=180",
    ]  # fmt: skip


def test_three_members_pipeline_and_the_inventorys_hca_and_port() -> None:
    base = group_vars_all()["sparkfleet_profiles_builtin"]["base"]
    site = {
        "sparkfleet_profiles_site": {"pp3": {**base, "cluster": {"parallel": "pipeline"}}},
        "sparkfleet_cluster_ib_hca": "=rocep1s0f0,roceP2p1s0f0",
        "sparkfleet_cluster_port": 29512,
    }
    plan = serving_plan.build(variables("spark-c", MEMBERS, **site), "pp3")
    argv = plan["service"]["argv"]
    assert flag(argv, "--pipeline-parallel-size") == "3" and flag(argv, "--node-rank") == "2"
    assert "--tensor-parallel-size" not in argv and flag(argv, "--master-port") == "29512"
    assert plan["service"]["env"]["NCCL_IB_HCA"] == "=rocep1s0f0,roceP2p1s0f0"
    assert [m["host"] for m in plan["cluster"]["members"]] == list(MEMBERS) and plan["cluster"]["role"] == "worker"


def test_a_single_node_profile_on_a_clusters_host_serves_it_alone() -> None:
    alone = serving_plan.build({k: v for k, v in variables("spark-b").items() if "cluster" not in k}, "dflash")
    member = serving_plan.build(variables("spark-b"), "dflash")
    assert member["cluster"] == {} and member["service"] == alone["service"]


PAIR = "cluster 'pair': "
ONE = {"spark-a": "192.168.100.10"}


@pytest.mark.parametrize(
    ("host", "overrides", "message"),
    [
        ("spark-a", {"sparkfleet_cluster": ""}, "profile 'dflash-tp2' serves one model across a cluster, but spark-a"),
        ("spark-a", {cluster.MEMBERS: ONE}, "cluster 'pair' has one member (spark-a)"),
        ("spark-c", {}, "spark-c sets sparkfleet_cluster 'pair' but is not in that group"),
        ("spark-a", {cluster.MEMBERS: {**ONE, "spark-b": ""}}, PAIR + "spark-b's sparkfleet_cluster_address ''"),
        (
            "spark-a",
            {cluster.MEMBERS: {"spark-a": "10.0.0.1", "spark-b": "10.0.0.1"}},
            PAIR + "spark-a and spark-b both have sparkfleet_cluster_address 10.0.0.1",
        ),
        ("spark-a", {"sparkfleet_cluster_interface": ""}, PAIR + "sparkfleet_cluster_interface is not set"),
        ("spark-a", {"sparkfleet_cluster_port": "http"}, PAIR + "sparkfleet_cluster_port 'http' is not a TCP port"),
    ],
)
def test_a_cluster_that_cannot_form_is_one_line_naming_it(host: str, overrides: dict, message: str) -> None:
    with pytest.raises(serving_plan.PlanError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as error:
        serving_plan.build(variables(host, **overrides), "dflash-tp2")
    assert "\n" not in str(error.value)


def test_the_profile_key_and_the_flags_the_cluster_owns_are_checked() -> None:
    assert cluster.profile_problems("profile 'x': cluster", {"parallel": "data"}) == [
        "profile 'x': cluster.parallel must be tensor or pipeline, got 'data'"
    ]
    assert cluster.profile_problems("p: cluster", {"parallel": "tensor", "nodes": 2}) == [
        "p: cluster.nodes: not a cluster key: the only one is parallel"
    ]
    assert profile_schema.serve_arg_problems("serve_args", {"nnodes": 2, "node-rank": 1}) == [
        "serve_args.nnodes: sparkfleet sets --nnodes itself: use the cluster's size (its inventory group)",
        "serve_args.node-rank: sparkfleet sets --node-rank itself: use the host's place in its cluster group",
    ]


def test_each_node_holds_its_share_of_the_235b() -> None:
    resolved = cluster.apply(
        profiles.resolve_from(variables("spark-a"), "qwen3-235b-tp2"),
        serving_plan.build(variables("spark-a"), "qwen3-235b-tp2")["cluster"],
    )
    models = pinned_models()
    assert profiles.memory_share_error(resolved, models) is None
    # the same weights on one node: 118 GiB do not fit its 100
    alone = profiles.resolve_from(variables("spark-a"), "qwen3-235b-tp2")
    assert "one node's share of its weights, 118.0 GiB" in str(profiles.memory_share_error(alone, models))


def cluster_inventory(tmp_path: Path) -> Path:
    """Two local hosts in cluster group ``pair`` (the shared group_vars; the cluster's in group_vars/pair.yml)."""
    inventory = link_shared_group_vars(tmp_path / "inventory", {"sparkfleet_models": pinned_models()})
    local = {"ansible_connection": "local", "ansible_python_interpreter": str(Path(__import__("sys").executable))}
    spark = {name: {**local, "sparkfleet_cluster_address": MEMBERS[name]} for name in ("spark-a", "spark-b")}
    hosts = {"all": {"children": {"spark": {"hosts": spark}, "pair": {"hosts": {"spark-a": {}, "spark-b": {}}}}}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (inventory / "group_vars" / "pair.yml").write_text(
        yaml.safe_dump({"sparkfleet_cluster": "pair", "sparkfleet_cluster_interface": "enp1s0f0np0"})
    )
    return inventory


@needs_ansible_playbook
def test_the_lookup_reads_the_members_from_the_group_and_a_partial_run_is_refused(tmp_path: Path) -> None:
    inventory = cluster_inventory(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    keep = {"content": "{{ sparkfleet_plan.cluster | to_json }}", "dest": f"{out}/{{{{ inventory_hostname }}}}.json"}
    play = write_play(
        tmp_path / "play.yml",
        [
            {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/resolve-profile.yml")},
            {"ansible.builtin.copy": keep},
        ],
    )
    whole = run_playbook(inventory / "hosts.yml", play, "-e", "sparkfleet_profile=dflash-tp2", timeout=180)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    head, worker = (json.loads((out / f"{name}.json").read_text()) for name in ("spark-a", "spark-b"))
    assert (head["role"], worker["role"], head["head"], worker["master_addr"]) == (
        "head",
        "worker",
        "spark-a",
        "192.168.100.10",
    )
    assert [m["address"] for m in head["members"]] == ["192.168.100.10", "192.168.100.11"]

    part = run_playbook(
        inventory / "hosts.yml", play, "-e", "sparkfleet_profile=dflash-tp2", "--limit", "spark-b", timeout=180
    )
    assert part.returncode != 0
    assert (
        "spark-b serves profile dflash-tp2 in cluster pair with spark-a, which this run leaves out of its batch"
        in " ".join(part.stdout.split())
    )


def pair_part(name: str, *members: str) -> dict[str, Any]:
    return {"name": name, "members": [{"host": member} for member in members]}


@pytest.mark.parametrize(
    ("serial", "sizes"),
    [(1, [1, 2, 1, 3, 1]), ("1", [1, 2, 1, 3, 1]), (2, [1, 2, 1, 3, 1]), (3, [3, 1, 3, 1]),
     ("50%", [4, 4]), ("100%", [8]), (0, [8]), ([1, 4], [1, 3, 4]), (["25%", 5], [1, 3, 4])],
)  # fmt: skip
def test_a_batch_never_splits_a_cluster_and_holds_at_most_the_batch_size_otherwise(serial: Any, sizes: list) -> None:
    hosts = ["s1", "a1", "s2", "a2", "b1", "b2", "s3", "b3"]
    clusters = {**dict.fromkeys(["a1", "a2"], pair_part("a", "a1", "a2")),
                **dict.fromkeys(["b1", "b2", "b3"], pair_part("b", "b1", "b2", "b3"))}  # fmt: skip
    out = cluster.batches(hosts, clusters, serial)
    assert out["serial"] == sizes
    # every host once; each cluster's members next to its first member, in the cluster's order
    assert out["order"] == ["s1", "a1", "a2", "s2", "b1", "b2", "b3", "s3"]
    batches, start = [], 0
    for size in out["serial"]:
        batches.append(out["order"][start : start + size])
        start += size
    for members in (["a1", "a2"], ["b1", "b2", "b3"]):
        assert any(set(members) <= set(batch) for batch in batches), (members, batches)
    requested = serial if isinstance(serial, list) else [serial]
    grown = []
    for step, batch in enumerate(batches):
        limit = cluster._batch_size(requested[min(step, len(requested) - 1)], len(hosts))
        if limit > 0 and len(batch) > limit:
            # only a cluster larger than the batch size makes a batch larger, and then it is alone
            assert batch in (["a1", "a2"], ["b1", "b2", "b3"]), batch
            grown.append(f"({', '.join(batch)}) changes as one batch of {len(batch)}")
    assert [line.split(" ", 2)[2].split(" (batch size")[0] for line in out["lines"]] == grown, out["lines"]


def test_without_a_cluster_the_order_and_batch_size_are_the_requests() -> None:
    hosts = ["s1", "s2", "s3"]
    assert cluster.batches(hosts, {}, "25%") == {"order": hosts, "serial": "25%", "lines": []}
    # a member whose cluster is not in the run (a partial --limit) is a host of its own; the play refuses it
    assert cluster.batches(["s1", "a2"], {"a2": pair_part("a", "a1", "a2")}, 1)["serial"] == 1
    with pytest.raises(cluster.ClusterError, match=r"batch size 'two' is not a number of hosts: give one such as 1"):
        cluster.batches(hosts, {}, "two")


def serving_plays(out: Path) -> list[dict[str, Any]]:
    """serve.yml's batching play as it is, and its serving play's hosts and serial with the refusal of a
    partial cluster (resolve-profile.yml) and a recorder of each batch as tasks."""
    plays = yaml.safe_load((ROOT / "playbooks/serve.yml").read_text())
    batching = next(play for play in plays if str(play.get("name", "")).startswith("Batch the hosts"))
    serving = next(play for play in plays if play.get("name") == "Serve the profile")
    record = {
        "ansible.builtin.lineinfile": {"path": str(out), "line": "{{ ansible_play_batch | join(',') }}",
                                       "create": True, "insertafter": "EOF"},
        "delegate_to": "localhost",
        "run_once": True,
    }  # fmt: skip
    resolve = {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/resolve-profile.yml")}
    return [
        batching,
        {"hosts": serving["hosts"], "serial": serving["serial"], "gather_facts": False, "tasks": [resolve, record]},
    ]


@needs_ansible_playbook
def test_the_serving_play_moves_each_cluster_in_one_batch(tmp_path: Path) -> None:
    inventory = link_shared_group_vars(tmp_path / "inventory", {"sparkfleet_models": pinned_models()})
    local = {"ansible_connection": "local", "ansible_python_interpreter": str(Path(__import__("sys").executable))}
    spark = {"spark-c": local, **{name: {**local, "sparkfleet_cluster_address": MEMBERS[name]}
                                  for name in ("spark-a", "spark-b")}, "spark-d": local}  # fmt: skip
    hosts = {"all": {"children": {"spark": {"hosts": spark}, "pair": {"hosts": {"spark-a": {}, "spark-b": {}}}}}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    (inventory / "group_vars" / "pair.yml").write_text(
        yaml.safe_dump(
            {
                "sparkfleet_cluster": "pair",
                "sparkfleet_cluster_interface": "enp1s0f0np0",
                "sparkfleet_profile": "dflash-tp2",
            }
        )  # fmt: skip
    )
    rolled = tmp_path / "rolled.txt"
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump(serving_plays(rolled), sort_keys=False))
    # batch size 1: the pair (dflash-tp2) rolls whole, the single hosts one at a time, in inventory order
    run = run_playbook(inventory / "hosts.yml", play, "-e", "sparkfleet_serve_serial=1", timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert rolled.read_text().split() == ["spark-c", "spark-a,spark-b", "spark-d"]
    assert "cluster pair (spark-a, spark-b) changes as one batch of 2 (batch size 1)" in run.stdout
    # a single-node profile on the pair's hosts: each is a host of its own again
    rolled.unlink()
    single = run_playbook(inventory / "hosts.yml", play, "-e", "sparkfleet_serve_serial=1", "-e",
                          "sparkfleet_profile=dflash", timeout=180)  # fmt: skip
    assert single.returncode == 0, single.stdout + single.stderr
    assert rolled.read_text().split() == ["spark-c", "spark-a", "spark-b", "spark-d"]
    assert "changes as one batch" not in single.stdout
