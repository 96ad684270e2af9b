"""Ansible filter over Prometheus text exposition (vLLM's ``/metrics``), for the serve_health role.

``sparkfleet_prometheus_sum(text, name)``: the sum of every sample of the metric ``name`` over all
its label sets (a vLLM server exposes one per engine), 0.0 when the metric is absent. The text is
parsed by ``prometheus_client`` (a controller dependency), as ``sparkfleet.bench.metrics`` does.
"""

from __future__ import annotations

import math
import re
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # the unit tests import this file without Ansible on the path

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        """Stand-in when Ansible is not importable."""


METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def sparkfleet_prometheus_sum(text: Any, name: str) -> float:
    """Sum of the finite samples named ``name`` in Prometheus text ``text``; 0.0 if it has none.

    Other metrics sharing the name as a prefix (``name`` + ``_other``, ``_created``) do not count.
    """
    if not isinstance(text, str):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: expected the /metrics text, got {type(text).__name__}")
    if not isinstance(name, str) or not METRIC_NAME.match(name):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: {name!r} is not a Prometheus metric name")
    try:
        values = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]
    except ValueError as exc:
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: /metrics is not Prometheus text ({exc})") from exc
    return float(sum(value for value in values if math.isfinite(value)))


class FilterModule:
    """serve_health's filters."""

    def filters(self) -> dict[str, Any]:
        return {"sparkfleet_prometheus_sum": sparkfleet_prometheus_sum}
