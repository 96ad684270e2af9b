"""The sparkfleet_timer callback (on by default in ansible.cfg): the run's time, its slowest tasks, per role."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

PLAYBOOK = """
- name: Timed
  hosts: all
  gather_facts: false
  tasks:
    - name: A quick task
      ansible.builtin.debug:
        msg: quick
    - name: A slow task
      ansible.builtin.command: sleep {{ nap }}
      changed_when: false
    - name: A failing task that is ignored
      ansible.builtin.command: "false"
      changed_when: false
      ignore_errors: true
    - name: A skipped task
      ansible.builtin.debug:
        msg: never
      when: false
"""


@pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv")
def test_the_slowest_task_is_named_and_the_json_adds_up(tmp_path: Path) -> None:
    inventory = {
        "all": {
            "hosts": {"alpha": {"nap": 1.2}, "beta": {"nap": 0.2}},
            "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        }
    }
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    timings = tmp_path / "timer.jsonl"
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),  # enables the callback, as for every run
        "ANSIBLE_NOCOLOR": "1",
        "SPARKFLEET_TIMER_JSON": str(timings),
        "SPARKFLEET_TIMER_TOP": "2",
        # one host at a time, alpha first: which host ends the task does not hang on the machine's load
        "ANSIBLE_FORKS": "1",
    }
    command = [str(ANSIBLE_PLAYBOOK), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Callback dispatch" not in proc.stdout + proc.stderr  # no handler of the callback failed

    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("sparkfleet_timer: play.yml took"))
    # the slowest task first, timed from its first host's start until its last host (beta, after alpha's
    # 1.2 s) finished
    assert "A slow task" in lines[head + 1] and "(last: beta)" in lines[head + 1], lines[head + 1]
    assert float(lines[head + 1].split()[0]) >= 1.4
    assert lines[head + 3].startswith("  per role: (play)")  # top 2, then the per-role line

    (run,) = [json.loads(line) for line in timings.read_text().splitlines()]
    assert run["playbook"] == "play.yml"
    assert [t["name"] for t in run["tasks"]] == [
        "A quick task",
        "A slow task",
        "A failing task that is ignored",
        "A skipped task",
    ]
    assert sum(t["seconds"] for t in run["tasks"]) <= run["seconds"]
    # per role: the tasks' seconds summed, slowest role first (a play without roles: all "(play)")
    assert run["per_role"] == {"(play)": round(sum(t["seconds"] for t in run["tasks"]), 2)}
