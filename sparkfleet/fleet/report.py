"""Render benchmark results (``results/*.json``) into a Markdown report with PNG plots.

    sparkfleet report --results results/ --out results/report.md

Sections per host and profile (the serving unit's start-up figures beside the profile's GB10
reference; the latest decode, e2e, serving and prefix run each, with tables and bar charts), each run's
baseline verdicts, per-position acceptance, the serving runs' concurrency sweep, plots over time where
a host/profile has several runs of a kind, and a cross-host comparison per profile. Plots are PNG files
written next to the report (``<report stem>_plots/``), drawn with matplotlib's Agg backend
(``sparkfleet.fleet.charts``): each draws the profile's baselines that apply to it (from the runs'
``comparison``) and marks the values that fail them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from sparkfleet.fleet import charts
from sparkfleet.hostlib.bench.results import ResultError, load_result, lower_is_better
from sparkfleet.serving import startup

HEADLINE = {
    "decode": "decode_tok_s_median",
    "e2e": "e2e_tok_s",
    "serving": "serving_output_tok_s",
    "prefix": "prefix_ttft_warm_over_cold",
}
HEADLINE_LABEL = {
    "decode": "decode-only tok/s (median)",
    "e2e": "end-to-end tok/s (albond method, mean)",
    "serving": "output tok/s (vllm bench serve)",
    "prefix": "warm-prefix TTFT / cold TTFT (agent turns)",
}
KINDS = tuple(HEADLINE)


def load_all(results_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every valid result in ``results_dir`` (sorted by time) and one line per file skipped."""
    if not results_dir.is_dir():
        raise ResultError(f"results directory {results_dir} does not exist; run `sparkfleet bench` first")
    loaded, skipped = [], []
    # results/<host>/<time>-<method>.json as `make bench` fetches them (latest.json repeats one)
    for path in sorted(results_dir.rglob("*.json")):
        # latest.json repeats a result; tune/ holds `make tune`'s runs, each at another n than its profile's
        if path.name == "latest.json" or path.relative_to(results_dir).parts[0] == "tune":
            continue
        try:
            result = load_result(path)
        except ResultError as exc:
            skipped.append(str(exc))
            continue
        result["_file"] = path.relative_to(results_dir).as_posix()
        loaded.append(result)
    loaded.sort(key=lambda r: r["utc_time"])
    return loaded, skipped


def slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", "_".join(parts)).strip("-").lower()


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.1f}%"


def short_time(utc: str) -> str:
    return utc[5:16].replace("T", " ")  # MM-DD HH:MM


