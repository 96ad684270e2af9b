"""Minimal OpenAI-compatible HTTP client for the benchmarks (standard library only).

Streams Server-Sent Events with ``http.client`` and time-stamps every event as it is read, so
the decode window is measured from the first to the last token chunk the client receives.
Also measures the client's own CPU use, to show the client is not the bottleneck.
"""

from __future__ import annotations

import http.client
import json
import resource
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any


class BenchHTTPError(RuntimeError):
    """The server answered with an error or an unexpected body."""


@dataclass
class StreamedCompletion:
    """Timing and token counts of one streamed chat completion."""

    request_start: float  # perf_counter when the request was sent
    first_token: float | None  # perf_counter of the first chunk carrying a choice (role chunk = 1st token)
    last_token: float | None  # perf_counter of the last chunk carrying a choice
    completion_tokens: int  # from the server's usage (stream_options.include_usage)
    prompt_tokens: int
    finish_reason: str | None
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.request_start

    @property
    def decode_s(self) -> float | None:
        """First token to last token: the decode window (excludes TTFT)."""
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first / decode window; None for fewer than 2 tokens."""
        decode_s = self.decode_s
        if decode_s is None or decode_s <= 0 or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / decode_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's definition of TPOT)."""
        decode_s = self.decode_s
        if decode_s is None or self.completion_tokens < 2:
            return None
        return decode_s / (self.completion_tokens - 1)


class OpenAIServer:
    """A vLLM OpenAI-compatible server at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"base URL {base_url!r} is not http(s)://HOST:PORT; e.g. http://127.0.0.1:8000")
        if parsed.path.rstrip("/") in ("/v1",):
            base_url = base_url.rstrip("/")[: -len("/v1")]
        self.base_url = base_url.rstrip("/")
        self.parsed = urllib.parse.urlparse(self.base_url)
        self.timeout_s = timeout_s

    def _connection(self) -> http.client.HTTPConnection:
        port = self.parsed.port
        if self.parsed.scheme == "https":
            return http.client.HTTPSConnection(self.parsed.hostname or "", port, timeout=self.timeout_s)
        return http.client.HTTPConnection(self.parsed.hostname or "", port, timeout=self.timeout_s)

    def get_json(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=30) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise BenchHTTPError(f"GET {path} answered HTTP {exc.code}") from exc

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        connection = self._connection()
        try:
            connection.request(
                "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            payload = response.read().decode("utf-8")
            if response.status != 200:
                raise BenchHTTPError(f"POST {path} answered HTTP {response.status}: {payload[:300]}")
            return json.loads(payload)
        finally:
            connection.close()

    def model_info(self) -> tuple[str, str | None]:
        """The first served model: (id, root), root being the path or repo vLLM loaded."""
        data = self.get_json("/v1/models").get("data") or []
        if not data:
            raise BenchHTTPError(f"{self.base_url}/v1/models lists no model")
        return str(data[0]["id"]), data[0].get("root")

    def vllm_version(self) -> str | None:
        try:
            return str(self.get_json("/version").get("version"))
        except (BenchHTTPError, OSError, ValueError):
            return None

    def chat(
        self, model: str, messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Non-streaming chat completion at temperature 0."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        body.update(extra or {})
        return self.post_json("/v1/chat/completions", body)

    def stream_chat(
        self, model: str, messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any] | None = None
    ) -> StreamedCompletion:
        """Streaming chat completion at temperature 0 with usage in the final chunk."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(extra or {})
        connection = self._connection()
        try:
            request_start = time.perf_counter()
            connection.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(body),
                headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
            )
            response = connection.getresponse()
            if response.status != 200:
                raise BenchHTTPError(
                    f"POST /v1/chat/completions answered HTTP {response.status}: {response.read()[:300]!r}"
                )
            return _read_event_stream(response, request_start)
        finally:
            connection.close()


def _read_event_stream(response: http.client.HTTPResponse, request_start: float) -> StreamedCompletion:
    first_token: float | None = None
    last_token: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    text_parts: list[str] = []
    chunk_times: list[float] = []
    while True:
        raw = response.readline()
        if not raw:
            break
        now = time.perf_counter()
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event and not event.get("choices"):
            raise BenchHTTPError(f"server error in stream: {event['error']}")
        if event.get("usage"):
            usage = event["usage"]
        choices = event.get("choices") or []
        if choices:
            if first_token is None:
                first_token = now
            last_token = now
            chunk_times.append(now)
            choice = choices[0]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text_parts.append(delta["content"])
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
    if usage is None:
        raise BenchHTTPError(
            "stream ended without a usage chunk; the server ignored stream_options.include_usage"
        )
    return StreamedCompletion(
        request_start=request_start,
        first_token=first_token,
        last_token=last_token,
        completion_tokens=int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        finish_reason=finish_reason,
        text="".join(text_parts),
        chunk_times=chunk_times,
    )


class CpuMeter:
    """Client CPU time (user + system, this process and optionally waited-for children) vs wall time."""

    def __init__(self, include_children: bool = False) -> None:
        self.include_children = include_children
        self._cpu_start = 0.0
        self._wall_start = 0.0
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def _cpu_now(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        total = usage.ru_utime + usage.ru_stime
        if self.include_children:
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            total += children.ru_utime + children.ru_stime
        return total

    def __enter__(self) -> CpuMeter:
        self._cpu_start = self._cpu_now()
        self._wall_start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = self._cpu_now() - self._cpu_start
        self.wall_s = time.perf_counter() - self._wall_start

    @property
    def share(self) -> float | None:
        """CPU seconds per wall second (1.0 = one core busy the whole run)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict[str, object]:
        return {
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "share": self.share,
            "includes_children": self.include_children,
        }
