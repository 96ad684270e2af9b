"""library/model_cache_verify.py run as Ansible runs it (JSON args in, JSON out), locally.

The host-side check of issue 4: missing, truncated and corrupted files found and (with remove_bad)
removed, the free-space refusal naming the path, the need and what is free, the manifest written
next to the revision, check mode changing nothing.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "library" / "model_cache_verify.py"
GROUP = grp.getgrgid(os.getgid()).gr_name


def run_module(args: dict, check_mode: bool = False) -> dict:
    payload = {"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check_mode}}
    result = subprocess.run(
        [sys.executable, str(MODULE)], input=json.dumps(payload), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    return json.loads(result.stdout)


@pytest.fixture()
def model(tmp_path: Path) -> tuple[Path, list[dict]]:
    directory = tmp_path / "models" / ".hub" / "tiny" / ("ab" * 20)
    directory.mkdir(parents=True)
    files = {"config.json": b'{"a": 1}', "model.safetensors": bytes(range(256)) * 40, "sub/tok.json": b"{}"}
    entries = []
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return directory, entries


def test_a_matching_directory_is_verified_and_unchanged(model: tuple[Path, list[dict]]) -> None:
    directory, entries = model
    result = run_module({"path": str(directory), "files": entries})
    assert result["verified"] and not result["changed"] and result["missing"] == [] and result["bad"] == []
    assert result["files"] == 3 and result["bytes"] == sum(e["size"] for e in entries)


def test_missing_truncated_and_corrupted_files_are_found_and_removed(model: tuple[Path, list[dict]]) -> None:
    directory, entries = model
    (directory / "config.json").unlink()
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    (directory / "sub" / "tok.json").write_bytes(b"[]")

    looked = run_module({"path": str(directory), "files": entries, "remove_bad": True}, check_mode=True)
    assert looked["changed"] and weights.exists()  # check mode removes nothing

    result = run_module({"path": str(directory), "files": entries, "remove_bad": True})
    assert not result["verified"] and result["changed"]
    reasons = {bad["path"]: bad["reason"] for bad in result["bad"]}
    assert reasons["model.safetensors"].startswith("size 10239, expected 10240")
    assert "corrupted" in reasons["sub/tok.json"]
    assert sorted(result["missing"]) == ["config.json", "model.safetensors", "sub/tok.json"]
    assert result["bytes_needed"] == sum(e["size"] for e in entries)
    assert not weights.exists() and not (directory / "sub" / "tok.json").exists()
    assert result["steps"] == [{"files": result["missing"], "bytes": result["bytes_needed"]}]


def test_too_little_free_space_is_refused_before_a_transfer(model: tuple[Path, list[dict]]) -> None:
    directory, entries = model
    huge = [*entries, {"path": "huge.safetensors", "size": 1 << 60, "sha256": "0" * 64}]
    result = run_module({"path": str(directory), "files": huge})
    assert result["failed"]
    assert result["msg"].startswith(f"{directory}: the model needs 1073741824.0 GiB ({1 << 60} bytes) more for 1 files")
    assert "is free there; free space or set model_cache_dir to a larger disk" in result["msg"]


def test_create_writes_the_directory_and_the_manifest(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("ownership root:<group> needs root")
    directory = tmp_path / "m" / ".hub" / "x" / ("cd" * 20)
    manifest = {"repo": "org/x", "revision": "cd" * 20, "files": []}
    args = {"path": str(directory), "files": [], "create": True, "group": GROUP, "manifest": manifest}
    first = run_module(args)
    assert first["changed"] and first["verified"] and directory.is_dir()
    assert oct(directory.stat().st_mode & 0o777) == "0o750"
    written = Path(str(directory) + ".manifest.json")
    assert json.loads(written.read_text()) == manifest and oct(written.stat().st_mode & 0o777) == "0o640"
    assert not run_module(args)["changed"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [({"path": "../etc/passwd", "size": 1, "sha256": "0"}, "path must be relative"),
     ({"path": "a", "size": 1, "sha256": None}, "needs an integer size and a sha256")],
)  # fmt: skip
def test_bad_manifest_entries_are_refused(tmp_path: Path, entry: dict, message: str) -> None:
    result = run_module({"path": str(tmp_path), "files": [entry]})
    assert result["failed"] and message in result["msg"]
