"""Ansible callback: where a run spent its time — the slowest tasks and roles, after the recap.

On by default (``ansible.cfg``: ``callbacks_enabled``). A task's time is its wall time from the
first host starting it to the last host finishing it (hosts run a task in parallel), so the task
times of a play add up to the play's wall time.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: sparkfleet_timer
type: aggregate
short_description: the run's wall time, its slowest tasks and its time per role
description:
  - After the play recap, prints the run's wall time, the C(top) slowest tasks (wall time across
    hosts, with the role and the host that finished last) and the time spent in each role.
  - Optionally writes the run's time, its seconds per role and every task's timing as JSON.
options:
  top:
    description: How many of the slowest tasks to print (0 prints only the totals).
    type: int
    default: 8
    env:
      - name: SPARKFLEET_TIMER_TOP
    ini:
      - section: callback_sparkfleet_timer
        key: top
  json_path:
    description: Append the run's task timings as one JSON line to this file.
    type: str
    default: ""
    env:
      - name: SPARKFLEET_TIMER_JSON
    ini:
      - section: callback_sparkfleet_timer
        key: json_path
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkfleet_timer"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._start = time.monotonic()
        self._tasks: dict[str, dict] = {}
        self._order: list[str] = []
        self._playbook = ""

    def v2_playbook_on_start(self, playbook):
        self._playbook = Path(playbook._file_name).name

    def _task_start(self, task):
        uuid = task._uuid
        if uuid not in self._tasks:
            role = task._role.get_name() if task._role else ""
            self._tasks[uuid] = {
                "name": task.get_name().strip(),
                "role": role,
                "start": time.monotonic(),
                "end": None,
                "last_host": "",
            }
            self._order.append(uuid)

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._task_start(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._task_start(task)

    def _task_end(self, result, *args, **kwargs):
        entry = self._tasks.get(result._task._uuid)
        if entry is not None:
            entry["end"] = time.monotonic()
            entry["last_host"] = result._host.get_name()

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = v2_runner_on_unreachable = _task_end

    def v2_playbook_on_stats(self, stats):
        total = time.monotonic() - self._start
        rows = []
        for uuid in self._order:
            t = self._tasks[uuid]
            end = t["end"] if t["end"] is not None else t["start"]
            rows.append(
                {
                    "name": t["name"],
                    "role": t["role"],
                    "seconds": round(end - t["start"], 2),
                    "last_host": t["last_host"],
                }
            )
        per_role: dict[str, float] = defaultdict(float)
        for row in rows:
            per_role[row["role"] or "(play)"] += row["seconds"]
        roles = {name: round(secs, 2) for name, secs in sorted(per_role.items(), key=lambda kv: -kv[1])}
        top = self.get_option("top")
        self._display.display(f"\nsparkfleet_timer: {self._playbook} took {total:.1f} s ({len(rows)} tasks)")
        if top > 0:
            for row in sorted(rows, key=lambda r: -r["seconds"])[:top]:
                # a role's task names already start with "role : "
                self._display.display(f"  {row['seconds']:8.1f} s  {row['name']}  (last: {row['last_host']})")
            self._display.display("  per role: " + ", ".join(f"{name} {secs:.0f} s" for name, secs in roles.items()))
        path = self.get_option("json_path")
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                run = {"playbook": self._playbook, "seconds": round(total, 2), "per_role": roles, "tasks": rows}
                fh.write(json.dumps(run) + "\n")
