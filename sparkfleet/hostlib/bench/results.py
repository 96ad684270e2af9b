"""Benchmark result JSON: its schema, writing, loading and comparison with a profile's baselines.

Standard library only. One result file per benchmark run::

    {
      "schema": "sparkfleet-bench/1",
      "kind": "decode" | "e2e" | "serving" | "prefix",
      "host": "spark-01",                 # --host-label, else the machine's host name
      "profile": "dflash",                # --profile (the sparkfleet serving profile)
      "patch_set": "sf1-3a9c...",         # --patch-set (id of the vLLM patch series), or null
      "model": {"served_name": "qwen", "root": "<path or repo vLLM loaded>", "revision": "<40 hex>"},
      "drafter": {"revision": "<40 hex>"} ,   # or {"revision": null} without speculation
      "vllm_version": "0.23.0+...",       # from the server's GET /version
      "utc_time": "2026-06-24T10:00:00Z", # when the run started
      "base_url": "http://127.0.0.1:8000",
      "settings": {...},                  # the knobs of the run (workloads, max_tokens scale, ...)
      "figures": {"decode_tok_s_median": 81.2, "decode_tok_s_median[agent]": 80.1, ...},
      "client_cpu": {"cpu_s": 1.2, "wall_s": 60.0, "share": 0.02, "includes_children": false},
      "details": {...},                   # per-kind breakdown (per workload / prompt / server window)
      "comparison": {"tolerance_pct": 5, "passed": true, "checks": [...]}   # only with baselines
    }

``figures`` is flat: every number a baseline can name. Names used by the clients:

- decode: ``decode_tok_s_median`` (median over all requests), ``decode_tok_s_median[<workload>]``,
  ``acceptance_length[<workload>]``, ``acceptance_rate[<workload>]``, ``ttft_s_median[<workload>]``,
  ``tpot_relative_difference`` (client vs server TPOT over the same window), ``client_cpu_share``;
- e2e: ``e2e_tok_s`` (mean over the prompts), ``e2e_tok_s[<prompt id>]``, ``acceptance_length``;
- serving: ``serving_output_tok_s``, ``serving_request_throughput``, ``serving_ttft_ms_median``,
  ``serving_ttft_ms_p99``, ``serving_tpot_ms_median``, ``serving_tpot_ms_p99``, ``serving_itl_ms_median``,
  ``serving_itl_ms_p99``, ``acceptance_length``, ``acceptance_rate``.

A baseline compares one figure: throughputs and acceptance must not fall more than
``tolerance_pct`` below it; latencies (names with ``ttft``, ``tpot``, ``itl``, ``_ms``) must not
rise more than ``tolerance_pct`` above it.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA = "sparkfleet-bench/1"
KINDS = ("decode", "e2e", "serving", "prefix")
LOWER_IS_BETTER_MARKERS = ("ttft", "tpot", "itl", "_ms", "latency")


class ResultError(ValueError):
    """A result file or baseline that cannot be used."""


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_result(
    kind: str,
    *,
    base_url: str,
    host: str | None,
    profile: str | None,
    patch_set: str | None,
    served_name: str | None,
    model_root: str | None,
    model_revision: str | None,
    drafter_revision: str | None,
    vllm_version: str | None,
    settings: dict[str, Any],
    utc_time: str | None = None,
    startup: dict[str, Any] | None = None,
    startup_reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A result skeleton with the run's identity filled in; the caller adds figures and details."""
    if kind not in KINDS:
        raise ResultError(f"result kind {kind!r} is not one of {', '.join(KINDS)}")
    return {
        "schema": SCHEMA,
        "kind": kind,
        "host": host or socket.gethostname(),
        "profile": profile,
        "patch_set": patch_set,
        "model": {"served_name": served_name, "root": model_root, "revision": model_revision},
        "drafter": {"revision": drafter_revision},
        "vllm_version": vllm_version,
        "utc_time": utc_time or utc_now(),
        "base_url": base_url,
        "settings": settings,
        # the serving unit's last start (state.json's "startup": time to /health, KV pool, memory)
        "startup": startup or {},
        # the profile's reference_startup: the same figures measured on a GB10 by the recipe's authors
        "startup_reference": startup_reference or {},
        "figures": {},
        "client_cpu": {},
        "details": {},
    }


def finite_figures(figures: dict[str, Any]) -> dict[str, float]:
    """Only the numeric, finite figures (None or NaN ones are dropped)."""
    kept = {}
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            kept[name] = float(value)
    return kept


