"""The CUDA smoke's verdicts, from the results of a run: greedy equality, acceptance, prefix hits.

    python3 tests/gpu/smoke_report.py RUN_DIR [RUN_DIR=case,case ...] \
        --json benchmarks/results/gpu/cuda_smoke_h200.json

Merges the runs (each a folder of install.json and wave-*.json as smoke_device.py leaves it), then
for every case with a baseline compares its greedy outputs request by request with the baseline's:
equal, or the first diverging position with both tokens and the baseline's logprob margin there
(the gap between its top-1 and the case's token, when that token is in its top 2). A divergence at
position 0 means the target's own state was wrong, not speculation.
Standard library only: it runs on the GPU machine (to print) and here (tests/unit reads the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import smoke_cases  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def sanitize(value, roots: dict[str, str]):
    """``value`` with the machines' own paths replaced by names ($REPO, $WORK): nothing absolute is kept."""
    if isinstance(value, str):
        for path, name in roots.items():
            value = value.replace(path, name)
        return value
    if isinstance(value, list):
        return [sanitize(item, roots) for item in value]
    if isinstance(value, dict):
        return {key: sanitize(item, roots) for key, item in value.items()}
    return value


def merge(runs: list[tuple[Path, set[str] | None]], roots: dict[str, str], models: Path | None = None) -> dict:
    """The cases of every run directory, later runs over earlier ones; each case names its run and wheel.

    A run is a directory as ``smoke_device.py run`` leaves it (install.json, wave-*.json); with a set
    of names only those cases are taken from it. A case recorded before runs kept the models'
    configs gets them from ``models`` (smoke_prepare.py makes the same files every time).
    """
    import tarfile

    from cuda_smoke import parse_log

    merged: dict = {"cases": {}, "runs": {}}
    for directory, only in runs:
        install = json.loads((directory / "install.json").read_text(encoding="utf-8"))
        logs: dict[str, str] = {}
        for tar_path in directory.glob("logs-*.tar.gz"):
            with tarfile.open(tar_path) as tar:
                for member in tar.getmembers():
                    if member.isfile() and member.name.endswith(".log"):
                        logs[Path(member.name).stem] = tar.extractfile(member).read().decode(errors="replace")
        merged["runs"][directory.name] = {"install": install, "waves": []}
        for path in sorted(directory.glob("wave-*.json")):
            data = json.loads(path.read_text(encoding="utf-8"))
            merged["runs"][directory.name]["waves"].append({k: v for k, v in data.items() if k != "cases"})
            for name, result in data["cases"].items():
                if only is None or name in only:
                    # What the logs say is re-read with this version of the parser.
                    parsed = parse_log(logs[name]) if name in logs else {}
                    merged["cases"][name] = {
                        **result,
                        **parsed,
                        "run": directory.name,
                        "wheel": install["patched_wheel"],
                    }
                    case = smoke_cases.CASES_BY_NAME.get(name)
                    if "configs" not in result and case is not None and models is not None:
                        merged["cases"][name]["configs"] = {
                            "target": json.loads((models / case.target / "config.json").read_text()),
                            "drafter": json.loads((models / case.drafter / "config.json").read_text())
                            if case.drafter
                            else None,
                            "from": "the models folder at merge time (the run predates recorded configs)",
                        }
    return sanitize(merged, roots)


def _margin(top: list[dict], position: int, token: int) -> float | None:
    """log p(top-1) - log p(token) at ``position`` of a greedy output's top-2 logprobs (None: not in top 2)."""
    if position >= len(top) or not top[position]:
        return None
    entry = {str(key): value for key, value in top[position].items()}
    best = max(entry.values())
    value = entry.get(str(token))
    return None if value is None else round(best - value, 6)


def compare_outputs(expected: dict, actual: dict) -> dict:
    """One request: equal, or where the two greedy outputs first differ and by how much."""
    if "error" in expected or "error" in actual:
        return {"equal": False, "error": actual.get("error") or expected.get("error")}
    want, got = expected["token_ids"], actual["token_ids"]
    position = smoke_cases.first_divergence(want, got)
    if position is None:
        return {"equal": True, "tokens": len(want)}
    result = {"equal": False, "first_divergence": position, "tokens": len(want)}
    if position < len(want) and position < len(got):
        result["expected_token"], result["actual_token"] = want[position], got[position]
        result["baseline_margin"] = _margin(expected.get("top_logprobs") or [], position, got[position])
        result["case_margin"] = _margin(actual.get("top_logprobs") or [], position, want[position])
    return result


