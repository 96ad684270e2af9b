"""The Markdown report and its pure-Python PNG charts."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from sparkfleet import cli
from sparkfleet.bench import png_charts
from sparkfleet.bench import results as res
from sparkfleet.report import build_report


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Parse an 8-bit RGB PNG written by png_charts (filter 0 rows), checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, width = 8, b"", 0
    height = 0
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        tag = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        if tag == b"IHDR":
            width, height, depth, color_type = struct.unpack(">IIBB", body[:10])
            assert (depth, color_type) == (8, 2)
        elif tag == b"IDAT":
            idat += body
        offset += 12 + length
    raw = zlib.decompress(idat)
    stride = width * 3 + 1
    assert len(raw) == stride * height
    rows = [raw[y * stride + 1 : (y + 1) * stride] for y in range(height)]
    assert all(raw[y * stride] == 0 for y in range(height))
    return width, height, rows


def count_color(rows: list[bytes], color: tuple[int, int, int]) -> int:
    needle = bytes(color)
    return sum(sum(1 for x in range(0, len(row), 3) if row[x : x + 3] == needle) for row in rows)


def test_bar_heights_are_proportional_to_values() -> None:
    png = png_charts.bar_chart("t", ["a", "b"], [("s", [10.0, 30.0])], "y", width=400, height=300)
    width, height, rows = decode_png(png)
    assert (width, height) == (400, 300)
    blue = png_charts.PALETTE[0]
    columns = {}
    for x in range(width):
        column = sum(1 for row in rows if row[x * 3 : x * 3 + 3] == bytes(blue))
        if column:
            columns[x] = column
    heights = sorted(set(columns.values()))
    assert len(heights) == 2 and heights[1] == pytest.approx(3 * heights[0], rel=0.05)


def colour_columns(rows: list[bytes], colour: tuple[int, int, int]) -> set[int]:
    """The x of every column holding at least one pixel of ``colour``."""
    width = len(rows[0]) // 3
    return {x for x in range(width) if any(row[x * 3 : x * 3 + 3] == bytes(colour) for row in rows)}


def test_line_chart_draws_each_series_and_skips_gaps() -> None:
    png = png_charts.line_chart("t", ["1", "2", "3"], [("a", [1.0, None, 3.0]), ("b", [2.0, 2.0, 2.0])], "y")
    _, _, rows = decode_png(png)
    assert count_color(rows, png_charts.PALETTE[0]) > 0 and count_color(rows, png_charts.PALETTE[1]) > 0
    # The gap: series a has no point at "2", so nothing of its colour joins its two points, while the
    # same series without the gap is drawn across.
    full = png_charts.line_chart("t", ["1", "2", "3"], [("a", [1.0, 2.0, 3.0]), ("b", [2.0, 2.0, 2.0])], "y")
    gap_columns = colour_columns(rows, png_charts.PALETTE[0])
    full_columns = colour_columns(decode_png(full)[2], png_charts.PALETTE[0])
    middle = (min(full_columns) + max(full_columns)) // 2
    assert middle in full_columns and middle not in gap_columns
    assert min(gap_columns) < middle < max(gap_columns)  # both points of a are drawn


def test_font_and_text_rendering() -> None:
    assert all(len(rows) == 7 and all(0 <= r < 32 for r in rows) for rows in png_charts.GLYPHS.values())
    canvas = png_charts.Canvas(40, 12)
    canvas.text(0, 0, "i1", png_charts.BLACK, 1)  # lower case is drawn as upper case
    lit = [(x, y) for y in range(12) for x in range(40) if canvas.pixels[(y * 40 + x) * 3] == png_charts.BLACK[0]]
    expected = sum(bin(r).count("1") for r in png_charts.GLYPHS["I"] + png_charts.GLYPHS["1"])
    assert len(lit) == expected
    edge = png_charts.Canvas(10, 4)
    edge.text(8, 0, "W", png_charts.BLACK, 1)  # clipped at the right edge, never wrapped to the next row
    assert all(edge.pixels[(y * 10 + x) * 3] == 255 for y in range(4) for x in range(0, 8))


def test_nice_ticks() -> None:
    assert png_charts.nice_ticks(0, 124.5) == [0, 50, 100, 150]
    assert png_charts.nice_ticks(0, 81) == [0, 20, 40, 60, 80, 100]
    assert png_charts.nice_ticks(0, 2.14) == [0, 0.5, 1.0, 1.5, 2.0, 2.5]
    with pytest.raises(ValueError, match="not finite"):
        png_charts.nice_ticks(0, float("nan"))
    with pytest.raises(ValueError, match="at least one"):
        png_charts.bar_chart("t", [], [], "y")


def make_result(kind: str, host: str, profile: str, utc: str, figures: dict, details: dict) -> dict:
    result = res.new_result(
        kind,
        base_url="http://h:8000",
        host=host,
        profile=profile,
        patch_set="fc856daa00",
        served_name="qwen",
        model_root=None,
        model_revision="a" * 40,
        drafter_revision="b" * 40,
        vllm_version="0.23.0",
        settings={"num_prompts": 64, "dataset": "sharegpt_small.json", "max_concurrency": 8},
        utc_time=utc,
    )
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
    images = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert any("over-time" in i for i in images) and any("hosts" in i for i in images)
    for image in images:
        width, height, _ = decode_png((tmp_path / "out" / image).read_bytes())
        assert (width, height) == (900, 460)


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
    (image,) = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert "prefix" in image and decode_png((tmp_path / image).read_bytes())[:2] == (900, 460)
