"""`make tune`: choose a host's num_speculative_tokens from its own measurements.

``playbooks/tune.yml`` drives it, one host at a time: ``sparkfleet tune candidates`` turns the range
into values of n and vets each with the KV planner (a value vLLM cannot lay out is refused with the
planner's reason, before the host is touched); the play then serves the profile at each n (health
gated) and runs the decode benchmark on one workload; ``sparkfleet tune finish`` reads those results,
prints the table and draws the chart of decode tok/s and acceptance against n, and writes the winner
into the host's inventory vars as ``sparkfleet_tuned.<profile>``, which every later deploy of that
profile on that host applies (``sparkfleet.serving.profiles.resolve``).

The winner is the highest *headline* decode figure (the client's where the server's /metrics confirm
it, else the server's own: ``sparkfleet.hostlib.bench.decode.headline``); a tie goes to the smaller n, which
drafts less work for the same speed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from sparkfleet.serving import kv_page_plan, profiles

DEFAULT_RANGE = "4-16:2"
MAX_N = profiles.MAX_SPECULATIVE_TOKENS
TUNED_VAR = "sparkfleet_tuned"
RANGE_HINT = f"give a range as FIRST-LAST[:STEP] (e.g. 4-16:2) or a list (e.g. 4,8,12), each from 1 to {MAX_N}"
# host_vars/<host> as Ansible's host_group_vars plugin finds it: the first of these that exists wins
# (a directory named <host> included), and only that one is read.
HOST_VARS_ENDINGS = ("", ".yml", ".yaml", ".json")
TUNE_FILE = "sparkfleet-tune.yml"


class TuneError(ValueError):
    """Bad tuning input or nothing to choose from; the message is one line naming the value and the fix."""


def parse_range(text: str | Sequence[int]) -> list[int]:
    """The values of n a range names: ``4-16:2`` (inclusive), ``4-16`` (step 1), ``4,8,12`` or a list."""
    if isinstance(text, Sequence) and not isinstance(text, str):
        values = list(text)
    else:
        spec = str(text).replace(" ", "")
        found = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?", spec)
        if found:
            first, last, step = int(found[1]), int(found[2]), int(found[3] or 1)
            if step < 1 or last < first:
                raise TuneError(f"tune range {text!r} is empty: {RANGE_HINT}")
            values = list(range(first, last + 1, step))
        elif re.fullmatch(r"\d+(,\d+)*", spec):
            values = [int(part) for part in spec.split(",")]
        else:
            raise TuneError(f"tune range {text!r} is not a range: {RANGE_HINT}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N]
    if bad or not values:
        raise TuneError(f"tune range {text!r} has {bad or 'no values'}: {RANGE_HINT}")
    return sorted(set(values))


def vet(candidates: Sequence[int], kv_inputs: Mapping[str, Any]) -> tuple[list[int], list[dict[str, Any]]]:
    """(the values the KV planner accepts, [{n, reason}] for those it refuses).

    ``kv_inputs`` is the deploy's KV plan input (playbooks/tasks/kv-plan-inputs.yml): target_config and
    drafter_config (paths on the controller), patched, platform and serve_args; empty means the profile
    has nothing to plan (no drafter), and every value passes.
    """
    if not kv_inputs:
        return list(candidates), []
    target = kv_page_plan.load_config(kv_inputs["target_config"])
    drafter_path = kv_inputs.get("drafter_config")
    drafter = kv_page_plan.load_config(drafter_path) if drafter_path else None
    accepted, refused = [], []
    for n in candidates:
        plan = kv_page_plan.plan_for_profile(
            target,
            drafter,
            n,
            bool(kv_inputs.get("patched", True)),
            drafter_path=drafter_path,
            platform=kv_inputs.get("platform") or "cuda",
            serve_args=kv_inputs.get("serve_args") or {},
        )
        if plan.ok:
            accepted.append(n)
        else:
            refused.append({"n": n, "reason": plan.reason})
    return accepted, refused


@dataclass(frozen=True)
class Row:
    """One value of n as measured (or why it was not)."""

    n: int
    decode_tok_s: float | None = None
    source: str | None = None  # "client" (confirmed by the server's /metrics) or "server"
    acceptance_length: float | None = None
    client_decode_tok_s: float | None = None
    server_decode_tok_s: float | None = None
    measured_utc: str | None = None  # the decode result's utc_time (its file in results/tune/<host>/)
    error: str | None = None

    @property
    def measured(self) -> bool:
        return self.decode_tok_s is not None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def row_from_result(n: int, workload: str, result: Mapping[str, Any]) -> Row:
    """A decode result (sparkfleet.hostlib.bench decode's JSON) reduced to the workload's figures at this n."""
    figures = result.get("figures") or {}
    chosen = ((result.get("details") or {}).get("headline") or {}).get(workload) or {}
    value = _finite(figures.get(f"decode_tok_s_median[{workload}]"))
    error = None
    if f"decode_tok_s_median[{workload}]" not in figures:
        error = f"the decode result has no figure for workload {workload!r}"
    elif value is None:
        error = "no decode figure the server's /metrics confirm"
    return Row(
        n=n,
        decode_tok_s=value,
        source=chosen.get("source"),
        acceptance_length=_finite(figures.get(f"acceptance_length[{workload}]")),
        client_decode_tok_s=_finite(figures.get(f"client_decode_tok_s_median[{workload}]")),
        server_decode_tok_s=_finite(figures.get(f"server_decode_tok_s_median[{workload}]")),
        measured_utc=result.get("utc_time"),
        error=error,
    )


def best(rows: Sequence[Row]) -> Row:
    """The measured row with the highest decode figure; a tie goes to the smaller n."""
    measured = [row for row in rows if row.measured]
    if not measured:
        tried = ", ".join(f"n={row.n} ({row.error or 'not measured'})" for row in rows) or "none"
        raise TuneError(f"no value of num_speculative_tokens was measured: {tried}; fix the first error and re-run")
    return max(measured, key=lambda row: (row.decode_tok_s, -row.n))


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row], winner: Row | None, refused: Sequence[Mapping[str, Any]] = ()) -> str:
    """The tuning table, one line per n (refused values included), the winner marked."""
    lines = [
        "|  n | decode tok/s | source | acceptance | client tok/s | server tok/s | note |",
        "|---:|---:|---|---:|---:|---:|---|",
    ]
    entries: list[tuple[int, str]] = []
    for row in rows:
        note = "BEST" if winner is not None and row.n == winner.n else (row.error or "")
        entries.append(
            (
                row.n,
                f"| {row.n:2d} | {_num(row.decode_tok_s)} | {row.source or '–'} | {_num(row.acceptance_length, 2)} | "
                f"{_num(row.client_decode_tok_s)} | {_num(row.server_decode_tok_s)} | {note} |",
            )
        )
    for item in refused:
        entries.append((int(item["n"]), f"| {int(item['n']):2d} | – | – | – | – | – | refused: {item['reason']} |"))
    lines += [line for _, line in sorted(entries)]
    return "\n".join(lines)


def chart_png(title: str, rows: Sequence[Row], winner: Row | None) -> bytes:
    from sparkfleet.fleet import charts  # matplotlib: only where a chart is drawn

    return charts.png(
        charts.tune_figure(
            title,
            [(row.n, row.decode_tok_s, row.acceptance_length) for row in rows],
            winner.n if winner is not None else None,
        )
    )


# -- the host's inventory vars -------------------------------------------------------------------


class _TaggedLoader(yaml.SafeLoader):
    """SafeLoader that reads Ansible's tagged values (``!vault``, ``!unsafe``) as their text."""


_TaggedLoader.add_multi_constructor("!", lambda loader, _suffix, node: loader.construct_scalar(node))


def host_vars_file(inventory_dir: Path, host: str) -> Path:
    """Where ``sparkfleet_tuned`` goes for ``host``: the host_vars entry Ansible reads, or a new
    ``host_vars/<host>.yml``. A directory ``host_vars/<host>/`` gets its own ``sparkfleet-tune.yml``."""
    base = Path(inventory_dir) / "host_vars"
    for ending in HOST_VARS_ENDINGS:
        path = base / f"{host}{ending}"
        if path.is_dir():
            return path / TUNE_FILE
        if path.is_file():
            return path
    return base / f"{host}.yml"


def _top_level_block(lines: list[str], key: str) -> tuple[int, int] | None:
    """[start, end) of the lines that hold top-level ``key`` in a block-style YAML mapping."""
    start = next((i for i, line in enumerate(lines) if re.match(rf"""(["']?){re.escape(key)}\1\s*:""", line)), None)
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (lines[end][:1] in (" ", "\t", "#", "") or not lines[end].strip()):
        end += 1
    return start, end


def updated_vars_text(text: str, profile: str, entry: Mapping[str, Any], where: str) -> str:
    """``text`` (a host_vars YAML file) with ``sparkfleet_tuned.<profile>`` set to ``entry``, every other
    line as it was. Raises TuneError where the file cannot be edited safely, saying what to do."""
    if text.lstrip().startswith("$ANSIBLE_VAULT"):
        raise TuneError(
            f"{where} is encrypted with Ansible Vault; move the secrets into host_vars/<host>/ (a directory) "
            f"or add {TUNED_VAR}.{profile} to it yourself: {json.dumps(dict(entry))}"
        )
    try:
        before = yaml.load(text, Loader=_TaggedLoader) if text.strip() else {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise TuneError(f"{where} is not YAML ({str(exc).splitlines()[0]}); fix it and re-run") from None
    if before is None:
        before = {}
    if not isinstance(before, dict):
        raise TuneError(f"{where} holds a {type(before).__name__}, not a mapping of variables; fix it and re-run")
    tuned = before.get(TUNED_VAR) or {}
    if not isinstance(tuned, dict):
        raise TuneError(f"{where}: {TUNED_VAR} is {tuned!r}, not a mapping of profile -> tuning; remove it and re-run")
    wanted = {**before, TUNED_VAR: {**tuned, profile: dict(entry)}}
    block = yaml.safe_dump({TUNED_VAR: wanted[TUNED_VAR]}, sort_keys=True, default_flow_style=False)
    lines = text.splitlines(keepends=True)
    span = _top_level_block(lines, TUNED_VAR)
    if span is None:
        head = "".join(lines)
        if head and not head.endswith("\n"):
            head += "\n"
        if not head.strip():
            head = "---\n"
        new = head + "# Written by `make tune` (sparkfleet/fleet/tune.py): the measured best n per profile.\n" + block
    else:
        start, end = span
        # keep trailing comments and blank lines that belong to what follows
        while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        new = "".join(lines[:start]) + block + "".join(lines[end:])
    try:
        after = yaml.load(new, Loader=_TaggedLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        after = None
    if after != wanted:
        raise TuneError(
            f"{where}: cannot set {TUNED_VAR}.{profile} without disturbing the file's other lines (an anchor or "
            f"alias on {TUNED_VAR}?); set it yourself: {json.dumps(dict(entry))}"
        )
    return new


def write_tuned(inventory_dir: Path, host: str, profile: str, entry: Mapping[str, Any]) -> Path:
    """Set ``sparkfleet_tuned.<profile>`` in the host's inventory vars; returns the file written."""
    path = host_vars_file(inventory_dir, host)
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        data[TUNED_VAR] = {**(data.get(TUNED_VAR) or {}), profile: dict(entry)}
        new = json.dumps(data, indent=2, sort_keys=True) + "\n"
    else:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        new = updated_vars_text(text, profile, entry, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(path)
    return path


# -- the command ---------------------------------------------------------------------------------


def _candidates(args: argparse.Namespace) -> int:
    values = parse_range(args.range)
    kv_inputs = json.loads(args.kv_plan) if args.kv_plan else {}
    accepted, refused = vet(values, kv_inputs)
    for item in refused:
        print(f"tune: n={item['n']} refused by the KV planner: {item['reason']}", file=sys.stderr)
    if not accepted:
        raise TuneError(
            f"the KV planner refuses every value of tune range {args.range!r} for this profile; "
            "pick values it accepts (sparkfleet kv-plan --num-speculative-tokens N shows why)"
        )
    print(json.dumps({"candidates": accepted, "refused": refused}))
    return 0


def _finish(args: argparse.Namespace) -> int:
    measured = json.loads(Path(args.measurements).read_text(encoding="utf-8"))
    refused = measured.get("refused") or []
    rows = []
    for item in measured.get("runs") or []:
        if item.get("error"):
            rows.append(Row(n=int(item["n"]), error=str(item["error"])))
            continue
        rows.append(row_from_result(int(item["n"]), args.workload, item["result"]))
    winner = best(rows)
    title = f"{args.host} {args.profile}: num_speculative_tokens on workload {args.workload}"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stem = f"{stamp}-tune-{args.profile}-{args.workload}"
    chart = out_dir / f"{stem}.png"
    chart.write_bytes(chart_png(title, rows, winner))
    entry = {
        "num_speculative_tokens": winner.n,
        "workload": args.workload,
        "decode_tok_s": round(winner.decode_tok_s, 3),
        "figure_source": winner.source,
        "acceptance_length": None if winner.acceptance_length is None else round(winner.acceptance_length, 3),
        "measured_utc": stamp,
    }
    record = {
        "kind": "tune",
        "host": args.host,
        "profile": args.profile,
        "workload": args.workload,
        "utc_time": stamp,
        "winner": entry,
        "rows": [asdict(row) for row in rows],
        "refused": refused,
        "chart": chart.name,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{title}\n{table(rows, winner, refused)}")
    print(
        f"best: n={winner.n}, decode {winner.decode_tok_s:.1f} tok/s ({winner.source}), acceptance "
        f"{_num(winner.acceptance_length, 2)}; chart {chart}; record {out_dir / f'{stem}.json'}"
    )
    print(json.dumps({"winner": entry}))
    return 0


def _record(args: argparse.Namespace) -> int:
    entry = json.loads(args.entry)
    if not isinstance(entry, dict) or "num_speculative_tokens" not in entry:
        raise TuneError(f"--entry {args.entry!r} is not a tuning entry with num_speculative_tokens")
    written = write_tuned(Path(args.inventory_dir), args.host, args.profile, entry)
    print(f"{TUNED_VAR}.{args.profile} written to {written}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="the steps of `make tune`: vet values of num_speculative_tokens, then pick and record the best",
        description=__doc__.splitlines()[0],
    )
    steps = parser.add_subparsers(dest="step", metavar="STEP", required=True)
    cand = steps.add_parser("candidates", help="the values of a range the KV planner accepts (JSON on stdout)")
    cand.add_argument("--range", default=DEFAULT_RANGE, help=f"FIRST-LAST[:STEP] or a list (default {DEFAULT_RANGE})")
    cand.add_argument("--kv-plan", help="the deploy's KV plan inputs as JSON (target_config, drafter_config, ...)")
    cand.set_defaults(func=_guarded(_candidates))
    fin = steps.add_parser("finish", help="table, chart and the winner, written into the host's inventory vars")
    fin.add_argument(
        "--measurements", required=True, help="JSON: {runs: [{n, result (a decode result) | error}], refused: [...]}"
    )
    fin.add_argument("--host", required=True)
    fin.add_argument("--profile", required=True)
    fin.add_argument("--workload", required=True)
    fin.add_argument("--out-dir", required=True, help="where the tuning record and its chart go")
    fin.set_defaults(func=_guarded(_finish))
    rec = steps.add_parser("record", help=f"set {TUNED_VAR}.<profile> in a host's inventory vars (host_vars)")
    rec.add_argument("--inventory-dir", required=True, help="the host's inventory directory (holds host_vars/)")
    rec.add_argument("--host", required=True)
    rec.add_argument("--profile", required=True)
    rec.add_argument("--entry", required=True, help="the tuning entry as JSON ({num_speculative_tokens: N, ...})")
    rec.set_defaults(func=_guarded(_record))


def _guarded(step: Any) -> Any:
    """``step`` with its input errors as one line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return step(args)
        except (TuneError, kv_page_plan.KVPlanInputError, OSError, json.JSONDecodeError) as exc:
            print(f"sparkfleet tune {args.step}: {exc}", file=sys.stderr)
            return 2

    return run
