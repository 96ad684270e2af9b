"""Multi-turn agent turns: what prefix caching buys (warm-prefix TTFT against cold) and what it must not
change (greedy output, acceptance).

A workload of conversations (``agent_turns.json``: a shared system prompt, then
user turns); every turn's prompt is the whole conversation so far, the model's own earlier answers
included, as an agent's are. Each turn is sent twice, streaming, at temperature 0:

- **cold**: with a ``cache_salt`` of its own (vLLM hashes the salt into the first block), so no block
  of it can hit the prefix cache: the whole prompt is prefilled, as with prefix caching off (the twins
  go in alternating order, turn by turn);
- **warm**: with the run's salt, shared by every warm request of the run: the system prompt and the
  conversation's earlier turns are in the cache (what an agent's next turn finds).

The warm answer is appended to the conversation. Per request the client's TTFT is timed, and
``/metrics`` is scraped around it (outside the timing) for the server's own TTFT
(``vllm:time_to_first_token_seconds`` sum delta), the prefix-cache queries and hits, and the
spec-decode counters. Figures:

- ``prefix_ttft_warm_over_cold``: median warm TTFT over median cold TTFT, over the turns after each
  conversation's first (the ratio an operator wants below 1); the client's figure, and the server's
  (``server_prefix_ttft_warm_over_cold``) beside it. Where the two disagree by more than
  ``RATIO_AGREEMENT`` the headline is the server's, marked as such (the same honesty rule as decode);
- ``prefix_cache_hit_rate_warm`` / ``prefix_cache_hits_warm`` (tokens): vLLM's own counters over the
  warm requests (the cold ones must hit nothing: ``prefix_cache_hits_cold``);
- ``prefix_greedy_mismatches``: warm answers that differ from their cold twin (0 when caching is
  correct);
- ``acceptance_length_warm`` / ``acceptance_length_cold``: acceptance with and without cached prefixes.

A server without prefix caching answers both twins cold: the ratio is then about 1 and the hits 0.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from sparkfleet.hostlib.bench import metrics as prom
from sparkfleet.hostlib.bench.http_client import CpuMeter, OpenAIServer, StreamedCompletion
from sparkfleet.hostlib.bench.workloads import CONVERSATION_WORKLOADS, WorkloadError, scaled_max_tokens, workload_path

PREFIX_WORKLOAD = CONVERSATION_WORKLOADS[0]
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
# The client's warm/cold ratio is the headline only within this of the server's (relative).
RATIO_AGREEMENT = 0.25


@dataclass(frozen=True)
class Conversation:
    """One agent conversation: a system prompt and the user's turns, each answered by the model."""

    conversation_id: str
    system: str
    turns: list[str]
    max_tokens: int


def load_conversations(
    name_or_path: str, max_tokens_scale: float = 1.0, limit: int | None = None
) -> list[Conversation]:
    """Read a conversations workload (``{"conversations": [{"id", "system", "turns", "max_tokens"}]}``)."""
    path = workload_path(name_or_path, CONVERSATION_WORKLOADS, "conversations JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        conversations = [
            Conversation(
                conversation_id=str(item["id"]),
                system=str(item["system"]),
                turns=[str(turn) for turn in item["turns"]],
                max_tokens=scaled_max_tokens(int(item["max_tokens"]), max_tokens_scale),
            )
            for item in data["conversations"]
        ]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise WorkloadError(
            f"workload file {path.name} is not a conversations workload ({exc}): "
            '{"conversations": [{"id", "system", "turns": [...], "max_tokens"}]}'
        ) from exc
    if limit is not None:
        if limit < 1:
            raise WorkloadError(f"conversation limit {limit!r} must be >= 1")
        conversations = conversations[:limit]
    if not conversations or any(len(c.turns) < 2 for c in conversations):
        raise WorkloadError(f"workload file {path.name} needs conversations of 2 turns or more (a warm turn)")
    return conversations


