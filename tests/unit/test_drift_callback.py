"""The sparkfleet_drift callback: diff sizes, the per-host line, and a real --check --diff run on localhost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from callback_plugins.sparkfleet_drift import diff_size, host_line, new_record, result_diffs

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def test_diff_size_counts_added_and_removed_lines() -> None:
    assert diff_size({"before": "a\nb\nc\n", "after": "a\nB\nc\nd\n"}) == (2, 1)
    assert diff_size([{"before": "", "after": "x\ny\n"}, {"before": "z\n", "after": ""}]) == (2, 1)
    assert diff_size({"prepared": "--- before\n+++ after\n-old\n+new\n+more\n"}) == (2, 1)
    assert diff_size({"before": {"state": "absent"}, "after": {"state": "directory"}}) == (1, 1)
    assert diff_size(None) == (0, 0)


def test_result_diffs_include_changed_loop_items() -> None:
    result = {
        "changed": True,
        "results": [
            {"changed": True, "diff": {"before": "1\n", "after": "2\n"}},
            {"changed": False, "diff": {"before": "x\n", "after": "y\n"}},
        ],
    }
    assert result_diffs(result) == [{"before": "1\n", "after": "2\n"}]


def test_host_line_names_changes_handlers_and_failures() -> None:
    record = new_record()
    record["changes"] = [{"task": f"task {i}", "added": i, "removed": 0} for i in range(1, 9)]
    record["handlers"] = ["sparkfleet vllm restart"]
    line = host_line("spark-01", record, check_mode=True, max_tasks=3)
    assert line.startswith("spark-01  DRIFT")
    assert "8 task(s) would change: task 1 (+1 -0), task 2 (+2 -0), task 3 (+3 -0), +5 more" in line
    assert "would run handler(s): sparkfleet vllm restart" in line

    in_sync = new_record()
    in_sync["ok"] = 12
    assert "in sync" in host_line("spark-02", in_sync, check_mode=True)

    failed = new_record()
    failed["failed"] = {"task": "Install", "msg": "boom"}
    assert "FAILED at 'Install': boom" in host_line("spark-03", failed, check_mode=True)

    unreachable = new_record()
    unreachable["unreachable"] = "ssh: connect refused"
    assert host_line("spark-04", unreachable, check_mode=True) == "spark-04  UNREACHABLE  ssh: connect refused"
    assert host_line("spark-01", record, check_mode=False).startswith("spark-01  CHANGED  ")


PLAYBOOK = """
- name: Drift fixture
  hosts: all
  gather_facts: false
  tasks:
    - name: Write the managed file
      ansible.builtin.copy:
        dest: "{{ drift_dir }}/{{ inventory_hostname }}.txt"
        content: "{{ drift_content }}"
        mode: "0644"
      notify: Restart the thing
    - name: Keep the directory
      ansible.builtin.file:
        path: "{{ drift_dir }}"
        state: directory
        mode: "0755"
  handlers:
    - name: Restart the thing
      ansible.builtin.debug:
        msg: restarted
"""


def run_drift(
    tmp_path: Path, check: bool, json_env: str | None = None
) -> tuple[subprocess.CompletedProcess[str], dict]:
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "drift_dir": str(tmp_path / "managed"),
            },
            "hosts": {"alpha": {"drift_content": "new\n"}, "beta": {"drift_content": "same\n"}},
        }
    }
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    summary_path = tmp_path / "drift.json"
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_CALLBACKS_ENABLED": "sparkfleet_drift",
        "ANSIBLE_CALLBACK_PLUGINS": str(ROOT / "callback_plugins"),
        "ANSIBLE_NOCOLOR": "1",
        "SPARKFLEET_DRIFT_JSON": str(summary_path) if json_env is None else json_env,
    }
    command = [str(ANSIBLE_PLAYBOOK), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml"), "--diff"]
    if check:
        command.append("--check")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(summary_path.read_text()) if summary_path.exists() else {}


@pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv")
def test_check_diff_run_prints_one_line_per_host_and_changes_nothing(tmp_path: Path) -> None:
    managed = tmp_path / "managed"
    managed.mkdir()
    managed.chmod(0o755)
    (managed / "alpha.txt").write_text("old\nsecond\n")
    (managed / "beta.txt").write_text("same\n")
    for name in ("alpha.txt", "beta.txt"):
        (managed / name).chmod(0o644)

    proc, summary = run_drift(tmp_path, check=True)

    lines = proc.stdout.splitlines()
    alpha = [line for line in lines if line.startswith("alpha ")]
    beta = [line for line in lines if line.startswith("beta ")]
    assert any("DRIFT" in line and "1 task(s) would change: Write the managed file (+1 -2)" in line for line in alpha)
    assert any("would run handler(s): Restart the thing" in line for line in alpha)
    assert any("in sync" in line for line in beta)
    assert "1 of 2 host(s) would change" in proc.stdout
    assert (managed / "alpha.txt").read_text() == "old\nsecond\n", "check mode must not change the file"
    assert summary["check_mode"] is True
    assert [c["task"] for c in summary["hosts"]["alpha"]["changes"]] == ["Write the managed file"]
    assert summary["hosts"]["beta"]["changes"] == []

    # applied for real, the same callback reports what changed
    proc, summary = run_drift(tmp_path, check=False)
    assert any(line.startswith("alpha ") and "CHANGED" in line for line in proc.stdout.splitlines())
    assert any(line.startswith("beta ") and "in sync" in line for line in proc.stdout.splitlines())
    assert (managed / "alpha.txt").read_text() == "new\n"
    assert summary["check_mode"] is False


@pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv")
def test_no_json_path_writes_nothing_and_warns_nothing(tmp_path: Path) -> None:
    """`make drift` sets SPARKFLEET_DRIFT_JSON='' when DRIFT_JSON is not given."""
    proc, summary = run_drift(tmp_path, check=True, json_env="")
    assert summary == {} and not (tmp_path / "drift.json").exists()
    assert "2 of 2 host(s) would change" in proc.stdout  # nothing managed exists yet
    for stream in (proc.stdout, proc.stderr):
        assert "Is a directory" not in stream and "[WARNING]" not in stream, stream[-2000:]
