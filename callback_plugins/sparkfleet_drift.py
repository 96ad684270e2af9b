"""Ansible callback: at the end of a ``--check --diff`` run, one line per host of what would change.

Enabled only for drift runs (``make drift`` sets ``ANSIBLE_CALLBACKS_ENABLED`` and
``ANSIBLE_CALLBACK_PLUGINS``); the normal stdout callback still prints every diff above it.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from ansible import context
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: sparkfleet_drift
type: aggregate
short_description: one line per host of what a --check --diff run would change (drift)
description:
  - Collects, per host, the tasks that report C(changed) (in check mode, the ones that I(would) change),
    the size of their diffs and the handlers they notify, then prints one line per host after the
    play recap, e.g. C(spark-02  DRIFT  2 task(s) would change ...) or C(spark-01  in sync).
  - Failures and unreachable hosts get their own one-line reason.
  - Works without check mode too; the header then says the changes were applied.
requirements:
  - enable it, e.g. C(ANSIBLE_CALLBACKS_ENABLED=sparkfleet_drift) and
    C(ANSIBLE_CALLBACK_PLUGINS=callback_plugins)
options:
  json_path:
    description:
      - Also write the summary as JSON (host -> changes, handlers, failure) to this file; empty for none.
      - A string, not Ansible's path type, which turns an empty value into the working directory.
    type: str
    default: ""
    env:
      - name: SPARKFLEET_DRIFT_JSON
    ini:
      - section: callback_sparkfleet_drift
        key: json_path
  max_tasks:
    description: How many changed task names a host's line lists before "+N more".
    type: int
    default: 6
    env:
      - name: SPARKFLEET_DRIFT_MAX_TASKS
    ini:
      - section: callback_sparkfleet_drift
        key: max_tasks
"""


def diff_size(diff: Any) -> tuple[int, int]:
    """(lines added, lines removed) of an Ansible diff result (a dict, a list of dicts, or a prepared text)."""
    if isinstance(diff, list):
        sizes = [diff_size(item) for item in diff]
        return sum(a for a, _ in sizes), sum(r for _, r in sizes)
    if not isinstance(diff, dict):
        return 0, 0
    if isinstance(diff.get("prepared"), str):
        lines = diff["prepared"].splitlines()
        added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
        return added, removed
    before, after = diff.get("before", ""), diff.get("after", "")
    if not isinstance(before, str) or not isinstance(after, str):
        before = json.dumps(before, indent=1, sort_keys=True, default=str) if before not in ("", None) else ""
        after = json.dumps(after, indent=1, sort_keys=True, default=str) if after not in ("", None) else ""
    added = removed = 0
    for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def result_diffs(result: dict[str, Any]) -> list[Any]:
    """The diff(s) of a task result, including those of loop items."""
    diffs = [result["diff"]] if result.get("diff") else []
    for item in result.get("results") or []:
        if isinstance(item, dict) and item.get("changed") and item.get("diff"):
            diffs.append(item["diff"])
    return diffs


def new_record() -> dict[str, Any]:
    return {"changes": [], "handlers": [], "failed": None, "unreachable": None, "ok": 0}


def host_line(host: str, record: dict[str, Any], check_mode: bool, max_tasks: int = 6, width: int = 0) -> str:
    """The one summary line of a host."""
    name = host.ljust(width)
    if record.get("unreachable"):
        return f"{name}  UNREACHABLE  {record['unreachable']}"
    parts = []
    changes = record.get("changes") or []
    if changes:
        shown = []
        for change in changes[:max_tasks]:
            added, removed = change.get("added", 0), change.get("removed", 0)
            shown.append(change["task"] + (f" (+{added} -{removed})" if added or removed else ""))
        if len(changes) > max_tasks:
            shown.append(f"+{len(changes) - max_tasks} more")
        verb = "would change" if check_mode else "changed"
        parts.append(f"{len(changes)} task(s) {verb}: {', '.join(shown)}")
    if record.get("handlers"):
        verb = "would run" if check_mode else "ran"
        parts.append(f"{verb} handler(s): {', '.join(record['handlers'])}")
    if record.get("failed"):
        parts.append(f"FAILED at {record['failed']['task']!r}: {record['failed']['msg']}")
    if not parts:
        return f"{name}  in sync     ({record.get('ok', 0)} task(s) ok, nothing would change)"
    label = "FAILED" if record.get("failed") else ("DRIFT" if check_mode else "CHANGED")
    return f"{name}  {label.ljust(10)}  " + "; ".join(parts)


def one_line(text: Any, limit: int = 160) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class CallbackModule(CallbackBase):
    """Summarise changed tasks per host at the end of the run."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkfleet_drift"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, display: Any = None) -> None:
        super().__init__(display=display)
        self.records: dict[str, dict[str, Any]] = {}

    def _record(self, host: Any) -> dict[str, Any]:
        return self.records.setdefault(host.get_name(), new_record())

    # ------------------------------------------------------------------------------------ events
    def v2_runner_on_ok(self, result: Any) -> None:
        record = self._record(result._host)
        outcome = result._result
        if not outcome.get("changed"):
            record["ok"] += 1
            return
        added = removed = 0
        for diff in result_diffs(outcome):
            a, r = diff_size(diff)
            added, removed = added + a, removed + r
        record["changes"].append({"task": result._task.get_name().strip(), "added": added, "removed": removed})

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        if ignore_errors:
            return
        record = self._record(result._host)
        if record["failed"] is None:
            message = result._result.get("msg") or result._result.get("stderr") or "failed"
            record["failed"] = {"task": result._task.get_name().strip(), "msg": one_line(message)}

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._record(result._host)["unreachable"] = one_line(result._result.get("msg") or "unreachable")

    def v2_playbook_on_notify(self, handler: Any, host: Any) -> None:
        handlers = self._record(host)["handlers"]
        name = handler.get_name().strip()
        if name not in handlers:
            handlers.append(name)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        check_mode = bool(context.CLIARGS.get("check", False))
        hosts = sorted(set(stats.processed) | set(self.records))
        if not hosts:
            return
        max_tasks = int(self.get_option("max_tasks"))
        width = max(len(h) for h in hosts)
        title = "DRIFT (check mode: nothing was changed)" if check_mode else "CHANGES (applied by this run)"
        self._display.banner(title)
        for host in hosts:
            record = self.records.get(host, new_record())
            self._display.display(host_line(host, record, check_mode, max_tasks, width))
        drifted = [h for h in hosts if self.records.get(h, {}).get("changes")]
        self._display.display(
            f"{len(drifted)} of {len(hosts)} host(s) " + ("would change" if check_mode else "changed")
        )
        json_path = (self.get_option("json_path") or "").strip()
        if json_path:
            json_path = str(Path(json_path).expanduser())
            summary = {
                "check_mode": check_mode,
                "hosts": {h: self.records.get(h, new_record()) for h in hosts},
            }
            Path(json_path).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
