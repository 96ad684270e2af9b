"""model_cache's fleet fan-out on the sandbox fleet (issue 4, points 2, 3 and 6).

The hub (the local double) serves each byte once, to the controller's seed; the seed sends the model
once into the fleet, to one host; the other hosts copy it host to host over SSH with a key made for the
run, authorized on the source read-only (rrsync -ro) and from the receiver's address only, and the
source's host key pinned from its /etc/ssh; the keys are gone when the run ends. A copy cut part-way
(a --bwlimit'ed rsync killed mid-file) resumes on the next run without sending the finished files
again. Only paths under /var/lib/sparkfleet-test and a test group and account are touched.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub.server import HubDouble
from tests.integration import model_cache_helpers as helpers
from tests.integration.conftest import ANSIBLE_PLAYBOOK, ROOT, PlaybookRun, run_playbook
from tests.integration.model_cache_helpers import CACHE_DIR, FANOUT_USER, GROUP, HOSTS, clean_fleet, sha256_on

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

PORT = 18504
REPO = "org/tiny-shards"
NAME = "tiny-shards"


def repo_files() -> dict[str, bytes]:
    """Two LFS shards big enough to cut a rate-limited copy in the middle of the second, and small files."""
    rng = random.Random(4)
    return {
        "config.json": json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}).encode(),
        "model-00001-of-00002.safetensors": rng.randbytes(2 * 1024 * 1024),
        "model-00002-of-00002.safetensors": rng.randbytes(3 * 1024 * 1024),
        "tokenizer.json": json.dumps({"version": "1.0", "seed": 4}).encode(),
    }


@pytest.fixture(scope="module")
def hub() -> Iterator[HubDouble]:
    with HubDouble("127.0.0.1", PORT) as double:
        yield double


@pytest.fixture(scope="module")
def fleet(sandbox_fleet) -> object:  # noqa: ANN001 - the shared fixture
    return clean_fleet(sandbox_fleet)


def write_run(tmp: Path, hub: HubDouble, revision: str, **extra: object) -> list[str]:
    return helpers.write_run(tmp, hub, [{"name": NAME, "repo": REPO, "revision": revision}], **extra)


def summary(run: PlaybookRun, host: str) -> str:
    lines = [line for line in run.output.splitlines() if f"model_cache {host}: " in line]
    assert lines, f"no summary line for {host}"
    return lines[-1]


def fleet_line(run: PlaybookRun) -> str:
    lines = [line for line in run.output.splitlines() if "model_cache fleet: " in line]
    assert lines, "no fleet summary line"
    return lines[-1]


def no_keys_left(fleet) -> None:  # noqa: ANN001
    for host in HOSTS:
        left = fleet.ssh(host, f"find {CACHE_DIR}/.fanout -type f 2>/dev/null").stdout.split()
        assert left == [], f"{host} keeps copy keys after the run: {left}"


def test_the_seed_sends_once_and_hosts_copy_from_each_other(fleet, hub: HubDouble, tmp_path_factory) -> None:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("fanout")
    files = repo_files()
    revision = hub.add_revision(REPO, files)
    total = sum(len(data) for data in files.values())
    hub.reset_log()

    first = run_playbook(*write_run(tmp, hub, revision), "--diff", timeout=600)
    assert first.returncode == 0, first.output[-4000:]
    # the hub: 1x the model's bytes for 3 hosts
    assert hub.file_bytes_served(REPO) == total
    # the seed sent every file once, to one host; the others got them from hosts
    assert f"the seed sent {len(files)} files ({total} bytes) to spark-01;" in fleet_line(first)
    assert f"hosts sent {2 * len(files)} files ({2 * total} bytes) to each other" in fleet_line(first)
    assert "from the seed, verified=yes" in summary(first, "spark-01")
    for host in ("spark-02", "spark-03"):
        assert f"received {len(files)} files" in summary(first, host) and "from spark-01," in summary(first, host)
        assert "verified=yes" in summary(first, host)
    assert "round 0: the seed -> spark-01; round 1: spark-01 -> spark-02; round 2: spark-01 -> spark-03" in first.output
    expected = {name: sha256_on(fleet, "spark-01", f"{CACHE_DIR}/{NAME}/{name}") for name in files}
    for host in HOSTS:
        for name, digest in expected.items():
            assert sha256_on(fleet, host, f"{CACHE_DIR}/{NAME}/{name}") == digest
    # least privilege: what the source authorized (the --diff of its authorized_keys) and what the receiver pinned
    address = fleet.hosts["spark-02"]
    assert f'+restrict,from="{address}",command="/usr/bin/rrsync -ro {CACHE_DIR}/.hub" ssh-ed25519 ' in first.output, (
        "the source did not authorize the receiver's key read-only, from its address only"
    )
    host_key = fleet.ssh("spark-01", "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[:2]
    assert f"+{fleet.hosts['spark-01']} {' '.join(host_key)}" in first.output, "spark-01's host key was not pinned"
    no_keys_left(fleet)
    account = fleet.ssh("spark-01", f"getent passwd {FANOUT_USER}; id -nG {FANOUT_USER}").stdout.split()
    assert account[0].split(":")[5] == f"{CACHE_DIR}/.fanout" and account[1:] == [GROUP]
    options = next(line for line in first.output.splitlines() if line.startswith(f'+restrict,from="{address}"'))
    probe_the_authorization(fleet, options[1:].rsplit(" ssh-ed25519 ", 1)[0], revision)

    second = run_playbook(*write_run(tmp, hub, revision), timeout=600)
    assert second.returncode == 0, second.output[-4000:]
    assert second.changed() == {host: 0 for host in HOSTS}
    assert "nothing to copy" in second.output
    assert hub.file_bytes_served(REPO) == total


def probe_the_authorization(fleet, options: str, revision: str) -> None:  # noqa: ANN001
    """With the role's own authorized_keys options on spark-01 and a probe key made on spark-02: reading the
    cache works; a shell, a write, a path outside the cache, and the same key from spark-03 do not."""
    probe = f"{CACHE_DIR}/.probe"
    keys = f"{CACHE_DIR}/.fanout/.ssh/authorized_keys"
    made = fleet.ssh(
        "spark-02", f"mkdir -m 700 {probe} && ssh-keygen -q -t ed25519 -N '' -f {probe}/id && cat {probe}/id.pub"
    )
    assert made.returncode == 0, made.stderr
    host_key = " ".join(fleet.ssh("spark-01", "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[:2])
    line = f"{options} {made.stdout.strip()}"
    assert fleet.ssh("spark-01", f"printf '%s\\n' {shlex.quote(line)} > {keys}").returncode == 0
    source = f"{FANOUT_USER}@{fleet.hosts['spark-01']}"
    ssh = (
        f"ssh -i {probe}/id -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes "
        f"-o UserKnownHostsFile={probe}/known_hosts -o GlobalKnownHostsFile=/dev/null"
    )
    model = f"{NAME}/{revision}"
    try:
        for host in ("spark-02", "spark-03"):
            setup = f"echo {shlex.quote(fleet.hosts['spark-01'] + ' ' + host_key)} > {probe}/known_hosts"
            if host == "spark-03":
                copy = fleet.ssh("spark-02", f"cat {probe}/id").stdout
                setup = f"mkdir -p -m 700 {probe} && printf '%s\\n' {shlex.quote(copy)} > {probe}/id && {setup}"
                setup += f" && chmod 600 {probe}/id"
            assert fleet.ssh(host, setup).returncode == 0
        read = fleet.ssh("spark-02", f"rsync -e {shlex.quote(ssh)} {source}:{model}/config.json {probe}/config.json")
        assert read.returncode == 0, read.stderr
        shell = fleet.ssh("spark-02", f"{ssh} {source} id")
        assert shell.returncode != 0 and "uid=" not in shell.stdout, "the copy key opened a shell"
        write = fleet.ssh("spark-02", f"rsync -e {shlex.quote(ssh)} {probe}/config.json {source}:{model}/injected")
        assert write.returncode != 0, "the copy key could write into the source's cache"
        assert fleet.ssh("spark-01", f"test -e {CACHE_DIR}/.hub/{model}/injected").returncode != 0
        outside = fleet.ssh("spark-02", f"rsync -e {shlex.quote(ssh)} {source}:../../../../etc/shadow {probe}/x")
        assert outside.returncode != 0 and fleet.ssh("spark-02", f"test -e {probe}/x").returncode != 0
        elsewhere = fleet.ssh(
            "spark-03", f"rsync -e {shlex.quote(ssh)} {source}:{model}/config.json {probe}/config.json"
        )
        assert elsewhere.returncode != 0, "the key worked from another host's address"
    finally:
        fleet.ssh("spark-01", f"rm -f {keys}")
        for host in ("spark-02", "spark-03"):
            fleet.ssh(host, f"rm -rf {probe}")


def partial_size(fleet, host: str, directory: str, name: str) -> int:  # noqa: ANN001
    """Size of rsync's in-progress temp file (.name.XXXXXX) or kept partial for name, 0 if none."""
    out = fleet.ssh(host, f"cd {directory} && stat -c '%s %n' .{name}.* .rsync-partial/{name} 2>/dev/null").stdout
    return max((int(line.split()[0]) for line in out.splitlines() if line.strip()), default=0)


