"""Decode and e2e client logic against a local HTTP stub (tests/unit/bench_stub.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkfleet.hostlib.bench import main as bench_main
from sparkfleet.hostlib.bench import results as res
from sparkfleet.hostlib.bench.decode import run_decode_bench, summarize_request_agreement, tpot_agreement
from sparkfleet.hostlib.bench.e2e import run_e2e_bench
from sparkfleet.hostlib.bench.http_client import (
    BenchHTTPError,
    OpenAIServer,
    StreamedCompletion,
    _lines,
    _read_event_stream,
    read_api_key,
)
from sparkfleet.hostlib.bench.metrics import ServerTpotWindow
from sparkfleet.hostlib.bench.workloads import BenchRequest, Workload, load_workload
from tests.unit.bench_stub import StubServer

GAP_S = 0.004


def one_request_workload(name: str, tokens: int, count: int = 2) -> Workload:
    requests = [BenchRequest(f"{name}-{i}", [{"role": "user", "content": f"{name} {i}"}], tokens) for i in range(count)]
    return Workload(name=name, description="test", requests=requests)


def completion(first: float, last: float, tokens: int, at_start: int = 1) -> StreamedCompletion:
    return StreamedCompletion(
        request_start=0.0,
        first_chunk=first,
        window_start=first,
        tokens_at_window_start=at_start,
        last_token=last,
        completion_tokens=tokens,
        prompt_tokens=5,
        finish_reason="length",
    )


def test_streamed_completion_arithmetic() -> None:
    plain = completion(0.5, 2.5, 101)
    assert plain.ttft_s == pytest.approx(0.5)
    assert plain.decode_s == pytest.approx(2.0)
    assert plain.decode_tok_s == pytest.approx(50.0)  # 100 tokens after the first in 2 s
    assert plain.tpot_s == pytest.approx(0.02)
    merged = completion(0.5, 2.5, 101, at_start=5)  # first content chunk carried 5 tokens
    assert merged.tokens_in_window == 96 and merged.decode_tok_s == pytest.approx(48.0)
    single = completion(0.5, 0.5, 1)
    assert single.decode_tok_s is None and single.tpot_s is None


def test_event_stream_lines_split_on_newline_only_across_reads() -> None:
    # a token's text may hold U+2028 or U+0085, which JSON leaves unescaped: still one data line;
    # events cut anywhere between two reads (even inside a UTF-8 character) come out whole
    def event(content: str | None, generated: int) -> dict[str, object]:
        delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {"choices": [choice], "usage": {"completion_tokens": generated}}

    events = [event(None, 0), event("a\u2028b", 1), event("\u0085é", 2)]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    stream = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in [*events, usage]) + "data: [DONE]\n\n"
    raw = stream.encode()
    cut = raw.index("é".encode()) + 1
    reads = [raw[:7], raw[7:cut], raw[cut:]]
    assert b"".join(_lines(reads)) == raw
    assert [line for line in _lines(reads) if line.strip()] == [
        line + b"\n" for line in raw.split(b"\n") if line.strip()
    ]
    completion = _read_event_stream(_lines(reads), request_start=0.0)
    assert completion.text == "a\u2028b\u0085é"
    assert (completion.completion_tokens, completion.prompt_tokens, completion.tokens_at_window_start) == (2, 3, 1)
    assert len(completion.chunk_times) == 3  # the role chunk and the two content chunks, each stamped


def test_tpot_agreement_exact_arithmetic() -> None:
    completions = [
        completion(1.0, 2.0, 11),  # 10 tokens after the first in 1.0 s
        completion(1.0, 4.0, 33, at_start=3),  # 30 tokens in 3.0 s after a merged first chunk
    ]
    server = ServerTpotWindow(
        requests=2,
        request_tpot_mean_s=0.105,
        request_tpot_median_s=None,
        inter_token_mean_s=None,
        decode_time_s=4.41,
        generation_tokens=44,
    )
    agreement = tpot_agreement(completions, server)
    assert agreement.client_tpot_s == pytest.approx(4.0 / 40)
    assert agreement.server_tpot_s == pytest.approx(4.41 / 42)
    assert agreement.relative_difference == pytest.approx((0.1 - 0.105) / 0.105)
    assert agreement.client_request_tpot_mean_s == pytest.approx(0.1)
    assert agreement.request_mean_relative_difference == pytest.approx((0.1 - 0.105) / 0.105)
    assert agreement.window_clean
    foreign = ServerTpotWindow(3, 0.07, None, None, 4.41, 45)
    assert not tpot_agreement(completions, foreign).window_clean
    assert tpot_agreement(completions, None).relative_difference is None


def test_decode_excludes_prefill_and_reads_acceptance() -> None:
    # prefill 0.15 s is about half the request: a tokens/total-time figure would drop to ~1/2
    with StubServer(token_gap_s=GAP_S, prefill_s=0.15, accepted_per_step=3, draft_len=4) as stub:
        server = OpenAIServer(stub.base_url)
        workloads = [one_request_workload("w1", 41), one_request_workload("w2", 21)]
        figures, details, cpu = run_decode_bench(server, "stub", workloads, progress=False)
    assert figures["decode_tok_s_median[w1]"] == pytest.approx(1 / GAP_S, rel=0.35)
    assert figures["decode_tok_s_median[w1]"] > 1.5 * 40 / (0.15 + 40 * GAP_S)
    assert figures["acceptance_length[w1]"] == pytest.approx(4.0)
    assert figures["acceptance_rate[w1]"] == pytest.approx(0.75)
    w1 = details["workloads"][0]
    assert w1["spec_decode"]["per_position_acceptance"] == pytest.approx([1.0, 1.0, 1.0, 0.0])
    assert w1["tpot_agreement"]["window_clean"]  # the warm-up request stayed outside the window
    assert w1["tpot_agreement"]["requests_server"] == 2
    # every request has its own /metrics window: the server's TPOT for exactly that request
    assert all(r["window_clean"] and r["server_tpot_s"] > 0 for r in w1["per_request"])
    assert figures["server_decode_tok_s_median[w1]"] == pytest.approx(1 / GAP_S, rel=0.35)
    assert details["tpot_agreement_per_request"]["requests"] == 4
    assert abs(figures["tpot_relative_difference_median"]) < 0.25
    assert all(r["ttft_s"] >= 0.15 for r in w1["per_request"])
    assert abs(figures["tpot_relative_difference"]) < 0.25  # loopback stub: same intervals both sides
    # a healthy stream: the client's figure is the headline, confirmed by the server's
    assert details["headline_source"] == "client" and figures["client_figure_invalid_workloads"] == 0
    assert figures["decode_tok_s_median[w1]"] == figures["client_decode_tok_s_median[w1]"]
    assert details["headline"]["w1"]["disagreeing_requests"] == []
    assert 0.0 <= figures["client_cpu_share"] == cpu["share"]
    assert cpu["wall_s"] > 0
    # every request was streamed at temperature 0 with usage requested
    assert all(
        b["stream"] and b["temperature"] == 0.0 and b["stream_options"]["include_usage"] for b in stub.state.bodies
    )


def test_first_chunk_carrying_several_tokens_does_not_bias_tpot() -> None:
    # a busy vLLM API server merges engine steps: its first content chunk can carry 2-4 tokens
    with StubServer(token_gap_s=0.005, prefill_s=0.01, merge_first=4) as stub:
        _, details, _ = run_decode_bench(
            OpenAIServer(stub.base_url), "stub", [one_request_workload("w", 21, count=3)], progress=False
        )
    workload = details["workloads"][0]
    agreement = workload["tpot_agreement"]
    assert agreement["window_clean"]
    assert abs(agreement["relative_difference"]) < 0.1
    # counting all 20 tokens after the first inside the shortened window would read ~15% fast
    naive_tpot = sum(r["decode_s"] for r in workload["per_request"]) / (20 * 3)
    assert (naive_tpot - agreement["server_tpot_s"]) / agreement["server_tpot_s"] < -0.1
    assert all(b["stream_options"]["continuous_usage_stats"] for b in stub.state.bodies)


def test_per_request_agreement_summary_counts_outliers() -> None:
    rows = [{"id": f"r{i}", "tpot_relative_difference": d} for i, d in enumerate([0.01, -0.02, 0.0, -0.99])]
    rows.append({"id": "single-token", "tpot_relative_difference": None})
    summary = summarize_request_agreement(rows)
    assert summary["requests"] == 4
    assert summary["median_relative_difference"] == pytest.approx(-0.01)
    assert summary["within_tolerance_share"] == 0.75
    assert summary["outside_tolerance"] == [{"id": "r3", "relative_difference": -0.99}]
    assert summarize_request_agreement([])["median_relative_difference"] is None


def test_burst_delivery_is_caught_by_the_server_cross_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a stalled API server: tokens generated on time, all chunks delivered at the end at once
    workload_file = tmp_path / "w.json"
    requests = [{"id": f"r{i}", "messages": [{"role": "user", "content": str(i)}], "max_tokens": 21} for i in range(3)]
    workload_file.write_text(json.dumps({"name": "w", "requests": requests}))
    with StubServer(token_gap_s=0.004, prefill_s=0.01, burst=True) as stub:
        code = stub.run_bench("decode", tmp_path / "r.json", "--workloads", str(workload_file))
    assert code == 0
    result = res.load_result(tmp_path / "r.json")
    figures = result["figures"]
    assert figures["tpot_within_5pct_share"] == 0.0
    assert figures["tpot_relative_difference_median"] < -0.5  # the collapsed windows read far too fast
    assert figures["server_decode_tok_s_median"] == pytest.approx(1 / 0.004, rel=0.35)
    # honest by default: the collapsed client figure is kept, marked, and is not the headline
    assert figures["client_decode_tok_s_median"] > 3 * figures["server_decode_tok_s_median"]
    assert figures["decode_tok_s_median"] == figures["server_decode_tok_s_median"]
    assert figures["decode_tok_s_median[w]"] == figures["server_decode_tok_s_median[w]"]
    assert figures["client_figure_invalid_workloads"] == 1
    chosen = result["details"]["headline"]["w"]
    assert (chosen["source"], chosen["client_valid"]) == ("server", False)
    assert [r["id"] for r in chosen["disagreeing_requests"]] == ["r0", "r1", "r2"]
    assert result["details"]["headline_source"] == "server"
    err = capsys.readouterr().err
    assert "w: client figure INVALID" in err and "r0 (-" in err and "from the server's /metrics" in err
    assert "the client's decode figure is INVALID for w" in err


def test_decode_flags_foreign_traffic_in_the_window() -> None:
    with StubServer(token_gap_s=GAP_S, prefill_s=0.01) as stub:
        stub.state.extra_requests = 1
        figures, details, _ = run_decode_bench(
            OpenAIServer(stub.base_url), "stub", [one_request_workload("w", 11)], warmup=False, progress=False
        )
    assert not details["workloads"][0]["tpot_agreement"]["window_clean"]


def test_e2e_discards_run_one_and_scales_max_tokens() -> None:
    workload = load_workload("albond_e2e", max_tokens_scale=0.125)
    assert [r.max_tokens for r in workload.requests] == [32, 64, 128, 8, 256]
    with StubServer(token_gap_s=0.001, prefill_s=0.01, first_run_extra_s=0.6) as stub:
        figures, details, _ = run_e2e_bench(OpenAIServer(stub.base_url), "stub", workload, progress=False)
    assert stub.state.max_tokens_seen == [32, 32, 64, 64, 128, 128, 8, 8, 256, 256]
    assert all(body["stream"] is False and body["temperature"] == 0.0 for body in stub.state.bodies)
    for prompt in details["prompts"]:
        run1, run2 = prompt["runs"]
        assert run1["discarded"] and not run2["discarded"]
        assert run1["wall_s"] > run2["wall_s"] + 0.3  # the slow first run is not what is reported
        assert prompt["tok_s"] == pytest.approx(run2["completion_tokens"] / run2["wall_s"])
    rates = [p["tok_s"] for p in details["prompts"]]
    assert figures["e2e_tok_s"] == pytest.approx(sum(rates) / 5)
    assert figures["e2e_tok_s[e2e-5]"] == rates[4]
    assert figures["acceptance_length"] == pytest.approx(3.0)  # stub default: 2 accepted per step


def test_cli_writes_result_and_fails_on_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload_file = tmp_path / "tiny.json"
    workload_file.write_text(
        json.dumps(
            {
                "name": "tiny",
                "requests": [{"id": "t1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 21}],
            }
        )
    )
    with StubServer(token_gap_s=GAP_S, prefill_s=0.01) as stub:
        common = ["--workloads", str(workload_file), "--profile", "dflash", "--host-label", "spark-test"]
        common += ["--drafter-revision", "b" * 40]
        ok_baselines = ["--baselines", '{"decode_tok_s_median": 1.0}', "--tolerance-pct", "5"]
        passing = stub.run_bench("decode", tmp_path / "ok.json", *common, *ok_baselines)
        failing = stub.run_bench(
            "decode", tmp_path / "bad.json", *common, "--baselines", '{"decode_tok_s_median[tiny]": 1000000}'
        )
    assert (passing, failing) == (0, 1)
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "decode_tok_s_median[tiny]" in out
    result = res.load_result(tmp_path / "ok.json")
    assert result["host"] == "spark-test" and result["profile"] == "dflash"
    assert result["model"] == {"served_name": "stub", "root": result["model"]["root"], "revision": "a" * 40}
    assert result["drafter"]["revision"] == "b" * 40
    assert result["vllm_version"] == "0.23.0+stub"
    assert result["utc_time"].endswith("Z")
    assert result["comparison"]["passed"] is True
    assert res.load_result(tmp_path / "bad.json")["comparison"]["passed"] is False


def test_cli_bad_inputs_give_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["decode", "--base-url", "ftp://x", "--out", str(tmp_path)]) == 2
    assert "is not http(s)://HOST:PORT" in capsys.readouterr().err
    assert bench_main(["e2e", "--base-url", "http://127.0.0.1:1", "--out", str(tmp_path)]) == 2
    assert "is a server listening at http://127.0.0.1:1" in capsys.readouterr().err
    with StubServer() as stub:
        assert bench_main(["decode", "--base-url", stub.base_url, "--workloads", "nosuch", "--out", str(tmp_path)]) == 2
    assert "workload 'nosuch' not found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written on a failed run


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("# sparkfleet secrets\nVLLM_API_KEY=k-123\nHF_TOKEN=hf_x\n", "k-123"),  # the unit's secrets file
        ("k-456\n", "k-456"),  # a bare key
        ("OPENAI_API_KEY='k-789'\n", "k-789"),
        ("HF_TOKEN=hf_x\n", None),  # an unkeyed server's secrets file
        ("", None),
    ],
)
def test_the_api_key_is_read_from_a_file(tmp_path, text: str, key: str | None) -> None:  # noqa: ANN001
    path = tmp_path / "secrets.env"
    path.write_text(text)
    assert read_api_key(str(path)) == key
    assert read_api_key(None) is None


def test_a_keyed_server_is_benchmarked_with_the_key_and_refuses_without(tmp_path) -> None:  # noqa: ANN001
    secrets = tmp_path / "vllm-dflash.env"
    secrets.write_text("VLLM_API_KEY=stub-key-1\n")
    with StubServer(token_gap_s=GAP_S, api_key="stub-key-1") as stub:
        with pytest.raises(BenchHTTPError, match="HTTP 401"):
            OpenAIServer(stub.base_url).model_info()
        refused = stub.state.refused
        server = OpenAIServer(stub.base_url, api_key=read_api_key(str(secrets)))
        assert server.model_info()[0] == "stub"
        figures, _details, _cpu = run_decode_bench(server, "stub", [one_request_workload("w", 11)], progress=False)
        assert figures["decode_tok_s_median[w]"] > 0
        assert stub.state.refused == refused, "every keyed request got in"
