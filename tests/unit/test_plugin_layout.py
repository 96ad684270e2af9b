"""Where Ansible finds sparkfleet's plugins, and how they reach the sparkfleet package (issue 15 point 4,
the plugin part): every folder ansible.cfg names exists, and no plugin edits ``sys.path`` to reach
the package. sparkfleet is installed in the controller venv that runs ansible-playbook, so a plugin
imports it like any other dependency, and one run by a Python without it fails the import instead of
reading whatever tree lies next to the plugin file."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIRS = ("filter_plugins", "lookup_plugins", "callback_plugins", "library", "module_utils", "action_plugins")


def plugin_files() -> list[Path]:
    found = []
    for folder in PLUGIN_DIRS:
        found += REPO_ROOT.glob(f"{folder}/*.py")
    return sorted(found)


def test_plugins_live_only_where_ansible_cfg_names() -> None:
    """No role carries plugins of its own: a reader finds every filter, lookup, module and callback in
    the folders ansible.cfg names (roles use them through that configuration)."""
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "ansible.cfg")
    named = {folder for key, value in config["defaults"].items() if key in PLUGIN_DIRS for folder in value.split(":")}
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    stray = [
        path for path in tracked if set(path.split("/")[:-1]) & set(PLUGIN_DIRS) and path.split("/")[0] not in named
    ]
    assert not stray, f"plugins outside the folders ansible.cfg names: {stray}"


def test_every_folder_ansible_cfg_names_exists() -> None:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "ansible.cfg")
    named = {key: value for key, value in config["defaults"].items() if key in {*PLUGIN_DIRS, "roles_path"}}
    assert named, "ansible.cfg names no plugin folder"
    for key, value in named.items():
        for folder in value.split(":"):
            assert (REPO_ROOT / folder).is_dir(), f"ansible.cfg {key} = {value}: {folder} does not exist"


def test_there_are_plugins_and_none_edits_sys_path() -> None:
    files = plugin_files()
    assert len(files) >= 8, files
    for path in files:
        assert "sys.path" not in path.read_text(), f"{path.relative_to(REPO_ROOT)} edits sys.path"


@pytest.mark.parametrize(
    "plugin",
    [
        "filter_plugins/sparkfleet_filters.py",
        "lookup_plugins/sparkfleet_profile.py",
        "lookup_plugins/sparkfleet_plan.py",
        "filter_plugins/spark_cuda.py",
        "filter_plugins/prometheus_text.py",
    ],
)
def test_a_plugin_run_by_a_python_without_sparkfleet_fails_the_import(plugin: str) -> None:
    # the same interpreter with the installed sparkfleet (the venv's editable finder) taken away: the
    # plugin must fail the import, not reach for the checkout's copy next to it
    hide = (
        "import sys, runpy\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'sparkfleet' not in (getattr(f, '__module__', '') or '')]\n"
        "sys.path[:] = [entry for entry in sys.path if '__editable__' not in entry]\n"
        f"assert {str(REPO_ROOT)!r} not in sys.path, sys.path\n"
        f"runpy.run_path({str(REPO_ROOT / plugin)!r})\n"
    )
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: its sparkfleet/ is not on the path
        result = subprocess.run(
            [sys.executable, "-c", hide],
            cwd=cwd,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode != 0
    assert "No module named 'sparkfleet" in result.stderr, result.stderr[-2000:]


def test_no_plugin_file_is_named_like_the_package_it_imports() -> None:
    """A plugin file called sparkfleet.py would shadow the sparkfleet package for anything that puts its
    folder on sys.path (a test importing a neighbouring plugin, a debugger)."""
    assert not [path for path in plugin_files() if path.stem == "sparkfleet"]