def acceptance_length(metrics: dict) -> float | None:
    drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
    if not drafts:
        return None
    return round(1 + (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) / drafts, 3)


def planner_prediction(case: smoke_cases.Case, configs: dict) -> dict:
    """What sparkfleet's KV planner predicts for the case (the patched build: both trees carry 0001)."""
    sys.path.insert(0, str(REPO))
    from sparkfleet.serving import kv_page_plan

    plan = kv_page_plan.plan(
        configs["target"],
        configs["drafter"],
        case.num_speculative_tokens,
        True,
        mamba_ssm_cache_dtype="float32" if case.hybrid else "auto",
        attention_backend="FLASH_ATTN",
        enable_prefix_caching=case.prefix_caching,
    )
    return {
        "ok": plan.ok,
        "attention_block": plan.attention_block_size if plan.mamba_page_size_bytes else None,
        "mamba_padding_pct": round(plan.padding_pct, 2) if plan.mamba_page_size_bytes else None,
        "failure_stage": plan.failure_stage,
        "reason": plan.reason,
    }


def planner_agrees(verdict: dict) -> bool:
    """The planner's prediction against what the GPU did: started or not, block and padding."""
    plan = verdict["planner"]
    if plan["ok"] != verdict["booted"]:
        return False
    if not plan["ok"]:
        return plan["failure_stage"] == "grouping" and "same kv cache group" in (verdict["error"] or "")
    return plan["attention_block"] == verdict["attention_block"] and (
        plan["mamba_padding_pct"] is None or abs(plan["mamba_padding_pct"] - verdict["mamba_padding_pct"]) < 0.01
    )


def verdicts(merged: dict) -> dict:
    """Per case: booted, equality against its baseline per request, acceptance, prefix hits."""
    out: dict = {}
    results = merged["cases"]
    for case in smoke_cases.CASES:
        result = results.get(case.name)
        if result is None:
            continue
        verdict: dict = {
            "booted": bool(result.get("booted")),
            "seconds_to_health": result.get("seconds_to_health"),
            "error": result.get("error") if not result.get("booted") else None,
            "attention_block": result.get("attention_block"),
            "mamba_padding_pct": result.get("mamba_padding_pct"),
            "kv_cache_tokens": result.get("kv_cache_tokens"),
            "gdn_prefill": result.get("gdn_prefill"),
            "int8_lm_head": result.get("int8_lm_head"),
            "acceptance_length": acceptance_length(result.get("metrics") or {}),
        }
        configs = result.get("configs")
        if configs:
            verdict["planner"] = planner_prediction(case, configs)
        metrics = result.get("metrics") or {}
        if case.prefix_caching:
            verdict["prefix_cache_hits"] = metrics.get("vllm:prefix_cache_hits")
            verdict["prefix_cache_queries"] = metrics.get("vllm:prefix_cache_queries")
        baseline = results.get(case.baseline) if case.baseline else None
        if baseline is not None and result.get("outputs") and baseline.get("outputs"):
            requests = {}
            for name, actual in result["outputs"].items():
                if name in baseline["outputs"]:
                    requests[name] = compare_outputs(baseline["outputs"][name], actual)
            verdict["baseline"] = case.baseline
            verdict["requests"] = requests
            verdict["equal"] = all(r["equal"] for r in requests.values())
            verdict["diverging"] = sorted(name for name, r in requests.items() if not r["equal"])
        if "planner" in verdict:
            verdict["planner_agrees"] = planner_agrees(verdict)
        out[case.name] = verdict
    return out


