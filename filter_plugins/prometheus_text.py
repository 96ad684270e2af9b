"""Ansible filter over Prometheus text exposition (vLLM's ``/metrics``), for the serve_health role.

``sparkfleet_prometheus_sum(text, name)``: the sum of every sample of the metric ``name`` over all
its label sets (a vLLM server exposes one per engine), 0.0 when the metric is absent. The text is
parsed by ``sparkfleet.hostlib.bench.metrics.parse_prometheus_text`` (prometheus_client's parser, a
controller dependency): the same parser the benchmark clients use on the hosts.
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


# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.hostlib.bench import metrics as _metrics

METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def sparkfleet_prometheus_sum(text: Any, name: str) -> float:
    """Sum of the finite samples named ``name`` in Prometheus text ``text``; 0.0 if it has none.

    A sample's timestamp is ignored; ``# HELP``/``# TYPE`` lines and other metrics sharing the name
    as a prefix (``name`` + ``_other``, a counter's ``_created``) do not count.
    """
    if not isinstance(text, str):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: expected the /metrics text, got {type(text).__name__}")
    if not isinstance(name, str) or not METRIC_NAME.match(name):
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: {name!r} is not a Prometheus metric name")
    try:
        samples = _metrics.parse_prometheus_text(text)
    except _metrics.MetricsFormatError as exc:
        raise AnsibleFilterError(f"sparkfleet_prometheus_sum: {exc}") from exc
    return float(sum(sample.value for sample in samples if sample.name == name and math.isfinite(sample.value)))


class FilterModule:
    """serve_health's filters."""

    def filters(self) -> dict[str, Any]:
        return {"sparkfleet_prometheus_sum": sparkfleet_prometheus_sum}