@pytest.mark.heavy  # a cut transfer and its resume across the fleet: ~3 min on 2 cores
def test_a_cut_copy_resumes_without_sending_finished_files(fleet, hub: HubDouble, tmp_path_factory) -> None:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("fanout-cut")
    files = repo_files()
    revision = hub.repos[REPO].revisions[-1].sha if REPO in hub.repos else hub.add_revision(REPO, files)
    directory = f"{CACHE_DIR}/.hub/{NAME}/{revision}"
    first_shard, second_shard = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    # the fleet holds the model (the test above, or this first run); then spark-02 loses its copy
    ready = run_playbook(*write_run(tmp, hub, revision), timeout=600)
    assert ready.returncode == 0, ready.output[-4000:]
    assert fleet.ssh("spark-02", f"rm -rf {directory}").returncode == 0
    served = hub.file_bytes_served(REPO)

    # a rate-limited copy (~5 s for the first shard, ~12 s for the second), killed in the second shard
    args = write_run(tmp, hub, revision, model_cache_transfer_bwlimit=256)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.Popen(  # noqa: S603 - our own ansible-playbook, argument list
        [str(ANSIBLE_PLAYBOOK), "-i", "inventory/sandbox", *args], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while partial_size(fleet, "spark-02", directory, second_shard) < 256 * 1024:
            assert proc.poll() is None, f"the play ended before the cut: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the second shard's copy never started"
            time.sleep(0.3)
        # the receiving rsync processes (ours: they write into the test directory), by their ids
        pids = fleet.ssh("spark-02", f"pgrep -f -- '^rsync .*{directory}/' || true").stdout.split()
        assert pids, "no receiving rsync on spark-02"
        assert fleet.ssh("spark-02", f"kill -TERM {' '.join(pids)}").returncode == 0
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the cut copy did not fail the run"
    kept = partial_size(fleet, "spark-02", directory, second_shard)
    assert 0 < kept < len(files[second_shard]), f"no partial copy kept ({kept} bytes)"
    assert fleet.ssh("spark-02", f"test -f {directory}/{first_shard}").returncode == 0, "the first shard was not done"
    no_keys_left(fleet)

    # check mode reports the copy and makes none
    check = run_playbook(*write_run(tmp, hub, revision), "--check", timeout=600)
    assert check.returncode == 0, check.output[-4000:]
    assert check.changed()["spark-02"] > 0 and check.changed()["spark-01"] == 0
    assert "spark-02 would receive 2 files" in check.output and "verified=no" in summary(check, "spark-02")
    assert partial_size(fleet, "spark-02", directory, second_shard) == kept

    resumed = run_playbook(*write_run(tmp, hub, revision), timeout=600)
    assert resumed.returncode == 0, resumed.output[-4000:]
    line = summary(resumed, "spark-02")
    # rsync copies in name order: config.json and the first shard were done before the cut
    assert "received 2 files" in line and "verified=yes" in line, line
    # the resumed shard crossed the wire only for what was missing (rsync's count of the bytes it moved)
    wire = int(line.split("received 2 files (", 1)[1].split(" bytes on the wire", 1)[0])
    small = len(files["tokenizer.json"])
    assert wire < len(files[second_shard]) - kept + small + 64 * 1024, f"{wire} bytes: the cut shard was sent whole"
    print(f"resume: {second_shard} {len(files[second_shard])} bytes, {kept} kept at the cut, {wire} bytes on the wire")
    # the source only authorized the run's key and removed it again; the third host was not touched
    assert resumed.changed()["spark-01"] == 2 and resumed.changed()["spark-03"] == 0
    assert sha256_on(fleet, "spark-02", f"{directory}/{second_shard}") == sha256_on(
        fleet, "spark-01", f"{directory}/{second_shard}"
    )
    assert fleet.ssh("spark-02", f"test -e {directory}/.rsync-partial").returncode != 0
    assert hub.file_bytes_served(REPO) == served, "the repair went back to the hub"
    no_keys_left(fleet)
