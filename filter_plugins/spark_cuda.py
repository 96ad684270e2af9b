"""Filter ``spark_wheel_cuda_check``: does the wheel's recorded CUDA code run on this host's GPU?

``manifest.cuda | spark_wheel_cuda_check(spark_gpu.compute_cap)`` returns sparkfleet.build.cuda_arch.check's
dict: ``ok``, ``checked`` (false for a manifest with no CUDA code recorded: a CPU wheel), ``native``,
``jit`` and ``none`` (binary (code) strings) and ``reason``.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.build import cuda_arch as _cuda_arch


def spark_wheel_cuda_check(cuda: Any, compute_cap: Any) -> dict[str, Any]:
    try:
        return _cuda_arch.check(dict(cuda) if cuda else None, str(compute_cap))
    except (ValueError, TypeError, AttributeError) as exc:
        raise AnsibleFilterError(f"spark_wheel_cuda_check: {exc}") from exc


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"spark_wheel_cuda_check": spark_wheel_cuda_check}
