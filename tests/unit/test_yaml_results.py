"""Results as YAML (ansible.cfg: ``callback_result_format = yaml``, stdout callback ``sparkfleet_default``).

A multi-line message prints as its lines; a long one-line message stays on one line (Ansible's own YAML
dumper folds it at 80 columns), apostrophes and all, so an operator's grep or a test finds it whole.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.helpers import needs_ansible_playbook, run_playbook, write_hosts, write_play

# > 80 columns, with ": " (YAML quotes it) and apostrophes (single quotes would double them)
ONE_LINE = (
    "model 'tiny-qwen3': revision 'main' is not a full 40-hex commit; pin it with make pin PROFILE=dflash, "
    "e.g. revision: 6c7242c934a9870d7c59c05240bdbb2467cc1394 (the profile's own pin was 'latest')"
)
LINES = ["arch x86_64: ok", "driver 580.95.05 (branch 580): ok", "port 8000 held by someone else: FAIL"]


@needs_ansible_playbook
def test_one_line_messages_stay_whole_and_multi_line_ones_print_as_lines(tmp_path: Path) -> None:
    tasks = [
        {"name": "A long one-line message", "ansible.builtin.debug": {"msg": ONE_LINE}},
        {"name": "A multi-line message", "ansible.builtin.debug": {"msg": "\n".join(LINES)}},
        {"name": "A long one-line failure", "ansible.builtin.fail": {"msg": ONE_LINE}, "ignore_errors": True},
        {"name": "A multi-line failure", "ansible.builtin.fail": {"msg": "\n".join(LINES)}},
    ]
    # an inventory of the test's own (the run lock is per inventory): one host, this machine
    proc = run_playbook(write_hosts(tmp_path / "inventory"), write_play(tmp_path / "play.yml", tasks))
    assert proc.returncode == 2, proc.stdout + proc.stderr  # the last task fails
    assert "Callback dispatch" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # the one-line message: one output line each time it is a result's msg (the debug and the failure)
    whole = [line for line in lines if re.fullmatch(r'\s+msg: "(.*)"', line)]
    assert [re.fullmatch(r'\s+msg: "(.*)"', line)[1] for line in whole] == [ONE_LINE, ONE_LINE], proc.stdout
    # the multi-line one: a block, each line of the message on a line of its own, more indented
    blocks = [number for number, line in enumerate(lines) if re.fullmatch(r"\s+msg: \|-", line)]
    assert len(blocks) == 2, proc.stdout
    for start in blocks:
        indent = len(lines[start]) - len(lines[start].lstrip())
        shown = lines[start + 1 : start + 1 + len(LINES)]
        assert [line.strip() for line in shown] == LINES, proc.stdout
        assert all(len(line) - len(line.lstrip()) > indent for line in shown), proc.stdout
    # nothing of it as JSON
    assert '"msg":' not in proc.stdout, proc.stdout
