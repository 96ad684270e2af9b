"""model_cache's ship plan (filter_plugins/model_cache_ship.py) against real find output.

The role lists a host's copies of the local models with ansible's own ``find`` (checksummed) and
ships only the models the filter names. The listing here comes from that module, run by ansible on
this machine over host copies that differ from the controller's in one way each: a model is stale
when any controller file is missing, differs in content, owner, group or mode; files only the host
has change nothing (``copy`` never deletes them).
"""

from __future__ import annotations

import grp
import importlib.util
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("model_cache_ship", ROOT / "filter_plugins" / "model_cache_ship.py")
ship = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ship)
OWNER = pwd.getpwuid(os.getuid()).pw_name
GROUP = grp.getgrgid(os.getgid()).gr_name


def _model(root: Path, name: str, files: dict[str, bytes]) -> dict[str, str]:
    for relative, content in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return {"name": name, "path": str(root / name)}


def _host_copy(models: list[dict[str, str]], cache: Path) -> None:
    for model in models:
        shutil.copytree(model["path"], cache / model["name"])
        for path in (cache / model["name"]).rglob("*"):
            if path.is_file():
                path.chmod(0o640)


def _find(paths: list[Path]) -> list[dict]:
    """ansible's find module, as the role runs it, over ``paths``."""
    args = json.dumps(
        {"paths": [str(p) for p in paths], "recurse": True, "hidden": True, "file_type": "file", "get_checksum": True}
    )
    env = {
        **os.environ,
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal",
        "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",  # the result is parsed below (ansible.cfg says yaml)
    }
    ansible = Path(sys.executable).with_name("ansible")
    result = subprocess.run(
        [str(ansible), "localhost", "-i", "localhost,", "-c", "local", "-m", "ansible.builtin.find", "-a", args,
         "-e", f"ansible_python_interpreter={sys.executable}"],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # minimal: "localhost | SUCCESS => {the module's result}"
    return json.JSONDecoder().raw_decode(result.stdout.split("=>", 1)[1].lstrip())[0]["files"]


@pytest.fixture
def controller(tmp_path: Path) -> list[dict[str, str]]:
    source = tmp_path / "controller"
    return [
        _model(source, "tiny-a", {"config.json": b"{}", "model.safetensors": os.urandom(70_000), ".hidden": b"x"}),
        _model(source, "tiny-b", {"config.json": b'{"b": 1}', "sub/tokenizer.json": b"[]" * 1000}),
    ]


def test_a_host_is_sent_exactly_the_models_whose_files_differ(tmp_path: Path, controller) -> None:
    cases = {
        "same": lambda cache: None,
        "flipped": lambda cache: (cache / "tiny-b" / "sub" / "tokenizer.json").write_bytes(b"[]" * 999 + b"]["),
        "missing-hidden": lambda cache: (cache / "tiny-a" / ".hidden").unlink(),
        "mode": lambda cache: (cache / "tiny-b" / "config.json").chmod(0o644),
        "extra-file": lambda cache: (cache / "tiny-a" / "notes.txt").write_bytes(b"the host's own"),
        "no-model-b": lambda cache: shutil.rmtree(cache / "tiny-b"),
    }
    expected = {
        "same": [],
        "flipped": ["tiny-b"],
        "missing-hidden": ["tiny-a"],
        "mode": ["tiny-b"],
        "extra-file": [],
        "no-model-b": ["tiny-b"],
    }
    for case, change in cases.items():
        _host_copy(controller, tmp_path / case)
        change(tmp_path / case)
    listing = _find([tmp_path / case for case in cases])
    files = sum(1 for m in controller for p in Path(m["path"]).rglob("*") if p.is_file())
    size = sum(p.stat().st_size for m in controller for p in Path(m["path"]).rglob("*") if p.is_file())
    for case in cases:
        plan = ship.model_cache_ship_plan(controller, listing, str(tmp_path / case), OWNER, GROUP, "0640")
        assert plan == {"stale": expected[case], "files": files, "bytes": size}, case
    # an owner or group the host's copy does not have makes every model stale
    for owner, group in (("someone-else", GROUP), (OWNER, "another-group")):
        plan = ship.model_cache_ship_plan(controller, listing, str(tmp_path / "same"), owner, group, "0640")
        assert plan["stale"] == ["tiny-a", "tiny-b"]
    # an empty listing (a host with no copy yet, or check mode on a new host): everything ships
    assert ship.model_cache_ship_plan(controller, [], str(tmp_path / "same"), OWNER, GROUP, "0640")["stale"] == [
        "tiny-a",
        "tiny-b",
    ]


def test_bad_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(ship.AnsibleFilterError, match="does not exist on the controller"):
        ship.model_cache_ship_plan([{"name": "gone", "path": str(tmp_path / "gone")}], [], "/c", "root", "vllm", "0640")
    with pytest.raises(ship.AnsibleFilterError, match="'rw-r'"):
        ship.model_cache_ship_plan([], [], "/c", "root", "vllm", "rw-r")
    with pytest.raises(ship.AnsibleFilterError, match="local_models"):
        ship.model_cache_ship_plan([{"name": "x"}], [], "/c", "root", "vllm", "0640")
