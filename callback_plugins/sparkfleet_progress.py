"""Ansible callback: show the progress lines of long steps as they come.

A long step (a vLLM start: ~3 min on a GB10, ~8 min on a first load; a venv's pip install; a checkpoint
build) runs as an async job while a task polls it and retries; Ansible prints only "FAILED - RETRYING" for
each poll. A poll that prints a line starting with ``progress:`` on stdout (``sparkfleet-start-progress``,
``sparkfleet-job-progress``) gets that line shown, with the host, at once. So does each item of a loop
that does a long job step by step (the hub download: ``sparkfleet weights fetch --progress``), as the item
returns.
"""

from __future__ import annotations

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: sparkfleet_progress
type: aggregate
short_description: show the "progress:" lines of retried polls as they come
description:
  - For a task that retries (until/retries), prints the stdout lines of each attempt that start
    with C(progress:), prefixed with the host, as soon as the attempt returns; the same for each
    item of a loop.
requirements:
  - enable in ansible.cfg (callbacks_enabled)
"""

PREFIX = "progress:"


def progress_lines(result: dict) -> list[str]:
    """The ``progress:`` lines of one attempt's stdout, without the prefix."""
    stdout = result.get("stdout") if isinstance(result, dict) else None
    if not isinstance(stdout, str):
        return []
    return [line[len(PREFIX) :].strip() for line in stdout.splitlines() if line.startswith(PREFIX)]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkfleet_progress"
    CALLBACK_NEEDS_ENABLED = True

    def v2_runner_retry(self, result) -> None:  # noqa: ANN001 - Ansible's TaskResult
        for line in progress_lines(result._result):
            self._display.display(f"  [{result._host.get_name()}] {line}")

    v2_runner_item_on_ok = v2_runner_retry
