"""End-to-end tok/s by albond's method (the reference's ``bench_albond.py``: 51.58 / 53.7 / 59.0).

Five prompts with max_tokens 256/512/1024/64/2048, non-streaming chat
completions at temperature 0; each prompt is run twice back to back and run 1 is discarded
(warm-up). Per prompt: tok/s = completion_tokens / wall-clock of run 2, prefill included. The
headline figure ``e2e_tok_s`` is the mean over the five prompts.

``max_tokens_scale`` multiplies every max_tokens (1.0 = the method as published; e.g. 0.125 for
the tiny sandbox models). Every run carries a ``cache_salt`` of its own: on a server with prefix caching
on, run 2 would otherwise find run 1's prompt in the cache and skip the prefill the method includes
(the published figures were measured with prefix caching off). Acceptance length over the kept runs
comes from ``/metrics`` deltas (the discarded runs are outside the windows).
"""

from __future__ import annotations

import secrets
import statistics
import sys
import time
from typing import Any

from sparkfleet.hostlib.bench import metrics as prom
from sparkfleet.hostlib.bench.http_client import BenchHTTPError, CpuMeter, OpenAIServer
from sparkfleet.hostlib.bench.workloads import Workload

RUNS_PER_PROMPT = 2  # run 1 is discarded


def run_e2e_bench(
    server: OpenAIServer, model: str, workload: Workload, ignore_eos: bool = False, progress: bool = True
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run albond's method over ``workload``; return (figures, details, client_cpu)."""
    extra = {"ignore_eos": True} if ignore_eos else None
    per_prompt: list[dict[str, Any]] = []
    spec_totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    spec_seen = False
    with CpuMeter() as cpu:
        for request in workload.requests:
            runs = []
            for run_number in range(1, RUNS_PER_PROMPT + 1):
                before = prom.fetch_metrics(server.base_url) if run_number == RUNS_PER_PROMPT else None
                cold = {**(extra or {}), "cache_salt": f"sparkfleet-e2e-{secrets.token_hex(8)}"}
                start = time.perf_counter()
                response = server.chat(model, request.messages, request.max_tokens, extra=cold)
                wall_s = time.perf_counter() - start
                usage = response.get("usage") or {}
                if "completion_tokens" not in usage:
                    raise BenchHTTPError(f"response to {request.request_id} has no usage.completion_tokens")
                tokens = int(usage["completion_tokens"])
                runs.append(
                    {
                        "run": run_number,
                        "completion_tokens": tokens,
                        "wall_s": wall_s,
                        "tok_s": tokens / wall_s if wall_s > 0 else None,
                        "discarded": run_number == 1,
                    }
                )
                if before is not None:
                    after = prom.fetch_settled_metrics(server.base_url, before, 1, tokens)
                    spec = prom.spec_decode_window(before, after)
                    if spec is not None:
                        spec_seen = True
                        spec_totals["drafts"] += spec.drafts
                        spec_totals["draft_tokens"] += spec.draft_tokens
                        spec_totals["accepted_tokens"] += spec.accepted_tokens
            kept = runs[-1]
            per_prompt.append(
                {
                    "id": request.request_id,
                    "max_tokens": request.max_tokens,
                    "tok_s": kept["tok_s"],
                    "completion_tokens": kept["completion_tokens"],
                    "wall_s": kept["wall_s"],
                    "runs": runs,
                }
            )
            if progress:
                print(
                    f"  e2e {request.request_id} (max_tokens {request.max_tokens}): "
                    f"{kept['completion_tokens']} tokens in {kept['wall_s']:.2f} s "
                    f"= {kept['tok_s']:.2f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    rates = [p["tok_s"] for p in per_prompt if p["tok_s"] is not None]
    figures: dict[str, Any] = {f"e2e_tok_s[{p['id']}]": p["tok_s"] for p in per_prompt}
    figures["e2e_tok_s"] = statistics.fmean(rates) if rates else None
    acceptance_length = None
    if spec_seen and spec_totals["drafts"] > 0:
        acceptance_length = 1.0 + spec_totals["accepted_tokens"] / spec_totals["drafts"]
        figures["acceptance_length"] = acceptance_length
    figures["client_cpu_share"] = cpu.share
    details = {
        "prompts": per_prompt,
        "spec_decode": spec_totals if spec_seen else None,
        "method": "albond: non-streaming, temperature 0, 2 runs per prompt, run 1 discarded, "
        "completion_tokens / wall-clock incl. prefill, mean over prompts",
    }
    if progress:
        print(
            f"e2e: mean {figures['e2e_tok_s']:.2f} tok/s over {len(rates)} prompts"
            + (f", acceptance length {acceptance_length:.2f}" if acceptance_length else ""),
            file=sys.stderr,
            flush=True,
        )
    return figures, details, cpu.as_dict()