class ReportWriter:
    """Collects Markdown lines and writes PNGs into the plot directory."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.plot_dir = out.parent / f"{out.stem}_plots"
        self.lines: list[str] = []
        self.plots: list[Path] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def plot(self, name: str, png: bytes, alt: str) -> None:
        """Write ``png`` as ``<plot dir>/<name>.png`` and link it from the report."""
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        path = self.plot_dir / f"{name}.png"
        path.write_bytes(png)
        self.plots.append(path)
        self.add(f"![{alt}]({self.plot_dir.name}/{path.name})", "")

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("\n".join(self.lines) + "\n", encoding="utf-8")


def thresholds(
    result: dict[str, Any], figure: str, *, category: str | None = None, series: str | None = None
) -> list[charts.Threshold]:
    """The baseline ``result`` was compared with for ``figure`` (none or one), as a chart threshold."""
    comparison = result.get("comparison") or {}
    return [
        charts.Threshold(
            figure=figure,
            baseline=float(check["baseline"]),
            tolerance_pct=float(comparison.get("tolerance_pct") or 0.0),
            lower_is_better=lower_is_better(figure),
            categories=None if category is None else (category,),
            series=series,
        )
        for check in comparison.get("checks", [])
        if check.get("figure") == figure and isinstance(check.get("baseline"), int | float)
    ]


def title(what: str, result: dict[str, Any]) -> str:
    return f"{what} - {result['host']} / {result.get('profile') or '-'}"


def per_position_plot(report: ReportWriter, name: str, result: dict[str, Any], series: list, where: str) -> None:
    """Acceptance by draft position (accepted at position k / drafts), one line per series."""
    series = [(label, values) for label, values in series if values]
    if not series:
        return
    positions = max(len(values) for _, values in series)
    report.plot(
        name,
        charts.png(
            charts.line_figure(
                title(f"Per-position acceptance ({where})", result),
                [str(i + 1) for i in range(positions)],
                [(label, list(values) + [None] * (positions - len(values))) for label, values in series],
                "share of drafts accepted at the position",
                ylim=(0.0, 1.05),
                xlabel="draft position",
            )
        ),
        f"per-position acceptance, {where}",
    )


def identity_lines(result: dict[str, Any]) -> list[str]:
    model = result.get("model") or {}
    drafter = result.get("drafter") or {}
    cpu = result.get("client_cpu") or {}
    return [
        f"- run: {result['utc_time']} (`{result['_file']}`), vLLM {fmt(result.get('vllm_version'))}, "
        f"patch set {fmt(result.get('patch_set'))}",
        f"- model {fmt(model.get('served_name'))} revision {fmt(model.get('revision'))}; "
        f"drafter revision {fmt(drafter.get('revision'))}",
        f"- client CPU share {fmt(cpu.get('share'))} "
        f"({fmt(cpu.get('cpu_s'))} CPU s over {fmt(cpu.get('wall_s'))} s wall)",
    ]


def comparison_lines(result: dict[str, Any]) -> list[str]:
    comparison = result.get("comparison")
    if not comparison:
        return ["- baselines: none given for this run"]
    verdict = "PASS" if comparison["passed"] else "FAIL"
    lines = [f"- baselines ({comparison['tolerance_pct']:g}% tolerance): **{verdict}**"]
    lines += [f"  - {check['reason']}" for check in comparison["checks"]]
    return lines


def decode_section(report: ReportWriter, result: dict[str, Any], key: str) -> None:
    workloads = result["details"].get("workloads", [])
    headlines = result["details"].get("headline") or {}
    report.add(
        "| workload | requests | headline tok/s (source) | client tok/s | server-side tok/s | acceptance length "
        "| acceptance rate | TTFT median s | TPOT client vs server: per-request median (whole workload) "
        "| window clean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    )
    for workload in workloads:
        spec = workload.get("spec_decode") or {}
        agreement = workload.get("tpot_agreement") or {}
        chosen = headlines.get(workload["name"])
        if chosen is None:  # a result from before headlines were chosen: the client's figure, unchecked
            chosen = {"value": workload["decode_tok_s_median"], "source": "client-unchecked", "client_valid": True}
        client = fmt(workload["decode_tok_s_median"]) + ("" if chosen["client_valid"] else " **INVALID**")
        report.add(
            f"| {workload['name']} | {workload['requests']} | {fmt(chosen['value'])} ({chosen['source']}) | {client} | "
            f"{fmt(workload.get('server_decode_tok_s_median'))} | "
            f"{fmt(spec.get('acceptance_length'))} | {fmt(spec.get('acceptance_rate'))} | "
            f"{fmt(workload.get('ttft_s_median'))} | {pct(workload.get('tpot_relative_difference_median'))} "
            f"({pct(agreement.get('relative_difference'))}) | "
            f"{fmt(agreement.get('window_clean'))} |"
        )
    overall = result["details"].get("tpot_agreement") or {}
    per_request = result["details"].get("tpot_agreement_per_request") or {}
    report.add(
        "",
        f"All requests: median {fmt(result['figures'].get('decode_tok_s_median'))} tok/s "
        f"(server-side {fmt(result['figures'].get('server_decode_tok_s_median'))}); client TPOT "
        f"{fmt(overall.get('client_tpot_s'))} s vs server {fmt(overall.get('server_tpot_s'))} s "
        f"({pct(overall.get('relative_difference'))}, server figure from "
        "vllm:request_decode_time_seconds and vllm:generation_tokens_total over the same window). "
        f"Per request: median difference {pct(per_request.get('median_relative_difference'))}, "
        f"{fmt(per_request.get('within_tolerance_share'))} of requests within 5%.",
        "",
    )
    for name, chosen in headlines.items():
        if not chosen["client_valid"]:
            named = ", ".join(f"{r['id']} ({pct(r['relative_difference'])})" for r in chosen["disagreeing_requests"])
            report.add(
                f"**{name}: the client's figure is invalid** ({fmt(chosen['client_value'])} tok/s, TPOT "
                f"{pct(chosen['relative_difference'])} against the server's; requests beyond "
                f"{pct(chosen['tolerance'])}: {named}): the headline is the server's {fmt(chosen['value'])} tok/s.",
                "",
            )
    if workloads:
        names = [w["name"] for w in workloads]
        rates = [(headlines.get(w["name"]) or {}).get("value", w["decode_tok_s_median"]) for w in workloads]
        overall = result["figures"].get("decode_tok_s_median")
        limits = [t for n in names for t in thresholds(result, f"decode_tok_s_median[{n}]", category=n)]
        if overall is not None:
            names, rates = ["all requests", *names], [overall, *rates]
            limits += thresholds(result, "decode_tok_s_median", category="all requests")
        report.plot(
            f"{key}-decode",
            charts.png(
                charts.bar_figure(
                    title("Decode-only tok/s", result),
                    names,
                    [("median tok/s", rates)],
                    "tok/s, median per workload",
                    limits,
                )
            ),
            "decode tok/s per workload",
        )
        names = [w["name"] for w in workloads]
        lengths = [(w.get("spec_decode") or {}).get("acceptance_length") for w in workloads]
        if any(length is not None for length in lengths):
            report.plot(
                f"{key}-acceptance",
                charts.png(
                    charts.bar_figure(
                        title("Mean acceptance length", result),
                        names,
                        [("1 + accepted/drafts", lengths)],
                        "tokens per verify step",
                        [t for n in names for t in thresholds(result, f"acceptance_length[{n}]", category=n)],
                    )
                ),
                "acceptance length per workload",
            )
        per_position_plot(
            report,
            f"{key}-per-position",
            result,
            [(w["name"], (w.get("spec_decode") or {}).get("per_position_acceptance")) for w in workloads],
            "decode, per workload",
        )


def e2e_section(report: ReportWriter, result: dict[str, Any], key: str) -> None:
    prompts = result["details"].get("prompts", [])
    report.add("| prompt | max_tokens | completion tokens | wall s (run 2) | tok/s |", "|---|---|---|---|---|")
    for prompt in prompts:
        report.add(
            f"| {prompt['id']} | {prompt['max_tokens']} | {prompt['completion_tokens']} | "
            f"{fmt(prompt['wall_s'])} | {fmt(prompt['tok_s'])} |"
        )
    report.add(
        "",
        f"Mean over prompts: **{fmt(result['figures'].get('e2e_tok_s'))} tok/s**"
        + (
            f", acceptance length {fmt(result['figures']['acceptance_length'])}"
            if "acceptance_length" in result["figures"]
            else ""
        )
        + ".",
        "",
    )
    if prompts:
        names = [f"{p['id']} ({p['max_tokens']})" for p in prompts]
        rates = [p["tok_s"] for p in prompts]
        limits = [
            t
            for prompt, name in zip(prompts, names, strict=True)
            for t in thresholds(result, f"e2e_tok_s[{prompt['id']}]", category=name)
        ]
        if result["figures"].get("e2e_tok_s") is not None:
            names, rates = ["mean", *names], [result["figures"]["e2e_tok_s"], *rates]
            limits += thresholds(result, "e2e_tok_s", category="mean")
        report.plot(
            f"{key}-e2e",
            charts.png(
                charts.bar_figure(
                    title("End-to-end tok/s (albond)", result),
                    names,
                    [("tok/s incl. prefill", rates)],
                    "tok/s per prompt (max_tokens)",
                    limits,
                )
            ),
            "e2e tok/s per prompt",
        )


def serving_section(report: ReportWriter, result: dict[str, Any], key: str) -> None:
    figures = result["figures"]
    settings = result.get("settings") or {}
    report.add(
        f"{fmt(settings.get('num_prompts'))} prompts of {fmt(settings.get('dataset'))} at concurrency "
        f"{fmt(settings.get('max_concurrency'))}: {fmt(figures.get('serving_completed'))} completed, "
        f"{fmt(figures.get('serving_failed'))} failed; "
        f"output {fmt(figures.get('serving_output_tok_s'))} tok/s, "
        f"{fmt(figures.get('serving_request_throughput'))} req/s.",
        "",
        "| ms | mean | median | p99 |",
        "|---|---|---|---|",
    )
    metrics, stats = ("ttft", "tpot", "itl"), ("mean", "median", "p99")
    for metric in metrics:
        cells = [fmt(figures.get(f"serving_{metric}_ms_{stat}")) for stat in stats]
        report.add(f"| {metric.upper()} | " + " | ".join(cells) + " |")
    sweep = result["details"].get("sweep") or []
    if sweep:
        report.add(
            "",
            "Concurrency sweep (one `vllm bench serve` run each; per stream = 1000 / median TPOT):",
            "",
            "| concurrency | output tok/s | per stream | TTFT median ms | TPOT median ms | acceptance length "
            "| completed | failed |",
            "|---|---|---|---|---|---|---|---|",
        )
        for entry in sweep:
            f = entry["figures"]
            report.add(
                f"| {entry['concurrency']} | {fmt(f.get('serving_output_tok_s'))} | "
                f"{fmt(f.get('serving_output_tok_s_per_stream'))} | {fmt(f.get('serving_ttft_ms_median'))} | "
                f"{fmt(f.get('serving_tpot_ms_median'))} | {fmt(f.get('acceptance_length'))} | "
                f"{fmt(f.get('serving_completed'))} | {fmt(f.get('serving_failed'))} |"
            )
    spec = result["details"].get("spec_decode")
    report.add("")
    if any(figures.get(f"serving_{m}_ms_{s}") is not None for m in metrics for s in stats):
        report.plot(
            f"{key}-latency",
            charts.png(
                charts.bar_figure(
                    title(f"Serving latency at concurrency {fmt(settings.get('max_concurrency'))}", result),
                    [m.upper() for m in metrics],
                    [(s, [figures.get(f"serving_{m}_ms_{s}") for m in metrics]) for s in stats],
                    "ms",
                    [
                        t
                        for m in metrics
                        for s in stats
                        for t in thresholds(result, f"serving_{m}_ms_{s}", category=m.upper(), series=s)
                    ],
                )
            ),
            "serving latency: TTFT, TPOT, ITL",
        )
    if spec:
        report.add(
            f"Speculative decoding: acceptance rate {fmt(spec['acceptance_rate'])}, mean acceptance length "
            f"{fmt(spec['acceptance_length'])}, per position "
            + ", ".join(fmt(p, 2) for p in spec["per_position_acceptance"])
            + ".",
            "",
        )
        reported = (result["details"].get("vllm_reported_spec_decode") or {}).get("per_position_acceptance")
        per_position_plot(
            report,
            f"{key}-per-position",
            result,
            [
                ("server counters over the run", spec["per_position_acceptance"]),
                ("vllm bench serve's reading", reported),
            ],
            f"serving at concurrency {fmt(settings.get('max_concurrency'))}",
        )


def prefix_section(report: ReportWriter, result: dict[str, Any], key: str) -> None:
    figures = result["figures"]
    details = result["details"]
    report.add(
        f"{fmt(details.get('conversations'))} conversations, every turn sent cold (a cache salt of its own) and "
        f"warm (the run's salt): warm-prefix TTFT **{fmt(figures.get('prefix_ttft_warm_s_median'))} s** against cold "
        f"{fmt(figures.get('prefix_ttft_cold_s_median'))} s (medians over the turns after each conversation's first), "
        f"ratio **{fmt(figures.get('prefix_ttft_warm_over_cold'))}** ({details.get('headline_source')}; client "
        f"{fmt(figures.get('client_prefix_ttft_warm_over_cold'))}, server "
        f"{fmt(figures.get('server_prefix_ttft_warm_over_cold'))}). {fmt(figures.get('prefix_cache_hits_warm'))} "
        f"prompt tokens came from the cache (hit rate {fmt(figures.get('prefix_cache_hit_rate_warm'))}; cold twins "
        f"{fmt(figures.get('prefix_cache_hits_cold'))}); greedy mismatches between twins: "
        f"**{fmt(figures.get('prefix_greedy_mismatches'))}**; acceptance length warm "
        f"{fmt(figures.get('acceptance_length_warm'))}, cold {fmt(figures.get('acceptance_length_cold'))}.",
        "",
        "| turn | prompt tokens | cached tokens | TTFT cold s | TTFT warm s | server TTFT cold / warm s "
        "| same answer |",
        "|---|---|---|---|---|---|---|",
    )
    turns = details.get("turns", [])
    for turn in turns:
        report.add(
            f"| {turn['id']} | {turn['prompt_tokens']} | {fmt(turn['cache_hits_warm'])} | {fmt(turn['ttft_cold_s'])} | "
            f"{fmt(turn['ttft_warm_s'])} | {fmt(turn['server_ttft_cold_s'])} / {fmt(turn['server_ttft_warm_s'])} | "
            f"{fmt(turn['greedy_identical'])} |"
        )
    report.add("")
    if turns:
        report.plot(
            f"{key}-prefix",
            charts.png(
                charts.bar_figure(
                    title("TTFT per turn, cold and warm", result),
                    [turn["id"] for turn in turns],
                    [("cold", [t["ttft_cold_s"] for t in turns]), ("warm", [t["ttft_warm_s"] for t in turns])],
                    "time to first token, s",
                )
            ),
            "TTFT per turn, cold and warm",
        )


SECTIONS = {"decode": decode_section, "e2e": e2e_section, "serving": serving_section, "prefix": prefix_section}


def over_time(report: ReportWriter, runs: list[dict[str, Any]], kind: str, key: str) -> None:
    headline = "all requests" if kind == "decode" else HEADLINE[kind]
    series: list[tuple[str, list[float | None]]] = [(headline, [r["figures"].get(HEADLINE[kind]) for r in runs])]
    if kind == "decode":
        names = sorted(
            {
                n[len("decode_tok_s_median[") : -1]
                for r in runs
                for n in r["figures"]
                if n.startswith("decode_tok_s_median[")
            }
        )
        series += [(name, [r["figures"].get(f"decode_tok_s_median[{name}]") for r in runs]) for name in names[:6]]
    # the latest run's baselines (the profile's as they stand), each on the series of its figure
    figure_of = {headline: HEADLINE[kind]} | {name: f"decode_tok_s_median[{name}]" for name, _ in series[1:]}
    limits = [t for name, _ in series for t in thresholds(runs[-1], figure_of[name], series=name)]
    report.plot(
        f"{key}-{kind}-over-time",
        charts.png(
            charts.line_figure(
                title(f"{kind} over time", runs[0]),
                [short_time(r["utc_time"]) for r in runs],
                series,
                HEADLINE_LABEL[kind],
                limits,
                xlabel="run (UTC, MM-DD HH:MM)",
            )
        ),
        f"{kind} over time",
    )


def startup_section(report: ReportWriter, runs: list[dict[str, Any]]) -> None:
    """The serving unit's last start as the latest run recorded it, beside the profile's GB10 reference."""
    recorded = [r for r in runs if r.get("startup") or r.get("startup_reference")]
    if not recorded:
        return
    latest = recorded[-1]
    rows = startup.comparison_rows(latest.get("startup"), latest.get("startup_reference"))
    if not rows:
        return
    recorded_at = (latest.get("startup") or {}).get("recorded_utc", "–")
    report.add(
        f"### start-up (the unit's start recorded {recorded_at}, as of the run at {latest['utc_time']})",
        "",
        "| figure | this host | reference (GB10, the recipe's authors) |",
        "|---|---|---|",
        *[f"| {label} | {measured} | {reference} |" for label, measured, reference in rows],
        "",
    )


def concurrency_sweep(report: ReportWriter, runs: list[dict[str, Any]], key: str) -> None:
    """Output tok/s against max concurrency: the latest run's sweep, or else the latest serving run at each
    concurrency (one point or more)."""
    sweep = (runs[-1].get("details") or {}).get("sweep") or []
    if sweep:
        points = [
            (
                entry["concurrency"],
                entry["figures"].get("serving_output_tok_s"),
                entry["figures"].get("serving_output_tok_s_per_stream"),
            )
            for entry in sweep
        ]
        top = f"{max(entry['concurrency'] for entry in sweep):g}"
        drawn = thresholds(runs[-1], "serving_output_tok_s", category=top)
    else:
        latest: dict[float, dict[str, Any]] = {}
        for run in runs:  # in time order: the last one at a concurrency wins
            concurrency = (run.get("settings") or {}).get("max_concurrency")
            if isinstance(concurrency, int | float) and not isinstance(concurrency, bool) and concurrency > 0:
                latest[float(concurrency)] = run
        if not latest:
            return
        points = [(c, run["figures"].get("serving_output_tok_s")) for c, run in sorted(latest.items())]
        drawn = [t for c, run in latest.items() for t in thresholds(run, "serving_output_tok_s", category=f"{c:g}")]
    report.plot(
        f"{key}-serving-concurrency",
        charts.png(charts.sweep_figure(title("Output tok/s by concurrency", runs[-1]), points, drawn)),
        "serving output tok/s by concurrency, aggregate and per stream",
    )


def tune_section(report: ReportWriter, results_dir: Path) -> None:
    """`make tune`'s records (results/tune/<host>/*-tune-*.json): the table and chart of each."""
    from sparkfleet.fleet import tune  # its chart is charts.tune_figure

    records = []
    for path in sorted((results_dir / "tune").glob("*/*-tune-*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            rows = [tune.Row(**row) for row in record["rows"]]
            records.append((record, rows, path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.add(f"- skipped tuning record {path.relative_to(results_dir)}: {exc}")
    if not records:
        return
    report.add("## Tuning num_speculative_tokens (make tune)", "")
    for record, rows, path in records:
        winner = next((row for row in rows if row.n == record["winner"]["num_speculative_tokens"]), None)
        report.add(
            f"### {record['host']} / {record['profile']} on {record['workload']} ({record['utc_time']})",
            "",
            f"Best: n={record['winner']['num_speculative_tokens']} (what the tune serves and records in the host's "
            f"`sparkfleet_tuned.{record['profile']}` once its gate passes); record "
            f"`{path.relative_to(results_dir).as_posix()}`.",
            "",
            tune.table(rows, winner, record.get("refused") or []),
            "",
        )
        report.plot(
            slug("tune", record["host"], record["profile"], record["workload"], record["utc_time"]),
            tune.chart_png(f"{record['host']} {record['profile']}: n on {record['workload']}", rows, winner),
            f"decode tok/s and acceptance against num_speculative_tokens, {record['host']}",
        )


def build_report(results_dir: Path, out: Path) -> ReportWriter:
    results, skipped = load_all(results_dir)
    report = ReportWriter(out)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report.add(
        "# sparkfleet benchmark report",
        "",
        f"Generated {now} from {len(results)} result file(s) in `{results_dir.name}/`.",
        "",
    )
    if skipped:
        report.add("Skipped files:", *[f"- {line}" for line in skipped], "")
    if not results:
        report.add("No results yet: run `sparkfleet bench decode|e2e|serving` (or `make bench`).", "")
        tune_section(report, results_dir)
        return report
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        groups[(result["host"], result.get("profile") or "-")].append(result)

    report.add(
        "## Summary (latest run of each kind)",
        "",
        "| host | profile | kind | headline | value | baselines | time |",
        "|---|---|---|---|---|---|---|",
    )
    for (host, profile), runs in sorted(groups.items()):
        for kind in KINDS:
            of_kind = [r for r in runs if r["kind"] == kind]
            if of_kind:
                latest = of_kind[-1]
                comparison = latest.get("comparison")
                verdict = "–" if not comparison else ("pass" if comparison["passed"] else "**FAIL**")
                report.add(
                    f"| {host} | {profile} | {kind} | {HEADLINE_LABEL[kind]} | "
                    f"{fmt(latest['figures'].get(HEADLINE[kind]))} | {verdict} | {latest['utc_time']} |"
                )
    report.add("")

    for (host, profile), runs in sorted(groups.items()):
        key = slug(host, profile)
        report.add(f"## {host} / {profile}", "")
        startup_section(report, runs)
        for kind in KINDS:
            of_kind = [r for r in runs if r["kind"] == kind]
            if not of_kind:
                continue
            latest = of_kind[-1]
            report.add(f"### {kind}", "", *identity_lines(latest), *comparison_lines(latest), "")
            SECTIONS[kind](report, latest, f"{key}-{kind}")
            if kind == "serving":
                concurrency_sweep(report, of_kind, key)
            if len(of_kind) > 1:
                over_time(report, of_kind, kind, key)

    tune_section(report, results_dir)

    by_profile: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for result in results:  # sorted by time: the last assignment is the latest
        by_profile[result.get("profile") or "-"][result["kind"]][result["host"]] = result
    comparisons = [
        (p, k, hosts) for p, kinds in sorted(by_profile.items()) for k, hosts in sorted(kinds.items()) if len(hosts) > 1
    ]
    if comparisons:
        report.add("## Across hosts (latest run each)", "")
        for profile, kind, hosts in comparisons:
            names = sorted(hosts)
            report.plot(
                slug("hosts", profile, kind),
                charts.png(
                    charts.bar_figure(
                        f"{kind} by host - profile {profile}",
                        names,
                        [(HEADLINE[kind], [hosts[h]["figures"].get(HEADLINE[kind]) for h in names])],
                        HEADLINE_LABEL[kind],
                        [t for h in names for t in thresholds(hosts[h], HEADLINE[kind], category=h)],
                    )
                ),
                f"{kind} by host for {profile}",
            )
    return report


def run_report_command(args: argparse.Namespace) -> int:
    try:
        report = build_report(Path(args.results), Path(args.out))
    except ResultError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.write()
    print(f"wrote {args.out} with {len(report.plots)} plot(s) in {report.plot_dir}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``sparkfleet report`` (CLI contract of sparkfleet.cli)."""
    parser = subparsers.add_parser("report", help="render results/*.json into a Markdown report with PNG plots")
    parser.add_argument("--results", default="results", help="directory of result JSON files (default results)")
    parser.add_argument("--out", default="results/report.md", help="Markdown file to write (default results/report.md)")
    parser.set_defaults(func=run_report_command)
