"""The `sparkfleet` command itself: --version, help on every subcommand, and a subcommand whose module
cannot load is an error that says why, not a command that silently is not there."""

from __future__ import annotations

import argparse
import sys

import pytest

from sparkfleet import __version__, cli


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"sparkfleet {__version__}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return dict(action.choices)


def _helps(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return {choice.dest: choice.help for choice in action._choices_actions}  # noqa: SLF001


def test_every_subcommand_and_action_has_help() -> None:
    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert set(commands) == set(cli.COMMANDS), "every command is listed, loadable here or not"
    missing = []
    for name, help_text in _helps(parser).items():
        if not help_text:
            missing.append(name)
    for name, sub in commands.items():
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):  # noqa: SLF001
            missing += [f"{name} {action}" for action, text in _helps(sub).items() if not text]
    assert missing == [], f"subcommands without help text: {missing}"


def test_a_module_that_cannot_load_is_an_error_naming_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "broken", "sparkfleet.no_such_module_for_the_test")
    monkeypatch.setitem(sys.modules, "sparkfleet.no_such_module_for_the_test", None)  # import fails
    helps = _helps(cli.build_parser())
    assert helps["broken"].startswith("(unavailable here: ModuleNotFoundError"), helps["broken"]
    assert cli.main(["broken", "--anything"]) == 1
    err = capsys.readouterr().err
    assert "sparkfleet broken: cannot load sparkfleet.no_such_module_for_the_test (ModuleNotFoundError" in err
    assert "make venv" in err
    # the other commands are untouched by it
    assert not helps["kv-plan"].startswith("(unavailable"), helps["kv-plan"]