@dataclass
class TurnRequest:
    """One request of a turn (cold or warm) with the server's view of it."""

    completion: StreamedCompletion
    server_ttft_s: float | None
    cache_queries: float
    cache_hits: float
    spec: prom.SpecDecodeWindow | None


def _measured(
    server: OpenAIServer, model: str, messages: list[dict[str, str]], max_tokens: int, extra: dict
) -> TurnRequest:
    before = prom.fetch_metrics(server.base_url)
    completion = server.stream_chat(model, messages, max_tokens, extra=extra)
    after = prom.fetch_settled_metrics(server.base_url, before, 1, completion.completion_tokens)
    ttft = prom.histogram_window(before, after, TTFT_HISTOGRAM)
    return TurnRequest(
        completion=completion,
        server_ttft_s=ttft.sum if ttft is not None and round(ttft.count) == 1 else None,
        cache_queries=after.total(PREFIX_CACHE_QUERIES) - before.total(PREFIX_CACHE_QUERIES),
        cache_hits=after.total(PREFIX_CACHE_HITS) - before.total(PREFIX_CACHE_HITS),
        spec=prom.spec_decode_window(before, after),
    )


def _acceptance(windows: list[prom.SpecDecodeWindow | None]) -> float | None:
    drafts = sum(w.drafts for w in windows if w is not None)
    accepted = sum(w.accepted_tokens for w in windows if w is not None)
    return 1.0 + accepted / drafts if drafts > 0 else None


def _ratio(warm: list[float], cold: list[float]) -> float | None:
    if not warm or not cold or statistics.median(cold) <= 0:
        return None
    return statistics.median(warm) / statistics.median(cold)


