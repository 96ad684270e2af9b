"""The shape of the `sparkfleet` command (issue 15 point 6), as an operator meets it: `--version` prints
the project's version, every subcommand (and every action under one) answers `--help` with a line that
says what it does, and a subcommand whose module cannot be imported is still listed and, run, fails
with one line naming the module, the missing dependency and the fix."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sparkfleet import __version__, cli

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """`python -m sparkfleet ARGS` from the checkout; ``prelude`` runs first in the same interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "100"}
    if prelude:
        code = (
            f"{prelude}\nimport runpy, sys\nsys.argv = ['sparkfleet', *{list(args)!r}]\nrunpy.run_module('sparkfleet')"
        )
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "-m", "sparkfleet", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _choices(parser: argparse.ArgumentParser) -> list[tuple[str, str | None, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand directly under ``parser``."""
    found = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {choice.dest: choice.help for choice in action._choices_actions}  # noqa: SLF001
            found += [(name, helps.get(name), sub) for name, sub in action.choices.items()]
    return found


def _every_command() -> list[tuple[str, ...]]:
    """Every command path: ("wheel",), ("wheel", "build"), ... as the parser has them here."""
    paths: list[tuple[str, ...]] = []

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for name, _help, sub in _choices(parser):
            paths.append((*prefix, name))
            walk(sub, (*prefix, name))

    walk(cli.build_parser(), ())
    return paths


# --version


def test_version_matches_pyproject_and_exits_0() -> None:
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert __version__ == declared, "sparkfleet.__version__ is not pyproject's version"
    done = _run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"sparkfleet {declared}"
    assert done.stderr == ""


# help text


def test_top_level_help_lists_every_command_with_a_one_line_help() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    listed = _flat(done.stdout)
    helps = {name: text for name, text, _sub in _choices(cli.build_parser())}
    assert list(helps) == list(cli.COMMANDS), "every command is listed, in COMMANDS' order"
    for name, text in helps.items():
        assert text and text.strip(), f"{name} has no help"
        assert "\n" not in text.strip(), f"{name}'s help is more than one line: {text!r}"
        assert f" {name} {_flat(text)}" in listed, f"--help does not list {name} with its help"
    assert re.search(r"^\S.*\S$", done.stdout.split("\n\n")[1]), "the top level has a description line"


@pytest.mark.parametrize("path", _every_command(), ids=" ".join)
def test_every_command_help_exits_0_with_a_description(path: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*path, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    paragraphs = [p for p in re.split(r"\n\s*\n", out) if p.strip()]
    assert paragraphs[0].startswith(f"usage: sparkfleet {' '.join(path)}"), out
    description = paragraphs[1] if len(paragraphs) > 1 else ""
    assert description.strip(), f"sparkfleet {' '.join(path)} --help has nothing after its usage:\n{out}"
    assert not description.lstrip().startswith(("positional arguments:", "options:")), (
        f"sparkfleet {' '.join(path)} --help has no description line, only its arguments:\n{out}"
    )


# a module that cannot be imported

BLOCK_MATPLOTLIB = "import sys\nsys.modules['matplotlib'] = None  # `import matplotlib` now fails"


def test_a_command_whose_dependency_is_missing_fails_in_one_line_naming_it() -> None:
    for args in (["report"], ["report", "--results", "somewhere"], ["report", "--help"]):
        done = _run(*args, prelude=BLOCK_MATPLOTLIB)
        assert done.returncode != 0, f"sparkfleet {' '.join(args)} succeeded without its module"
        assert "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, f"not one line: {done.stderr!r}"
        (line,) = lines
        assert line.startswith("sparkfleet report: "), line
        assert "sparkfleet.fleet.report" in line, "the error names the module"
        assert "matplotlib" in line, "the error names the missing dependency"
        assert "make venv" in line, "the error says how to fix it"


def test_a_command_whose_module_cannot_load_is_still_listed() -> None:
    done = _run("--help", prelude=BLOCK_MATPLOTLIB)
    assert done.returncode == 0, done.stderr
    listed = _flat(done.stdout)
    assert re.search(r" report \(unavailable here: [^)]*matplotlib", listed), done.stdout
    for name in cli.COMMANDS:
        assert f" {name} " in listed, f"{name} is missing from --help"
    # the commands that do not need it are listed as usual
    assert " kv-plan (unavailable" not in listed


def test_a_multi_line_import_error_is_still_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # as numpy's import error is, for one: several lines of advice after the cause
    (tmp_path / "sparkfleet_shape_probe.py").write_text(
        "raise ImportError('broken native part\\n\\nIMPORTANT: read this\\n  and this', name='numpy')\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "probe", "sparkfleet_shape_probe")
    help_text = {name: text for name, text, _sub in _choices(cli.build_parser())}["probe"]
    assert help_text and "\n" not in help_text, repr(help_text)
    assert cli.main(["probe"]) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, f"not one line: {captured.err!r}"
    assert "sparkfleet_shape_probe" in lines[0] and "numpy" in lines[0] and "make venv" in lines[0], lines[0]
