"""Parse vLLM's Prometheus ``/metrics`` text and compute deltas over a measurement window.

The exposition format is parsed by ``prometheus_client`` (a vLLM 0.23 requirement, so the service
venv has it; a controller dependency too): this module runs on a serving host under the service
venv's Python, and on the controller, where serve_health's ``sparkfleet_prometheus_sum`` filter
uses the same parser. Samples are read by their full names (``..._total``, ``..._bucket``,
``..._created``), not by family: prometheus_client names a counter's family without ``_total``,
and a counter's ``_created`` sample is a sample of its own, never added to the counter.

The figures taken from ``/metrics`` (metric names as vLLM 0.23 exposes them, see
``vllm/v1/spec_decode/metrics.py`` and ``vllm/v1/metrics/loggers.py``):

- speculative decoding counters ``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}``;
- the server's own latency histograms ``vllm:request_time_per_output_token_seconds`` (one
  observation per finished request: decode time / (generated tokens - 1)),
  ``vllm:inter_token_latency_seconds`` (one observation per engine step per request) and
  ``vllm:request_decode_time_seconds``; the counters ``vllm:generation_tokens_total`` and
  ``vllm:request_success_total``.

Mean acceptance length is defined as in vLLM's own ``vllm bench serve`` and in the reference's
figures (e.g. "acceptance ~3.2-3.3 of num_speculative_tokens=5"): ``1 + accepted / drafts``, i.e.
tokens emitted per verify step including the bonus/corrected token. Acceptance rate is
``accepted / draft_tokens``; per-position acceptance is ``accepted_at_position_k / drafts``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sparkfleet.hostlib.bench.http_client import get_bytes

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUEST_TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"
INTER_TOKEN_HISTOGRAM = "vllm:inter_token_latency_seconds"
DECODE_TIME_HISTOGRAM = "vllm:request_decode_time_seconds"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"


class MetricsFormatError(ValueError):
    """A ``/metrics`` line that is not Prometheus text exposition format."""


@dataclass(frozen=True)
class Sample:
    """One sample line: metric name, its labels and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        for label_key, label_value in self.labels:
            if label_key == key:
                return label_value
        return None


