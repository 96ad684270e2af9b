"""``vllm serve`` of a tiny model on vLLM's 0.23 CPU build, as the live tests start it (test_bench_live.py,
test_dflash_cpu.py): the argument list and environment they share. Stop a server with
tests/gpu/process_group.py's ``stop_group``: it leads its own process group."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def serve_argv(model: Path, served_name: str, port: int, *extra: str) -> list[str]:
    """``vllm serve MODEL`` (this interpreter's vLLM) on 127.0.0.1:``port``, eager, within what a 2-core
    machine serves (a 512-token context and step, 2 sequences), then ``extra``."""
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
        "--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "512", *extra,
    ]  # fmt: skip


def serve_env(cache: Path, pythonpath: str) -> dict[str, str]:
    """This process's environment for a CPU server: offline, its compile cache in ``cache``, ``pythonpath``."""
    return dict(
        os.environ,
        PYTHONPATH=pythonpath,
        VLLM_CPU_KVCACHE_SPACE="1",
        # the CPU sampler's torch.compile of its random-sampling helper costs ~24 s a start (eager: same math)
        TORCHDYNAMO_DISABLE="1",
        # engine core and worker forked, not spawned: no second and third import of torch and vLLM
        # (CPU patch 0006 keeps the setting)
        VLLM_WORKER_MULTIPROC_METHOD="fork",
        VLLM_CACHE_ROOT=str(cache),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
