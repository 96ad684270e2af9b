"""A serving unit's start-up figures: what its last start took and left.

Every start of a sparkfleet unit records them in the host's state.json under ``startup`` (the unit's
``ExecStartPost=+sparkfleet-record-startup``: this start's journal, systemd's timestamps, the memory
guard's readings); benchmark results carry them, ``make status`` shows them and the report puts them
beside the figures the recipe's authors measured on a GB10 (a profile's ``reference_startup``).
"""

from __future__ import annotations

from typing import Any

from sparkfleet.hostlib.bench.results import finite_figures

GIB = 2**30

# (name, label, unit) in the order they are shown. *_gib figures are state.json's *_bytes ones.
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("ready_s", "unit start to /health", "s"),
    ("weights_load_s", "weight load", "s"),
    ("engine_init_s", "engine init (profile, KV cache, warm-up)", "s"),
    ("kv_pool_tokens", "KV pool", "tokens"),
    ("max_concurrency", "max concurrency at the context", "x"),
    ("free_at_ready_gib", "host memory available at READY", "GiB"),
    ("peak_service_gib", "memory guard: peak service memory", "GiB"),
    ("min_available_gib", "memory guard: lowest MemAvailable", "GiB"),
)
FIGURE_NAMES = tuple(name for name, _, _ in FIGURES)
_FROM_BYTES = {"free_at_ready_gib": "free_at_ready_bytes", "peak_service_gib": "peak_service_bytes",
               "min_available_gib": "min_available_bytes"}  # fmt: skip


def figures(startup: Any) -> dict[str, float]:
    """The numeric figures of a recorded ``startup`` by FIGURES' names (bytes turned into GiB)."""
    numeric = finite_figures(startup) if isinstance(startup, dict) else {}
    found = {}
    for name in FIGURE_NAMES:
        source = _FROM_BYTES.get(name, name)
        if source in numeric:
            found[name] = numeric[source] / GIB if name in _FROM_BYTES else numeric[source]
    return found


def format_figure(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name == "kv_pool_tokens":
        return f"{value:,.0f}"
    if name == "max_concurrency":
        return f"{value:.2f}x"
    if name.endswith("_gib"):
        return f"{value:.1f} GiB"
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def status_cells(startup: Any) -> dict[str, str]:
    """The status table's cells: time to /health, KV pool (max concurrency), memory available at READY."""
    found = figures(startup)
    pool = format_figure("kv_pool_tokens", found.get("kv_pool_tokens"))
    if "max_concurrency" in found:
        pool += f" ({format_figure('max_concurrency', found['max_concurrency'])})"
    return {
        "ready": format_figure("ready_s", found.get("ready_s")),
        "kv_pool": pool,
        "free_at_ready": format_figure("free_at_ready_gib", found.get("free_at_ready_gib")),
    }


def comparison_rows(startup: Any, reference: Any) -> list[tuple[str, str, str]]:
    """(label, measured, the reference's GB10 figure) for each figure measured or referenced."""
    found = figures(startup)
    ref = finite_figures(reference) if isinstance(reference, dict) else {}
    rows = []
    for name, label, _ in FIGURES:
        if name in found or name in ref:
            rows.append((label, format_figure(name, found.get(name)), format_figure(name, ref.get(name))))
    return rows


def reference_problems(where: str, value: Any) -> list[str]:
    """A profile's ``reference_startup``: figure name -> number (the reference's GB10 measurement)."""
    if not isinstance(value, dict):
        return [f"{where} must be a mapping of start-up figure -> number, got {type(value).__name__} {value!r}"]
    found = []
    numeric = finite_figures(value)
    for key, item in value.items():
        if key not in FIGURE_NAMES:
            found.append(f"{where}.{key}: not a start-up figure (one of {', '.join(FIGURE_NAMES)})")
        elif key not in numeric or item < 0:
            found.append(f"{where}.{key}: must be a number >= 0, got {item!r}")
    return found
