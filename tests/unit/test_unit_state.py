"""sparkfleet.serving.unit_state: the one line `make health` and `make status` print for a serving unit.

The crash-loop journals are recorded from a sandbox host (systemd 252) whose unit was given an argument
vLLM 0.23 refuses: five automatic restarts, then systemd's start rate limit (StartLimitBurst=5). systemd
252 keeps Result=exit-code there (later versions say start-limit-hit); both must read as a crash loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkfleet.serving import unit_state

DATA = Path(__file__).parent / "unit_state_data"
UNIT = "sparkfleet-vllm-dflash.service"
GAVE_UP = {
    "LoadState": "loaded",
    "ActiveState": "failed",
    "SubState": "failed",
    "Result": "exit-code",
    "NRestarts": "5",
    "ExecMainStatus": "2",
}
VLLM_ERROR = "vllm: error: unrecognized arguments: --sparkfleet-crash-test"


@pytest.mark.parametrize("journal", ["crash-loop-systemd252.cat", "crash-loop-systemd252.short"])
def test_a_crash_loop_systemd_gave_up_on_is_named_with_vllms_error(journal: str) -> None:
    lines = (DATA / journal).read_text().splitlines()
    state = unit_state.describe(UNIT, GAVE_UP, lines)
    assert (state.running, state.word) == (False, "crash-loop")
    assert "5 automatic restarts" in state.text and "StartLimitBurst" in state.text
    assert f"last error: {VLLM_ERROR};" in state.text  # not systemd's "Failed with result" line
    assert f"systemctl reset-failed {UNIT}" in state.text and "make restart" in state.text
    assert "\n" not in state.text


def test_start_limit_hit_reads_as_a_crash_loop_without_a_journal() -> None:
    state = unit_state.describe(UNIT, {**GAVE_UP, "Result": "start-limit-hit"})
    assert state.word == "crash-loop" and "last error" not in state.text


def test_a_start_after_the_give_up_is_not_a_crash_loop_any_more() -> None:
    """The rate-limit line counts only after the unit's last start."""
    lines = (DATA / "crash-loop-systemd252.cat").read_text().splitlines()
    lines += [
        "Starting sparkfleet-vllm-dflash.service - vLLM serving qwen (sparkfleet profile dflash)...",
        "(APIServer pid=77) ERROR 12-02 01:50:00 [api_server.py:1] RuntimeError: no port",
        "sparkfleet-vllm-dflash.service: Main process exited, code=exited, status=1/FAILURE",
        "sparkfleet-vllm-dflash.service: Failed with result 'exit-code'.",
    ]
    state = unit_state.describe(UNIT, {**GAVE_UP, "NRestarts": "0", "ExecMainStatus": "1"}, lines)
    assert state.word == "failed"
    assert "last error: RuntimeError: no port;" in state.text  # vLLM's log prefix dropped
    assert "exit status 1" in state.text and "0 automatic restarts" in state.text


def test_the_memory_guards_exit_is_named() -> None:
    show = {**GAVE_UP, "NRestarts": "0", "ExecMainStatus": "137"}
    lines = ["memory guard: host MemAvailable 0.41 GiB below the floor 0.50 GiB: SIGKILL to the server (pid 9)"]
    state = unit_state.describe(UNIT, show, lines)
    assert state.word == "failed" and "memory guard stopped it" in state.text
    assert "last error: memory guard: host MemAvailable 0.41 GiB" in state.text


def test_waiting_between_restarts_says_which_restart_comes() -> None:
    show = {**GAVE_UP, "ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "2"}
    state = unit_state.describe(UNIT, show, [VLLM_ERROR])
    assert (state.running, state.word) == (False, "restarting")
    assert "automatic restart 3" in state.text and VLLM_ERROR in state.text


@pytest.mark.parametrize(
    ("show", "word", "running", "says"),
    [
        (
            {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0"},
            "running",
            True,
            f"{UNIT} running",
        ),
        (
            {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "2"},
            "running",
            True,
            "2 automatic restarts since it was started",
        ),
        (
            {"LoadState": "loaded", "ActiveState": "activating", "SubState": "start-post"},
            "starting",
            False,
            "is starting",
        ),
        (
            {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead"},
            "stopped",
            False,
            "inactive (not running)",
        ),
        ({"LoadState": "not-found", "ActiveState": "inactive"}, "not-installed", False, "not installed: deploy"),
    ],
)
def test_other_states(show: dict[str, str], word: str, running: bool, says: str) -> None:
    state = unit_state.describe(UNIT, show)
    assert (state.word, state.running) == (word, running)
    assert says in state.text


def test_last_error_prefers_an_error_over_later_chatter_and_shortens_it() -> None:
    long = "ValueError: " + "x" * 400
    lines = ["Traceback (most recent call last):", '  File "a.py", line 1', long, "shutting down", "Stopped x."]
    error = unit_state.last_error(lines)
    assert error.startswith("ValueError: x") and error.endswith("...") and len(error) == unit_state.MAX_ERROR_CHARS
    assert unit_state.last_error(["INFO starting", "listening"]) == "listening"  # no error line: the program's last
    assert unit_state.last_error(["sparkfleet-vllm-dflash.service: Failed with result 'exit-code'."]) == ""


def test_parse_show() -> None:
    assert unit_state.parse_show("ActiveState=failed\nResult=exit-code\nnoise\n") == {
        "ActiveState": "failed",
        "Result": "exit-code",
    }


def test_a_pydantic_refusal_keeps_its_detail_line() -> None:
    """vLLM's ModelConfig refusal (recorded: a context beyond the model's) is two lines: the exception,
    then the indented reason; the error names both, without the "further information" link."""
    lines = (DATA / "pydantic-refusal.cat").read_text().splitlines()
    error = unit_state.last_error(lines)
    assert error.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: ")
    assert "Value error, User-specified max_model_len (1000000) is greater than the derived" in error
    assert "errors.pydantic.dev" not in error and "APIServer pid" not in error
