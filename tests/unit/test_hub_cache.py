"""sparkfleet.build.hub_cache with the real huggingface_hub client against the local hub double (tests/hub).

Covers issue 4's controller side: pinning (a branch, tag or short sha is refused), verification
against the hub's sha256 / git blob id, the manifest, each byte fetched once, resume after a cut,
a corrupted download or seed file replaced, the disk check, a gated repo's token kept out of output,
serving offline from the seed, and the drafter's upstream change (bce6f76) that the pin ignores and
the KV planner refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkfleet import cli
from sparkfleet.build import hub_cache
from sparkfleet.build.hub_cache import HubCacheError, check_revision, describe, fetch, transfer_batches
from sparkfleet.serving import kv_page_plan
from tests.hub.server import HubDouble, git_blob_id

REPO_ROOT = Path(__file__).resolve().parents[2]
KV_CONFIGS = REPO_ROOT / "tests" / "fixtures" / "kv_configs"
PORT = 18502
TARGET = "org/tiny-target"
DRAFTER = "z-lab/tiny-dflash"


def synthetic_repo(config: dict, weight_bytes: int, seed: int) -> dict[str, bytes]:
    """A small model repo: a config, a tokenizer-ish JSON and an LFS weight file of known bytes."""
    weights = bytes((seed * 7 + i * 31) % 251 for i in range(weight_bytes))
    return {
        "config.json": json.dumps(config, indent=1).encode(),
        "tokenizer_config.json": json.dumps({"model_max_length": 2048, "seed": seed}).encode(),
        "model.safetensors": weights,
    }


@pytest.fixture()
def hub() -> Iterator[HubDouble]:
    with HubDouble(port=PORT) as double:
        yield double


@pytest.fixture()
def repos(hub: HubDouble) -> dict[str, str]:
    """The target (the 122B's real config) and the drafter at 6c7242c-like, then bce6f76-like commits."""
    target_config = kv_page_plan.load_config(KV_CONFIGS / "qwen3_5_122b_a10b")
    old = kv_page_plan.load_config(KV_CONFIGS / "dflash_6c7242c")
    new = kv_page_plan.load_config(KV_CONFIGS / "dflash_bce6f76")
    return {
        "target": hub.add_revision(TARGET, synthetic_repo(target_config, 300_000, 1)),
        "drafter_old": hub.add_revision(DRAFTER, synthetic_repo(old, 200_000, 2)),
        "drafter_new": hub.add_revision(DRAFTER, synthetic_repo(new, 260_000, 3)),
    }


def repo_bytes(hub: HubDouble, repo: str, revision: str) -> int:
    return sum(f.size for f in hub.repos[repo].resolve(revision).files.values())


@pytest.mark.parametrize(
    ("revision", "kind"),
    [("main", "a branch or tag name"), ("v1.0", "a branch or tag name"), ("6c7242c", "a short sha"),
     ("6C7242C934A9870D7C59C05240BDBB2467CC1394", "a branch or tag name"), ("", "no revision")],
)  # fmt: skip
def test_a_revision_that_can_move_is_refused_with_how_to_pin(revision: str, kind: str) -> None:
    with pytest.raises(HubCacheError) as error:
        check_revision(DRAFTER, revision)
    message = str(error.value)
    assert kind in message and DRAFTER in message
    assert "full 40-hex commit" in message and hub_cache.DFLASH_DRAFTER_REVISION in message
    assert "\n" not in message


def test_the_default_drafter_pin_is_the_known_good_commit() -> None:
    assert check_revision(DRAFTER, "6c7242c934a9870d7c59c05240bdbb2467cc1394") == hub_cache.DFLASH_DRAFTER_REVISION


def test_a_moving_revision_is_refused_before_any_request(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    with pytest.raises(HubCacheError, match="branch or tag"):
        describe(DRAFTER, "main", endpoint=hub.endpoint, token=False)
    assert hub.log == []


def test_fetch_verifies_writes_the_manifest_and_asks_once(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    assert {f.path for f in manifest.files} == {"config.json", "tokenizer_config.json", "model.safetensors"}
    weights = next(f for f in manifest.files if f.path == "model.safetensors")
    assert weights.lfs and len(weights.sha256) == 64
    config = next(f for f in manifest.files if f.path == "config.json")
    assert not config.lfs and config.sha256 is None and len(config.git_blob_id) == 40

    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    total = repo_bytes(hub, TARGET, repos["target"])
    assert report.verified and report.downloaded_files == 3 and report.downloaded_bytes == total
    assert hub.file_bytes_served(TARGET) == total

    written = json.loads(Path(report.manifest).read_text())
    assert (written["repo"], written["revision"], written["total_bytes"]) == (TARGET, repos["target"], total)
    snapshot = Path(report.snapshot)
    for entry in written["files"]:
        data = (snapshot / entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hub_cache.hashlib.sha256(data).hexdigest()
        assert entry["git_blob_id"] == hub.repos[TARGET].resolve(repos["target"]).files[entry["path"]].blob_id
    assert written["files"][0]["git_blob_id"] == git_blob_id((snapshot / written["files"][0]["path"]).read_bytes())

    # a second run (another host, another deploy) asks the hub for no file again
    again = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    assert again.verified and again.downloaded_files == 0
    assert hub.file_bytes_served(TARGET) == total
    assert len(hub.file_gets(TARGET)) == 3


def test_each_download_says_its_rate_and_the_bytes_the_seed_holds(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    """What an operator sees of a long download (``weights fetch --progress``, one role step per big
    file): every file's rate, and the repo's bytes in the seed so far against its total."""
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    sizes = {f.path: f.size for f in manifest.files}
    first = "model.safetensors"
    lines: list[str] = []
    fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False, only=[first], progress=lines.append)
    done = [line for line in lines if "downloaded in" in line]
    total = hub_cache.human_bytes(manifest.total_bytes)
    held = hub_cache.human_bytes(sizes[first])
    share = f"({100 * sizes[first] / manifest.total_bytes:.0f}%)"
    assert len(done) == 1 and first in done[0] and "/s);" in done[0], lines
    assert done[0].endswith(f"{TARGET}: {held} of {total} in the seed {share}"), done[0]

    rest = [path for path in sizes if path != first]
    manifest_file = str(hub_cache.SeedCache(tmp_path).write_manifest(manifest))
    fetched = subprocess.run(
        [sys.executable, "-m", "sparkfleet.build.hub_cache", "fetch", "--manifest", manifest_file,
         "--seed-dir", str(tmp_path), "--endpoint", hub.endpoint, "--progress", *[f"--file={p}" for p in rest]],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    progress = [line for line in fetched.stdout.splitlines() if line.startswith("progress: ")]
    assert len([line for line in progress if "downloaded in" in line]) == len(rest), fetched.stdout
    assert progress[-1].endswith(f"{total} of {total} in the seed (100%)"), fetched.stdout


def test_allow_patterns_limit_the_files(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False, allow_patterns=["*.json"])
    assert {f.path for f in manifest.files} == {"config.json", "tokenizer_config.json"}
    with pytest.raises(HubCacheError, match=r"no file matches allow_patterns \['\*.bin'\]"):
        describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False, allow_patterns=["*.bin"])


def test_a_cut_transfer_resumes_where_it_stopped(
    hub: HubDouble, repos: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client resumes from the last whole chunk it wrote (10 MiB in huggingface_hub); small chunks
    # make that point land inside these small files.
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    hub.cut(TARGET, "model.safetensors", after_bytes=40 * 4096)
    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    assert report.verified
    gets = hub.file_gets(TARGET, "model.safetensors")
    assert [(g.status, g.range_start) for g in gets] == [(200, 0), (206, 40 * 4096)]
    assert sum(g.body_bytes for g in gets) == 300_000  # nothing fetched twice


def test_an_interrupted_run_keeps_finished_files(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    hub.cut(TARGET, "tokenizer_config.json", after_bytes=0, times=10)  # the network keeps dropping mid-run
    with pytest.raises(HubCacheError, match="tokenizer_config.json: download failed.*run again to resume"):
        fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    done_before = {g.path for g in hub.file_gets(TARGET)}
    assert "config.json" in done_before and "model.safetensors" in done_before
    hub.cut(TARGET, "tokenizer_config.json", after_bytes=0, times=0)
    hub.reset_log()
    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    assert report.verified
    assert [g.path for g in hub.file_gets(TARGET)] == ["tokenizer_config.json"]


def test_a_corrupted_download_is_detected_and_fetched_again(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    hub.corrupt(TARGET, "model.safetensors", times=1)
    hub.corrupt(TARGET, "config.json", times=1)
    lines: list[str] = []
    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False, progress=lines.append)
    assert report.verified and report.replaced_files == 2
    assert any("model.safetensors" in line and "sha256" in line for line in lines)
    assert any("config.json" in line and "git blob id" in line for line in lines)
    assert len(hub.file_gets(TARGET, "model.safetensors")) == 2

    hub.corrupt(TARGET, "tokenizer_config.json", times=5)
    other = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    hub_cache.SeedCache(tmp_path).remove(other, next(f for f in other.files if f.path == "tokenizer_config.json"))
    with pytest.raises(HubCacheError, match="still fails verification after 2 downloads"):
        fetch(other, tmp_path, endpoint=hub.endpoint, token=False)


def test_a_corrupted_seed_file_is_replaced(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    weights = Path(report.snapshot) / "model.safetensors"
    blob = weights.resolve()
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0x55
    blob.write_bytes(bytes(data))  # bit rot: same size, new mtime
    repaired = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    assert repaired.verified and repaired.replaced_files == 1 and repaired.downloaded_files == 1
    assert hub_cache.sha256_of_file(weights) == next(f.sha256 for f in manifest.files if f.lfs)


def test_free_space_is_checked_before_any_transfer(
    hub: HubDouble, repos: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    monkeypatch.setattr(hub_cache, "free_bytes", lambda path: 1000)
    with pytest.raises(HubCacheError) as error:
        fetch(manifest, tmp_path / "seed", endpoint=hub.endpoint, token=False)
    message = str(error.value)
    total = repo_bytes(hub, TARGET, repos["target"])
    assert str(tmp_path / "seed") in message and f"({total} bytes)" in message and "(1000 bytes) is free" in message
    assert hub.file_gets() == []


def test_the_pin_ignores_the_drafters_upstream_change(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    """The bce6f76 case: main moves to a drafter whose KV pages vLLM 0.23 cannot unify; the pin holds."""
    assert hub.repos[DRAFTER].resolve("main").sha == repos["drafter_new"]
    manifest = describe(DRAFTER, repos["drafter_old"], endpoint=hub.endpoint, token=False)
    report = fetch(manifest, tmp_path, endpoint=hub.endpoint, token=False)
    pinned = kv_page_plan.load_config(Path(report.snapshot))
    assert (pinned["num_key_value_heads"], pinned["num_hidden_layers"], pinned["sliding_window"]) == (4, 4, 2048)
    target = kv_page_plan.load_config(
        Path(fetch(describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False), tmp_path,
                   endpoint=hub.endpoint, token=False).snapshot)
    )  # fmt: skip
    assert kv_page_plan.plan(target, pinned, 5, patched=False, platform="cuda").ok

    # what following main would have brought: the planner refuses it on stock vLLM 0.23
    upstream = fetch(describe(DRAFTER, repos["drafter_new"], endpoint=hub.endpoint, token=False), tmp_path,
                     endpoint=hub.endpoint, token=False)  # fmt: skip
    moved = kv_page_plan.load_config(Path(upstream.snapshot))
    assert (moved["num_key_value_heads"], moved["num_hidden_layers"], moved["sliding_window"]) == (8, 6, 4096)
    refused = kv_page_plan.plan(target, moved, 5, patched=False, platform="cuda", drafter_label="upstream main")
    assert not refused.ok and refused.failure_stage == "unify"
    # and the pinned snapshot was not touched by the newer revision
    assert kv_page_plan.load_config(Path(report.snapshot)) == pinned


@pytest.mark.parametrize("source", ["token-file", "HF_TOKEN"])
def test_a_gated_repo_needs_the_token_and_never_prints_it(
    hub: HubDouble, repos: dict, tmp_path: Path, source: str
) -> None:
    """The token from a private file (what model_cache writes from an inventory/Vault variable) or from
    the controller's HF_TOKEN (no variable set)."""
    secret = "hf_sparkfleetTestToken0123456789"
    hub.gate(TARGET, secret)
    with pytest.raises(HubCacheError, match="refused the file list"):
        describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False)
    hub.reset_log()
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    seed = tmp_path / "seed"
    common = ["--seed-dir", str(seed), "--endpoint", hub.endpoint, "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    if source == "token-file":
        common += ["--token-file", str(token_file)]
    else:
        env["HF_TOKEN"] = secret
    described = subprocess.run(
        [sys.executable, "-m", "sparkfleet.build.hub_cache", "describe", "--repo", TARGET,
         "--revision", repos["target"], *common],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert described.returncode == 0, described.stderr
    manifest_file = json.loads(described.stdout)["manifest"]
    fetched = subprocess.run(
        [sys.executable, "-m", "sparkfleet.build.hub_cache", "fetch", "--manifest", manifest_file, *common],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads(fetched.stdout)["verified"]
    assert hub.log and all(served.authorized for served in hub.log)
    for text in (described.stdout, described.stderr, fetched.stdout, fetched.stderr):
        assert secret not in text
    for path in seed.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert secret.encode() not in path.read_bytes(), path


def test_the_seed_serves_offline(hub: HubDouble, repos: dict, tmp_path: Path) -> None:
    """With HF_HUB_OFFLINE=1 the client loads the pinned revision from the cache and asks the hub nothing."""
    report = fetch(describe(DRAFTER, repos["drafter_old"], endpoint=hub.endpoint, token=False), tmp_path,
                   endpoint=hub.endpoint, token=False)  # fmt: skip
    hub.reset_log()
    script = (
        "import sys; from huggingface_hub import hf_hub_download;"
        "p = hf_hub_download(sys.argv[1], 'config.json', revision=sys.argv[2], cache_dir=sys.argv[3]);"
        "w = hf_hub_download(sys.argv[1], 'model.safetensors', revision=sys.argv[2], cache_dir=sys.argv[3]);"
        "print(p); print(w)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint}
    result = subprocess.run(
        [sys.executable, "-c", script, DRAFTER, repos["drafter_old"], str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config_path, weights_path = result.stdout.split()
    assert Path(weights_path).parent == Path(report.snapshot) == Path(config_path).parent
    assert json.loads(Path(config_path).read_text())["num_key_value_heads"] == 4
    assert hub.log == []


def test_verify_directory_reports_missing_truncated_and_corrupted(hub: HubDouble, repos: dict, tmp_path: Path):
    report = fetch(describe(TARGET, repos["target"], endpoint=hub.endpoint, token=False), tmp_path / "seed",
                   endpoint=hub.endpoint, token=False)  # fmt: skip
    manifest = hub_cache.load_manifest(Path(report.manifest))
    host = tmp_path / "host"
    host.mkdir()
    for entry in manifest.files:
        (host / entry.path).write_bytes((Path(report.snapshot) / entry.path).read_bytes())
    assert hub_cache.verify_directory(manifest, host) == []
    (host / "config.json").unlink()
    weights = host / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    tokenizer = host / "tokenizer_config.json"
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b"2048", b"4096"))
    assert hub_cache.verify_directory(manifest, host) == [
        "config.json: missing",
        "model.safetensors: size 299990 != 300000",
        "tokenizer_config.json: sha256 differs from the manifest",
    ]


def test_transfer_batches_put_big_files_alone() -> None:
    files = [("a", 10), ("big1", 500), ("b", 20), ("c", 90), ("big2", 100), ("d", 1)]
    assert transfer_batches(files, 100) == [["big1"], ["a", "b", "c"], ["big2"], ["d"]]
    assert transfer_batches([], 100) == []


def test_the_cli_is_registered_and_refuses_a_branch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.COMMANDS.get("weights") == "sparkfleet.build.hub_cache"
    code = cli.main(
        ["weights", "describe", "--repo", DRAFTER, "--revision", "main", "--seed-dir", str(tmp_path), "--json"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("sparkfleet weights: z-lab/tiny-dflash: revision 'main' is a branch or tag name")
    assert list(tmp_path.iterdir()) == []
