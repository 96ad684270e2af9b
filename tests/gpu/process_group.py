"""Stopping a server started as the leader of its own process group (``start_new_session=True``), as the
CUDA smoke's runner (tests/gpu/cuda_smoke.py, standard library only, on the GPU machine) and the live
vLLM tests (tests/vllm) start ``vllm serve``: its engine core and workers share the group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_group(process: subprocess.Popen, grace_s: float = 20, reap_s: float | None = 10) -> None:
    """SIGTERM the group ``process`` leads, SIGKILL it if the leader has not exited within ``grace_s``, and
    reap the leader (waiting ``reap_s`` at most; None: as long as it takes); then SIGKILL whatever is left
    of the group, so that no engine core or worker outlives the server."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=reap_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
