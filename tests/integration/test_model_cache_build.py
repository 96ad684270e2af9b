"""model_cache builds the dense profile's hybrid checkpoint on the seed and fans it out (issue 9, point 3).

The hub (the local double) serves a tiny synthetic INT4 base (BF16 shared experts) and an FP8 donor
whose index also names a shard the build never needs. The role fetches and verifies the base into the
controller's seed, the builder fetches only the donor files holding the shared experts' tensors, the
build runs once per fleet, and its result reaches three hosts host to host, verified. A second run
finds the build's manifest matching and changes nothing. Only paths under /var/lib/sparkfleet-test,
a test group and a test account are touched.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkfleet.build.checkpoint import INDEX_NAME
from sparkfleet.build.safetensors_stream import ShardEntry, write_shard
from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint
from tests.hub.server import HubDouble
from tests.integration.conftest import ROOT, run_playbook
from tests.integration.model_cache_helpers import CACHE_DIR, HOSTS, clean_fleet, write_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

PORT = 18505
BASE, DONOR, NAME = "intel/tiny-int4", "qwen/tiny-fp8", "tiny-hybrid"
UNNEEDED = "model-extra.safetensors"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubDouble]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("checkpoints")
    base = write_hybrid_fp8_checkpoint(tmp / "base", fp8_scales="none").path
    donor = write_hybrid_fp8_checkpoint(tmp / "donor", fp8_scales="block").path
    write_shard(donor / UNNEEDED, [ShardEntry("mtp.fc.weight", "F32", (2,), lambda: b"\0" * 8)])
    index = json.loads((donor / INDEX_NAME).read_text())
    index["weight_map"]["mtp.fc.weight"] = UNNEEDED
    (donor / INDEX_NAME).write_text(json.dumps(index))
    with HubDouble("127.0.0.1", PORT) as double:
        double.base_revision = double.add_revision(BASE, base)  # type: ignore[attr-defined]
        double.donor_revision = double.add_revision(DONOR, donor)  # type: ignore[attr-defined]
        yield double


@pytest.fixture(scope="module")
def fleet(sandbox_fleet) -> object:  # noqa: ANN001 - the shared fixture
    return clean_fleet(sandbox_fleet)


def test_the_seed_builds_once_and_the_fleet_gets_the_hybrid(fleet, hub: HubDouble, tmp_path: Path) -> None:  # noqa: ANN001
    model = {
        "name": NAME,
        "build": "hybrid-fp8",
        "base": {"repo": BASE, "revision": hub.base_revision},  # type: ignore[attr-defined]
        "donor": {"repo": DONOR, "revision": hub.donor_revision},  # type: ignore[attr-defined]
    }
    args = write_run(tmp_path, hub, [model])

    first = run_playbook(*args, timeout=900)
    assert first.returncode == 0, first.output[-4000:]
    # the hub: the whole base once; of the donor, its index and the two shards holding shared-expert tensors
    base_files = hub.repos[BASE].revisions[-1].files
    donor_files = hub.repos[DONOR].revisions[-1].files
    assert hub.file_bytes_served(BASE) == sum(f.size for f in base_files.values())
    got = {g.path for g in hub.file_gets(DONOR) if g.method == "GET"}
    needed = {INDEX_NAME} | {n for n in donor_files if n.startswith("model-0")}
    assert got == needed, got  # not its config, not the shard holding only an MTP tensor
    assert hub.file_bytes_served(DONOR) == sum(donor_files[name].size for name in needed)

    # one build, on the seed; its manifest names the FP8 modules
    built = sorted((tmp_path / "seed" / "built").iterdir())
    assert [p.name.split("@")[0] for p in built] == [NAME]
    manifest = json.loads((built[0] / "sparkfleet-checkpoint.json").read_text())
    assert len(manifest["fp8_modules"]) == 6 and manifest["donor_fetch"]["shards"] == sorted(
        n for n in donor_files if n.endswith(".safetensors") and n != UNNEEDED
    )
    inspected = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "sparkfleet", "checkpoint", "inspect", str(built[0]), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(inspected.stdout)["totals"]["FP8"]["modules"] == 6

    # every host holds the same bytes as the seed's build, verified, received host to host after the first
    revision = built[0].name.split("@")[1]
    shards = [s["name"] for s in manifest["output_shards"]]
    for host in HOSTS:
        line = next(li for li in first.output.splitlines() if f"model_cache {host}: 1 hub models" in li)
        assert "verified=yes" in line, line
        assert fleet.ssh(host, f"readlink {CACHE_DIR}/{NAME}").stdout.strip() == f".hub/{NAME}/{revision}"
        for shard in shards:
            digest = fleet.ssh(host, f"sha256sum {CACHE_DIR}/{NAME}/{shard}").stdout.split()[0]
            assert digest == next(s["sha256"] for s in manifest["output_shards"] if s["name"] == shard)
        host_manifest = json.loads(fleet.ssh(host, f"cat {CACHE_DIR}/.hub/{NAME}/{revision}.manifest.json").stdout)
        assert host_manifest["build"]["base"]["repo"] == BASE and host_manifest["build"]["kind"] == "hybrid-fp8"
    assert "the seed sent" in first.output and "to spark-01;" in first.output

    served = hub.file_bytes_served()
    build_mtime = (built[0] / "sparkfleet-checkpoint.json").stat().st_mtime_ns
    second = run_playbook(*args, timeout=900)
    assert second.returncode == 0, second.output[-4000:]
    assert second.changed() == {host: 0 for host in HOSTS}, "the re-run changed something"
    assert (built[0] / "sparkfleet-checkpoint.json").stat().st_mtime_ns == build_mtime, "the seed built again"
    assert hub.file_bytes_served() == served
    shutil.rmtree(tmp_path / "seed", ignore_errors=True)