def summary_lines(table: dict) -> list[str]:
    lines = []
    for name, verdict in table.items():
        if not verdict["booted"]:
            lines.append(f"{name:34s} did not start: {verdict.get('error')}")
            continue
        parts = [f"{name:34s} up in {verdict['seconds_to_health']} s"]
        if verdict.get("attention_block"):
            parts.append(f"block {verdict['attention_block']}")
        if verdict.get("mamba_padding_pct") is not None:
            parts.append(f"mamba +{verdict['mamba_padding_pct']}%")
        if verdict.get("acceptance_length"):
            parts.append(f"acceptance {verdict['acceptance_length']}")
        if "equal" in verdict:
            if verdict["equal"]:
                parts.append(f"= {verdict['baseline']} on all {len(verdict['requests'])} requests")
            else:
                first = {n: verdict["requests"][n].get("first_divergence") for n in verdict["diverging"]}
                parts.append(f"DIFFERS from {verdict['baseline']}: {first}")
        if verdict.get("prefix_cache_hits") is not None:
            parts.append(f"prefix hits {verdict['prefix_cache_hits']:.0f}/{verdict['prefix_cache_queries']:.0f}")
        lines.append(", ".join(parts))
    return lines


def _cell(verdict: dict) -> str:
    if "equal" not in verdict:
        return "-"
    if verdict["equal"]:
        return f"= {verdict['baseline']} ({len(verdict['requests'])}/{len(verdict['requests'])})"
    firsts = ", ".join(f"{name} @{verdict['requests'][name].get('first_divergence')}" for name in verdict["diverging"])
    return f"**differs** from {verdict['baseline']}: {firsts}"


def render_document(merged: dict) -> str:
    """docs/gpu-smoke.md: every case of the committed run, from the JSON (never typed)."""
    rows = []
    for case in smoke_cases.CASES:
        verdict = merged["verdicts"].get(case.name)
        if verdict is None:
            continue
        drafter = f"{case.drafter} n={case.num_speculative_tokens}" if case.drafter else "-"
        options = (
            ", ".join(
                option
                for option, on in (
                    ("eager", case.eager),
                    ("stock dispatch", case.tree == "stock"),
                    ("prefix caching", case.prefix_caching),
                    ("int8 lm head", case.int8_lm_head),
                    (" ".join(case.extra_args), bool(case.extra_args)),
                )
                if on
            )
            or "CUDA graphs"
        )
        if verdict["booted"]:
            started = f"{verdict['seconds_to_health']} s"
            layout = (
                f"{verdict['attention_block']} / {verdict['mamba_padding_pct']}%" if verdict["attention_block"] else "-"
            )
        else:
            started, layout = f"no: {verdict['error']}", "-"
        acceptance = verdict["acceptance_length"] if verdict["acceptance_length"] is not None else "-"
        rows.append(
            f"| {case.name} | {case.target} | {drafter} | {options} | {started} | {layout} "
            f"| {'agrees' if verdict.get('planner_agrees') else '**disagrees**'} | {acceptance} "
            f"| {_cell(verdict)} | {merged['cases'][case.name]['run']} |"
        )
    runs = []
    for name, run in merged["runs"].items():
        install = run["install"]
        runs.append(
            f"- `{name}`: {install['gpu']}; wheel `{install['patched_wheel']}` (built there from the carried "
            f"source, byte-identical to the controller's: {install['same_as_controller_build']}), "
            f"{install['carried_wheels']} dependency wheels carried"
        )
    prefix = merged["verdicts"].get("hybrid-dflash12-prefix", {})
    int8 = merged["verdicts"].get("hybrid-dflash12-int8", {})
    lines = [
        "# The CUDA smoke: the patched wheel on a GPU",
        "",
        "Generated by `python3 tests/gpu/smoke_report.py ... --doc docs/gpu-smoke.md` from",
        "`benchmarks/results/gpu/cuda_smoke_h200.json`; do not edit by hand. How to run it: tests/gpu/README.md.",
        "",
        "Every case is one `vllm serve` of the patched vLLM 0.23.0 x86_64 GPU wheel on one H200, side by",
        "side with the others, with the recipe's flags where a tiny model allows them (FLASH_ATTN for the",
        "target and the drafter, CUDA graphs with FULL_AND_PIECEWISE up to 64 tokens, float32 mamba SSM",
        "state, GDN prefill on Triton/FLA, chunked prefill, max 4 sequences). Each answers the same greedy",
        "requests (token-id prompts: the first request after start, prompts of 1, 5, 9 and 13 tokens, a",
        "repeat, a chat turn, a 192-token generation, a batch of four sent at once); *greedy* compares them",
        "request by request with the case's baseline and names the first diverging position.",
        "",
        "| case | target | drafter | options | /health | attention block / mamba pad | planner | acceptance | greedy "
        "| run |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Runs (each case above names the one it comes from; the equality cases all come from the run of",
        "the series as committed, which `tests/unit/test_cuda_smoke_results.py` checks):",
        "",
        *runs,
        "",
        f"Prefix caching (mamba cache mode 'align'): {prefix.get('prefix_cache_hits', 0):.0f} of "
        f"{prefix.get('prefix_cache_queries', 0):.0f} prompt tokens hit the cache, output unchanged.",
        f"int8 lm head: the server logged `{int8.get('int8_lm_head')}`.",
        "",
        "## What this is not",
        "",
        "- Not a GB10: the H200 is SM90 (Hopper). FLASH_ATTN runs FlashAttention 3 there; on a GB10 (SM121)",
        "  vLLM uses the FA2 kernels, which PyPI's wheel carries only as sm_80 code (JIT-compiled from PTX",
        "  at first start). FLA's big chunk tiles are chosen on SM90 anyway (patch 0004 is a no-op here).",
        "- Not the 122B: tiny models (hidden 128, two layers), so speed and memory say nothing about a",
        "  Spark. What carries over is the code path: dispatch, metadata, KV layout, kernels' shapes.",
        "- FlashInfer, TileLang, CuTe-DSL and the other optional kernel packages were not carried",
        "  (tests/gpu/smoke_prepare.py says why); the FlashInfer sampler is off (greedy requests).",
        "",
    ]
    return "\n".join(lines)