def validate_result(result: Any, source: str = "result") -> dict[str, Any]:
    """Check a loaded result against the schema; raise ResultError naming what is wrong."""
    if not isinstance(result, dict):
        raise ResultError(f"{source}: not a JSON object")
    if result.get("schema") != SCHEMA:
        raise ResultError(f"{source}: schema {result.get('schema')!r} is not {SCHEMA!r}")
    if result.get("kind") not in KINDS:
        raise ResultError(f"{source}: kind {result.get('kind')!r} is not one of {', '.join(KINDS)}")
    for key in ("host", "utc_time"):
        if not isinstance(result.get(key), str) or not result[key]:
            raise ResultError(f"{source}: missing {key!r}")
    if not isinstance(result.get("figures"), dict):
        raise ResultError(f"{source}: 'figures' must be an object of name -> number")
    return result


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(validate_result(result), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def default_result_name(result: dict[str, Any]) -> str:
    stamp = result["utc_time"].replace("-", "").replace(":", "")
    profile = result.get("profile") or "noprofile"
    return f"{result['host']}_{profile}_{result['kind']}_{stamp}.json"


def load_result(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path.name}: not JSON ({exc})") from exc
    return validate_result(data, path.name)


def load_baselines(spec: str) -> dict[str, float]:
    """Baselines from a JSON object string or a path to a JSON file (name -> number)."""
    text = spec
    if not spec.lstrip().startswith("{"):
        path = Path(spec)
        if not path.is_file():
            raise ResultError(f"baselines {spec!r} is neither a JSON object nor a file; e.g. '{{\"e2e_tok_s\": 53.7}}'")
        text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultError(f"baselines {spec[:80]!r} are not valid JSON ({exc})") from exc
    if isinstance(data, dict) and "baselines" in data and isinstance(data["baselines"], dict):
        data = data["baselines"]
    if not isinstance(data, dict):
        raise ResultError("baselines must be a JSON object of figure name -> number")
    baselines = {}
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ResultError(f"baseline {name!r} = {value!r} is not a finite number")
        baselines[str(name)] = float(value)
    return baselines


def lower_is_better(figure: str) -> bool:
    return any(marker in figure for marker in LOWER_IS_BETTER_MARKERS)


@dataclass(frozen=True)
class Check:
    """One figure compared with its baseline."""

    figure: str
    baseline: float
    measured: float | None
    passed: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_figure(figure: str, measured: float | None, baseline: float, tolerance_pct: float) -> Check:
    """Compare one figure with its baseline, allowing ``tolerance_pct`` in the bad direction."""
    if measured is None:
        return Check(figure, baseline, None, False, f"{figure}: not measured in this run (baseline {baseline:g})")
    if baseline == 0:
        change_pct = 0.0 if measured == 0 else math.copysign(math.inf, measured)
    else:
        change_pct = (measured - baseline) / abs(baseline) * 100.0
    if lower_is_better(figure):
        passed = change_pct <= tolerance_pct
        direction = "above" if change_pct > 0 else "below"
        rule = f"may be at most {tolerance_pct:g}% above"
    else:
        passed = change_pct >= -tolerance_pct
        direction = "below" if change_pct < 0 else "above"
        rule = f"may be at most {tolerance_pct:g}% below"
    verdict = "ok" if passed else "REGRESSION"
    reason = (
        f"{figure}: {measured:.4g} vs baseline {baseline:.4g} ({abs(change_pct):.1f}% {direction}; {rule}) {verdict}"
    )
    return Check(figure, baseline, measured, passed, reason)


def compare_with_baselines(result: dict[str, Any], baselines: dict[str, float], tolerance_pct: float) -> dict[str, Any]:
    """Compare a result's figures with baselines; baselines naming figures of another kind are skipped.

    A baseline applies to a result when its figure name is one this kind of run produces
    (the prefix before ``[``); e.g. ``e2e_tok_s`` is skipped for a decode result.
    """
    if tolerance_pct < 0:
        raise ResultError(f"tolerance {tolerance_pct!r}% must be >= 0, e.g. 5")
    figures = finite_figures(result.get("figures", {}))
    produced_prefixes = {name.split("[", 1)[0] for name in result.get("figures", {})}
    checks = []
    skipped = []
    for name, baseline in sorted(baselines.items()):
        if name.split("[", 1)[0] not in produced_prefixes:
            skipped.append(name)
            continue
        checks.append(compare_figure(name, figures.get(name), baseline, tolerance_pct))
    return {
        "tolerance_pct": tolerance_pct,
        "passed": all(check.passed for check in checks),
        "checks": [check.as_dict() for check in checks],
        "skipped_other_kind": skipped,
    }
