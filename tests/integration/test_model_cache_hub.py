"""model_cache in hub mode on the sandbox fleet, against the local hub double (issue 4).

One seed per fleet: three hosts get two pinned repos and the hub serves their bytes once. A second
run repairs a corrupted file on one host and a truncated one on another from the seed (the hub is
not asked again) and changes nothing on the untouched host. A branch name is refused before any
request. A gated repo is refused without a token and fetched with the one from an inventory variable
(Ansible Vault); the token shows up in no output (-vvv) and no file on the seed or host (the
controller's HF_TOKEN as the source: tests/unit/test_hub_cache.py).
Only model-cache paths under /var/lib/sparkfleet-test are touched; no service is.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub.server import HubDouble
from tests.integration.conftest import run_playbook
from tests.integration.model_cache_helpers import CACHE_DIR, GROUP, HOSTS, clean_fleet, sha256_on, write_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "build" / "models"
PORT = 18503


@pytest.fixture(scope="module")
def hub() -> Iterator[HubDouble]:
    for name in ("tiny-qwen3", "tiny-qwen3-dflash", "tiny-qwen3-dflash-wide"):
        if not (MODELS / name / "config.json").is_file():
            pytest.skip(f"build/models/{name} is missing: build the tiny models (tests/fixtures/tiny_models.py)")
    with HubDouble("127.0.0.1", PORT) as double:
        yield double


@pytest.fixture(scope="module")
def fleet(sandbox_fleet) -> object:  # noqa: ANN001 - the shared fixture
    return clean_fleet(sandbox_fleet)


def test_one_seed_per_fleet_then_repair_from_the_seed(fleet, hub: HubDouble, tmp_path_factory) -> None:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("hub-run")
    target_rev = hub.add_revision("org/tiny-qwen3", MODELS / "tiny-qwen3")
    drafter_rev = hub.add_revision("z-lab/tiny-dflash", MODELS / "tiny-qwen3-dflash")
    hub.add_revision("z-lab/tiny-dflash", MODELS / "tiny-qwen3-dflash-wide")  # upstream moves main on
    models = [
        {"name": "tiny-qwen3", "repo": "org/tiny-qwen3", "revision": target_rev},
        {"name": "tiny-dflash", "repo": "z-lab/tiny-dflash", "revision": drafter_rev},
    ]
    args = write_run(tmp, hub, models)
    total = sum(f.size for f in hub.repos["org/tiny-qwen3"].resolve(target_rev).files.values()) + sum(
        f.size for f in hub.repos["z-lab/tiny-dflash"].resolve(drafter_rev).files.values()
    )

    first = run_playbook(*args, timeout=600)
    assert first.returncode == 0, first.output[-4000:]
    # N hosts, 1x the models' bytes from the hub
    assert hub.file_bytes_served() == total
    assert {g.path for g in hub.file_gets("z-lab/tiny-dflash")} and all(g.status == 200 for g in hub.file_gets())
    # the download's progress reaches the Ansible output: each file's rate, each repo's bytes in the seed
    shown = [line for line in first.output.splitlines() if "downloaded in" in line and "in the seed" in line]
    for repo in ("org/tiny-qwen3", "z-lab/tiny-dflash"):
        assert any(f"; {repo}: " in line and "(100%)" in line for line in shown), first.output[-4000:]
    for host in HOSTS:
        assert any(
            f"model_cache {host}: 2 hub models, 12 files," in line and f"({total} bytes)" in line
            and "verified=yes" in line for line in first.output.splitlines()
        ), f"no summary line for {host}"  # fmt: skip
        link = fleet.ssh(host, f"readlink {CACHE_DIR}/tiny-dflash").stdout.strip()
        assert link == f".hub/tiny-dflash/{drafter_rev}"
        config = json.loads(fleet.ssh(host, f"cat {CACHE_DIR}/tiny-dflash/config.json").stdout)
        assert config["num_key_value_heads"] == 1  # the pinned drafter, not upstream's wider one
        manifest_path = f"{CACHE_DIR}/.hub/tiny-qwen3/{target_rev}.manifest.json"
        mode = fleet.ssh(host, f"stat -c '%a %U %G' {manifest_path}").stdout.strip()
        assert mode == f"640 root {GROUP}"
        manifest = json.loads(fleet.ssh(host, f"cat {manifest_path}").stdout)
        assert (manifest["repo"], manifest["revision"]) == ("org/tiny-qwen3", target_rev)
        weights = next(f for f in manifest["files"] if f["path"] == "model.safetensors")
        assert sha256_on(fleet, host, f"{CACHE_DIR}/tiny-qwen3/model.safetensors") == weights["sha256"]
        file_mode = fleet.ssh(host, f"stat -c '%a %G' {CACHE_DIR}/tiny-qwen3/model.safetensors").stdout.strip()
        assert file_mode == f"640 {GROUP}"

    # damage two hosts: bit rot that keeps size and mtime, and a truncated file
    weights_path = f"{CACHE_DIR}/tiny-qwen3/model.safetensors"
    flip = (
        "import os,sys; p=sys.argv[1]; st=os.stat(p); f=open(p,'r+b'); f.seek(4096); b=f.read(1); f.seek(4096);"
        "f.write(bytes([b[0]^255])); f.close(); os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    assert fleet.ssh("spark-02", f"python3 -c {shlex.quote(flip)} {weights_path}").returncode == 0
    assert fleet.ssh("spark-03", f"truncate -s 100 {CACHE_DIR}/tiny-dflash/config.json").returncode == 0
    served_before = hub.file_bytes_served()

    second = run_playbook(*args, timeout=600)
    assert second.returncode == 0, second.output[-4000:]
    # the untouched host only serves the repairs: it authorizes the run's copy keys, then removes them
    assert second.changed()["spark-01"] == 2, "the untouched host changed more than its copy keys"
    assert second.changed()["spark-02"] > 0 and second.changed()["spark-03"] > 0
    assert hub.file_bytes_served() == served_before, "the repair went back to the hub"
    expected = sha256_on(fleet, "spark-01", weights_path)
    assert sha256_on(fleet, "spark-02", weights_path) == expected
    assert sha256_on(fleet, "spark-03", f"{CACHE_DIR}/tiny-dflash/config.json") == sha256_on(
        fleet, "spark-01", f"{CACHE_DIR}/tiny-dflash/config.json"
    )
    repaired = next(
        line for line in second.output.splitlines() if "model_cache spark-02: 2 hub models, 12 files," in line
    )
    assert "received 1 files" in repaired and "from spark-01," in repaired  # host to host, not from the seed


def test_a_branch_is_refused_before_any_request(fleet, hub: HubDouble, tmp_path: Path) -> None:  # noqa: ANN001
    hub.add_revision("org/branchy", MODELS / "tiny-qwen3-dflash")
    hub.reset_log()
    args = write_run(tmp_path, hub, [{"name": "branchy", "repo": "org/branchy", "revision": "main"}])
    run = run_playbook(*args, timeout=300)
    assert run.returncode != 0
    assert "revision 'main' of org/branchy is not a full 40-hex commit" in run.output
    assert "e.g. revision: 6c7242c934a9870d7c59c05240bdbb2467cc1394" in run.output
    assert hub.log == []
    assert fleet.ssh("spark-01", f"test -e {CACHE_DIR}/branchy").returncode != 0


def test_a_gated_repo_takes_the_token_from_the_inventory_and_never_shows_it(
    fleet,
    hub: HubDouble,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    secret = "hf_sparkfleetFleetToken0123456789abc"
    rev = hub.add_revision("org/gated", MODELS / "tiny-qwen3-dflash")
    hub.gate("org/gated", secret)
    host = HOSTS[0]
    model = {"name": "gated", "repo": "org/gated", "revision": rev}
    no_env_token = {"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": ""}
    tokens_before = set(Path("/tmp").glob("*.hf-token"))
    for run in ("none", "vault"):
        (tmp_path / run).mkdir()

    # no token: the hub refuses, the run names the repo and fails before any copy
    refused = run_playbook(*write_run(tmp_path / "none", hub, [model], test_hosts=host), env=no_env_token)
    assert refused.returncode != 0
    assert "org/gated" in refused.output and "refused the file list" in refused.output
    assert fleet.ssh(host, f"test -e {CACHE_DIR}/gated").returncode != 0

    # the token as Ansible Vault gives it (an inventory variable), at -vvv: served, never printed
    run_dir = tmp_path / "vault"
    vault = run_playbook(
        *write_run(run_dir, hub, [model], test_hosts=host, model_cache_hub_token=secret), "-vvv", env=no_env_token
    )
    assert vault.returncode == 0, vault.output[-4000:]
    assert secret not in vault.output
    gated_gets = [s for s in hub.log if s.repo == "org/gated" and s.status == 200]
    assert gated_gets and all(s.authorized for s in gated_gets)
    # nowhere on disk but the inventory's own variables: not in the seed, not on the host
    leaked = [p for p in (run_dir / "seed").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []
    grep = fleet.ssh(host, f"grep -rl {shlex.quote(secret)} /var/lib/sparkfleet-test /etc /tmp /var/tmp || true")
    assert grep.stdout.strip() == ""
    assert set(Path("/tmp").glob("*.hf-token")) == tokens_before, "the private token file was left behind"
