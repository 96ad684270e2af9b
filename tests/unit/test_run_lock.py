"""One run at a time per inventory (callback_plugins/sparkfleet_lock.py), with real ansible-playbook runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.unit.helpers import ANSIBLE_PLAYBOOK, ROOT, ansible_env, needs_ansible_playbook, run, write_hosts, write_play

pytestmark = needs_ansible_playbook


def setup(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    inventory = tmp_path / "inventory"
    write_hosts(inventory)
    task = {
        "name": "Record when this run changed the host, then hold it",
        "ansible.builtin.shell": "date +%s.%N >> {{ marks }}/{{ run }} && sleep {{ hold }}",
        "changed_when": True,
    }
    playbook = write_play(tmp_path / "change.yml", [task])
    env = ansible_env(SPARKFLEET_LOCK_DIR=str(tmp_path / "locks"))
    (tmp_path / "marks").mkdir()
    return inventory, playbook, env


def command(inventory: Path, playbook: Path, tmp_path: Path, run: str, hold: float, *extra: str) -> list[str]:
    return [
        str(ANSIBLE_PLAYBOOK), "-i", str(inventory / "hosts.yml"), str(playbook),
        "-e", json.dumps({"marks": str(tmp_path / "marks"), "run": run, "hold": hold}), *extra,
    ]  # fmt: skip


def hold_lock(inventory: Path, playbook: Path, tmp_path: Path, env: dict[str, str], hold: float) -> subprocess.Popen:
    first = subprocess.Popen(command(inventory, playbook, tmp_path, "first", hold, "--limit", "spark-x"), cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (tmp_path / "marks" / "first").exists():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the first run never reached its task"
        time.sleep(0.1)
    return first


def test_a_second_run_refuses_naming_the_holder_and_changes_nothing(tmp_path: Path) -> None:
    inventory, playbook, env = setup(tmp_path)
    first = hold_lock(inventory, playbook, tmp_path, env, 30)
    try:
        second = run(command(inventory, playbook, tmp_path, "second", 0), env=env, timeout=120)
        assert second.returncode == 3, second.stdout + second.stderr
        out = second.stdout + second.stderr
        assert f"another run holds inventory {inventory / 'hosts.yml'}: pid {first.pid} (" in out, out
        assert "change.yml --limit spark-x, since " in out and "SPARKFLEET_LOCK_WAIT" in out, out
        assert not (tmp_path / "marks" / "second").exists(), "the refused run changed the host"
        # a check-mode run (make drift) changes nothing and takes no lock
        checked = run(command(inventory, playbook, tmp_path, "checked", 0, "--check"), env=env, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "another run holds" not in checked.stdout + checked.stderr
    finally:
        # the run and its workers, as a closed terminal or a kill of its process group ends them (a
        # worker still changing a host keeps the lock until its task ends)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the lock went with the killed run: the next one gets in
    after = run(command(inventory, playbook, tmp_path, "after", 0), env=env, timeout=120)
    assert after.returncode == 0, after.stdout + after.stderr
    lock_files = list((tmp_path / "locks").iterdir())
    assert len(lock_files) == 1 and oct(lock_files[0].stat().st_mode & 0o777) == "0o600"


def test_with_lock_wait_a_second_run_waits_then_runs(tmp_path: Path) -> None:
    inventory, playbook, env = setup(tmp_path)
    first = hold_lock(inventory, playbook, tmp_path, env, 4)
    second = run(command(inventory, playbook, tmp_path, "second", 0), env={**env, "SPARKFLEET_LOCK_WAIT": "120"},
                 timeout=180)  # fmt: skip
    first_out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, first_out
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"waiting up to 120 s for pid {first.pid}" in second.stdout, second.stdout
    started_first = float((tmp_path / "marks" / "first").read_text())
    started_second = float((tmp_path / "marks" / "second").read_text())
    assert started_second >= started_first + 4, "the second run changed the host while the first held it"
