"""The `vllm bench serve` wrapper: argument list, result parsing, /metrics acceptance, failures.

bench_data/vllm-bench-serve-0.23.0-result.json is the --save-result JSON of a real
`vllm bench serve` 0.23.0 run (16 ShareGPT prompts, tiny-qwen3 with ngram speculation), with the
per-request lists removed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkfleet.hostlib.bench import serving
from sparkfleet.hostlib.bench.http_client import OpenAIServer
from tests.unit.bench_stub import StubServer

RECORDED = json.loads((Path(__file__).parent / "bench_data" / "vllm-bench-serve-0.23.0-result.json").read_text())

# Stands in for vLLM's CLI: checks the flags it gets and writes the recorded result where told.
FAKE_VLLM = """
import json, sys, pathlib
argv = sys.argv[1:]
assert argv[:2] == ["bench", "serve"], argv
flag = lambda name: argv[argv.index(name) + 1]
assert flag("--max-concurrency") == "8" and flag("--temperature") == "0"
assert flag("--dataset-name") == "sharegpt"
if flag("--num-prompts") == "13":
    print("Traceback: boom", file=sys.stderr)
    sys.exit(3)
pathlib.Path(flag("--result-dir"), flag("--result-filename")).write_text(sys.stdin.read() or RECORDED)
"""


def serve_argv(**overrides: object) -> list[str]:
    """build_serve_argv with placeholder values for every required keyword, and the overrides."""
    keywords: dict[str, object] = {
        "vllm_command": ["vllm"],
        "base_url": "u",
        "model": "m",
        "served_model_name": "s",
        "dataset_path": "d",
        "result_dir": "r",
        "result_filename": "f",
    }
    return serving.build_serve_argv(**{**keywords, **overrides})


def test_argv_uses_vllm_flags_and_chat_endpoint() -> None:
    argv = serve_argv(dataset_path="d.json", tokenizer="/tok", output_len=256)
    assert argv[:3] == ["vllm", "bench", "serve"]
    pairs = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert pairs["--backend"] == "openai-chat" and pairs["--endpoint"] == "/v1/chat/completions"
    assert pairs["--max-concurrency"] == "8" and pairs["--temperature"] == "0"
    assert pairs["--dataset-name"] == "sharegpt" and pairs["--dataset-path"] == "d.json"
    assert pairs["--sharegpt-output-len"] == "256" and pairs["--tokenizer"] == "/tok"
    assert "--save-result" in argv
    completions = serve_argv(backend="vllm")
    assert completions[completions.index("--endpoint") + 1] == "/v1/completions"
    with pytest.raises(serving.ServingBenchError, match="backend 'tgi'"):
        serve_argv(backend="tgi")


def test_figures_from_recorded_result() -> None:
    figures = serving.figures_from_vllm_result(RECORDED)
    assert figures["serving_output_tok_s"] == RECORDED["output_throughput"]
    assert figures["serving_ttft_ms_median"] == RECORDED["median_ttft_ms"]
    assert figures["serving_tpot_ms_p99"] == RECORDED["p99_tpot_ms"]
    assert figures["serving_itl_ms_p99"] == RECORDED["p99_itl_ms"]
    assert figures["serving_completed"] == 16
    with pytest.raises(serving.ServingBenchError, match="--save-result"):
        serving.figures_from_vllm_result({"date": "x"})


def test_run_adds_acceptance_from_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(f"RECORDED = {json.dumps(json.dumps(RECORDED))}\n" + FAKE_VLLM)
    original_run = serving.subprocess.run
    with StubServer(accepted_per_step=1, draft_len=3) as stub:

        def run_with_traffic(*args: Any, **kwargs: Any) -> Any:
            # one speculative request inside the /metrics window, as the real client would send
            OpenAIServer(stub.base_url).chat("stub", [{"role": "user", "content": "x"}], 9)
            return original_run(*args, **kwargs)

        monkeypatch.setattr(serving.subprocess, "run", run_with_traffic)
        figures, details, cpu = serving.run_serving_bench(
            base_url=stub.base_url,
            model="/m",
            served_model_name="stub",
            dataset_path=str(script),
            vllm_command=[sys.executable, str(script)],
        )
    assert figures["serving_output_tok_s"] == RECORDED["output_throughput"]
    assert figures["acceptance_length"] == pytest.approx(2.0)  # stub: 1 of 3 drafted tokens accepted
    assert figures["acceptance_rate"] == pytest.approx(1 / 3)
    assert details["spec_decode"]["per_position_acceptance"] == pytest.approx([1.0, 0.0, 0.0])
    assert cpu["includes_children"] is True and cpu["cpu_s"] > 0
    assert "ttfts" not in details["vllm_result"]


def test_failed_run_reports_exit_code_and_tail(tmp_path: Path) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(f"RECORDED = {json.dumps(json.dumps(RECORDED))}\n" + FAKE_VLLM)
    with StubServer() as stub, pytest.raises(serving.ServingBenchError, match="exited 3 .*boom"):
        serving.run_serving_bench(
            base_url=stub.base_url,
            model="/m",
            served_model_name="stub",
            dataset_path=str(script),
            num_prompts=13,
            vllm_command=[sys.executable, str(script)],
        )
    with pytest.raises(serving.ServingBenchError, match="dataset 'nope.json' not found"):
        serving.run_serving_bench(base_url="http://x", model="m", served_model_name="s", dataset_path="nope.json")


# Stands in for vLLM's CLI at any concurrency: the recorded result, throughput and TPOT moved with it.
FAKE_VLLM_AT_ANY_CONCURRENCY = """
import json, sys, pathlib
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1]
c = int(flag("--max-concurrency"))
data = json.loads(RECORDED)
data.update(output_throughput=10.0 * c, median_tpot_ms=100.0 + 25 * (c - 1), median_ttft_ms=50.0 * c)
pathlib.Path(flag("--result-dir"), flag("--result-filename")).write_text(json.dumps(data))
"""


def test_a_sweep_runs_each_concurrency_and_heads_with_the_highest(tmp_path: Path) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(f"RECORDED = {json.dumps(json.dumps(RECORDED))}\n" + FAKE_VLLM_AT_ANY_CONCURRENCY)
    with StubServer() as stub:
        figures, details, cpu = serving.run_serving_sweep(
            concurrencies=[3, 1, 2, 3],
            base_url=stub.base_url,
            model="/m",
            served_model_name="stub",
            dataset_path=str(script),
            vllm_command=[sys.executable, str(script)],
        )
    assert [entry["concurrency"] for entry in details["sweep"]] == [1, 2, 3]
    assert [entry["command"][entry["command"].index("--max-concurrency") + 1] for entry in details["sweep"]] == [
        "1",
        "2",
        "3",
    ]
    # the headline figures (the ones baselines name) are the highest concurrency's
    assert figures["serving_output_tok_s"] == 30.0 and figures["serving_tpot_ms_median"] == 150.0
    for c in (1, 2, 3):
        assert figures[f"serving_output_tok_s[conc{c}]"] == 10.0 * c
        assert figures[f"serving_ttft_ms_median[conc{c}]"] == 50.0 * c
        # per stream: what one request sees while it decodes, 1000 / median TPOT
        assert figures[f"serving_output_tok_s_per_stream[conc{c}]"] == pytest.approx(1000 / (100 + 25 * (c - 1)))
    # named apart from the decode method's per-workload acceptance_length[<workload>]
    assert not any(name.startswith("acceptance_length[") for name in figures)
    assert "serving_acceptance_length[conc1]" in figures
    assert cpu["cpu_s"] > 0 and figures["client_cpu_share"] == cpu["share"]


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"), [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 3, 4]), (8, [1, 2, 3, 8])]
)
def test_the_default_sweep_ends_at_max_num_seqs(max_num_seqs: int, expected: list[int]) -> None:
    assert serving.default_concurrencies(max_num_seqs) == expected


def test_a_sweep_is_parsed_or_refused_by_name() -> None:
    assert serving.parse_concurrencies("8") == [8]
    assert serving.parse_concurrencies("8, 1,2,2") == [1, 2, 8]
    for bad in ("0", "1,x", "", "2,-1"):
        with pytest.raises(serving.ServingBenchError, match="is not a whole number >= 1"):
            serving.parse_concurrencies(bad)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], [8]), (["--max-num-seqs", "3"], [1, 2, 3]), (["--max-num-seqs", "8"], [1, 2, 3, 8]),
     (["--max-concurrency", "2,1", "--max-num-seqs", "8"], [1, 2])],
)  # fmt: skip
def test_the_serving_command_sweeps_what_it_is_told(
    flags: list[str], expected: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[int]] = []

    def fake_sweep(*, concurrencies: list[int], **_kwargs: Any) -> tuple[dict, dict, dict]:
        seen.append(concurrencies)
        return {"serving_output_tok_s": 1.0}, {"sweep": []}, {"cpu_s": 0.0, "wall_s": 1.0, "share": 0.0}

    monkeypatch.setattr(serving, "run_serving_sweep", fake_sweep)
    with StubServer() as stub:
        code = stub.run_bench("serving", tmp_path / "r.json", *flags)
    assert code == 0 and seen == [expected]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["settings"]["concurrencies"] == expected and result["settings"]["max_concurrency"] == expected[-1]
