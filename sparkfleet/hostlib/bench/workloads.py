"""Prompt sets for the benchmark clients, read from ``sparkfleet/hostlib/data/workloads/*.json``.

Standard library only. The data directory is found relative to this file, so a copied
``sparkfleet`` directory works on a serving host. A workload file is::

    {"name": "prose", "description": "...",
     "requests": [{"id": "prose-01", "messages": [{"role": "user", "content": "..."}], "max_tokens": 512}]}

``sharegpt_small.json`` is a list of ShareGPT conversations for ``vllm bench serve``, and
``agent_turns.json`` multi-turn conversations for ``bench prefix`` (sparkfleet.hostlib.bench.prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "data" / "workloads"
DECODE_WORKLOADS = ("prose", "code", "counting", "agent")
E2E_WORKLOAD = "albond_e2e"
# Conversations (sparkfleet.hostlib.bench.prefix), not lists of requests.
CONVERSATION_WORKLOADS = ("agent_turns", "agent_turns_small")
SHAREGPT_DATASET = WORKLOAD_DIR / "sharegpt_small.json"


class WorkloadError(ValueError):
    """A workload name or file that cannot be used."""


@dataclass(frozen=True)
class BenchRequest:
    """One chat request of a workload."""

    request_id: str
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named list of chat requests."""

    name: str
    description: str
    requests: list[BenchRequest]


def available_workloads() -> list[str]:
    """Names of the workload files shipped in the data directory."""
    names = []
    for path in sorted(WORKLOAD_DIR.glob("*.json")):
        if path.name != SHAREGPT_DATASET.name and path.stem not in CONVERSATION_WORKLOADS:
            names.append(path.stem)
    return names


def scaled_max_tokens(max_tokens: int, scale: float) -> int:
    """``max_tokens`` times ``scale``, rounded, at least 1 (the knob for tiny sandbox models)."""
    if scale <= 0:
        raise WorkloadError(f"max-tokens scale {scale!r} must be > 0 (1.0 keeps the reference values)")
    return max(1, round(max_tokens * scale))


def workload_path(name_or_path: str, names: list[str] | tuple[str, ...], kind: str) -> Path:
    """The file of a shipped workload (by name) or a given JSON path; a one-line error naming both kinds."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise WorkloadError(f"workload {name_or_path!r} not found; use one of {', '.join(names)} or a path to a {kind}")
    return path


def load_workload(name_or_path: str, max_tokens_scale: float = 1.0, limit: int | None = None) -> Workload:
    """Load a workload by name (``prose``) or by path to a JSON file in the workload format."""
    path = workload_path(name_or_path, available_workloads(), "workload JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        raw_requests = data["requests"]
        requests = [
            BenchRequest(
                request_id=str(item["id"]),
                messages=list(item["messages"]),
                max_tokens=scaled_max_tokens(int(item["max_tokens"]), max_tokens_scale),
            )
            for item in raw_requests
        ]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise WorkloadError(
            f"workload file {path.name} is not in the workload format ({exc}); see {__name__} docstring"
        ) from exc
    if limit is not None:
        if limit < 1:
            raise WorkloadError(f"request limit {limit!r} must be >= 1")
        requests = requests[:limit]
    if not requests:
        raise WorkloadError(f"workload file {path.name} has no requests")
    return Workload(
        name=str(data.get("name", path.stem)), description=str(data.get("description", "")), requests=requests
    )
