"""`bench prefix` (multi-turn agent turns, cold and warm) against the HTTP stub's prefix cache, and the
cold prefill of albond's e2e method on a caching server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkfleet.hostlib.bench.e2e import run_e2e_bench
from sparkfleet.hostlib.bench.http_client import OpenAIServer
from sparkfleet.hostlib.bench.prefix import Conversation, load_conversations, run_prefix_bench
from sparkfleet.hostlib.bench.workloads import WorkloadError, available_workloads, load_workload
from tests.unit.bench_stub import StubServer

SYSTEM = "You are an agent. " * 40  # 180 stub tokens: eleven whole cache blocks


def conversations(count: int = 2, turns: int = 3) -> list[Conversation]:
    return [
        Conversation(f"c{i}", SYSTEM, [f"turn {t} of conversation {i}: " + "data " * 30 for t in range(turns)], 8)
        for i in range(count)
    ]


def test_warm_turns_hit_the_cache_and_answer_as_cold_ones() -> None:
    # a prefill of 0.3 s that the cache cuts to its uncached share: far above any scheduling noise
    with StubServer(prefill_s=0.3, token_gap_s=0.001, prefix_caching=True) as stub:
        figures, details, _ = run_prefix_bench(OpenAIServer(stub.base_url), "stub", conversations(), progress=False)
    # every later turn finds the conversation so far in the cache; cold twins find nothing
    assert figures["prefix_cache_hits_cold"] == 0
    assert figures["prefix_cache_hits_warm"] > 0 and 0 < figures["prefix_cache_hit_rate_warm"] < 1
    assert all(turn["cache_hits_warm"] > 0 for turn in details["turns"][1:])
    assert figures["prefix_greedy_mismatches"] == 0
    # the prefill the cache saves shows in both clocks
    assert figures["client_prefix_ttft_warm_over_cold"] < 0.8
    assert figures["server_prefix_ttft_warm_over_cold"] < 0.8
    # the headline is the client's where the two agree within RATIO_AGREEMENT, else the server's
    client, server = figures["client_prefix_ttft_warm_over_cold"], figures["server_prefix_ttft_warm_over_cold"]
    agree = abs(client / server - 1) <= details["ratio_agreement"]
    assert details["headline_source"] == ("client" if agree else "server")
    assert figures["prefix_ttft_warm_over_cold"] == (client if agree else server)
    assert details["warm_turns_measured"] == 4  # the turns after each conversation's first
    assert figures["acceptance_length_warm"] == pytest.approx(figures["acceptance_length_cold"])


def test_a_server_without_prefix_caching_shows_no_gain() -> None:
    with StubServer(prefill_s=0.3, token_gap_s=0.001) as stub:
        figures, _, _ = run_prefix_bench(OpenAIServer(stub.base_url), "stub", conversations(1, 3), progress=False)
    assert figures["prefix_cache_hits_warm"] == 0
    assert 0.7 < figures["prefix_ttft_warm_over_cold"] < 1.4


def test_a_wrong_answer_from_cached_state_is_counted_and_named() -> None:
    with StubServer(prefill_s=0.01, token_gap_s=0.001, prefix_caching=True, wrong_when_cached=True) as stub:
        figures, details, _ = run_prefix_bench(OpenAIServer(stub.base_url), "stub", conversations(1, 3), progress=False)
    differing = [turn["id"] for turn in details["turns"] if not turn["greedy_identical"]]
    assert differing == ["c0#2", "c0#3"] and figures["prefix_greedy_mismatches"] == 2


def test_cold_twins_carry_a_salt_of_their_own_and_warm_ones_the_run_s(tmp_path: Path) -> None:
    with StubServer(prefill_s=0.0, token_gap_s=0.0, prefix_caching=True) as stub:
        run_prefix_bench(OpenAIServer(stub.base_url), "stub", conversations(2, 2), progress=False)
        salts = [body["cache_salt"] for body in stub.state.bodies]
    pairs = [salts[i : i + 2] for i in range(0, len(salts), 2)]
    cold = [pair[0] if i % 2 == 0 else pair[1] for i, pair in enumerate(pairs)]  # the twins alternate
    warm = [pair[1] if i % 2 == 0 else pair[0] for i, pair in enumerate(pairs)]
    assert len(set(cold)) == len(cold) == 4
    assert len(set(warm)) == 1 and not set(warm) & set(cold)


def test_the_cli_writes_a_prefix_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StubServer(prefill_s=0.02, token_gap_s=0.0, prefix_caching=True) as stub:
        code = stub.run_bench("prefix", tmp_path / "p.json", "--max-tokens-scale", "0.05", "--max-conversations", "2")
    assert code == 0
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["kind"] == "prefix" and result["settings"]["conversations"] == 2
    assert result["figures"]["prefix_cache_hits_warm"] > 0
    assert "prefix on" in capsys.readouterr().out


def test_the_shipped_conversations_grow_turn_by_turn() -> None:
    shipped = load_conversations("agent_turns")
    assert len(shipped) >= 3 and all(len(c.turns) >= 4 for c in shipped)
    assert len({c.system for c in shipped}) == 1  # one system prompt: later conversations hit it warm
    assert "agent_turns" not in available_workloads()  # not a decode workload
    with pytest.raises(WorkloadError, match="not a decode|not in the workload format"):
        load_workload("agent_turns")
    with pytest.raises(WorkloadError, match="needs conversations of 2 turns"):
        bad = Path(__file__).parent / "bench_data" / "one_turn.json"
        load_conversations(str(bad))


def test_e2e_runs_are_prefilled_cold_on_a_caching_server() -> None:
    """albond's method discards run 1 and times run 2 with its prefill: on a server with prefix caching
    on, run 2 must not find run 1's prompt in the cache."""
    workload = load_workload("albond_e2e", max_tokens_scale=0.01)
    with StubServer(prefill_s=0.0, token_gap_s=0.0, prefix_caching=True) as stub:
        run_e2e_bench(OpenAIServer(stub.base_url), "stub", workload, progress=False)
        salts = [body.get("cache_salt") for body in stub.state.bodies]
        hits = stub.state.cache_hits
    assert None not in salts and len(set(salts)) == len(salts) == 10
    assert hits == 0
