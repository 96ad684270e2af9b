"""Benchmark clients for a serving host: decode-only, albond's end-to-end, serving at conc 8, and
multi-turn prefix reuse.

It imports the standard library and packages vLLM 0.23 itself brings into the service venv
(``httpx`` for HTTP, ``prometheus_client`` for ``/metrics``; and vLLM's own ``vllm bench serve`` for
the serving run), so it runs on a serving host under the service venv's Python from a copied
``sparkfleet`` directory (tests/unit/test_bench_portable.py holds the list)::

    PYTHONPATH=<dir holding sparkfleet> python -m sparkfleet.hostlib.bench decode --base-url http://127.0.0.1:8000
    python -m sparkfleet.hostlib.bench e2e --base-url ... --max-tokens-scale 0.125
    python -m sparkfleet.hostlib.bench serving --base-url ... --num-prompts 64 --max-concurrency 8
    python -m sparkfleet.hostlib.bench prefix --base-url ...   # warm-prefix vs cold TTFT over agent turns
    python -m sparkfleet.hostlib.bench compare --result results/x.json --baselines '{"e2e_tok_s": 53.7}'

and as ``sparkfleet bench ...`` on the controller. Each run writes one result JSON (schema in
``sparkfleet.hostlib.bench.results``); with ``--baselines`` it compares and exits 1 on a regression.
Exit codes: 0 ok, 1 regression, 2 bad input or a failed run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from sparkfleet.hostlib.bench import results as res
from sparkfleet.hostlib.bench.http_client import BenchHTTPError, OpenAIServer, read_api_key
from sparkfleet.hostlib.bench.workloads import (
    CONVERSATION_WORKLOADS,
    DECODE_WORKLOADS,
    E2E_WORKLOAD,
    SHAREGPT_DATASET,
    WorkloadError,
)

PREFIX_WORKLOAD = CONVERSATION_WORKLOADS[0]

SNAPSHOT_REVISION = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")
PATCHSET_LINE = re.compile(r"^PATCHSET_ID = ['\"]([^'\"]+)['\"]", re.MULTILINE)


def local_patch_set() -> str | None:
    """The patch-set id of the vLLM this Python would import (the service venv's on a host), if any.

    ``sparkfleet wheel build`` writes ``vllm/_sparkfleet_patchset.py``; it is read as text, so
    vLLM (and torch) are not imported.
    """
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        marker = Path(location) / "_sparkfleet_patchset.py"
        if marker.is_file():
            match = PATCHSET_LINE.search(marker.read_text(encoding="utf-8"))
            if match:
                return match.group(1)
    return None


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the first of GET /v1/models)")
    parser.add_argument("--host-label", help="host name recorded in the result (default: this host's)")
    parser.add_argument("--profile", help="sparkfleet serving profile being measured, e.g. dflash")
    parser.add_argument(
        "--patch-set", help="id of the vLLM patch set the server runs (default: read from the local vLLM)"
    )
    parser.add_argument("--model-revision", help="model revision (default: read from an HF snapshot path, else none)")
    parser.add_argument("--drafter-revision", help="drafter revision, e.g. 6c7242c934a9870d7c59c05240bdbb2467cc1394")
    parser.add_argument(
        "--state-file",
        help="the host's /etc/sparkfleet/state.json: the serving unit's start-up figures go into the result",
    )
    parser.add_argument(
        "--reference-startup",
        help="JSON object: the profile's reference start-up figures (a GB10's), recorded beside the host's",
    )
    parser.add_argument("--out", default="results", help="result file (*.json) or directory (default: results)")
    parser.add_argument("--baselines", help="JSON object or file of figure -> baseline, e.g. '{\"e2e_tok_s\": 53.7}'")
    parser.add_argument("--tolerance-pct", type=float, default=5.0, help="allowed regression in %% (default 5)")
    parser.add_argument("--quiet", action="store_true", help="no per-request progress on stderr")
    parser.add_argument(
        "--api-key-file",
        help="file holding the server's API key (the bare key, or VLLM_API_KEY=... as in the unit's secrets file); "
        "never pass the key itself on the command line",
    )


def add_bench_subcommands(sub: Any) -> None:
    decode = sub.add_parser("decode", help="decode-only tok/s per workload (streaming, excludes TTFT)")
    _add_common(decode)
    decode.add_argument(
        "--workloads",
        default=",".join(DECODE_WORKLOADS),
        help=f"comma-separated workload names or JSON paths (default {','.join(DECODE_WORKLOADS)})",
    )
    decode.add_argument("--max-tokens-scale", type=float, default=1.0, help="multiply every max_tokens")
    decode.add_argument("--max-requests", type=int, help="use only the first N requests of each workload")
    decode.add_argument("--repeats", type=int, default=1, help="run each workload N times (default 1)")
    decode.add_argument("--ignore-eos", action="store_true", help="generate up to max_tokens (tiny models)")
    decode.add_argument(
        "--tpot-tolerance-pct",
        type=float,
        default=10.0,
        help="the client's decode figure is the headline only within this %% of the server's TPOT (default 10; 0: off)",
    )
    decode.set_defaults(func=run_with_errors, command=run_decode_command)

    e2e = sub.add_parser("e2e", help="albond's end-to-end tok/s (5 prompts, run 1 discarded)")
    _add_common(e2e)
    e2e.add_argument("--workload", default=E2E_WORKLOAD, help=f"prompt set (default {E2E_WORKLOAD})")
    e2e.add_argument("--max-tokens-scale", type=float, default=1.0, help="multiply max_tokens 256/512/1024/64/2048")
    e2e.add_argument("--ignore-eos", action="store_true", help="generate up to max_tokens (not in albond's method)")
    e2e.set_defaults(func=run_with_errors, command=run_e2e_command)

    serving = sub.add_parser("serving", help="vllm bench serve on a ShareGPT-format dataset (conc 8)")
    _add_common(serving)
    serving.add_argument("--dataset", default=str(SHAREGPT_DATASET), help="ShareGPT-format JSON dataset")
    serving.add_argument("--num-prompts", type=int, default=64)
    serving.add_argument(
        "--max-concurrency",
        help="one concurrency or a sweep, e.g. 1,2,3 (each runs vllm bench serve; the highest is the headline); "
        "default: the sweep --max-num-seqs gives, else 8",
    )
    serving.add_argument(
        "--max-num-seqs",
        type=int,
        help="the server's max-num-seqs: sweep 1, 2, 3 below it and it (1,2,3 for 3; 1,2,3,8 for 8)",
    )
    serving.add_argument("--backend", default="openai-chat", choices=["openai-chat", "vllm"])
    serving.add_argument("--tokenizer", help="tokenizer path or repo (default: the model root the server reports)")
    serving.add_argument("--output-len", type=int, help="fixed output length (--sharegpt-output-len)")
    serving.add_argument("--seed", type=int, default=0)
    serving.add_argument("--vllm-command", help="how to run vLLM's CLI (default: this Python -m vllm...)")
    serving.set_defaults(func=run_with_errors, command=run_serving_command)

    prefix = sub.add_parser(
        "prefix", help="multi-turn agent conversations, each turn cold and warm: what prefix caching saves"
    )
    _add_common(prefix)
    prefix.add_argument("--workload", default=PREFIX_WORKLOAD, help=f"conversations (default {PREFIX_WORKLOAD})")
    prefix.add_argument("--max-tokens-scale", type=float, default=1.0, help="multiply every turn's max_tokens")
    prefix.add_argument("--max-conversations", type=int, help="use only the first N conversations")
    prefix.add_argument("--ignore-eos", action="store_true", help="generate up to max_tokens (tiny models)")
    prefix.set_defaults(func=run_with_errors, command=run_prefix_command)

    compare = sub.add_parser("compare", help="compare a result file with baselines")
    compare.add_argument("--result", required=True, help="result JSON written by a bench run")
    compare.add_argument("--baselines", required=True, help="JSON object or file of figure -> baseline")
    compare.add_argument("--tolerance-pct", type=float, default=5.0)
    compare.set_defaults(func=run_with_errors, command=run_compare_command)


def register(subparsers: Any) -> None:
    """Add ``sparkfleet bench`` (CLI contract of sparkfleet.cli)."""
    bench = subparsers.add_parser("bench", help="benchmark a serving host (decode, e2e, serving, prefix, compare)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    add_bench_subcommands(sub)
    bench.set_defaults(func=lambda _args: (bench.print_help(), 2)[1])


def _identity(args: argparse.Namespace, server: OpenAIServer) -> tuple[str, str | None, str | None]:
    served, root = server.model_info()
    model = args.model or served
    revision = args.model_revision
    if revision is None and root:
        match = SNAPSHOT_REVISION.search(str(root))
        revision = match.group(1) if match else None
    return model, root, revision


def _finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Compare with baselines if given, write the result, print one line per check; return the exit code."""
    exit_code = 0
    if getattr(args, "baselines", None):
        comparison = res.compare_with_baselines(result, res.load_baselines(args.baselines), args.tolerance_pct)
        result["comparison"] = comparison
        for check in comparison["checks"]:
            print(check["reason"])
        exit_code = 0 if comparison["passed"] else 1
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / res.default_result_name(result)
    res.write_result(result, path)
    invalid = [name for name, h in (result.get("details") or {}).get("headline", {}).items() if not h["client_valid"]]
    if invalid:
        print(
            f"warning: the client's decode figure is INVALID for {', '.join(invalid)} (its TPOT disagrees with the "
            "server's: the host delayed delivery, overloaded?); decode_tok_s_median is the server's figure there",
            file=sys.stderr,
        )
    shown = {k: v for k, v in result["figures"].items() if "[" not in k and v is not None}
    summary = ", ".join(f"{k} {v:.4g}" for k, v in sorted(shown.items()))
    print(f"{result['kind']} on {result['host']}: {summary}; wrote {path}")
    return exit_code


def _new_result(
    kind: str,
    args: argparse.Namespace,
    server: OpenAIServer,
    model: str,
    root: str | None,
    revision: str | None,
    settings: dict[str, Any],
) -> dict[str, Any]:
    return res.new_result(
        kind,
        base_url=server.base_url,
        host=args.host_label,
        profile=args.profile,
        patch_set=args.patch_set or local_patch_set(),
        served_name=model,
        model_root=root,
        model_revision=revision,
        drafter_revision=args.drafter_revision,
        vllm_version=server.vllm_version(),
        settings=settings,
        startup=_recorded_startup(getattr(args, "state_file", None)),
        startup_reference=_reference_startup(getattr(args, "reference_startup", None)),
    )


def _reference_startup(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--reference-startup {text!r} is not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--reference-startup {text!r} is not a JSON object of figure -> number")
    return value


def _recorded_startup(state_file: str | None) -> dict[str, Any]:
    """state.json's "startup" (what the unit's last start recorded); {} without one."""
    if not state_file:
        return {}
    try:
        state = json.loads(Path(state_file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"warning: no start-up figures from {state_file}: {exc}", file=sys.stderr)
        return {}
    startup = state.get("startup") if isinstance(state, dict) else None
    return startup if isinstance(startup, dict) else {}


def run_decode_command(args: argparse.Namespace) -> int:
    from sparkfleet.hostlib.bench.decode import run_decode_bench
    from sparkfleet.hostlib.bench.workloads import load_workload

    server = OpenAIServer(args.base_url, api_key=read_api_key(args.api_key_file))
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    workloads = [load_workload(name, args.max_tokens_scale, args.max_requests) for name in names]
    model, root, revision = _identity(args, server)
    settings = {
        "workloads": names,
        "max_tokens_scale": args.max_tokens_scale,
        "max_requests": args.max_requests,
        "repeats": args.repeats,
        "ignore_eos": args.ignore_eos,
        "concurrency": 1,
        "temperature": 0.0,
        "stream": True,
        "tpot_tolerance_pct": args.tpot_tolerance_pct,
    }
    if not 0 <= args.tpot_tolerance_pct < 100:
        raise ValueError(f"--tpot-tolerance-pct {args.tpot_tolerance_pct} is not 0 (off) to 99: give e.g. 10")
    result = _new_result("decode", args, server, model, root, revision, settings)
    figures, details, cpu = run_decode_bench(
        server,
        model,
        workloads,
        repeats=args.repeats,
        progress=not args.quiet,
        ignore_eos=args.ignore_eos,
        tolerance=args.tpot_tolerance_pct / 100 if args.tpot_tolerance_pct > 0 else None,
    )
    result.update(figures=figures, details=details, client_cpu=cpu)
    return _finish(result, args)


def run_e2e_command(args: argparse.Namespace) -> int:
    from sparkfleet.hostlib.bench.e2e import run_e2e_bench
    from sparkfleet.hostlib.bench.workloads import load_workload

    server = OpenAIServer(args.base_url, api_key=read_api_key(args.api_key_file))
    workload = load_workload(args.workload, args.max_tokens_scale)
    model, root, revision = _identity(args, server)
    settings = {
        "workload": args.workload,
        "max_tokens_scale": args.max_tokens_scale,
        "max_tokens": [r.max_tokens for r in workload.requests],
        "ignore_eos": args.ignore_eos,
        "temperature": 0.0,
        "stream": False,
        "runs_per_prompt": 2,
        "discarded_runs": 1,
    }
    result = _new_result("e2e", args, server, model, root, revision, settings)
    figures, details, cpu = run_e2e_bench(server, model, workload, ignore_eos=args.ignore_eos, progress=not args.quiet)
    result.update(figures=figures, details=details, client_cpu=cpu)
    return _finish(result, args)


def run_serving_command(args: argparse.Namespace) -> int:
    from sparkfleet.hostlib.bench.serving import default_concurrencies, parse_concurrencies, run_serving_sweep

    if args.max_concurrency is not None:
        concurrencies = parse_concurrencies(args.max_concurrency)
    elif args.max_num_seqs is not None:
        concurrencies = default_concurrencies(args.max_num_seqs)
    else:
        concurrencies = [8]
    server = OpenAIServer(args.base_url, api_key=read_api_key(args.api_key_file))
    model, root, revision = _identity(args, server)
    settings = {
        "dataset": Path(args.dataset).name,
        "num_prompts": args.num_prompts,
        "max_concurrency": max(concurrencies),
        "concurrencies": concurrencies,
        "backend": args.backend,
        "output_len": args.output_len,
        "temperature": 0.0,
        "seed": args.seed,
    }
    result = _new_result("serving", args, server, model, root, revision, settings)
    # the options run_serving_bench takes under the names of their flags
    same_named = {name: getattr(args, name) for name in ("tokenizer", "backend", "num_prompts", "output_len", "seed")}
    figures, details, cpu = run_serving_sweep(
        concurrencies=concurrencies,
        base_url=server.base_url,
        model=root or model,
        served_model_name=model,
        dataset_path=args.dataset,
        vllm_command=shlex.split(args.vllm_command) if args.vllm_command else None,
        api_key=server.api_key,
        **same_named,
    )
    result.update(figures=figures, details=details, client_cpu=cpu)
    return _finish(result, args)


def run_prefix_command(args: argparse.Namespace) -> int:
    from sparkfleet.hostlib.bench.prefix import load_conversations, run_prefix_bench

    server = OpenAIServer(args.base_url, api_key=read_api_key(args.api_key_file))
    conversations = load_conversations(args.workload, args.max_tokens_scale, args.max_conversations)
    model, root, revision = _identity(args, server)
    settings = {
        "workload": args.workload,
        "max_tokens_scale": args.max_tokens_scale,
        "conversations": len(conversations),
        "turns": sum(len(c.turns) for c in conversations),
        "ignore_eos": args.ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "concurrency": 1,
    }
    result = _new_result("prefix", args, server, model, root, revision, settings)
    figures, details, cpu = run_prefix_bench(
        server, model, conversations, progress=not args.quiet, ignore_eos=args.ignore_eos
    )
    result.update(figures=figures, details=details, client_cpu=cpu)
    return _finish(result, args)


def run_compare_command(args: argparse.Namespace) -> int:
    result = res.load_result(args.result)
    comparison = res.compare_with_baselines(result, res.load_baselines(args.baselines), args.tolerance_pct)
    for check in comparison["checks"]:
        print(check["reason"])
    verdict = "PASS" if comparison["passed"] else "FAIL"
    print(
        f"{verdict}: {len(comparison['checks'])} figure(s) of {Path(args.result).name} "
        f"against baselines at {args.tolerance_pct:g}% tolerance"
    )
    return 0 if comparison["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m sparkfleet.hostlib.bench`` entry point (no controller packages needed)."""
    parser = argparse.ArgumentParser(prog="python -m sparkfleet.hostlib.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    add_bench_subcommands(sub)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def run_with_errors(args: argparse.Namespace) -> int:
    """Run a parsed command; print a one-line error and return 2 for bad input or a failed run."""
    from sparkfleet.hostlib.bench.serving import ServingBenchError

    try:
        return int(args.command(args) or 0)
    except (WorkloadError, res.ResultError, BenchHTTPError, ServingBenchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        url = getattr(args, "base_url", None)
        print(f"error: {exc}" + (f" (is a server listening at {url}?)" if url else ""), file=sys.stderr)
        return 2