def run_prefix_bench(
    server: OpenAIServer,
    model: str,
    conversations: list[Conversation],
    progress: bool = True,
    ignore_eos: bool = False,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run every conversation cold and warm, turn by turn; return (figures, details, client_cpu)."""
    run_salt = f"sparkfleet-bench-{secrets.token_hex(8)}"
    base_extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
    turns: list[dict[str, Any]] = []
    pairs: list[tuple[TurnRequest, TurnRequest, int]] = []
    with CpuMeter() as cpu:
        for conversation in conversations:
            history = [{"role": "system", "content": conversation.system}]
            for index, user in enumerate(conversation.turns):
                messages = [*history, {"role": "user", "content": user}]
                cold_extra = {**base_extra, "cache_salt": f"sparkfleet-cold-{secrets.token_hex(8)}"}
                warm_extra = {**base_extra, "cache_salt": run_salt}
                # which twin goes first alternates: a second request of a prompt can be faster for reasons
                # of its own (warm caches on the host), which must not count for either
                if len(pairs) % 2 == 0:
                    cold = _measured(server, model, messages, conversation.max_tokens, cold_extra)
                    warm = _measured(server, model, messages, conversation.max_tokens, warm_extra)
                else:
                    warm = _measured(server, model, messages, conversation.max_tokens, warm_extra)
                    cold = _measured(server, model, messages, conversation.max_tokens, cold_extra)
                history = [*messages, {"role": "assistant", "content": warm.completion.text}]
                pairs.append((cold, warm, index))
                turn = {
                    "id": f"{conversation.conversation_id}#{index + 1}",
                    "prompt_tokens": warm.completion.prompt_tokens,
                    "completion_tokens": warm.completion.completion_tokens,
                    "ttft_cold_s": cold.completion.ttft_s,
                    "ttft_warm_s": warm.completion.ttft_s,
                    "server_ttft_cold_s": cold.server_ttft_s,
                    "server_ttft_warm_s": warm.server_ttft_s,
                    "cache_hits_cold": cold.cache_hits,
                    "cache_hits_warm": warm.cache_hits,
                    "cache_queries_warm": warm.cache_queries,
                    "greedy_identical": cold.completion.text == warm.completion.text,
                    # what the warm turn answered, comparable across runs (prefix caching on and off)
                    "answer_sha256": hashlib.sha256(warm.completion.text.encode("utf-8")).hexdigest(),
                }
                turns.append(turn)
                if progress:
                    print(
                        f"  prefix {turn['id']}: {turn['prompt_tokens']} prompt tokens, "
                        f"{turn['cache_hits_warm']:.0f} cached; TTFT cold {_ms(turn['ttft_cold_s'])} "
                        f"warm {_ms(turn['ttft_warm_s'])}{'' if turn['greedy_identical'] else '; ANSWERS DIFFER'}",
                        file=sys.stderr,
                        flush=True,
                    )
    later = [(cold, warm) for cold, warm, index in pairs if index > 0]
    client_ratio = _ratio(
        [w.completion.ttft_s for _, w in later if w.completion.ttft_s is not None],
        [c.completion.ttft_s for c, _ in later if c.completion.ttft_s is not None],
    )
    server_ratio = _ratio(
        [w.server_ttft_s for _, w in later if w.server_ttft_s is not None],
        [c.server_ttft_s for c, _ in later if c.server_ttft_s is not None],
    )
    agree = (
        client_ratio is not None
        and server_ratio is not None
        and (abs(client_ratio / server_ratio - 1) <= RATIO_AGREEMENT)
    )
    headline_source = "client" if agree or server_ratio is None else "server"
    warm_queries = sum(w.cache_queries for _, w, _ in pairs)
    warm_hits = sum(w.cache_hits for _, w, _ in pairs)
    figures = {
        "prefix_ttft_warm_over_cold": client_ratio if headline_source == "client" else server_ratio,
        "client_prefix_ttft_warm_over_cold": client_ratio,
        "server_prefix_ttft_warm_over_cold": server_ratio,
        "prefix_ttft_cold_s_median": statistics.median([c.completion.ttft_s for c, _ in later]) if later else None,
        "prefix_ttft_warm_s_median": statistics.median([w.completion.ttft_s for _, w in later]) if later else None,
        "prefix_cache_hits_warm": warm_hits,
        "prefix_cache_hit_rate_warm": warm_hits / warm_queries if warm_queries > 0 else None,
        "prefix_cache_hits_cold": sum(c.cache_hits for c, _, _ in pairs),
        "prefix_greedy_mismatches": sum(not turn["greedy_identical"] for turn in turns),
        "acceptance_length_warm": _acceptance([w.spec for _, w, _ in pairs]),
        "acceptance_length_cold": _acceptance([c.spec for c, _, _ in pairs]),
        "client_cpu_share": cpu.share,
    }
    details = {
        "conversations": len(conversations),
        "turns": turns,
        "headline_source": headline_source,
        "ratio_agreement": RATIO_AGREEMENT,
        "warm_turns_measured": len(later),
    }
    if progress or headline_source != "client":
        print(describe_prefix(figures, headline_source), file=sys.stderr, flush=True)
    return figures, details, cpu.as_dict()


def describe_prefix(figures: dict[str, Any], source: str) -> str:
    """One line for the operator: the warm/cold TTFT ratio, where it came from, hits and equality."""
    ratio = figures["prefix_ttft_warm_over_cold"]
    return (
        f"prefix: warm-prefix TTFT {_ms(figures['prefix_ttft_warm_s_median'])} vs cold "
        f"{_ms(figures['prefix_ttft_cold_s_median'])}: warm/cold {'n/a' if ratio is None else f'{ratio:.2f}'} "
        f"({source}; server {_fmt(figures['server_prefix_ttft_warm_over_cold'])}, client "
        f"{_fmt(figures['client_prefix_ttft_warm_over_cold'])}), {figures['prefix_cache_hits_warm']:.0f} tokens from "
        f"the cache (hit rate {_fmt(figures['prefix_cache_hit_rate_warm'])}), greedy mismatches "
        f"{figures['prefix_greedy_mismatches']}, acceptance warm {_fmt(figures['acceptance_length_warm'])} / cold "
        f"{_fmt(figures['acceptance_length_cold'])}"
    )


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