def archive(directory: Path, target: Path, roots: dict[str, str]) -> Path:
    """A sanitized copy of a run directory (JSON and the log tars, paths replaced) under ``target``."""
    import io
    import tarfile

    out = target / directory.name
    out.mkdir(parents=True, exist_ok=True)
    for path in directory.glob("*.json"):
        data = sanitize(json.loads(path.read_text(encoding="utf-8")), roots)
        (out / path.name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for path in directory.glob("logs-*.tar.gz"):
        with tarfile.open(path) as source, tarfile.open(out / path.name, "w:gz") as copy:
            for member in source.getmembers():
                if not member.isfile():
                    continue
                text = sanitize(source.extractfile(member).read().decode(errors="replace"), roots).encode()
                info = tarfile.TarInfo(member.name)
                info.size, info.mtime, info.mode = len(text), 0, 0o644
                copy.addfile(info, io.BytesIO(text))
    return out


def parse_run(text: str) -> tuple[Path, set[str] | None]:
    directory, _, names = text.partition("=")
    return Path(directory), set(names.split(",")) if names else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=parse_run, help="DIR or DIR=case,case (later runs win)")
    parser.add_argument("--device-repo", default=str(REPO), help="the repository's path on the GPU machine")
    parser.add_argument("--device-work", default="/tmp/sf-smoke", help="smoke_device.py's work folder there")
    parser.add_argument("--json", type=Path, help="write the merged results and verdicts here")
    parser.add_argument("--archive-to", type=Path, help="first copy each run here, sanitized (the committed form)")
    parser.add_argument("--models", type=Path, default=REPO / "build/gpu-smoke/models", help="the cases' models")
    parser.add_argument("--doc", type=Path, help="write docs/gpu-smoke.md (the table of every case) here")
    args = parser.parse_args(argv)
    roots = {args.device_repo: "$REPO", args.device_work: "$WORK"}
    runs = args.runs
    if args.archive_to:
        runs = [(archive(directory, args.archive_to, roots), only) for directory, only in runs]
    merged = merge(runs, roots, args.models if args.models.is_dir() else None)
    merged["verdicts"] = verdicts(merged)
    for line in summary_lines(merged["verdicts"]):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if args.doc:
        args.doc.write_text(render_document(merged), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
