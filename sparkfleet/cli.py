"""The `sparkfleet` command: one subcommand per module.

Each module named in ``COMMANDS`` exposes ``register(subparsers) -> None``, which adds its
subparser and sets ``func`` (a callable taking the parsed args and returning an exit code). A module
that cannot be imported (a dependency missing from this venv) still gets its subcommand: its help says
why it is unavailable, and running it prints that reason, the dependency it needs and the fix on one
line and exits 1, so no command goes missing silently and one module's trouble never breaks the others.
Every subcommand, and every action under one, that has no description of its own gets its one-line
help as one, so ``sparkfleet SUB [ACTION] --help`` always says what it does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

import sparkfleet
from sparkfleet import __version__

# subcommand -> module. Order is the order `sparkfleet --help` lists them.
COMMANDS: dict[str, str] = {
    "wheel": "sparkfleet.build.wheel_build",
    "wheelhouse": "sparkfleet.build.wheelhouse",
    "kv-plan": "sparkfleet.serving.kv_page_plan",
    "checkpoint": "sparkfleet.build.checkpoint",
    "bench": "sparkfleet.hostlib.bench",
    "report": "sparkfleet.fleet.report",
    "ops": "sparkfleet.fleet.fleet_ops",
    "profile": "sparkfleet.serving.profiles",
    "weights": "sparkfleet.build.hub_cache",
    "tune": "sparkfleet.fleet.tune",
}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _reason(error: BaseException) -> str:
    """The error on one line (an import error's message can run to several: numpy's does)."""
    message = _one_line(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _cannot_load(name: str, module_name: str, error: BaseException) -> int:
    missing = getattr(error, "name", None)
    needs = f", which needs {missing}" if missing and missing != module_name else ""
    print(
        f"sparkfleet {name}: cannot load {module_name}{needs} ({_reason(error)}); install the controller venv "
        "(make venv) and run it again",
        file=sys.stderr,
    )
    return 1


def _unavailable(sub: Any, name: str, module_name: str, error: BaseException) -> None:
    """A stand-in subcommand for a module that failed to import: listed with why, and it fails."""
    parser = sub.add_parser(name, help=f"(unavailable here: {_reason(error)})")
    parser.set_defaults(func=lambda _args: _cannot_load(name, module_name, error))


def _describe(parser: argparse.ArgumentParser) -> None:
    """Give each subcommand under ``parser`` (at any depth) without a description its help as one."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if not sub.description and helps.get(name) and helps[name] != argparse.SUPPRESS:
                sub.description = helps[name]
            _describe(sub)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or only ``only``'s (so one module's state never breaks another)."""
    summary = (sparkfleet.__doc__ or "").strip().splitlines()  # none under python -OO
    description = summary[0].removeprefix("sparkfleet: ") if summary else None
    parser = argparse.ArgumentParser(prog="sparkfleet", description=description)
    parser.add_argument("--version", action="version", version=f"sparkfleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            _unavailable(sub, name, module_name, exc)
            continue
        module.register(sub)
    _describe(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:  # one command: its module must load, whatever its arguments
        try:
            importlib.import_module(COMMANDS[argv[0]])
        except ImportError as exc:
            return _cannot_load(argv[0], COMMANDS[argv[0]], exc)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
