"""Result schema, writing/loading, and comparison with a profile's baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkfleet.hostlib.bench import main as bench_main
from sparkfleet.hostlib.bench import results as res
from tests.unit.helpers import bench_result


def decode_result(**figures: float | None) -> dict:
    result = bench_result("decode")
    result["figures"] = dict(figures)
    return result


def test_throughput_within_tolerance_passes_and_beyond_fails() -> None:
    ok = res.compare_figure("decode_tok_s_median", 78.0, 81.0, 5.0)
    assert ok.passed and "3.7% below" in ok.reason and ok.reason.endswith("ok")
    bad = res.compare_figure("decode_tok_s_median", 70.0, 81.0, 5.0)
    assert not bad.passed and "13.6% below" in bad.reason and "REGRESSION" in bad.reason
    assert res.compare_figure("e2e_tok_s", 60.0, 53.7, 5.0).passed  # faster is never a regression


def test_latency_figures_are_lower_is_better() -> None:
    assert res.lower_is_better("serving_tpot_ms_median") and not res.lower_is_better("e2e_tok_s")
    assert res.compare_figure("serving_ttft_ms_median", 600.0, 681.0, 5.0).passed
    slow = res.compare_figure("serving_ttft_ms_median", 800.0, 681.0, 5.0)
    assert not slow.passed and "above" in slow.reason


def test_missing_figure_fails_with_reason() -> None:
    check = res.compare_figure("acceptance_length[agent]", None, 8.3, 5.0)
    assert not check.passed and "not measured" in check.reason


def test_compare_skips_baselines_of_other_kinds() -> None:
    result = decode_result(**{"decode_tok_s_median": 80.0, "decode_tok_s_median[agent]": 79.0})
    comparison = res.compare_with_baselines(
        result, {"decode_tok_s_median[agent]": 81.0, "e2e_tok_s": 53.7}, tolerance_pct=5
    )
    assert comparison["passed"] is True
    assert [c["figure"] for c in comparison["checks"]] == ["decode_tok_s_median[agent]"]
    assert comparison["skipped_other_kind"] == ["e2e_tok_s"]
    with pytest.raises(res.ResultError, match="tolerance"):
        res.compare_with_baselines(result, {}, tolerance_pct=-1)


def test_write_load_roundtrip_and_validation(tmp_path: Path) -> None:
    result = decode_result(decode_tok_s_median=80.0)
    path = res.write_result(result, tmp_path / res.default_result_name(result))
    assert path.name == "spark-01_dflash_decode_20260624T100000Z.json"
    assert res.load_result(path) == json.loads(path.read_text())
    bad = dict(result, schema="other/9")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(res.ResultError, match="schema 'other/9'"):
        res.load_result(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(res.ResultError, match="not JSON"):
        res.load_result(tmp_path / "junk.json")


def test_load_baselines_from_string_file_and_profile_shape(tmp_path: Path) -> None:
    assert res.load_baselines('{"e2e_tok_s": 53.7}') == {"e2e_tok_s": 53.7}
    (tmp_path / "b.json").write_text(json.dumps({"baselines": {"decode_tok_s_median": 81}}))
    assert res.load_baselines(str(tmp_path / "b.json")) == {"decode_tok_s_median": 81.0}
    with pytest.raises(res.ResultError, match="not a finite number"):
        res.load_baselines('{"e2e_tok_s": "fast"}')
    with pytest.raises(res.ResultError, match="neither a JSON object nor a file"):
        res.load_baselines("nosuch.json")


def test_compare_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = res.write_result(decode_result(decode_tok_s_median=80.0), tmp_path / "r.json")
    assert bench_main(["compare", "--result", str(path), "--baselines", '{"decode_tok_s_median": 81}']) == 0
    assert "PASS" in capsys.readouterr().out
    assert bench_main(["compare", "--result", str(path), "--baselines", '{"decode_tok_s_median": 100}']) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "20.0% below" in out
    assert bench_main(["compare", "--result", str(path), "--baselines", "{bad"]) == 2
    assert "are not valid JSON" in capsys.readouterr().err
