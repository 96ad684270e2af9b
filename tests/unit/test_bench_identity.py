"""What a result records about the server it measured: patch set, model revision."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sparkfleet.hostlib import bench


def test_patch_set_read_from_local_vllm_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('vllm must not be imported to read the patch set')\n")
    (package / "_sparkfleet_patchset.py").write_text("PATCHSET_ID = 'fc856daa00'\nVERSION = '0.23.0+sffc856daa00'\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert bench.local_patch_set() == "fc856daa00"
    (package / "_sparkfleet_patchset.py").unlink()
    assert bench.local_patch_set() is None


def test_model_revision_from_hf_snapshot_path() -> None:
    match = bench.SNAPSHOT_REVISION.search("/hf/hub/models--Intel--Qwen3.5/snapshots/" + "c" * 40 + "/")
    assert match and match.group(1) == "c" * 40
    assert bench.SNAPSHOT_REVISION.search("/models/tiny-qwen3") is None
