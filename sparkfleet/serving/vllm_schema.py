"""What vLLM 0.23's `vllm serve` accepts, read from vLLM itself, so a profile is checked on a controller
that has no vLLM.

``python -m sparkfleet.serving.vllm_schema --write`` (run with a vLLM 0.23 venv's python) reads the flags of
vLLM's own serve parser (``make_arg_parser``) and the fields of its ``SpeculativeConfig`` into
``sparkfleet/serving/data/vllm-<version>-schema.json``; ``--check`` says whether that file is still what
the installed vLLM gives (tests/vllm runs it, so the file cannot drift from the code). The profile
check (sparkfleet.serving.profiles) reads only the JSON.

``python -m sparkfleet.serving.vllm_schema --argv -- ARGS...`` parses a rendered serve argv with vLLM's own
parser and validates the --speculative-config JSON with the config class's own field validators,
without loading any weights: the deeper check, where a vLLM venv exists.
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.23.0"
SCHEMA_FILE = Path(__file__).resolve().parent / "data" / f"vllm-{VLLM_VERSION}-schema.json"


# -- reading vLLM (needs vLLM) -----------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _value_type(action: argparse.Action) -> str:
    """int, float, str, or json (a flag whose value vLLM parses itself, e.g. a config dict)."""
    kind = action.type
    if kind is None:  # argparse hands the string through
        return "str"
    if kind in (int, float, str):
        return kind.__name__
    inner = getattr(kind, "__closure__", None) or ()
    for cell in inner:  # vLLM's optional_type(inner) wraps the real type
        if cell.cell_contents in (int, float, str):
            return cell.cell_contents.__name__
    return "json"


def _serve_flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    flags: dict[str, dict[str, Any]] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions here
        longs = [opt for opt in action.option_strings if opt.startswith("--") and not opt.startswith("--no-")]
        if not longs or isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        name = longs[0][2:]
        if isinstance(action, argparse.BooleanOptionalAction):
            entry: dict[str, Any] = {"kind": "bool"}
        elif action.nargs == 0:
            entry = {"kind": "true"}  # store_true: there is no --no-flag
        else:
            entry = {
                "kind": "list" if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction) else "value",  # noqa: SLF001
                "type": _value_type(action),
            }
            if action.choices is not None and not callable(action.choices):
                entry["choices"] = sorted(str(c) for c in action.choices)
        flags[name] = entry
    return dict(sorted(flags.items()))


def _annotation_schema(annotation: Any) -> dict[str, Any]:
    """The JSON types (and allowed values) a pydantic field annotation takes."""
    kinds: set[str] = set()
    choices: list[str] = []
    stack = [annotation]
    while stack:
        tp = stack.pop()
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            stack += list(typing.get_args(tp))
        elif origin is typing.Literal:
            kinds.add("str")
            choices += [str(v) for v in typing.get_args(tp)]
        elif origin in (list, tuple):
            kinds.add("list")
        elif tp is type(None):
            kinds.add("null")
        elif tp is bool:
            kinds.add("bool")
        elif tp is int:
            kinds.add("int")
        elif tp is float:
            kinds.update({"int", "float"})
        elif tp is str:
            kinds.add("str")
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            kinds.add("str")
            choices += [member.name for member in tp]
        else:
            kinds.add("object")
    out: dict[str, Any] = {"types": sorted(kinds)}
    # a Literal next to a plain str (quantization: Literal[...] | str) takes any string
    plain_str = any(a is str for a in typing.get_args(annotation))
    if choices and "object" not in kinds and not plain_str:
        out["choices"] = sorted(set(choices))
    return out


def _speculative_fields() -> dict[str, dict[str, Any]]:
    from vllm.config.speculative import SpeculativeConfig

    fields: dict[str, dict[str, Any]] = {}
    for name, info in SpeculativeConfig.__pydantic_fields__.items():
        entry = _annotation_schema(info.annotation)
        for meta in info.metadata:
            kind = type(meta).__name__
            if kind in ("Gt", "Ge", "Lt", "Le"):
                entry[kind.lower()] = getattr(meta, kind.lower())
            elif kind == "SkipValidation":
                entry["internal"] = True  # set by vLLM from the engine's own configs
        fields[name] = entry
    return fields


def generate() -> dict[str, Any]:
    import vllm

    return {
        "vllm": vllm.__version__.split("+")[0],
        "written_by": "python -m sparkfleet.serving.vllm_schema --write (from vLLM's own parser and SpeculativeConfig)",
        "serve_flags": _serve_flags(_serve_parser()),
        "speculative": _speculative_fields(),
    }


def check_argv(argv: list[str]) -> list[str]:
    """Problems vLLM's own parser and SpeculativeConfig's validators find in a serve argv (after
    ``vllm serve``; the model is the first item). Loads no weights and starts no engine."""
    import pydantic
    from vllm.config.speculative import SpeculativeConfig

    parser = _serve_parser()
    problems: list[str] = []

    def refuse(message: str) -> typing.NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        namespace = parser.parse_args(argv)
    except ValueError as exc:
        return [f"vllm serve: {exc}"]
    spec = getattr(namespace, "speculative_config", None)
    if isinstance(spec, dict):
        # Each field through the class's own validators (field validators included), on a bare
        # instance: the model-level checks need the engine's target config and are left out.
        fields = SpeculativeConfig.__pydantic_fields__
        bare = SpeculativeConfig.__new__(SpeculativeConfig)
        for key, value in spec.items():
            if key not in fields:
                problems.append(f"--speculative-config: {key!r} is not a SpeculativeConfig field")
                continue
            try:
                SpeculativeConfig.__pydantic_validator__.validate_assignment(bare, key, value)
            except pydantic.ValidationError as exc:
                field_errors = [error for error in exc.errors() if error.get("loc")]
                if field_errors:
                    problems.append(f"--speculative-config: {key}={value!r}: {field_errors[0]['msg'][:300]}")
    return problems


# -- reading the JSON (no vLLM) ----------------------------------------------------------------


@functools.cache
def load() -> dict[str, Any]:
    """The recorded schema, read once per process."""
    return json.loads(SCHEMA_FILE.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkfleet.serving.vllm_schema", description=__doc__.split("\n\n")[0]
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help=f"write {SCHEMA_FILE.name} from the installed vLLM")
    group.add_argument("--check", action="store_true", help="exit 1 when the file is not what the installed vLLM gives")
    group.add_argument(
        "--argv", action="store_true", help="check the serve argv after it (model first) with vLLM's parser"
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--argv"]:  # everything after it (and an optional --) is the serve argv
        rest = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        problems = check_argv(rest)
        for line in problems:
            print(f"sparkfleet: {line}", file=sys.stderr)
        return 2 if problems else 0
    args = parser.parse_args(argv)
    text = json.dumps(generate(), indent=1, sort_keys=True) + "\n"
    if args.write:
        SCHEMA_FILE.write_text(text)
        print(f"wrote {SCHEMA_FILE}")
        return 0
    if SCHEMA_FILE.read_text() != text:
        print(
            f"sparkfleet: {SCHEMA_FILE.name} differs from the installed vLLM: "
            "run python -m sparkfleet.serving.vllm_schema --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
