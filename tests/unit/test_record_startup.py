"""Start-up figures (issue 16 point 2): what sparkfleet-record-startup reads from a start's journal and
writes into state.json, the memory guard's readings it asks for, and how status shows them.

The journal lines are vLLM 0.23's own log formats (v1/core/kv_cache_utils.py, v1/engine/core.py,
model_loader/default_loader.py, v1/worker/gpu_model_runner.py, gpu_worker.py) as journald keeps them
with `-o cat`; tests/unit/startup_data holds a sandbox host's journal of one start.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from sparkfleet.serving import profile_schema, startup

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "files" / "bin"
DATA = Path(__file__).with_name("startup_data")


def load_recorder() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("record_startup", str(BIN / "sparkfleet-record-startup"))
    spec = importlib.util.spec_from_loader("record_startup", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


recorder = load_recorder()

# A GB10 start of the dflash profile, in vLLM 0.23's formats (figures of the recipe's conc-8 log).
GB10_START = """\
memory guard: pid 4242, service memory limit 110.00 GiB, host MemAvailable floor 4.00 GiB
(APIServer pid=4242) INFO 12-03 10:00:01 [api_server.py:1000] vLLM API server version 0.23.0
(EngineCore pid=4300) INFO 12-03 10:07:44 [default_loader.py:398] Loading weights took 463.12 seconds
(EngineCore pid=4300) INFO 12-03 10:07:50 [default_loader.py:398] Loading weights took 2.51 seconds
(EngineCore pid=4300) INFO 12-03 10:07:51 [gpu_model_runner.py:5188] Model loading took 63.71 GiB memory and 470.114581 seconds
(EngineCore pid=4300) INFO 12-03 10:08:40 [gpu_worker.py:481] Available KV cache memory: 27.72 GiB
(EngineCore pid=4300) INFO 12-03 10:08:40 [kv_cache_utils.py:1744] GPU KV cache size: 800,129 tokens
(EngineCore pid=4300) INFO 12-03 10:08:40 [kv_cache_utils.py:1746] Maximum concurrency for 262,144 tokens per request: 3.05x
(EngineCore pid=4300) INFO 12-03 10:09:30 [core.py:307] init engine (profile, create kv cache, warmup model) took 98.40 s (compilation: 41.90 s)
healthy after 545 s: http://127.0.0.1:8000/health
memory guard: since the start: peak service memory 3221225472 bytes, lowest MemAvailable 15032385536 bytes (3.00 GiB, 14.00 GiB)
"""  # noqa: E501


def test_a_gb10_start_gives_every_figure() -> None:
    figures = recorder.parse_journal(GB10_START.splitlines())
    assert figures == {
        # the target's and the drafter's weights
        "weights_load_s": 465.63,
        "model_load_gib": 63.71,
        "model_load_s": 470.114581,
        "kv_cache_gib": 27.72,
        "kv_pool_tokens": 800_129,
        "context_tokens": 262_144,
        "max_concurrency": 3.05,
        "engine_init_s": 98.4,
        "peak_service_bytes": 3 * 2**30,
        "min_available_bytes": 14 * 2**30,
    }


def test_the_sandbox_journal_of_one_start_gives_its_figures() -> None:
    # a sandbox host's journal (vLLM's CPU build): the CPU runner has no "Model loading took" line
    lines = (DATA / "sandbox-dflash-start.journal").read_text().splitlines()
    figures = recorder.parse_journal(lines)
    assert {"weights_load_s", "kv_pool_tokens", "max_concurrency", "context_tokens", "engine_init_s"} <= set(figures)
    assert figures["context_tokens"] == 1024
    assert (
        figures["kv_pool_tokens"] == int(figures["max_concurrency"] * 1024)
        or abs(figures["kv_pool_tokens"] - figures["max_concurrency"] * 1024) <= 0.005 * 1024
    )


def test_nothing_is_made_up_for_lines_that_are_not_there() -> None:
    assert recorder.parse_journal(["(EngineCore pid=1) INFO something else", "healthy after 3 s"]) == {}


def test_state_json_keeps_every_key_and_is_written_as_ansible_writes_it(tmp_path: Path) -> None:
    from ansible.plugins.filter.core import to_nice_json

    state = {"profile": "dflash", "unit": "sparkfleet-vllm-dflash.service", "model_revisions": {"a": "b" * 40}}
    path = tmp_path / "state.json"
    path.write_text(to_nice_json(state) + "\n")
    path.chmod(0o640)
    record = {"ready_s": 12.5, "kv_pool_tokens": 3456, "free_at_ready_bytes": 5 * 2**30, "invocation_id": "ab" * 16}
    recorder.write_startup(path, record)
    assert path.stat().st_mode & 0o777 == 0o640
    assert json.loads(path.read_text()) == {**state, "startup": record}
    # the deploy after it renders the same bytes from the same data: no change, no restart
    assert path.read_text() == to_nice_json({**state, "startup": record}) + "\n"
    assert not list(tmp_path.glob(".state.*")), "no temporary file is left behind"


def test_the_recorder_never_fails_a_start(tmp_path: Path) -> None:
    # no systemd unit of that name, no state file: it says so and exits 0 (the unit's start goes on)
    proc = subprocess.run(
        [sys.executable, str(BIN / "sparkfleet-record-startup"), "no-such.service", str(tmp_path / "state.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "MAINPID": "999999999"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "start-up figures not recorded" in proc.stdout


def test_the_recorder_signals_only_the_memory_guard() -> None:
    # anything else but the guard would die of SIGUSR1
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert recorder.ask_the_guard(sleeper.pid) is False
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_guard_reports_its_peak_readings_when_asked() -> None:
    hog = "import time; b = bytearray(96 * 2**20); print('up', flush=True); time.sleep(30)"
    guard = subprocess.Popen(
        [sys.executable, str(BIN / "sparkfleet-memory-guard"), str(2**30), "0", "--", sys.executable, "-c", hog],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert guard.stdout is not None
        assert "memory guard: pid" in guard.stdout.readline()
        assert guard.stdout.readline().strip() == "up"
        time.sleep(1.5)  # a sample after the allocation
        guard.send_signal(signal.SIGUSR1)
        line = guard.stdout.readline()
        figures = recorder.parse_journal([line])
        assert figures["peak_service_bytes"] >= 96 * 2**20, line
        assert figures["min_available_bytes"] > 0, line
        assert guard.poll() is None, "SIGUSR1 leaves the guard and the server running"
    finally:
        guard.send_signal(signal.SIGTERM)
        guard.wait(timeout=10)


def test_status_and_report_read_the_recorded_figures() -> None:
    recorded = {"ready_s": 183.4, "kv_pool_tokens": 456664, "max_concurrency": 1.74, "free_at_ready_bytes": 16 * 2**30}
    assert startup.status_cells(recorded) == {
        "ready": "183 s",
        "kv_pool": "456,664 (1.74x)",
        "free_at_ready": "16.0 GiB",
    }
    assert startup.status_cells({}) == {"ready": "-", "kv_pool": "-", "free_at_ready": "-"}
    rows = startup.comparison_rows(recorded, {"kv_pool_tokens": 456664, "ready_s": 180, "free_at_ready_gib": 16})
    assert rows == [
        ("unit start to /health", "183 s", "180 s"),
        ("KV pool", "456,664", "456,664"),
        ("max concurrency at the context", "1.74x", "-"),
        ("host memory available at READY", "16.0 GiB", "16.0 GiB"),
    ]


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ({"kv_pool": 1}, "reference_startup.kv_pool: not a start-up figure"),
        ({"ready_s": "3 min"}, "reference_startup.ready_s: must be a number >= 0, got '3 min'"),
        ([180], "reference_startup must be a mapping"),
    ],
)
def test_a_bad_reference_is_refused_by_name(reference: object, message: str) -> None:
    problems = profile_schema.profile_problems("dflash", {"reference_startup": reference})
    assert len(problems) == 1 and message in problems[0], problems


def test_the_report_puts_the_start_beside_the_gb10_reference(tmp_path: Path) -> None:
    from sparkfleet import cli
    from sparkfleet.hostlib.bench import results as res
    from tests.unit.helpers import bench_result

    result = bench_result(
        utc_time="2026-12-03T10:00:00Z",
        startup={"ready_s": 14.2, "kv_pool_tokens": 3456, "max_concurrency": 3.38, "recorded_utc": "2026-12-03T09:58Z"},
        startup_reference={"ready_s": 180, "kv_pool_tokens": 456664, "free_at_ready_gib": 16},
    )
    result["figures"] = {"decode_tok_s_median": 50.0}
    res.write_result(result, tmp_path / "results" / "r.json")
    assert cli.main(["report", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "### start-up (the unit's start recorded 2026-12-03T09:58Z" in text
    assert "| unit start to /health | 14 s | 180 s |" in text
    assert "| KV pool | 3,456 | 456,664 |" in text
    assert "| host memory available at READY | - | 16.0 GiB |" in text
