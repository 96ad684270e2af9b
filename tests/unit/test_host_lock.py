"""The host-side operations lock (roles/vllm_service/files/sparkfleet-host-lock), run for real on small commands.

Each test locks a file under tmp_path with --lock-file; the holders are real wrapper processes (or this
test process, for a holder that left no record).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "roles" / "vllm_service" / "files" / "sparkfleet-host-lock"
USAGE = "usage: sparkfleet-host-lock [--lock-file PATH] [--wait SECONDS] [--holder TEXT] -- COMMAND [ARG...]"
HOLDER = "alice@ctl make restart"


def wrapper(lock: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--lock-file", str(lock), *args]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def touch(path: Path) -> list[str]:
    return python(f"import pathlib; pathlib.Path({str(path)!r}).touch()")


def run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def wait_for(condition: Callable[[], bool], what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the holder exited {process.returncode} before {what}: {process.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def record(lock: Path) -> dict | None:
    """The holder record in the lock file, None while there is none (yet)."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:  # caught between the truncate and the write
        return None


@contextlib.contextmanager
def holding(lock: Path, command: list[str], ready: Path | None = None) -> Iterator[subprocess.Popen]:
    """A wrapper holding the lock while command runs: yielded once its record is written (and ready exists)."""
    first = subprocess.Popen(
        wrapper(lock, "--holder", HOLDER, "--", *command), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: record(lock) is not None and (ready is None or ready.exists()), "its holder record", first)
        yield first
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
        first.wait(timeout=10)


def sleeper(ready: Path, seconds: float, then: str = "") -> list[str]:
    """A command that writes its pid to ready, sleeps, then runs the `then` statement."""
    code = f"import os, pathlib, time; pathlib.Path({str(ready)!r}).write_text(str(os.getpid())); time.sleep({seconds})"
    return python(f"{code}; {then or 'pass'}")


def test_runs_the_command_and_passes_its_exit_status(tmp_path: Path) -> None:
    lock = tmp_path / "run-lock" / "ops.lock"  # the directory is made too
    seen = tmp_path / "seen"
    code = f"import pathlib, sys; pathlib.Path({str(seen)!r}).write_text(open({str(lock)!r}).read()); sys.exit(3)"
    result = run(wrapper(lock, "--", *python(code)))
    assert result.returncode == 3, result.stderr
    assert result.stderr == ""
    held = json.loads(seen.read_text())  # what the lock file said while the command ran
    assert held["pid"] > 0 and held["command"] == shlex.join(python(code))
    assert held["holder"]  # default: the user and the parent process
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", held["since"])
    assert lock.read_text() == ""  # emptied before the lock went
    assert lock.stat().st_mode & 0o777 == 0o644 and lock.parent.stat().st_mode & 0o777 == 0o755
    assert run(wrapper(lock, "--", *python("pass"))).returncode == 0


def test_a_second_operation_refuses_naming_the_holder_and_runs_nothing(tmp_path: Path) -> None:
    lock, marker = tmp_path / "ops.lock", tmp_path / "second-ran"
    with holding(lock, python("import time; time.sleep(30)")) as first:
        held = record(lock)
        assert held is not None and held["holder"] == HOLDER and held["pid"] == first.pid
        started = time.monotonic()
        second = run(wrapper(lock, "--", *touch(marker)))
        assert second.returncode == 75, second.stderr
        assert time.monotonic() - started < 5  # without --wait it does not block
        assert not marker.exists()
        assert second.stderr.count("\n") == 1
        assert (
            f'sparkfleet-host-lock: {lock} is held by "{HOLDER}" (pid {first.pid}, since {held["since"]}, '
            f"running: {shlex.join(python('import time; time.sleep(30)'))}): another operation is restarting this "
            "host's server; wait for it to finish, or retry with --wait SECONDS"
        ) in second.stderr
        assert first.poll() is None and record(lock) == held  # the refusal left the holder alone


def test_with_wait_it_runs_once_the_holder_is_done(tmp_path: Path) -> None:
    lock, ready, done, marker = (tmp_path / name for name in ("ops.lock", "ready", "first-done", "second-ran"))
    with holding(lock, sleeper(ready, 1.5, f"pathlib.Path({str(done)!r}).touch()"), ready) as first:
        # the second's command fails unless the first's finished before it started
        code = (
            f"import pathlib, sys; pathlib.Path({str(marker)!r}).touch(); "
            f"sys.exit(0 if pathlib.Path({str(done)!r}).exists() else 9)"
        )
        second = run(wrapper(lock, "--wait", "15", "--", *python(code)))
        assert second.returncode == 0, second.stderr
        assert marker.exists()
        assert f'waiting for the host lock held by "{HOLDER}" (pid {first.pid}, since ' in second.stderr
        assert "took the host lock" in second.stderr
        assert first.wait(timeout=10) == 0


