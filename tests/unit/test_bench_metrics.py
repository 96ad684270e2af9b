"""Prometheus /metrics parsing and window deltas, on /metrics text recorded from vLLM 0.23.0 (CPU).

The two recordings in bench_data/ come from a vLLM 0.23.0 CPU server (the project's patched CPU
wheel) serving build/models/tiny-qwen3 with ngram speculation (3 speculative tokens), scraped
before and after one chat completion with max_tokens 120 and ignore_eos.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkfleet.hostlib.bench import metrics as prom

DATA = Path(__file__).parent / "bench_data"
BEFORE = prom.MetricsSnapshot.from_text((DATA / "vllm-0.23.0-cpu-ngram-metrics-before.txt").read_text())
AFTER = prom.MetricsSnapshot.from_text((DATA / "vllm-0.23.0-cpu-ngram-metrics-after.txt").read_text())


def test_parses_recorded_counters_with_labels() -> None:
    assert AFTER.total(prom.SPEC_DRAFTS) == 129.0
    assert AFTER.total(prom.SPEC_ACCEPTED) == 119.0
    assert AFTER.by_label(prom.SPEC_ACCEPTED_PER_POS, "position") == {"0": 50.0, "1": 39.0, "2": 30.0}
    # request_success_total has one series per finished_reason; total sums them, a filter picks one
    assert AFTER.total(prom.REQUEST_SUCCESS) == 14.0
    assert AFTER.total(prom.REQUEST_SUCCESS, finished_reason="length") == 3.0
    # *_created samples are separate names and never counted as the counter
    assert AFTER.total("vllm:spec_decode_num_drafts_created") > 1e9


def test_spec_decode_window_over_one_request() -> None:
    window = prom.spec_decode_window(BEFORE, AFTER)
    assert window is not None
    assert (window.drafts, window.draft_tokens, window.accepted_tokens) == (41.0, 123.0, 40.0)
    assert window.accepted_per_position == (17.0, 13.0, 10.0)
    assert window.acceptance_length == pytest.approx(1 + 40 / 41)
    assert window.acceptance_rate == pytest.approx(40 / 123)
    assert window.per_position_acceptance == pytest.approx([17 / 41, 13 / 41, 10 / 41])
    # per-position acceptance sums to accepted / drafts, i.e. acceptance length - 1
    assert sum(window.per_position_acceptance) == pytest.approx(window.acceptance_length - 1)


def test_spec_decode_window_absent_without_speculation() -> None:
    plain = prom.MetricsSnapshot.from_text('vllm:generation_tokens_total{engine="0"} 5.0\n')
    assert prom.spec_decode_window(plain, plain) is None


def test_server_tpot_window_from_recorded_histograms() -> None:
    window = prom.server_tpot_window(BEFORE, AFTER)
    assert window is not None
    assert window.requests == 1.0
    assert window.generation_tokens == 120.0
    assert window.decode_time_s == pytest.approx(1.3076457290001144 - 1.0436107660001426)
    assert window.token_weighted_tpot_s == pytest.approx(window.decode_time_s / 119)
    assert window.request_tpot_mean_s == pytest.approx(0.06955686146970028 - 0.06733808026801984)
    # one request: its TPOT equals the token-weighted one
    assert window.request_tpot_mean_s == pytest.approx(window.token_weighted_tpot_s, rel=1e-6)
    # the interpolated median lies in the first bucket [0, 10 ms]
    assert 0.0 < window.request_tpot_median_s <= 0.01


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    hist = prom.Histogram(buckets=((0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)), sum=1.0, count=8.0)
    assert hist.quantile(0.5) == pytest.approx(0.1 + 0.1 * (4 - 2) / 4)
    assert hist.quantile(1.0) == 0.2  # falls in +Inf: the highest finite bound
    assert hist.mean == pytest.approx(0.125)
    with pytest.raises(ValueError, match="outside"):
        hist.quantile(1.5)


def test_histogram_minus_gives_window() -> None:
    earlier = prom.Histogram(buckets=((0.1, 1.0), (float("inf"), 2.0)), sum=0.3, count=2.0)
    later = prom.Histogram(buckets=((0.1, 4.0), (float("inf"), 6.0)), sum=1.0, count=6.0)
    window = later.minus(earlier)
    assert window.buckets == ((0.1, 3.0), (float("inf"), 4.0))
    assert window.count == 4.0 and window.sum == pytest.approx(0.7)


def test_label_values_with_escapes_and_special_values() -> None:
    samples = prom.parse_prometheus_text(
        '# HELP x y\nm{a="q\\"uote",b="back\\\\slash",c="new\\nline"} +Inf\nplain_metric 3 1700000000\n'
    )
    assert samples[0].labels == (("a", 'q"uote'), ("b", "back\\slash"), ("c", "new\nline"))
    assert samples[0].value == float("inf")
    assert samples[1].name == "plain_metric" and samples[1].value == 3.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('m{a="x" 1', "unclosed"),
        ("m{a=x} 1", "bad label"),
        ("m 1.2.3", "bad value"),
        ("lonely_name", "no value"),
    ],
)
def test_malformed_lines_name_the_line(line: str, message: str) -> None:
    with pytest.raises(prom.MetricsFormatError, match=message):
        prom.parse_prometheus_text(line + "\n")


def test_definitions_reproduce_the_reference_conc8_figures() -> None:
    # reference/bench-log-dflash-conc8.md: num_speculative_tokens 5, per-position acceptance
    # 0.78 / 0.56 / 0.39 / 0.29 / 0.21, "mean acceptance length ~3.2-3.3", "avg draft acceptance ~44%".
    # Counters scaled to 100 drafts: the definitions here must give back both stated figures.
    per_position = (78.0, 56.0, 39.0, 29.0, 21.0)
    window = prom.SpecDecodeWindow(
        drafts=100, draft_tokens=500, accepted_tokens=sum(per_position), accepted_per_position=per_position
    )
    assert 3.2 <= window.acceptance_length <= 3.3
    assert window.acceptance_rate == pytest.approx(0.446)
