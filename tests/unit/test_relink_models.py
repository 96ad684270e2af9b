"""A rollback puts each hub model's link back on its last good revision (playbooks/tasks/relink-models.yml,
run for real by ansible-playbook on this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
OLD = "1" * 40
NEW = "2" * 40


def relink(tmp_path: Path, revisions: dict) -> subprocess.CompletedProcess:
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "vars": {"sparkfleet_service_user": "root"},
            "tasks": [
                {
                    "ansible.builtin.include_tasks": str(ROOT / "playbooks/tasks/relink-models.yml"),
                    "vars": {"__relink_revisions": revisions, "__relink_models_dir": str(tmp_path / "models")},
                }
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    inventory = {
        "all": {"hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}
    }
    (tmp_path / "hosts.json").write_text(json.dumps(inventory))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the task sets root ownership, as on a host")
@pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv")
def test_hub_links_go_back_to_the_recorded_revision_and_local_copies_stay(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for rev in (OLD, NEW):
        (models / ".hub" / "target" / rev).mkdir(parents=True)
        (models / ".hub" / "target" / rev / "config.json").write_text(rev)
    (models / "target").symlink_to(f".hub/target/{NEW}")  # the failed update had moved it
    (models / "tiny").mkdir()  # a model shipped from a local path: a directory, not versioned
    (models / "tiny" / "config.json").write_text("local")

    run = relink(tmp_path, {"target": OLD, "tiny": "local"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert os.readlink(models / "target") == f".hub/target/{OLD}"
    assert (models / "target" / "config.json").read_text() == OLD
    assert (models / "tiny").is_dir() and not (models / "tiny").is_symlink()
    assert "changed=1" in run.stdout

    again = relink(tmp_path, {"target": OLD, "tiny": "local"})
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the task sets root ownership, as on a host")
@pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv")
def test_a_revision_no_longer_on_the_host_fails_the_rollback(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / ".hub" / "target" / NEW).mkdir(parents=True)
    (models / "target").symlink_to(f".hub/target/{NEW}")
    run = relink(tmp_path, {"target": OLD})
    assert run.returncode != 0
    assert f"cannot point target back at revision {OLD}" in run.stdout, run.stdout[-3000:]
    assert f"{models}/.hub/target/{OLD} is no longer on the host" in run.stdout
    assert "Deploy that revision again (pin it under sparkfleet_models.target.revision)" in run.stdout
    assert os.readlink(models / "target") == f".hub/target/{NEW}"  # nothing changed
