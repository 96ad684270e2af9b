"""Serving benchmark on a ShareGPT-format dataset through ``vllm bench serve``, swept over concurrencies.

``run_serving_sweep`` runs it once per concurrency (by default 1, 2, 3 up to the profile's
``max-num-seqs``, and that: 1, 2, 3, 8 for the conc-8 profile); the result's headline figures are the
highest concurrency's (the ones baselines name), and every concurrency's TTFT, TPOT, output tok/s
(aggregate, and per stream: 1000 / median TPOT, what one request sees while it decodes) and
acceptance are figures of their own, ``<figure>[conc<N>]`` (acceptance as ``serving_acceptance_length[conc<N>]``).

Runs vLLM's own client (it ships with the service venv's vLLM) as a subprocess, so its TTFT,
TPOT and ITL are vLLM's definitions; then reads its ``--save-result`` JSON and adds the
speculative-decoding acceptance (rate, mean length, per position) from ``/metrics`` deltas
taken around the run. Flags used, as vLLM 0.23's ``vllm/benchmarks/serve.py`` and
``vllm/benchmarks/datasets/datasets.py`` define them: ``--backend openai-chat`` (with
``--endpoint /v1/chat/completions``) or ``vllm``, ``--base-url``, ``--model``,
``--served-model-name``, ``--tokenizer``, ``--dataset-name sharegpt``, ``--dataset-path``,
``--num-prompts``, ``--max-concurrency``, ``--temperature 0`` (0.23 no longer defaults to greedy),
``--sharegpt-output-len``, ``--seed``, ``--disable-tqdm``, ``--percentile-metrics ttft,tpot,itl``,
``--metric-percentiles 50,99``, ``--save-result``, ``--result-dir``, ``--result-filename``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sparkfleet.hostlib.bench import metrics as prom
from sparkfleet.hostlib.bench.http_client import CpuMeter

BACKEND_ENDPOINTS = {"openai-chat": "/v1/chat/completions", "vllm": "/v1/completions"}
LATENCY_FIGURES = ("ttft", "tpot", "itl")


class ServingBenchError(RuntimeError):
    """``vllm bench serve`` failed or wrote no usable result."""


def default_vllm_command() -> list[str]:
    """vLLM's CLI under the Python running this module (the service venv's on a serving host)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def build_serve_argv(
    *,
    vllm_command: list[str],
    base_url: str,
    model: str,
    served_model_name: str,
    dataset_path: str,
    result_dir: str,
    result_filename: str,
    tokenizer: str | None = None,
    backend: str = "openai-chat",
    num_prompts: int = 64,
    max_concurrency: int = 8,
    output_len: int | None = None,
    seed: int = 0,
) -> list[str]:
    """The ``vllm bench serve`` argument list for one run (an argument list, never a shell string)."""
    if backend not in BACKEND_ENDPOINTS:
        raise ServingBenchError(f"backend {backend!r} is not one of {', '.join(BACKEND_ENDPOINTS)}")
    if num_prompts < 1 or max_concurrency < 1:
        raise ServingBenchError(f"num-prompts {num_prompts} and max-concurrency {max_concurrency} must both be >= 1")
    argv = [
        *vllm_command,
        "bench",
        "serve",
        "--backend",
        backend,
        "--endpoint",
        BACKEND_ENDPOINTS[backend],
        "--base-url",
        base_url,
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        dataset_path,
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency),
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--percentile-metrics",
        ",".join(LATENCY_FIGURES),
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_filename,
    ]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if output_len is not None:
        argv += ["--sharegpt-output-len", str(output_len)]
    return argv


