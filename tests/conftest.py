"""Suite-wide: with SPARKFLEET_FAIL_ON_SKIP=1 (set by .ci/run) a skipped test fails the run unless
tests/allowed-skips.txt lists it with the reason it gives, so that a skip cannot hide a test CI was
meant to run (a missing package, an unset variable, a broken fleet)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

ALLOW_LIST = Path(__file__).with_name("allowed-skips.txt")
_skipped: list[tuple[str, str]] = []


def allowed_skips(path: Path = ALLOW_LIST) -> list[tuple[str, str, str]]:
    """(node-id pattern, reason prefix, why) of each entry; a malformed line is an error naming it."""
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"{path.name}:{number}: want 'node-id pattern | reason prefix | why', got {line!r}")
        entries.append((parts[0], parts[1], parts[2]))
    return entries


def is_allowed(nodeid: str, reason: str, entries: list[tuple[str, str, str]]) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, pattern) and reason.startswith(prefix) for pattern, prefix, _ in entries)


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, _reason(report)))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module skipped at import (importorskip)
        _skipped.append((report.nodeid, _reason(report)))  # type: ignore[arg-type]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("SPARKFLEET_FAIL_ON_SKIP") != "1" or not _skipped:
        return
    entries = allowed_skips()
    unexpected = [(nodeid, reason) for nodeid, reason in _skipped if not is_allowed(nodeid, reason, entries)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"skips: {len(_skipped)} in all, {len(_skipped) - len(unexpected)} on tests/allowed-skips.txt, "
            f"{len(unexpected)} not"
        )
        for nodeid, reason in unexpected:
            reporter.write_line(f"SKIPPED IN CI, NOT ALLOWED: {nodeid}: {reason}", red=True)
    if unexpected and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