def _samples(text: str) -> list[Sample]:
    return [
        Sample(name=sample.name, labels=tuple(sample.labels.items()), value=float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _line_fault(line: str) -> str:
    """What is wrong with a sample line prometheus_client refused, in words (for the error message)."""
    _name, brace, rest = line.partition("{")
    if brace:
        close = rest.rfind("}")
        if close < 0:
            return "unterminated labels (unclosed '{')"
        fields = rest[close + 1 :].split()
    else:
        fields = line.split()[1:]
    if not fields:
        return "no value"
    try:
        float(fields[0])  # float() accepts +Inf, -Inf and NaN, as the format does
    except ValueError:
        return f"bad value {fields[0]!r}"
    return "bad label set" if brace else "not a sample"


def parse_prometheus_text(text: str) -> list[Sample]:
    """Parse Prometheus text exposition format into samples (comments, blank lines and timestamps
    skipped); a malformed line raises ``MetricsFormatError`` naming the line and what is wrong."""
    try:
        return _samples(text)
    except ValueError as exc:
        for raw_line in text.splitlines():  # name the line: parse them one at a time
            line = raw_line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                _samples(line + "\n")
            except ValueError as line_exc:
                raise MetricsFormatError(f"{_line_fault(line)} in /metrics line {line!r} ({line_exc})") from exc
        raise MetricsFormatError(f"/metrics is not Prometheus text exposition format: {exc}") from exc


@dataclass(frozen=True)
class Histogram:
    """A (possibly delta) histogram: cumulative bucket counts by upper bound, sum and count."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), sorted, last is +Inf
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Estimate quantile ``q`` as Prometheus' ``histogram_quantile`` does (linear in a bucket)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q!r} is outside [0, 1]; pass e.g. 0.5 for the median")
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for upper_bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper_bound):
                    return lower_bound  # as Prometheus: the highest finite bound
                in_bucket = cumulative - lower_count
                if in_bucket <= 0:
                    return upper_bound
                return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / in_bucket
            lower_bound, lower_count = upper_bound, cumulative
        return lower_bound

    def minus(self, earlier: Histogram) -> Histogram:
        """This histogram minus an earlier snapshot of the same series (the window's histogram)."""
        earlier_counts = dict(earlier.buckets)
        buckets = tuple((le, count - earlier_counts.get(le, 0.0)) for le, count in self.buckets)
        return Histogram(buckets=buckets, sum=self.sum - earlier.sum, count=self.count - earlier.count)


@dataclass
class MetricsSnapshot:
    """All samples of one ``/metrics`` scrape, with helpers that sum over label sets."""

    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def from_text(cls, text: str) -> MetricsSnapshot:
        return cls(parse_prometheus_text(text))

    def has(self, name: str) -> bool:
        return any(sample.name == name for sample in self.samples)

    def total(self, name: str, **label_filter: str) -> float:
        """Sum of every sample named ``name`` whose labels match ``label_filter`` (0 if none)."""
        total = 0.0
        for sample in self.samples:
            if sample.name != name:
                continue
            if all(sample.label(key) == value for key, value in label_filter.items()):
                total += sample.value
        return total

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Samples named ``name`` summed per value of ``label`` (e.g. per ``position``)."""
        values: dict[str, float] = {}
        for sample in self.samples:
            if sample.name == name:
                key = sample.label(label)
                if key is not None:
                    values[key] = values.get(key, 0.0) + sample.value
        return values

    def histogram(self, name: str) -> Histogram | None:
        """The histogram ``name`` summed over all its label sets (engines, models); None if absent."""
        bucket_counts: dict[float, float] = {}
        for sample in self.samples:
            if sample.name == name + "_bucket":
                le_text = sample.label("le")
                if le_text is None:
                    raise MetricsFormatError(f"histogram bucket of {name} without an le label")
                le = float(le_text)
                bucket_counts[le] = bucket_counts.get(le, 0.0) + sample.value
        if not bucket_counts:
            return None
        return Histogram(
            buckets=tuple(sorted(bucket_counts.items())),
            sum=self.total(name + "_sum"),
            count=self.total(name + "_count"),
        )


def fetch_metrics(base_url: str, timeout_s: float = 10.0) -> MetricsSnapshot:
    """Scrape ``{base_url}/metrics`` (base_url without the ``/v1`` suffix; vLLM serves it without the key)."""
    return MetricsSnapshot.from_text(get_bytes(base_url.rstrip("/") + "/metrics", timeout_s).decode("utf-8"))


def fetch_settled_metrics(
    base_url: str,
    before: MetricsSnapshot,
    expected_requests: int,
    expected_generation_tokens: int = 0,
    settle_s: float = 3.0,
) -> MetricsSnapshot:
    """Scrape until the window since ``before`` shows the expected finished requests and tokens.

    vLLM records a finished request's counters and histograms a moment after the client has
    read its last byte, so a scrape right after the response can miss the last request. Gives
    up after ``settle_s`` and returns the last scrape (the caller's checks then flag the window).
    """
    deadline = time.monotonic() + settle_s
    while True:
        after = fetch_metrics(base_url)
        finished = after.total(REQUEST_SUCCESS) - before.total(REQUEST_SUCCESS)
        tokens = after.total(GENERATION_TOKENS) - before.total(GENERATION_TOKENS)
        settled = finished >= expected_requests and tokens >= expected_generation_tokens
        if settled or time.monotonic() >= deadline:
            return after
        time.sleep(0.05)


@dataclass(frozen=True)
class SpecDecodeWindow:
    """Speculative-decoding counters over one measurement window (after minus before)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: tuple[float, ...]

    @property
    def acceptance_length(self) -> float | None:
        """Mean acceptance length: ``1 + accepted / drafts`` (tokens per verify step)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        """Fraction of drafted tokens accepted: ``accepted / draft_tokens``."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Per draft position k: ``accepted_at_k / drafts`` (fraction of drafts whose k-th token held)."""
        if self.drafts <= 0:
            return []
        return [accepted / self.drafts for accepted in self.accepted_per_position]

    def as_dict(self) -> dict[str, object]:
        """The counters (not the raw per-position ones) and the figures made of them."""
        figures = ("acceptance_length", "acceptance_rate", "per_position_acceptance")
        return {name: getattr(self, name) for name in ("drafts", "draft_tokens", "accepted_tokens", *figures)}


def spec_decode_window(before: MetricsSnapshot, after: MetricsSnapshot) -> SpecDecodeWindow | None:
    """Spec-decode counter deltas between two scrapes; None when the server does not speculate."""
    if not after.has(SPEC_DRAFTS):
        return None
    before_pos = before.by_label(SPEC_ACCEPTED_PER_POS, "position")
    after_pos = after.by_label(SPEC_ACCEPTED_PER_POS, "position")
    positions = sorted({int(key) for key in after_pos} | {int(key) for key in before_pos})
    per_position = tuple(after_pos.get(str(pos), 0.0) - before_pos.get(str(pos), 0.0) for pos in positions)
    return SpecDecodeWindow(
        drafts=after.total(SPEC_DRAFTS) - before.total(SPEC_DRAFTS),
        draft_tokens=after.total(SPEC_DRAFT_TOKENS) - before.total(SPEC_DRAFT_TOKENS),
        accepted_tokens=after.total(SPEC_ACCEPTED) - before.total(SPEC_ACCEPTED),
        accepted_per_position=per_position,
    )


def histogram_window(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> Histogram | None:
    """The histogram ``name`` over the window between two scrapes; None if the server lacks it."""
    later = after.histogram(name)
    if later is None:
        return None
    earlier = before.histogram(name)
    return later.minus(earlier) if earlier is not None else later


@dataclass(frozen=True)
class ServerTpotWindow:
    """The server's own time-per-output-token figures over a window, from its histograms."""

    requests: float
    request_tpot_mean_s: float | None  # mean over requests of decode_time / (tokens - 1)
    request_tpot_median_s: float | None  # bucket-interpolated, coarse (bucket bounds 10, 25, 50 ms...)
    inter_token_mean_s: float | None  # mean engine-step gap; > TPOT when a step emits >1 token
    decode_time_s: float | None  # summed decode time of the window's finished requests
    generation_tokens: float

    @property
    def token_weighted_tpot_s(self) -> float | None:
        """Summed decode time / tokens after each request's first: TPOT weighted by tokens."""
        tokens_after_first = self.generation_tokens - self.requests
        if self.decode_time_s is None or tokens_after_first <= 0:
            return None
        return self.decode_time_s / tokens_after_first

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "token_weighted_tpot_s": self.token_weighted_tpot_s}


def server_tpot_window(before: MetricsSnapshot, after: MetricsSnapshot) -> ServerTpotWindow | None:
    """The server's TPOT histograms over the window; None if it exposes no TPOT histogram."""
    tpot = histogram_window(before, after, REQUEST_TPOT_HISTOGRAM)
    if tpot is None:
        return None
    inter_token = histogram_window(before, after, INTER_TOKEN_HISTOGRAM)
    decode_time = histogram_window(before, after, DECODE_TIME_HISTOGRAM)
    return ServerTpotWindow(
        requests=tpot.count,
        request_tpot_mean_s=tpot.mean,
        request_tpot_median_s=tpot.quantile(0.5),
        inter_token_mean_s=inter_token.mean if inter_token else None,
        # every inter-token gap of a request sums to its decode time: a fallback for the same figure
        decode_time_s=decode_time.sum if decode_time else (inter_token.sum if inter_token else None),
        generation_tokens=after.total(GENERATION_TOKENS) - before.total(GENERATION_TOKENS),
    )
