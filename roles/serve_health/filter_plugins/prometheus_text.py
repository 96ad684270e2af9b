"""Ansible filter over Prometheus text exposition (vLLM's ``/metrics``), for the serve_health role.

``sparkfleet_prometheus_sum(text, name)``: the sum of every sample of the metric ``name`` over all
its label sets (a vLLM server exposes one per engine), 0.0 when the metric is absent. Pure and
standard library only; the same parsing rules as ``sparkfleet.bench.metrics``.
"""

from __future__ import annotations

import math
import re
from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # the unit tests import this file without Ansible on the path

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        """Stand-in when Ansible is not importable."""


METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def sparkfleet_prometheus_sum(text: Any, name: str) -> float:
    """Sum of the samples of metric ``name`` in Prometheus text ``text``; 0.0 if it has none.

    A sample line is ``name{labels} value`` or ``name value`` (an optional timestamp after the value
    is ignored). ``# HELP``/``# TYPE`` lines and other metrics (e.g. ``name`` + ``_created``) are skipped.
    """
    if not isinstance(text, str):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: expected the /metrics text, got {type(text).__name__}")
    if not isinstance(name, str) or not METRIC_NAME.match(name):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: {name!r} is not a Prometheus metric name")
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                raise AnsibleFilterError(f"sparkfleet_prometheus_sum: unterminated labels in {line[:120]!r}")
            rest = rest[close + 1 :]
        elif not rest.startswith((" ", "\t")):
            continue  # another metric sharing the prefix
        fields = rest.split()
        if not fields:
            raise AnsibleFilterError(f"sparkfleet_prometheus_sum: no value in {line[:120]!r}")
        try:
            value = float(fields[0])
        except ValueError as exc:
            raise AnsibleFilterError(f"sparkfleet_prometheus_sum: value {fields[0]!r} in {line[:120]!r}") from exc
        if math.isfinite(value):
            total += value
    return total


class FilterModule:
    """serve_health's filters."""

    def filters(self) -> dict[str, Any]:
        return {"sparkfleet_prometheus_sum": sparkfleet_prometheus_sum}