def test_a_wait_that_runs_out_refuses(tmp_path: Path) -> None:
    lock, marker = tmp_path / "ops.lock", tmp_path / "second-ran"
    with holding(lock, python("import time; time.sleep(30)")) as first:
        started = time.monotonic()
        second = run(wrapper(lock, "--wait", "1", "--", *touch(marker)))
        assert second.returncode == 75, second.stderr
        assert 1 <= time.monotonic() - started < 8
        assert not marker.exists()
        assert f"(pid {first.pid}, since " in second.stderr
        assert "after waiting 1 s: " in second.stderr and "retry with a longer --wait SECONDS" in second.stderr


def test_a_killed_wrappers_stale_record_blocks_nobody(tmp_path: Path) -> None:
    lock, ready, marker = tmp_path / "ops.lock", tmp_path / "ready", tmp_path / "second-ran"
    child_pid = 0
    try:
        with holding(lock, sleeper(ready, 30), ready) as first:
            child_pid = int(ready.read_text())
            first.send_signal(signal.SIGKILL)  # the wrapper, not its command
            assert first.wait(timeout=10) == -signal.SIGKILL
            stale = record(lock)
            assert stale is not None and stale["pid"] == first.pid  # left behind ...
            os.kill(child_pid, 0)  # ... and its command still runs, without the lock
            second = run(wrapper(lock, "--", *touch(marker)))
            assert second.returncode == 0, second.stderr
            assert marker.exists()
            assert lock.read_text() == ""
    finally:
        if child_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("then_catch", "status"),
    [
        (False, 128 + signal.SIGTERM),  # the command died of it: 143
        (True, 5),  # the command caught it and exited 5
    ],
)
def test_sigterm_reaches_the_command(then_catch: bool, status: int, tmp_path: Path) -> None:
    lock, ready, got = tmp_path / "ops.lock", tmp_path / "ready", tmp_path / "got"
    catch = (
        f"import pathlib, signal, sys; signal.signal(signal.SIGTERM, lambda n, f: "
        f"(pathlib.Path({str(got)!r}).write_text(str(n)), sys.exit(5)));"
    )
    command = sleeper(ready, 30)
    if then_catch:
        command[-1] = catch + command[-1]
    with holding(lock, command, ready) as first:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=10) == status, first.stderr.read()
    if then_catch:
        assert got.read_text() == str(int(signal.SIGTERM))
    assert lock.read_text() == ""


@pytest.mark.parametrize("content", ["", "{not json"])
def test_a_holder_without_a_record_is_an_unknown_process(content: str, tmp_path: Path) -> None:
    lock, marker = tmp_path / "ops.lock", tmp_path / "second-ran"
    lock.write_text(content)
    with open(lock, "r+") as held:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this test process holds it
        result = run(wrapper(lock, "--", *touch(marker)))
    assert result.returncode == 75, result.stderr
    assert f"{lock} is held by an unknown process (its holder record is " in result.stderr
    assert "another operation is restarting this host's server" in result.stderr
    assert not marker.exists()


def test_a_missing_command_is_127(tmp_path: Path) -> None:
    result = run(wrapper(tmp_path / "ops.lock", "--", str(tmp_path / "no-such-command")))
    assert result.returncode == 127
    assert "no-such-command not found" in result.stderr
    assert (tmp_path / "ops.lock").read_text() == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no COMMAND"),
        (["touch", "MARKER"], "no '--' before COMMAND in 'touch MARKER'"),
        (["--"], "no COMMAND after '--'"),
        (["--wait", "soon", "--", "touch", "MARKER"], "--wait 'soon' is not a number of seconds"),
        (["--wait", "-1", "--", "touch", "MARKER"], "--wait '-1' is not a number of seconds"),
        (["--wait", "--", "touch", "MARKER"], "--wait needs a value"),
        (["--force", "--", "touch", "MARKER"], "unknown argument '--force' before '--'"),
    ],
)
def test_bad_usage_is_2_naming_the_bad_value(args: list[str], message: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    args = [str(marker) if arg == "MARKER" else arg for arg in args]
    message = message.replace("MARKER", str(marker))
    result = run([sys.executable, str(SCRIPT), *args])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"sparkfleet-host-lock: {message}") and result.stderr.endswith(f"; {USAGE}\n")
    assert not marker.exists()
