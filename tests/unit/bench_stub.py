"""A tiny OpenAI-compatible HTTP server stub for the benchmark client tests (tests only).

It streams ``tokens`` chunks with a fixed gap, after a fixed prefill delay, and keeps
Prometheus counters and histograms the way vLLM names them, fed from its own timings, so the
clients' arithmetic (decode window, acceptance length, TPOT agreement, run-1 discard) can be
checked against known values. It records finished requests a moment after the response ends,
as vLLM does, to exercise the clients' settle logic.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sparkfleet.hostlib.bench import main as bench_main

TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
CHARS_PER_TOKEN = 4
CACHE_BLOCK_TOKENS = 16


class StubState:
    """Counters the stub exposes on /metrics and what it saw."""

    def __init__(
        self,
        token_gap_s: float,
        prefill_s: float,
        accepted_per_step: int,
        draft_len: int,
        first_run_extra_s: float,
        record_delay_s: float,
        merge_first: int,
        burst: bool = False,
        api_key: str | None = None,
        prefix_caching: bool = False,
        wrong_when_cached: bool = False,
    ) -> None:
        self.lock = threading.Lock()
        # Prefix caching as vLLM does it, coarsely: a prompt is its messages' text, 4 characters a token,
        # cached in blocks of CACHE_BLOCK_TOKENS under the request's cache_salt (with the answer once it
        # is done); a hit skips that share of the prefill. ``wrong_when_cached`` answers a request that
        # hit differently (the fault a prefix-cache bug shows).
        self.prefix_caching = prefix_caching
        self.wrong_when_cached = wrong_when_cached
        self.cached: dict[str | None, list[str]] = {}
        self.cache_queries = 0.0
        self.cache_hits = 0.0
        self.api_key = api_key  # as vLLM's --api-key: /v1 answers 401 without "Bearer <key>"
        self.refused = 0
        self.merge_first = merge_first
        self.burst = burst
        self.token_gap_s = token_gap_s
        self.prefill_s = prefill_s
        self.accepted_per_step = accepted_per_step
        self.draft_len = draft_len
        self.first_run_extra_s = first_run_extra_s
        self.record_delay_s = record_delay_s
        self.seen_prompts: dict[str, int] = {}
        self.max_tokens_seen: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.counters = {
            "success": 0.0,
            "generation_tokens": 0.0,
            "drafts": 0.0,
            "draft_tokens": 0.0,
            "accepted": 0.0,
        }
        self.per_pos = [0.0] * draft_len
        self.hist: dict[str, dict[str, Any]] = {
            name: {"buckets": [0.0] * (len(TPOT_BUCKETS) + 1), "sum": 0.0, "count": 0.0}
            for name in (
                "vllm:request_time_per_output_token_seconds",
                "vllm:request_decode_time_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:time_to_first_token_seconds",
            )
        }
        self.extra_requests = 0  # simulate foreign traffic: counted on /metrics, not sent by the client

    def observe(self, name: str, value: float) -> None:
        hist = self.hist[name]
        for index, bound in enumerate(TPOT_BUCKETS):
            if value <= bound:
                hist["buckets"][index] += 1
        hist["buckets"][-1] += 1
        hist["sum"] += value
        hist["count"] += 1

    def prompt_hit_tokens(self, salt: str | None, prompt: str) -> tuple[int, int]:
        """(prompt tokens, tokens found in the cache under ``salt``): whole blocks of a cached text."""
        tokens = len(prompt) // CHARS_PER_TOKEN
        if not self.prefix_caching:
            return tokens, 0
        best = 0
        with self.lock:
            for text in self.cached.get(salt, []):
                common = 0
                for a, b in zip(text, prompt, strict=False):
                    if a != b:
                        break
                    common += 1
                best = max(best, common)
        hit_blocks = min(best, len(prompt) - 1) // CHARS_PER_TOKEN // CACHE_BLOCK_TOKENS
        return tokens, hit_blocks * CACHE_BLOCK_TOKENS

    def remember(self, salt: str | None, text: str) -> None:
        if self.prefix_caching:
            with self.lock:
                self.cached.setdefault(salt, []).append(text)

    def record(
        self,
        tokens: int,
        first: float,
        last: float,
        gaps: list[float],
        ttft: float | None = None,
        queries: int = 0,
        hits: int = 0,
    ) -> None:
        with self.lock:
            if ttft is not None:
                self.observe("vllm:time_to_first_token_seconds", ttft)
            self.cache_queries += queries
            self.cache_hits += hits
            requests = 1 + self.extra_requests
            self.counters["success"] += requests
            self.counters["generation_tokens"] += tokens
            decode = last - first
            self.observe("vllm:request_decode_time_seconds", decode)
            self.observe("vllm:request_time_per_output_token_seconds", decode / (tokens - 1) if tokens > 1 else 0.0)
            for gap in gaps:
                self.observe("vllm:inter_token_latency_seconds", gap)
            for _ in range(self.extra_requests):  # foreign requests: one token each
                self.counters["generation_tokens"] += 1
                self.observe("vllm:request_decode_time_seconds", 0.0)
                self.observe("vllm:request_time_per_output_token_seconds", 0.0)
            steps = max(1, (tokens - 1) // (self.accepted_per_step + 1))
            self.counters["drafts"] += steps
            self.counters["draft_tokens"] += steps * self.draft_len
            self.counters["accepted"] += steps * self.accepted_per_step
            for pos in range(min(self.accepted_per_step, self.draft_len)):
                self.per_pos[pos] += steps

    def metrics_text(self) -> str:
        with self.lock:
            labels = 'engine="0",model_name="stub"'
            lines = [
                "# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter",
                f'vllm:request_success_total{{{labels},finished_reason="length"}} {self.counters["success"]}',
                f'vllm:request_success_total{{{labels},finished_reason="stop"}} 0.0',
                f"vllm:generation_tokens_total{{{labels}}} {self.counters['generation_tokens']}",
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {self.counters['drafts']}",
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {self.counters['draft_tokens']}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {self.counters['accepted']}",
                f"vllm:prefix_cache_queries_total{{{labels}}} {self.cache_queries}",
                f"vllm:prefix_cache_hits_total{{{labels}}} {self.cache_hits}",
            ]
            for pos, value in enumerate(self.per_pos):
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} {value}')
            for name, hist in self.hist.items():
                lines.append(f"# TYPE {name} histogram")
                for bound, count in zip([*TPOT_BUCKETS, "+Inf"], hist["buckets"], strict=True):
                    lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {count}')
                lines.append(f"{name}_sum{{{labels}}} {hist['sum']}")
                lines.append(f"{name}_count{{{labels}}} {hist['count']}")
            return "\n".join(lines) + "\n"


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    """One whole response: the status, its type and length, the body."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def make_handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            send(self, status, body, content_type)

        def _refused(self) -> bool:
            if state.api_key is None or not self.path.startswith("/v1"):
                return False
            if self.headers.get("Authorization") == f"Bearer {state.api_key}":
                return False
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.refused += 1
            self._send(401, b'{"error": "Unauthorized"}', "application/json")
            return True

        def do_GET(self) -> None:
            if self._refused():
                return
            if self.path == "/v1/models":
                body = {"data": [{"id": "stub", "root": "/models/hub/models--org--stub/snapshots/" + "a" * 40}]}
                self._send(200, json.dumps(body).encode(), "application/json")
            elif self.path == "/version":
                self._send(200, b'{"version": "0.23.0+stub"}', "application/json")
            elif self.path == "/metrics":
                self._send(200, state.metrics_text().encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}", "application/json")

        def do_POST(self) -> None:
            if self._refused():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.bodies.append(body)
            max_tokens = int(body["max_tokens"])
            state.max_tokens_seen.append(max_tokens)
            key = json.dumps(body["messages"], sort_keys=True)
            with state.lock:
                state.seen_prompts[key] = state.seen_prompts.get(key, 0) + 1
                first_time = state.seen_prompts[key] == 1
            if body.get("temperature") != 0.0:
                self._send(400, b'{"error": "stub wants temperature 0"}', "application/json")
                return
            tokens = max_tokens
            arrived = time.perf_counter()
            salt = body.get("cache_salt")
            prompt = "".join(str(m.get("content", "")) for m in body["messages"])
            prompt_tokens, hits = state.prompt_hit_tokens(salt, prompt)
            uncached = 1.0 - hits / prompt_tokens if prompt_tokens else 1.0
            time.sleep(state.prefill_s * uncached + (state.first_run_extra_s if first_time else 0.0))
            letter = "u" if state.wrong_when_cached and hits else "t"
            self.cache = {"arrived": arrived, "queries": prompt_tokens, "hits": hits, "salt": salt, "prompt": prompt}
            if body.get("stream"):
                self._stream(tokens, bool((body.get("stream_options") or {}).get("continuous_usage_stats")), letter)
            else:
                first = time.perf_counter()
                time.sleep(state.token_gap_s * (tokens - 1))
                last = time.perf_counter()
                payload = {
                    "choices": [{"message": {"content": "x" * tokens}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": self.cache["queries"], "completion_tokens": tokens},
                }
                self._send(200, json.dumps(payload).encode(), "application/json")
                state.remember(salt, prompt + "x" * tokens)
                self._record_later(tokens, first, last, [state.token_gap_s] * (tokens - 1))

        def _chunk(self, data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        def _stream(self, tokens: int, continuous: bool, letter: str = "t") -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(content: str | None, generated: int, finish: str | None = None) -> None:
                delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
                event: dict[str, Any] = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                if continuous:
                    event["usage"] = {"prompt_tokens": self.cache["queries"], "completion_tokens": generated}
                self._chunk(json.dumps(event))

            # token 1 is ready now (vLLM's first_token_ts); like a lagging API server, the stub
            # may hold it back and send the first merge_first tokens together in one chunk
            token_times = [time.perf_counter()]
            if state.burst:  # a stalled API server: tokens generated on time, delivered at the end in a burst
                for _ in range(tokens - 1):
                    time.sleep(state.token_gap_s)
                    token_times.append(time.perf_counter())
                send(None, 0)
                for index in range(tokens):
                    send(letter, index + 1, "length" if index == tokens - 1 else None)
                self._finish(tokens, token_times, letter)
                return
            merged = min(state.merge_first, tokens)
            for _ in range(merged - 1):
                time.sleep(state.token_gap_s)
                token_times.append(time.perf_counter())
            send(None, 0)
            send(letter * merged, merged, "length" if merged == tokens else None)
            for index in range(merged, tokens):
                time.sleep(state.token_gap_s)
                token_times.append(time.perf_counter())
                send(letter, index + 1, "length" if index == tokens - 1 else None)
            self._finish(tokens, token_times, letter)

        def _finish(self, tokens: int, token_times: list[float], letter: str = "t") -> None:
            usage = {"prompt_tokens": self.cache["queries"], "completion_tokens": tokens}
            state.remember(self.cache["salt"], self.cache["prompt"] + letter * tokens)
            self._chunk(json.dumps({"choices": [], "usage": usage}))
            self._chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
            self._record_later(tokens, token_times[0], token_times[-1], gaps)

        def _record_later(self, tokens: int, first: float, last: float, gaps: list[float]) -> None:
            cache = getattr(self, "cache", None) or {}
            args = (tokens, first, last, gaps, first - cache["arrived"] if cache else None)
            kwargs = {"queries": cache.get("queries", 0), "hits": cache.get("hits", 0)}
            timer = threading.Timer(state.record_delay_s, state.record, args=args, kwargs=kwargs)
            timer.daemon = True
            timer.start()

    return Handler


class StubServer:
    """Context manager running the stub on 127.0.0.1 on a free port."""

    def __init__(
        self,
        token_gap_s: float = 0.004,
        prefill_s: float = 0.05,
        accepted_per_step: int = 2,
        draft_len: int = 3,
        first_run_extra_s: float = 0.0,
        record_delay_s: float = 0.05,
        merge_first: int = 1,
        burst: bool = False,
        api_key: str | None = None,
        prefix_caching: bool = False,
        wrong_when_cached: bool = False,
    ) -> None:
        self.state = StubState(
            token_gap_s,
            prefill_s,
            accepted_per_step,
            draft_len,
            first_run_extra_s,
            record_delay_s,
            merge_first,
            burst=burst,
            api_key=api_key,
            prefix_caching=prefix_caching,
            wrong_when_cached=wrong_when_cached,
        )
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def run_bench(self, method: str, out: Path, *flags: str) -> int:
        """``sparkfleet.hostlib.bench METHOD`` against this stub, quiet, its result written to ``out``: the exit
        status."""
        return bench_main([method, "--base-url", self.base_url, "--quiet", "--out", str(out), *flags])

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
