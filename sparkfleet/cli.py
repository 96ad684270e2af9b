"""The `sparkfleet` command: one subcommand per module.

Each module named in ``COMMANDS`` exposes ``register(subparsers) -> None``, which adds its
subparser and sets ``func`` (a callable taking the parsed args and returning an exit code).
Modules are imported only when listed here and present, so a controller without the heavy
optional pieces (torch, vllm) still runs the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module. Order is the order `sparkfleet --help` lists them.
COMMANDS: dict[str, str] = {
    "wheel": "sparkfleet.wheel_build",
    "kv-plan": "sparkfleet.kv_page_plan",
    "checkpoint": "sparkfleet.checkpoint",
    "bench": "sparkfleet.bench",
    "report": "sparkfleet.report",
    "ops": "sparkfleet.fleet_ops",
    "profile": "sparkfleet.profiles",
    "weights": "sparkfleet.hub_cache",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or only ``only``'s (so one module's state never breaks another)."""
    parser = argparse.ArgumentParser(prog="sparkfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not written yet / not installed in this tree
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
