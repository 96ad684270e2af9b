"""The progress line of a vLLM (re)start (files/bin/sparkfleet-start-progress) and the callback that
shows it as it comes (callback_plugins/sparkfleet_progress.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "files" / "bin" / "sparkfleet-start-progress"
UNIT = "sparkfleet-vllm-dflash.service"


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """systemctl and journalctl stand-ins that answer as systemd does for a unit in its start-post."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\necho "systemctl $*" >> {calls}\n'
        "printf 'ActiveState=activating\\nSubState=start-post\\nInvocationID=0123abcd\\n'\n"
    )
    (bin_dir / "journalctl").write_text(
        f'#!/bin/sh\necho "journalctl $*" >> {calls}\n'
        "echo '(EngineCore pid=7) INFO [default_loader.py:291] Loading weights took 31.24 seconds'\n"
    )
    for tool in ("systemctl", "journalctl"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def run(fake_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    return subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, env=env, timeout=30, check=False
    )


def test_a_start_under_way_prints_its_state_and_last_journal_line(fake_bin: Path, tmp_path: Path) -> None:
    job = tmp_path / "j1.2"
    job.write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": "j1.2"}))
    began = time.monotonic()
    out = run(fake_bin, UNIT, str(job), "1")
    assert out.returncode == 3, out
    assert time.monotonic() - began >= 1.0  # it waited its interval for the job first
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"progress: {UNIT} activating (start-post), ")
    assert line.endswith(": (EngineCore pid=7) INFO [default_loader.py:291] Loading weights took 31.24 seconds")
    # the journal line is this invocation's, not an older start's
    assert "journalctl --no-pager -o cat -n 1 _SYSTEMD_INVOCATION_ID=0123abcd" in (tmp_path / "calls").read_text()


@pytest.mark.parametrize(
    "content",
    [
        {"changed": True, "rc": 0, "stdout": ""},  # the job's result: async_status's rule says finished
        {"started": 1, "finished": 1},
    ],
)
def test_a_finished_job_ends_the_wait_at_once(fake_bin: Path, tmp_path: Path, content: dict) -> None:
    job = tmp_path / "j3.4"
    job.write_text(json.dumps(content))
    began = time.monotonic()
    out = run(fake_bin, UNIT, str(job), "20")
    assert out.returncode == 0 and out.stdout == "", out
    assert time.monotonic() - began < 10


def test_a_job_whose_file_is_not_written_yet_is_still_starting(fake_bin: Path, tmp_path: Path) -> None:
    out = run(fake_bin, UNIT, str(tmp_path / "not-yet"), "1")
    assert out.returncode == 3 and out.stdout.startswith("progress: "), out


@pytest.mark.parametrize("args", [[], [UNIT], [UNIT, "f", "x"], [UNIT, "f", "1", "2"]])
def test_bad_arguments_are_refused(fake_bin: Path, args: list[str]) -> None:
    out = run(fake_bin, *args)
    assert out.returncode == 2 and "usage: sparkfleet-start-progress" in out.stderr


def load_callback():
    spec = importlib.util.spec_from_file_location(
        "sparkfleet_progress", ROOT / "callback_plugins/sparkfleet_progress.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_callback_shows_progress_lines_of_each_retry_and_loop_item() -> None:
    callback = load_callback()
    shown: list[str] = []

    class Display:
        def display(self, text: str) -> None:
            shown.append(text)

    class Host:
        def get_name(self) -> str:
            return "spark-01"

    class Result:
        _host = Host()
        _result = {"stdout": "progress: unit activating (start-post), 30 s: Loading weights\nother", "rc": 3}

    plugin = callback.CallbackModule()
    plugin._display = Display()
    plugin.v2_runner_retry(Result())
    Result._result = {"stdout": "no progress here"}
    plugin.v2_runner_retry(Result())
    Result._result = {"msg": "no stdout"}
    plugin.v2_runner_retry(Result())
    # a loop's item (the hub download's steps) shows its lines as it returns
    Result._result = {"stdout": "progress: a (1 GiB): downloaded in 2.0 s (512 MiB/s); org/a: 1 GiB of 4 GiB\n{}"}
    plugin.v2_runner_item_on_ok(Result())
    assert shown == [
        "  [spark-01] unit activating (start-post), 30 s: Loading weights",
        "  [spark-01] a (1 GiB): downloaded in 2.0 s (512 MiB/s); org/a: 1 GiB of 4 GiB",
    ]
    assert "sparkfleet_progress" in (ROOT / "ansible.cfg").read_text()
