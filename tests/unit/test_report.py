"""The Markdown report and its matplotlib charts."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from sparkfleet import cli
from sparkfleet.fleet import charts
from sparkfleet.fleet.report import build_report
from sparkfleet.hostlib.bench import results as res
from tests.unit.helpers import bench_result

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, read back by matplotlib (which checks it is one)."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = mpimg.imread(path).shape[:2]
    return width, height


def texts(fig: Figure) -> list[str]:
    """Every text drawn on the figure: titles, tick and axis labels, annotations, legend entries."""
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def by_gid(fig: Figure, gid: str) -> list:
    return [a for a in fig.findobj() if a.get_gid() == gid]


def test_bar_figure_heights_labels_in_their_case_and_valid_png(tmp_path: Path) -> None:
    fig = charts.bar_figure("Decode - spark-01 / dflash", ["spark-01", "spark-02"], [("tok/s", [10.0, 30.0])], "tok/s")
    (ax,) = fig.axes
    assert [bar.get_height() for bar in ax.patches] == [10.0, 30.0]
    assert ax.get_ylim()[0] == 0  # bars start at 0
    shown = texts(fig)
    assert {"spark-01", "spark-02", "Decode - spark-01 / dflash", "tok/s"} <= set(shown)
    assert not any("SPARK" in t for t in shown)
    path = tmp_path / "bar.png"
    path.write_bytes(charts.png(fig))
    assert png_size(path) == (900, 460)
    assert charts.png(fig) == path.read_bytes()  # the same figure, the same bytes (no date or software stamp)


def test_a_baseline_is_drawn_and_the_failing_bars_marked() -> None:
    threshold = charts.Threshold("decode_tok_s_median", 81.0, 5.0)
    assert threshold.limit == pytest.approx(76.95) and threshold.fails(70.0) and not threshold.fails(80.0)
    fig = charts.bar_figure("t", ["spark-01", "spark-02"], [("tok/s", [82.0, 70.0])], "tok/s", [threshold])
    (ax,) = fig.axes
    (baseline,) = by_gid(fig, "baseline")
    (limit,) = by_gid(fig, "baseline-limit")
    assert list(baseline.get_ydata()) == [81.0, 81.0] and list(limit.get_ydata()) == pytest.approx([76.95, 76.95])
    label = "baseline decode_tok_s_median 81; fail below 76.95 (5 % tolerance)"
    assert baseline.get_label() == label and texts(fig).count(label) == 2  # on the line and in the legend
    (fail,) = by_gid(fig, "fail")
    assert fail.get_text() == "70 FAIL"
    passing, failing = ax.patches
    assert failing.get_hatch() == "//" and failing.get_edgecolor()[:3] == pytest.approx((0.839, 0.153, 0.157), abs=0.01)
    assert passing.get_hatch() is None
    # latencies fail above the limit; a baseline of one category is drawn over that group only
    ttft = charts.Threshold("serving_ttft_ms_median", 600.0, 10.0, lower_is_better=True, categories=("TTFT",))
    fig = charts.bar_figure("t", ["TTFT", "TPOT"], [("median", [700.0, 700.0])], "ms", [ttft])
    assert [t.get_text() for t in by_gid(fig, "fail")] == ["700 FAIL"]  # the TPOT bar has no baseline
    (baseline,) = by_gid(fig, "baseline")
    assert max(baseline.get_xdata()) < 0.5  # over the first group, not across the figure


def test_thresholds_of_several_categories_merge_into_one_line() -> None:
    per_host = [charts.Threshold("e2e_tok_s", 53.7, 5, categories=(host,)) for host in ("spark-01", "spark-02")]
    (merged,) = charts.merge_thresholds(per_host, ["spark-01", "spark-02"])
    assert merged.categories is None
    other = charts.Threshold("e2e_tok_s", 50.0, 5, categories=("spark-03",))
    assert len(charts.merge_thresholds([*per_host, other], ["spark-01", "spark-02", "spark-03"])) == 2


def test_time_series_show_a_five_percent_change() -> None:
    runs = ["06-20 10:00", "06-21 10:00"]
    fig = charts.line_figure("decode over time", runs, [("all requests", [100.0, 95.0])], "tok/s")
    (ax,) = fig.axes
    assert ax.get_ylim()[0] > 0  # not pinned at 0
    fig.canvas.draw()
    (_, y100), (_, y95) = ax.transData.transform([(0, 100.0), (1, 95.0)])
    assert (y100 - y95) / ax.bbox.height > 0.5  # the 5 % drop spans most of the axes' height
    # with a baseline on the figure the axis takes it in and the drop still shows
    threshold = charts.Threshold("decode_tok_s_median", 100.0, 3.0, series="all requests")
    fig = charts.line_figure("t", ["a", "b"], [("all requests", [100.0, 95.0])], "tok/s", [threshold])
    (ax,) = fig.axes
    fig.canvas.draw()
    (_, y100), (_, y95) = ax.transData.transform([(0, 100.0), (1, 95.0)])
    assert (y100 - y95) / ax.bbox.height > 0.3 and ax.get_ylim()[0] > 0
    fails = by_gid(fig, "fail")
    assert [a.get_text() for a in fails if isinstance(a, Text)] == ["FAIL"]
    (marker,) = [a for a in fails if not isinstance(a, Text)]
    assert list(marker.get_xdata()) == [1] and list(marker.get_ydata()) == [95.0]


def test_identical_series_stay_visible_and_gaps_stay_gaps() -> None:
    fig = charts.line_figure(
        "t", ["1", "2", "3"], [("agent", [1.0, None, 3.0]), ("chat", [2.0, 2.0, 2.0]), ("code", [2.0, 2.0, 2.0])], "y"
    )
    (ax,) = fig.axes
    agent, chat, code = ax.lines
    assert math.isnan(agent.get_ydata()[1])
    assert chat.get_marker() != code.get_marker() and chat.get_linestyle() != code.get_linestyle()
    assert chat.get_markersize() > code.get_markersize()  # the later one is drawn smaller, on top
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["agent", "chat", "code (same values as chat)"]


def test_concurrency_sweep_with_one_and_several_points(tmp_path: Path) -> None:
    threshold = charts.Threshold("serving_output_tok_s", 107.43, 5, categories=("8",))
    fig = charts.sweep_figure("sweep", [(8, 101.0)], [threshold])
    aggregate, per_stream = fig.axes
    assert list(aggregate.lines[0].get_ydata()) == [101.0] and list(per_stream.lines[0].get_ydata()) == [101.0 / 8]
    assert by_gid(fig, "baseline") and [t.get_text() for t in by_gid(fig, "fail") if isinstance(t, Text)] == ["FAIL"]
    (tmp_path / "one.png").write_bytes(charts.png(fig))
    assert png_size(tmp_path / "one.png") == (900, 460)
    fig = charts.sweep_figure("sweep", [(8, 101.0), (1, 30.0), (4, 80.0)], [threshold])
    aggregate, per_stream = fig.axes
    assert list(aggregate.lines[0].get_xdata()) == [1, 4, 8]
    assert list(per_stream.lines[0].get_ydata()) == pytest.approx([30.0, 20.0, 101 / 8])
    assert [t.get_text() for t in aggregate.get_xticklabels()] == ["1", "4", "8"]
    assert len([t for t in by_gid(fig, "fail") if isinstance(t, Text)]) == 1  # only the run at 8 had the baseline
    with pytest.raises(ValueError, match="at least one"):
        charts.sweep_figure("sweep", [])
    with pytest.raises(ValueError, match="at least one"):
        charts.bar_figure("t", [], [], "y")


def make_result(kind: str, host: str, profile: str, utc: str, figures: dict, details: dict) -> dict:
    settings = {"num_prompts": 64, "dataset": "sharegpt_small.json", "max_concurrency": 8}
    result = bench_result(kind, host=host, profile=profile, settings=settings, utc_time=utc)
    result.update(figures=figures, details=details, client_cpu={"cpu_s": 1.0, "wall_s": 50.0, "share": 0.02})
    return result


def decode_details(rate: float) -> dict:
    spec = {"acceptance_length": 8.3, "acceptance_rate": 0.6, "per_position_acceptance": [0.9, 0.8]}
    workload = {
        "name": "agent",
        "requests": 8,
        "decode_tok_s_median": rate,
        "ttft_s_median": 0.2,
        "spec_decode": spec,
        "tpot_agreement": {"relative_difference": 0.01, "window_clean": True},
    }
    return {
        "workloads": [workload],
        "tpot_agreement": {"client_tpot_s": 0.0123, "server_tpot_s": 0.0122, "relative_difference": 0.008},
    }


def test_report_renders_sections_plots_and_verdicts(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for host, utc, rate in [
        ("spark-01", "2026-06-20T10:00:00Z", 80.0),
        ("spark-01", "2026-06-21T10:00:00Z", 82.0),
        ("spark-02", "2026-06-21T11:00:00Z", 70.0),
    ]:
        result = make_result(
            "decode",
            host,
            "dflash",
            utc,
            {"decode_tok_s_median": rate, "decode_tok_s_median[agent]": rate},
            decode_details(rate),
        )
        result["comparison"] = res.compare_with_baselines(result, {"decode_tok_s_median": 81}, 5)
        res.write_result(result, results / res.default_result_name(result))
    e2e = make_result(
        "e2e",
        "spark-01",
        "dense",
        "2026-06-22T10:00:00Z",
        {"e2e_tok_s": 59.0},
        {"prompts": [{"id": "e2e-1", "max_tokens": 256, "completion_tokens": 256, "wall_s": 4.3, "tok_s": 59.5}]},
    )
    res.write_result(e2e, results / "e2e.json")
    (results / "broken.json").write_text("{}")

    assert cli.main(["report", "--results", str(results), "--out", str(tmp_path / "out" / "report.md")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| spark-01 | dflash | decode | decode-only tok/s (median) | 82 | pass |" in text
    assert "| spark-02 | dflash | decode | decode-only tok/s (median) | 70 | **FAIL** |" in text
    assert "decode_tok_s_median: 70 vs baseline 81 (13.6% below; may be at most 5% below) REGRESSION" in text
    assert "## spark-01 / dense" in text and "| e2e-1 | 256 | 256 | 4.3 | 59.5 |" in text
    assert "broken.json: schema None" in text
    images = [line.rsplit("(", 1)[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert any("over-time" in i for i in images) and any("hosts" in i for i in images)
    assert any(i.endswith("spark-01-dflash-decode-per-position.png") for i in images)
    for image in images:
        assert png_size(tmp_path / "out" / image) == (900, 460)


def serving_run(concurrency: int, output_tok_s: float, utc: str) -> dict:
    figures = {"serving_output_tok_s": output_tok_s, "serving_ttft_ms_median": 700.0, "serving_tpot_ms_median": 60.0}
    spec = {"acceptance_rate": 0.4, "acceptance_length": 3.0, "per_position_acceptance": [0.8, 0.6, 0.4]}
    details = {"spec_decode": spec, "vllm_reported_spec_decode": {"per_position_acceptance": [0.8, 0.6, 0.4]}}
    result = make_result("serving", "spark-01", "dflash-conc8", utc, figures, details)
    result["settings"]["max_concurrency"] = concurrency
    baselines = {"serving_output_tok_s": 107.43, "serving_ttft_ms_median": 681.0}
    result["comparison"] = res.compare_with_baselines(result, baselines, 5)
    return result


def test_report_plots_the_concurrency_sweep_per_position_acceptance_and_baselines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    runs = [serving_run(1, 30.0, "2026-06-20T10:00:00Z"), serving_run(8, 110.0, "2026-06-21T10:00:00Z")]
    for result in runs:
        res.write_result(result, results / res.default_result_name(result))
    drawn: dict[str, Figure] = {}
    figures = {"bar_figure": charts.bar_figure, "line_figure": charts.line_figure, "sweep_figure": charts.sweep_figure}
    for name, build in figures.items():
        monkeypatch.setattr(
            charts, name, lambda title, *a, _build=build, **k: drawn.setdefault(title, _build(title, *a, **k))
        )
    report = build_report(results, tmp_path / "report.md")
    names = sorted(path.name for path in report.plots)
    assert names == [
        "spark-01-dflash-conc8-serving-concurrency.png",
        "spark-01-dflash-conc8-serving-latency.png",
        "spark-01-dflash-conc8-serving-over-time.png",
        "spark-01-dflash-conc8-serving-per-position.png",
    ]
    assert all(png_size(path) == (900, 460) for path in report.plots)
    sweep = drawn["Output tok/s by concurrency - spark-01 / dflash-conc8"]
    aggregate, per_stream = sweep.axes
    assert list(aggregate.lines[0].get_xdata()) == [1, 8] and list(per_stream.lines[0].get_ydata()) == [30.0, 13.75]
    # the profile's baseline on the sweep and on the figure over time; the run at concurrency 1 fails it
    for title in ("Output tok/s by concurrency", "serving over time"):
        fig = drawn[f"{title} - spark-01 / dflash-conc8"]
        assert {line.get_ydata()[0] for line in by_gid(fig, "baseline")} == {107.43}
        assert [a.get_text() for a in by_gid(fig, "fail") if isinstance(a, Text)] == ["FAIL"]
    latency = drawn["Serving latency at concurrency 8 - spark-01 / dflash-conc8"]
    assert "baseline serving_ttft_ms_median 681 (TTFT); fail above 715 (5 % tolerance)" in texts(latency)
    assert [a.get_text() for a in by_gid(latency, "fail")] == []  # 700 ms is within 5 % of 681
    per_position = drawn["Per-position acceptance (serving at concurrency 8) - spark-01 / dflash-conc8"]
    (legend,) = per_position.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "server counters over the run",
        "vllm bench serve's reading (same values as server counters over the run)",
    ]
    assert list(per_position.axes[0].lines[0].get_ydata()) == [0.8, 0.6, 0.4]


def test_report_without_results_and_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    report = build_report(tmp_path / "empty", tmp_path / "r.md")
    assert any("No results yet" in line for line in report.lines)
    assert cli.main(["report", "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "r.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_report_marks_an_invalid_client_figure_and_shows_the_server_headline(tmp_path: Path) -> None:
    details = decode_details(299_130.0)
    details["workloads"][0]["server_decode_tok_s_median"] = 712.0
    details["headline"] = {
        "agent": {
            "source": "server",
            "value": 712.0,
            "client_valid": False,
            "client_value": 299_130.0,
            "server_value": 712.0,
            "tolerance": 0.10,
            "relative_difference": -0.60,
            "agreeing_share": 0.0,
            "disagreeing_requests": [{"id": "agent-3", "relative_difference": -0.998}],
        }
    }
    result = make_result(
        "decode", "spark-01", "dflash", "2026-06-20T10:00:00Z", {"decode_tok_s_median": 712.0}, details
    )
    res.write_result(result, tmp_path / "results" / res.default_result_name(result))
    assert cli.main(["report", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "| agent | 8 | 712 (server) | 299130 **INVALID** | 712 |" in text, text
    assert "**agent: the client's figure is invalid** (299130 tok/s, TPOT -60.0% against the server's" in text
    assert "agent-3 (-99.8%)" in text and "the headline is the server's 712 tok/s" in text


def test_report_shows_the_warm_and_cold_ttft_of_the_prefix_run(tmp_path: Path) -> None:
    turns = [
        {"id": f"agent-turns-01#{t}", "prompt_tokens": 300 + 60 * t, "cache_hits_warm": 0 if t == 1 else 256 + 64 * t,
         "ttft_cold_s": 0.40, "ttft_warm_s": 0.40 if t == 1 else 0.05, "server_ttft_cold_s": 0.38,
         "server_ttft_warm_s": 0.38 if t == 1 else 0.04, "greedy_identical": True}
        for t in (1, 2, 3)
    ]  # fmt: skip
    figures = {
        "prefix_ttft_warm_over_cold": 0.125,
        "client_prefix_ttft_warm_over_cold": 0.125,
        "server_prefix_ttft_warm_over_cold": 0.105,
        "prefix_ttft_cold_s_median": 0.40,
        "prefix_ttft_warm_s_median": 0.05,
        "prefix_cache_hits_warm": 704.0,
        "prefix_cache_hit_rate_warm": 0.55,
        "prefix_cache_hits_cold": 0.0,
        "prefix_greedy_mismatches": 0,
        "acceptance_length_warm": 7.7,
        "acceptance_length_cold": 7.6,
    }
    details = {"conversations": 1, "turns": turns, "headline_source": "client"}
    results = tmp_path / "results"
    result = make_result("prefix", "spark-01", "dflash", "2026-12-03T10:00:00Z", figures, details)
    res.write_result(result, results / res.default_result_name(result))
    assert cli.main(["report", "--results", str(results), "--out", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| spark-01 | dflash | prefix | warm-prefix TTFT / cold TTFT (agent turns) | 0.125 |" in text
    assert "warm-prefix TTFT **0.05 s** against cold 0.4 s" in text and "ratio **0.125** (client" in text
    assert "| agent-turns-01#2 | 420 | 384 | 0.4 | 0.05 | 0.38 / 0.04 | yes |" in text
    assert "greedy mismatches between twins: **0**" in text
    (image,) = [line.rsplit("(", 1)[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert "prefix" in image and png_size(tmp_path / image) == (900, 460)
