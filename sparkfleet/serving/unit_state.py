"""What a serving unit's state says, in one line: running, restarting after a crash, or given up.

`systemctl show` of the unit (ActiveState, SubState, Result, NRestarts, ExecMainCode/Status) and its
journal (``journalctl -u UNIT -o cat``) are read on the host; this module turns them into the line
`make health` and `make status` print, with the journal's last error, so that a unit systemd stopped
restarting (StartLimitBurst=, then Result=start-limit-hit) is reported, not hidden behind "down".
Pure and standard library only: the Ansible filter and the ops status both call it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# systemd's own journal lines about the unit: they say that it failed, not why.
_SYSTEMD_LINE = re.compile(
    r"^(?:Started|Starting|Stopped|Stopping|Failed to start|Deactivated successfully|Consumed |"
    r"Scheduled restart job|Start request repeated too quickly|Main process exited|Control process exited|"
    r"Failed with result|Unit .* entered failed state|.*: Failed with result|"
    r"[^ ]+\.service: )"
)
_ERROR_LINE = re.compile(
    r"(?:\bERROR\b|\bCRITICAL\b|Error\b|error:|Exception\b|Traceback|Killed|out of memory|"
    r"\bOOM\b|memory guard|refused|cannot|could not|No such file|Permission denied)",
)
# vLLM's process tag and log prefix: "(APIServer pid=123) ERROR 12-02 01:02:03 [file.py:45] text".
_PROCESS_TAG = re.compile(r"^\((?:[A-Za-z]+|EngineCore_DP\d+) pid=\d+\) ")
_VLLM_PREFIX = re.compile(r"^(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")
# journalctl's default (short) output prefix: "Dec 02 01:02:03 host sparkfleet-vllm-x.service[123]: ".
_JOURNAL_PREFIX = re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [^:\s]+(?:\[\d+\])?: ")
MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class UnitState:
    """One unit's state: ``running`` is True only for active/running."""

    unit: str
    running: bool
    word: str  # running | restarting | crash-loop | failed | stopped | not-installed | unknown
    text: str  # one line, with the last error and the fix when not running


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show -p A,B`` output as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _message(line: str) -> str:
    """A journal line's message: no journalctl prefix, no vLLM process tag; indentation kept."""
    line = _JOURNAL_PREFIX.sub("", line.rstrip().lstrip("\n"), count=1)
    return _PROCESS_TAG.sub("", line, count=1)


def last_error(lines: Iterable[str]) -> str:
    """The journal's last line that says what went wrong (not systemd's "failed" lines), with the
    indented lines that continue it (a pydantic ValidationError's detail), shortened; failing a line
    that looks like an error, the last line of the program itself; "" for none."""
    messages = [_message(line) for line in lines]
    own = [m for m in messages if m.strip() and not _SYSTEMD_LINE.match(m.strip()) and not m.startswith("-- ")]
    for index in range(len(own) - 1, -1, -1):
        if _ERROR_LINE.search(own[index]):
            parts = [own[index].strip()]
            for more in own[index + 1 :]:
                if not more[:1].isspace():
                    break
                if not more.strip().startswith("For further information"):
                    parts.append(more.strip())
            return _short(": ".join(parts))
    return _short(own[-1].strip()) if own else ""


def gave_up(lines: Iterable[str]) -> bool:
    """Whether systemd refused the unit's last restart for its start rate limit (StartLimitBurst=):
    systemd 252 logs "Start request repeated too quickly" and keeps Result=exit-code, where later
    versions say Result=start-limit-hit. Only lines after the last start count."""
    messages = [_JOURNAL_PREFIX.sub("", line.strip(), count=1) for line in lines]
    starts = [i for i, line in enumerate(messages) if line.startswith("Starting ")]
    return any("Start request repeated too quickly" in line for line in messages[(starts[-1] if starts else 0) :])


def _short(line: str) -> str:
    line = _VLLM_PREFIX.sub("", line, count=1)
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def describe(unit: str, show: Mapping[str, str], journal: Iterable[str] = ()) -> UnitState:
    """The unit's state from its ``systemctl show`` properties and its journal lines."""
    load = show.get("LoadState", "")
    active, sub = show.get("ActiveState", ""), show.get("SubState", "")
    result, restarts = show.get("Result", ""), show.get("NRestarts", "0")
    status = show.get("ExecMainStatus", "")
    if load == "not-found":
        return UnitState(unit, False, "not-installed", f"{unit} is not installed: deploy a profile (make deploy)")
    if active == "active" and sub in ("running", ""):
        note = f" ({restarts} automatic restarts since it was started)" if restarts not in ("", "0") else ""
        return UnitState(unit, True, "running", f"{unit} running{note}")
    journal = list(journal)
    error = last_error(journal)
    why = f"; last error: {error}" if error else ""
    logs = "make logs LIMIT=<host>"
    if active == "failed" and (result == "start-limit-hit" or gave_up(journal)):
        return UnitState(
            unit,
            False,
            "crash-loop",
            f"crash loop: {unit} kept failing ({restarts} automatic restarts) and systemd stopped "
            f"restarting it (its start rate limit, StartLimitBurst=){why}; fix the cause ({logs}), then "
            f"`systemctl reset-failed {unit}` and make restart (or make deploy)",
        )
    if active == "failed":
        exit_text = f", exit status {status}" if status not in ("", "0") else ""
        guard = " (the memory guard stopped it: the host ran short of memory)" if status == "137" else ""
        return UnitState(
            unit,
            False,
            "failed",
            f"{unit} failed (result {result or '?'}{exit_text}){guard} after {restarts} automatic restarts{why}; "
            f"fix the cause ({logs}), then make restart (or make deploy)",
        )
    if active == "activating" and sub == "auto-restart":
        return UnitState(
            unit,
            False,
            "restarting",
            f"{unit} crashed and is waiting to restart (automatic restart {int(restarts or 0) + 1}, "
            f"result {result or '?'}){why}",
        )
    if active == "activating":
        return UnitState(unit, False, "starting", f"{unit} is starting ({sub or 'start'}, not yet healthy)")
    if active in ("inactive", "deactivating"):
        return UnitState(
            unit, False, "stopped", f"{unit} is {active} (not running){why}; start it: make restart (or make deploy)"
        )
    return UnitState(unit, False, "unknown", f"{unit} is {active or '?'}/{sub or '?'}{why}")
