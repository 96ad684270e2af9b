"""tests/conftest.py's skip gate: under SPARKFLEET_FAIL_ON_SKIP=1 (.ci/run) a skip fails the run unless
tests/allowed-skips.txt lists it with its reason; the committed allow-list is well-formed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest as gate
from tests.unit.helpers import run as run_command

TESTS = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_runs():
    assert True

def test_needs_amx():
    pytest.skip("no AMX on this CPU")

def test_needs_a_variable():
    pytest.skip("set SOME_VARIABLE=1 to run")
"""


def run(tmp_path: Path, allow: str, fail_on_skip: bool) -> subprocess.CompletedProcess[str]:
    suite = tmp_path / "tests"
    suite.mkdir(exist_ok=True)
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    (suite / "allowed-skips.txt").write_text(allow)
    (suite / "test_mixed.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "SPARKFLEET_FAIL_ON_SKIP"}
    if fail_on_skip:
        env["SPARKFLEET_FAIL_ON_SKIP"] = "1"
    return run_command(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path, env=env, timeout=120
    )


def test_a_skip_not_on_the_list_fails_the_run_and_is_named(tmp_path: Path) -> None:
    allow = "tests/test_mixed.py::test_needs_amx | no AMX | the CI CPU has no AMX\n"
    result = run(tmp_path, allow, fail_on_skip=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "skips: 2 in all, 1 on tests/allowed-skips.txt, 1 not" in result.stdout
    assert (
        "SKIPPED IN CI, NOT ALLOWED: tests/test_mixed.py::test_needs_a_variable: set SOME_VARIABLE=1" in result.stdout
    )
    assert "test_needs_amx: no AMX" not in result.stdout.split("skips:")[1]


def test_listed_skips_pass_and_without_the_variable_nothing_is_checked(tmp_path: Path) -> None:
    allow = "tests/test_mixed.py::* | no AMX | why\ntests/test_mixed.py::test_needs_a_variable | set SOME | why\n"
    assert run(tmp_path, allow, fail_on_skip=True).returncode == 0
    # a pattern that matches but with another reason does not allow it
    assert run(tmp_path, "tests/test_mixed.py::* | no AMX | why\n", fail_on_skip=True).returncode == 1
    assert run(tmp_path, "", fail_on_skip=False).returncode == 0


def test_the_committed_allow_list_is_well_formed_and_short() -> None:
    entries = gate.allowed_skips()
    assert 1 <= len(entries) <= 5, entries
    for pattern, prefix, why in entries:
        assert pattern.startswith("tests/") and prefix and len(why) > 20, (pattern, prefix, why)


def test_a_malformed_entry_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "allowed-skips.txt"
    bad.write_text("# fine\ntests/x.py::y | no reason given\n")
    with pytest.raises(ValueError, match=r"allowed-skips.txt:2: want 'node-id pattern \| reason prefix \| why'"):
        gate.allowed_skips(bad)
