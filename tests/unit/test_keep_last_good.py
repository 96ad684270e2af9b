"""playbooks/tasks/keep-last-good.yml, run for real on localhost: what passed the health gate is kept as
the last good state, without the start-up record every start of the unit rewrites, so a restart
(crash, `make restart`, reboot) leaves the next converged deploy with nothing to change."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
UNIT = "sparkfleet-vllm-dflash.service"


def keep(tmp_path: Path) -> str:
    """Run keep-last-good.yml on localhost; the recap's changed count for localhost."""
    playbook = tmp_path / "keep.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Keep the last good state",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [{"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/keep-last-good.yml")}],
                }
            ]
        )
    )
    variables = {
        "sparkfleet_config_dir": str(tmp_path / "etc"),
        "sparkfleet_systemd_dir": str(tmp_path / "systemd"),
        "sparkfleet_plan": {"unit": UNIT},
        "ansible_python_interpreter": sys.executable,
    }
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", "-c", "local", "-e", json.dumps(variables), str(playbook)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return re.search(r"localhost\s+: ok=\d+\s+changed=(\d+)", proc.stdout).group(1)


def write_state(tmp_path: Path, **startup: float) -> dict:
    state = {"profile": "dflash", "unit": UNIT, "port": 8000, "startup": startup}
    (tmp_path / "etc" / "state.json").write_text(json.dumps(state, indent=4, sort_keys=True) + "\n")
    return state


def test_the_last_good_state_leaves_out_the_startup_record_so_a_restart_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / UNIT).write_text("[Service]\nExecStart=/bin/true\n")
    state = write_state(tmp_path, ready_s=41.5)
    assert keep(tmp_path) != "0"
    kept = json.loads((tmp_path / "etc" / "last-good" / "state.json").read_text())
    assert kept == {key: value for key, value in state.items() if key != "startup"}
    assert (tmp_path / "etc" / "last-good" / UNIT).read_text() == (tmp_path / "systemd" / UNIT).read_text()
    # the unit restarted: its start rewrote "startup"; keeping the same healthy state again changes nothing
    write_state(tmp_path, ready_s=38.0, weights_load_s=12.0)
    assert keep(tmp_path) == "0"
    # a real change (another port) is still kept
    (tmp_path / "etc" / "state.json").write_text(json.dumps({**state, "port": 8100}))
    assert keep(tmp_path) == "1"
    assert json.loads((tmp_path / "etc" / "last-good" / "state.json").read_text())["port"] == 8100
