"""Decode-only tok/s (the reference's ``bench_decode.py`` figure, "~81 tok/s on agent turns").

Sequential (concurrency 1) streaming chat completions at temperature 0,
``stream_options.include_usage`` on. Per request:

- decode window = arrival of the last chunk carrying a choice - arrival of the first chunk
  carrying generated tokens, so TTFT/prefill is excluded;
- tokens in the window = completion_tokens (the server's usage) - tokens already generated when
  the window opened, read from ``stream_options.continuous_usage_stats`` (normally 1: the
  prefill token; more when vLLM's API server merged engine steps into its first chunk, which
  happens on a busy host and would otherwise shorten the window without removing its tokens);
- decode tok/s = tokens in the window / decode window; client TPOT = its inverse.

Per workload: median decode tok/s over its requests, and from ``/metrics`` scraped just before
and just after the workload: mean acceptance length (1 + accepted / drafts), acceptance rate and
per-position acceptance, and the server's own TPOT over the same window, compared with the
client's (``tpot_agreement``). The client's CPU share (CPU seconds / wall seconds) is recorded.

The headline is honest by default (``headline``): a workload's ``decode_tok_s_median[...]`` is the
client's figure only when the client's TPOT agrees with the server's within the tolerance (10 %),
over the workload token-weighted and for at least 90 % of its requests one by one. Otherwise the
client figure is marked invalid, the requests whose windows disagree are named (a stalled host
delivers a request's chunks in one burst and its window collapses: a 400x figure), and the headline
is the server's own per-request decode rate, with its source. The client's figure stays in the
result as ``client_decode_tok_s_median[...]``; baselines judge the headline.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from sparkfleet.hostlib.bench import metrics as prom
from sparkfleet.hostlib.bench.http_client import CpuMeter, OpenAIServer, StreamedCompletion
from sparkfleet.hostlib.bench.workloads import Workload

# A client figure is the headline only when its TPOT is within this of the server's ...
AGREEMENT_TOLERANCE = 0.10
# ... over the workload and for at least this share of its requests.
AGREEMENT_SHARE = 0.9


@dataclass(frozen=True)
class TpotAgreement:
    """The client's TPOT against the server's own, over the same window."""

    client_tpot_s: float | None  # sum of decode windows / sum of (completion_tokens - 1)
    server_tpot_s: float | None  # sum of request decode times / (generation tokens - requests)
    relative_difference: float | None  # (client - server) / server
    client_request_tpot_mean_s: float | None  # mean over requests of the client's per-request TPOT
    server_request_tpot_mean_s: float | None  # mean of vllm:request_time_per_output_token_seconds
    request_mean_relative_difference: float | None
    requests_client: int
    requests_server: float
    window_clean: bool  # the server finished exactly the client's requests and tokens in the window

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _relative(client: float | None, server: float | None) -> float | None:
    if client is None or server is None or server <= 0:
        return None
    return (client - server) / server


def tpot_agreement(completions: list[StreamedCompletion], server: prom.ServerTpotWindow | None) -> TpotAgreement:
    """Compare the client's TPOT with the server's histograms for the same requests.

    Primary figure: token-weighted TPOT on both sides (client: summed decode windows over summed
    tokens delivered inside them; server: ``vllm:request_decode_time_seconds_sum`` delta over
    ``vllm:generation_tokens_total`` delta minus finished requests). Secondary: the mean over
    requests of per-request TPOT, the client's against ``vllm:request_time_per_output_token_seconds``.
    ``window_clean`` is False when other traffic reached the server during the window (the
    server's finished requests or generated tokens differ from the client's).
    """
    measured = [c for c in completions if c.tpot_s is not None]
    decode_total = sum(c.decode_s or 0.0 for c in measured)
    tokens_in_windows = sum(c.tokens_in_window for c in measured)
    client_tpot = decode_total / tokens_in_windows if tokens_in_windows > 0 else None
    per_request = [c.tpot_s for c in measured if c.tpot_s is not None]
    single_token = sum(1 for c in completions if c.completion_tokens < 2)
    # the server counts requests with one token as TPOT 0; include them the same way
    per_request_all = per_request + [0.0] * single_token
    client_request_mean = statistics.fmean(per_request_all) if per_request_all else None
    server_tpot = server.token_weighted_tpot_s if server else None
    server_request_mean = server.request_tpot_mean_s if server else None
    requests_server = server.requests if server else 0.0
    return TpotAgreement(
        client_tpot_s=client_tpot,
        server_tpot_s=server_tpot,
        relative_difference=_relative(client_tpot, server_tpot),
        client_request_tpot_mean_s=client_request_mean,
        server_request_tpot_mean_s=server_request_mean,
        request_mean_relative_difference=_relative(client_request_mean, server_request_mean),
        requests_client=len(completions),
        requests_server=requests_server,
        window_clean=(
            server is not None
            and round(requests_server) == len(completions)
            and round(server.generation_tokens) == sum(c.completion_tokens for c in completions)
        ),
    )


def run_workload(
    server: OpenAIServer,
    model: str,
    workload: Workload,
    before: prom.MetricsSnapshot,
    repeats: int = 1,
    progress: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one workload sequentially after the scrape ``before``; return figures and details.

    /metrics is scraped after every request too (outside the timed windows), so each request
    has the server's own decode time beside the client's: per-request TPOT agreement, and a
    server-side decode tok/s. The result's ``_after`` is the settled scrape that closes the
    workload's window (the next one's start).
    """
    completions: list[StreamedCompletion] = []
    ids: list[str] = []
    per_request_server: list[prom.ServerTpotWindow | None] = []
    previous = before
    for repeat in range(repeats):
        for request in workload.requests:
            completion = server.stream_chat(model, request.messages, request.max_tokens, extra=extra)
            scrape = prom.fetch_settled_metrics(server.base_url, previous, 1, completion.completion_tokens)
            per_request_server.append(prom.server_tpot_window(previous, scrape))
            previous = scrape
            completions.append(completion)
            ids.append(request.request_id if repeats == 1 else f"{request.request_id}#{repeat + 1}")
            if progress:
                rate = completion.decode_tok_s
                print(
                    f"  {workload.name} {ids[-1]}: {completion.completion_tokens} tokens, "
                    f"{'n/a' if rate is None else f'{rate:.1f}'} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    after = previous
    spec = prom.spec_decode_window(before, after)
    server_tpot = prom.server_tpot_window(before, after)
    agreement = tpot_agreement(completions, server_tpot)
    per_request_agreement = [
        tpot_agreement([c], window) for c, window in zip(completions, per_request_server, strict=True)
    ]
    rates = [c.decode_tok_s for c in completions if c.decode_tok_s is not None]
    server_rates = [1.0 / a.server_tpot_s for a in per_request_agreement if a.server_tpot_s]
    ttfts = [c.ttft_s for c in completions if c.ttft_s is not None]
    request_diffs = [a.relative_difference for a in per_request_agreement if a.relative_difference is not None]
    return {
        "name": workload.name,
        "requests": len(completions),
        "tpot_relative_difference_median": statistics.median(request_diffs) if request_diffs else None,
        "requests_measured": len(rates),
        "completion_tokens": sum(c.completion_tokens for c in completions),
        "decode_tok_s_median": statistics.median(rates) if rates else None,
        "decode_tok_s_mean": statistics.fmean(rates) if rates else None,
        "server_decode_tok_s_median": statistics.median(server_rates) if server_rates else None,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "spec_decode": spec.as_dict() if spec else None,
        "server_tpot": server_tpot.as_dict() if server_tpot else None,
        "tpot_agreement": agreement.as_dict(),
        "per_request": [
            {
                "id": rid,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens": c.prompt_tokens,
                "ttft_s": c.ttft_s,
                "decode_s": c.decode_s,
                "tokens_in_window": c.tokens_in_window,
                "decode_tok_s": c.decode_tok_s,
                "server_tpot_s": a.server_tpot_s,
                "tpot_relative_difference": a.relative_difference,
                "window_clean": a.window_clean,
                "finish_reason": c.finish_reason,
            }
            for rid, c, a in zip(ids, completions, per_request_agreement, strict=True)
        ],
        "_rates": rates,
        "_server_rates": server_rates,
        "_completions": completions,
        "_after": after,
    }


def headline(outcome: dict[str, Any], tolerance: float | None = AGREEMENT_TOLERANCE) -> dict[str, Any]:
    """Which decode figure a workload reports, and why (see the module docstring).

    A request without a server-side figure to compare with counts as disagreeing: the client's
    number is reported only where the server confirms it. ``tolerance`` None turns the check off
    (the client's figure, source "client-unchecked").
    """
    timed = [r for r in outcome["per_request"] if r["decode_tok_s"] is not None]
    if tolerance is None:
        client = outcome["decode_tok_s_median"]
        return {
            "source": "client-unchecked",
            "value": client,
            "client_valid": True,
            "client_value": client,
            "server_value": outcome["server_decode_tok_s_median"],
            "tolerance": None,
            "relative_difference": outcome["tpot_agreement"]["relative_difference"],
            "agreeing_share": None,
            "disagreeing_requests": [],
        }
    outside = [
        {"id": r["id"], "relative_difference": r["tpot_relative_difference"]}
        for r in timed
        if r["tpot_relative_difference"] is None or abs(r["tpot_relative_difference"]) > tolerance
    ]
    share = 1.0 - len(outside) / len(timed) if timed else None
    overall = outcome["tpot_agreement"]["relative_difference"]
    valid = share is not None and share >= AGREEMENT_SHARE and overall is not None and abs(overall) <= tolerance
    client, server = outcome["decode_tok_s_median"], outcome["server_decode_tok_s_median"]
    return {
        "source": "client" if valid else "server",
        "value": client if valid else server,
        "client_valid": valid,
        "client_value": client,
        "server_value": server,
        "tolerance": tolerance,
        "relative_difference": overall,
        "agreeing_share": share,
        "disagreeing_requests": outside,
    }


def describe_headline(name: str, chosen: dict[str, Any]) -> str:
    """One line for the operator: which figure is the headline and, for an invalid client one, why."""
    if chosen["tolerance"] is None:
        return f"{name}: decode {_fmt(chosen['value'])} tok/s (client, not checked against the server's)"
    if chosen["client_valid"]:
        within = f"{chosen['tolerance']:.0%}"
        return f"{name}: decode {_fmt(chosen['value'])} tok/s (client, TPOT within {within} of the server's)"
    named = ", ".join(f"{r['id']} ({_fmt_pct(r['relative_difference'])})" for r in chosen["disagreeing_requests"][:6])
    more = len(chosen["disagreeing_requests"]) - 6
    return (
        f"{name}: client figure INVALID ({_fmt(chosen['client_value'])} tok/s; TPOT "
        f"{_fmt_pct(chosen['relative_difference'])} against the server's, "
        f"{len(chosen['disagreeing_requests'])} request(s) beyond {chosen['tolerance']:.0%}: {named}"
        f"{f' and {more} more' if more > 0 else ''}): headline decode {_fmt(chosen['value'])} tok/s from the "
        "server's /metrics"
    )


def summarize_request_agreement(per_request: list[dict[str, Any]], tolerance: float = 0.05) -> dict[str, Any]:
    """Per-request client/server TPOT differences: median and the share within ``tolerance``.

    Robust to the odd request whose chunks a stalled host delivered in one burst (the client
    then sees a collapsed window); such requests are counted, not hidden.
    """
    diffs = [r["tpot_relative_difference"] for r in per_request if r["tpot_relative_difference"] is not None]
    if not diffs:
        return {"requests": 0, "median_relative_difference": None, "within_tolerance_share": None}
    within = sum(1 for d in diffs if abs(d) <= tolerance)
    return {
        "requests": len(diffs),
        "median_relative_difference": statistics.median(diffs),
        "tolerance": tolerance,
        "within_tolerance_share": within / len(diffs),
        "outside_tolerance": [
            {"id": r["id"], "relative_difference": r["tpot_relative_difference"]}
            for r in per_request
            if r["tpot_relative_difference"] is not None and abs(r["tpot_relative_difference"]) > tolerance
        ],
    }


def run_decode_bench(
    server: OpenAIServer,
    model: str,
    workloads: list[Workload],
    repeats: int = 1,
    warmup: bool = True,
    progress: bool = True,
    ignore_eos: bool = False,
    tolerance: float | None = AGREEMENT_TOLERANCE,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run every workload; return (figures, details, client_cpu).

    ``ignore_eos`` (a vLLM request extension) makes every request generate max_tokens: for tiny
    sandbox models that stop early; off for real measurements.
    """
    extra = {"ignore_eos": True} if ignore_eos else None
    snapshot = prom.fetch_metrics(server.base_url)
    if warmup and workloads and workloads[0].requests:
        first = workloads[0].requests[0]
        warm = server.stream_chat(model, first.messages, min(first.max_tokens, 16), extra=extra)
        snapshot = prom.fetch_settled_metrics(server.base_url, snapshot, 1, warm.completion_tokens)
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {"workloads": [], "headline": {}}
    all_rates: list[float] = []
    all_server_rates: list[float] = []
    all_completions: list[StreamedCompletion] = []
    server_windows: list[prom.ServerTpotWindow] = []
    with CpuMeter() as cpu:
        for workload in workloads:
            outcome = run_workload(server, model, workload, snapshot, repeats=repeats, progress=progress, extra=extra)
            snapshot = outcome.pop("_after")
            rates = outcome.pop("_rates")
            all_server_rates.extend(outcome.pop("_server_rates"))
            completions = outcome.pop("_completions")
            all_rates.extend(rates)
            all_completions.extend(completions)
            if outcome["server_tpot"] is not None:
                server_windows.append(_window_from_dict(outcome["server_tpot"]))
            name = workload.name
            chosen = headline(outcome, tolerance)
            details["headline"][name] = chosen
            figures[f"decode_tok_s_median[{name}]"] = chosen["value"]
            figures[f"client_decode_tok_s_median[{name}]"] = outcome["decode_tok_s_median"]
            figures[f"server_decode_tok_s_median[{name}]"] = outcome["server_decode_tok_s_median"]
            figures[f"ttft_s_median[{name}]"] = outcome["ttft_s_median"]
            spec = outcome["spec_decode"]
            if spec is not None:
                figures[f"acceptance_length[{name}]"] = spec["acceptance_length"]
                figures[f"acceptance_rate[{name}]"] = spec["acceptance_rate"]
            figures[f"tpot_relative_difference[{name}]"] = outcome["tpot_agreement"]["relative_difference"]
            details["workloads"].append(outcome)
            if progress or not chosen["client_valid"]:
                acc = spec["acceptance_length"] if spec else None
                print(f"{describe_headline(name, chosen)}, acceptance length {_fmt(acc)}", file=sys.stderr, flush=True)
    client_overall = statistics.median(all_rates) if all_rates else None
    # the same figure from the server's own per-request decode times: the cross-check
    server_overall = statistics.median(all_server_rates) if all_server_rates else None
    valid = bool(details["headline"]) and all(h["client_valid"] for h in details["headline"].values())
    figures["decode_tok_s_median"] = client_overall if valid else server_overall
    figures["client_decode_tok_s_median"] = client_overall
    figures["server_decode_tok_s_median"] = server_overall
    figures["client_figure_invalid_workloads"] = sum(not h["client_valid"] for h in details["headline"].values())
    details["headline_source"] = "client" if valid else "server"
    overall = tpot_agreement(all_completions, _sum_windows(server_windows))
    details["tpot_agreement"] = overall.as_dict()
    per_request = [r for w in details["workloads"] for r in w["per_request"]]
    details["tpot_agreement_per_request"] = summarize_request_agreement(per_request)
    figures["tpot_relative_difference"] = overall.relative_difference
    figures["tpot_relative_difference_median"] = details["tpot_agreement_per_request"]["median_relative_difference"]
    figures["tpot_within_5pct_share"] = details["tpot_agreement_per_request"]["within_tolerance_share"]
    figures["client_cpu_share"] = cpu.share
    return figures, details, cpu.as_dict()


def _window_from_dict(data: dict[str, Any]) -> prom.ServerTpotWindow:
    return prom.ServerTpotWindow(
        requests=data["requests"],
        request_tpot_mean_s=data["request_tpot_mean_s"],
        request_tpot_median_s=data["request_tpot_median_s"],
        inter_token_mean_s=data["inter_token_mean_s"],
        decode_time_s=data["decode_time_s"],
        generation_tokens=data["generation_tokens"],
    )


def _sum_windows(windows: list[prom.ServerTpotWindow]) -> prom.ServerTpotWindow | None:
    """Combine consecutive windows (sums add; the request-weighted mean is recombined)."""
    if not windows:
        return None
    requests = sum(w.requests for w in windows)
    tpot_sum = sum((w.request_tpot_mean_s or 0.0) * w.requests for w in windows)
    decode_times = [w.decode_time_s for w in windows]
    return prom.ServerTpotWindow(
        requests=requests,
        request_tpot_mean_s=tpot_sum / requests if requests > 0 else None,
        request_tpot_median_s=None,
        inter_token_mean_s=None,
        decode_time_s=None if any(d is None for d in decode_times) else sum(d or 0.0 for d in decode_times),
        generation_tokens=sum(w.generation_tokens for w in windows),
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"