def figures_from_vllm_result(data: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a ``vllm bench serve`` result JSON, renamed for sparkfleet."""
    if "completed" not in data or "output_throughput" not in data:
        raise ServingBenchError(
            "vllm bench serve result lacks 'completed'/'output_throughput'; was --save-result honoured?"
        )
    figures: dict[str, Any] = {
        "serving_output_tok_s": data.get("output_throughput"),
        "serving_request_throughput": data.get("request_throughput"),
        "serving_total_tok_s": data.get("total_token_throughput"),
        "serving_completed": data.get("completed"),
        "serving_failed": data.get("failed"),
    }
    for metric in LATENCY_FIGURES:
        figures[f"serving_{metric}_ms_mean"] = data.get(f"mean_{metric}_ms")
        figures[f"serving_{metric}_ms_median"] = data.get(f"median_{metric}_ms", data.get(f"p50_{metric}_ms"))
        figures[f"serving_{metric}_ms_p99"] = data.get(f"p99_{metric}_ms")
    return figures


# per-request lists vllm writes; dropped from the stored copy (kept: every summary figure)
BULKY_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


def run_serving_bench(
    *,
    base_url: str,
    dataset_path: str,
    vllm_command: list[str] | None = None,
    timeout_s: float = 3600.0,
    api_key: str | None = None,
    **request: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run ``vllm bench serve``; return (figures, details, client_cpu). ``request``: the rest of
    ``build_serve_argv``'s keywords (model, served_model_name, tokenizer, backend, num_prompts,
    max_concurrency, output_len, seed). With ``api_key``, vLLM's client gets it in its environment
    (OPENAI_API_KEY, which it sends as the bearer token), not in argv."""
    if not Path(dataset_path).is_file():
        raise ServingBenchError(f"dataset {dataset_path!r} not found; pass a ShareGPT-format JSON file")
    with tempfile.TemporaryDirectory(prefix="sparkfleet-serve-") as result_dir:
        result_filename = "vllm-bench-serve.json"
        argv = build_serve_argv(
            vllm_command=vllm_command or default_vllm_command(),
            base_url=base_url,
            dataset_path=dataset_path,
            result_dir=result_dir,
            result_filename=result_filename,
            **request,
        )
        before = prom.fetch_metrics(base_url)
        with CpuMeter(include_children=True) as cpu:
            env = {**os.environ, "OPENAI_API_KEY": api_key} if api_key else None
            completed = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
        result_path = Path(result_dir) / result_filename
        if completed.returncode != 0 or not result_path.is_file():
            tail = (completed.stderr or completed.stdout or "").strip().splitlines()[-5:]
            raise ServingBenchError(
                f"vllm bench serve exited {completed.returncode} without a result: " + " | ".join(tail)
            )
        data = json.loads(result_path.read_text(encoding="utf-8"))
    figures = figures_from_vllm_result(data)
    after = prom.fetch_settled_metrics(base_url, before, int(data.get("completed") or 0))
    spec = prom.spec_decode_window(before, after)
    if spec is not None:
        figures["acceptance_length"] = spec.acceptance_length
        figures["acceptance_rate"] = spec.acceptance_rate
    figures["client_cpu_share"] = cpu.share
    details = {
        "command": argv,
        "vllm_result": {key: value for key, value in data.items() if key not in BULKY_KEYS},
        "spec_decode": spec.as_dict() if spec else None,
        # vllm bench serve's own reading of the same counters (its window excludes its start-up)
        "vllm_reported_spec_decode": {
            "acceptance_length": data.get("spec_decode_acceptance_length"),
            "acceptance_rate_pct": data.get("spec_decode_acceptance_rate"),
            "per_position_acceptance": data.get("spec_decode_per_position_acceptance_rates"),
        },
        "client_cpu_note": "vllm bench serve runs as a child process; its CPU time is counted",
    }
    return figures, details, cpu.as_dict()


# the figures each concurrency of a sweep keeps as "<name>[conc<N>]"
SWEEP_FIGURES = (
    "serving_output_tok_s",
    "serving_output_tok_s_per_stream",
    "serving_ttft_ms_median",
    "serving_tpot_ms_median",
    "serving_completed",
    "serving_failed",
    "acceptance_length",
)


# "acceptance_length[...]" is the decode method's per-workload family: a concurrency's is named apart, so a
# baseline of one method is never handed to the other
SWEEP_FIGURE_NAMES = {"acceptance_length": "serving_acceptance_length"}


def default_concurrencies(max_num_seqs: int) -> list[int]:
    """1, 2, 3 below the server's max-num-seqs, and max-num-seqs itself (what it serves at full load)."""
    if max_num_seqs < 1:
        raise ServingBenchError(f"max-num-seqs {max_num_seqs} must be >= 1")
    return [c for c in (1, 2, 3) if c < max_num_seqs] + [max_num_seqs]


def parse_concurrencies(text: str) -> list[int]:
    """``8`` or ``1,2,3,8``: distinct concurrencies >= 1, ascending; a one-line error names a bad one."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ServingBenchError(f"max-concurrency {text!r}: {part!r} is not a whole number >= 1 (e.g. 1,2,3,8)")
        values.append(int(part))
    return sorted(set(values))


def run_serving_sweep(
    *, concurrencies: list[int], **kwargs: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``run_serving_bench`` at each concurrency, lowest first; (figures, details, client_cpu).

    The headline figures are the highest concurrency's; ``details`` is that run's, with ``sweep``: one
    entry per concurrency (its figures, acceptance and command)."""
    if not concurrencies:
        raise ServingBenchError("no concurrency to measure (e.g. --max-concurrency 1,2,3)")
    sweep, cpu_s, wall_s = [], 0.0, 0.0
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for concurrency in sorted(set(concurrencies)):
        figures, details, cpu = run_serving_bench(max_concurrency=concurrency, **kwargs)
        tpot = figures.get("serving_tpot_ms_median")
        per_stream = 1000.0 / tpot if isinstance(tpot, int | float) and tpot > 0 else None
        figures["serving_output_tok_s_per_stream"] = per_stream
        cpu_s, wall_s = cpu_s + cpu["cpu_s"], wall_s + cpu["wall_s"]
        sweep.append(
            {
                "concurrency": concurrency,
                "figures": {name: figures.get(name) for name in SWEEP_FIGURES},
                "acceptance_rate": figures.get("acceptance_rate"),
                "per_position_acceptance": (details.get("spec_decode") or {}).get("per_position_acceptance"),
                "command": details["command"],
            }
        )
    figures = dict(figures)
    for entry in sweep:
        for name, value in entry["figures"].items():
            figures[f"{SWEEP_FIGURE_NAMES.get(name, name)}[conc{entry['concurrency']}]"] = value
    details = {**details, "sweep": sweep}
    share = cpu_s / wall_s if wall_s > 0 else None
    figures["client_cpu_share"] = share
    return figures, details, {"cpu_s": cpu_s, "wall_s": wall_s, "share": share, "includes_children": True}
