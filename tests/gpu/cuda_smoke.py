"""The CUDA smoke's runner: start the matrix's vLLM servers side by side on one GPU, ask, record.

Runs on the GPU machine (tests/gpu/README.md says how it gets there) with the patched wheel installed
under ``--site`` and, for the ``stock`` cases, the same tree without patches 0005 and 0006 under
``--stock-site``. For each case of the asked waves (tests/gpu/smoke_cases.py) it starts
``python -m vllm.entrypoints.cli.main serve`` with the case's flags, waits for /health (or the
process's exit), sends the case's requests (greedy, token-id prompts, top-2 logprobs), reads
/metrics, stops the server, and parses what vLLM logged (attention block, mamba padding, KV pool,
GDN prefill kernel, the int8 lm head's line, the error it died of). Results are written after every
case, so a run cut short still leaves what it measured:

    python3 tests/gpu/cuda_smoke.py --wave A --site SITE --stock-site SITE2 --models DIR --out OUT

Standard library only; the verdicts (greedy equality, first diverging position, planner agreement)
are computed from the results by tests/gpu/smoke_report.py, here and on the controller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import smoke_cases  # noqa: E402
from process_group import stop_group  # noqa: E402
from smoke_cases import BATCH, BOOT, PREFIX, SEQUENTIAL, Case, prompt_ids  # noqa: E402

LOG_PATTERNS = {
    "attention_block": re.compile(r"Setting attention block size to (\d+) tokens"),
    "mamba_padding_pct": re.compile(r"Padding mamba page size by ([\d.]+)%"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "gdn_prefill": re.compile(r"Using (.+?) GDN prefill kernel"),
    "int8_lm_head": re.compile(r"(sparkfleet int8 lm head: .*)"),
    "mamba_cache_mode": re.compile(r"(?i)mamba[ _]cache[ _]mode[^\n]*?'(\w+)'"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "attention_backend": re.compile(r"Using (\S+) attention backend"),
}
ERROR_LINE = re.compile(r"\b((?:[A-Z]\w*Error|AssertionError|ValueError|NotImplementedError)\b.*)")


def log(message: str) -> None:
    print(f"[cuda-smoke {time.strftime('%H:%M:%S')}] {message}", flush=True)


def post(port: int, path: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def complete(port: int, ids: list[int], max_tokens: int) -> dict:
    """One greedy completion: the generated ids, and the top-2 logprobs at each position."""
    started = time.monotonic()
    body = {
        "model": "qwen",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 2,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    try:
        reply = post(port, "/v1/completions", body)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    choice = reply["choices"][0]
    top = []
    for entry in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        top.append({key.split(":", 1)[-1]: value for key, value in (entry or {}).items()})
    return {
        "prompt_len": len(ids),
        "token_ids": choice.get("token_ids") or [],
        "text": choice.get("text", ""),
        "finish_reason": choice.get("finish_reason"),
        "top_logprobs": top,
        "seconds": round(time.monotonic() - started, 3),
    }


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus counters that matter here, summed over their labels."""
    wanted = (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries",
    )
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in wanted:
            if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
                if "_per_pos" in line:
                    continue
                with contextlib.suppress(ValueError):
                    sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def parse_log(text: str) -> dict:
    found: dict = {}
    for key, pattern in LOG_PATTERNS.items():
        values = pattern.findall(text)
        if values:
            found[key] = values[-1] if key != "attention_backend" else sorted(set(values))
    for key in ("attention_block", "kv_cache_tokens"):
        if key in found:
            found[key] = int(str(found[key]).replace(",", ""))
    for key in ("mamba_padding_pct", "graph_capture_s"):
        if key in found:
            found[key] = float(found[key])
    # The root cause is what the engine core raised (the API server only reports that it died).
    engine = [m for line in text.splitlines() if "EngineCore" in line for m in ERROR_LINE.findall(line)]
    errors = engine or ERROR_LINE.findall(text)
    if errors:
        found["error"] = errors[-1].strip()[:500]
    return found


class Server:
    """One case's server process and what it returned."""

    def __init__(self, case: Case, port: int, args: argparse.Namespace) -> None:
        self.case = case
        self.port = port
        self.log_path = Path(args.logs) / f"{case.name}.log"
        self.result: dict = {"case": case.name, "port": port, "booted": False}
        models = Path(args.models)
        model_dir = str(models / case.target)
        drafter_dir = str(models / case.drafter) if case.drafter else None
        site = args.stock_site if case.tree == "stock" else args.site
        env = dict(os.environ)
        env.update(case.environment())
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["VLLM_CACHE_ROOT"] = str(Path(args.work) / "vllm-cache" / case.name)
        env["TRITON_CACHE_DIR"] = str(Path(args.work) / "triton-cache")
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        if args.cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            model_dir,
            *case.serve_args(model_dir, drafter_dir, port, cpu=args.cpu),
        ]
        self.result["command"] = [arg.replace(str(models), "$MODELS") for arg in command[3:]]
        self.result["env"] = case.environment()
        self.result["configs"] = {
            "target": json.loads((models / case.target / "config.json").read_text()),
            "drafter": json.loads((models / case.drafter / "config.json").read_text()) if case.drafter else None,
        }
        self.log_file = self.log_path.open("w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def poll_health(self) -> str | None:
        """ "up", "exited" or None (still starting)."""
        if self.process.poll() is not None:
            self.result["exit_code"] = self.process.returncode
            return "exited"
        status, _ = get(self.port, "/health", timeout=1.0)
        if status == 200:
            self.result["booted"] = True
            self.result["seconds_to_health"] = round(time.monotonic() - self.started, 1)
            return "up"
        return None

    def ask(self, encode) -> None:
        prompts = BOOT if self.case.requests == "boot" else SEQUENTIAL
        outputs: dict[str, dict] = {}
        for prompt in prompts:
            outputs[prompt.name] = complete(self.port, prompt_ids(prompt, encode), prompt.max_tokens)
        if self.case.requests != "boot":
            threads = []
            batch: dict[str, dict] = {}

            def one(prompt) -> None:
                batch[prompt.name] = complete(self.port, prompt_ids(prompt, encode), prompt.max_tokens)

            for prompt in BATCH:
                thread = threading.Thread(target=one, args=(prompt,))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            outputs.update({name: batch[name] for name in (p.name for p in BATCH)})
        if self.case.prefix_caching or self.case.name == "hybrid":
            for prompt in PREFIX:
                outputs[prompt.name] = complete(self.port, prompt_ids(prompt, encode), prompt.max_tokens)
        self.result["outputs"] = outputs
        _, metrics = get(self.port, "/metrics", timeout=10.0)
        self.result["metrics"] = metric_sums(metrics)

    def stop(self) -> None:
        stop_group(self.process, reap_s=None)  # a killed leader is waited for however long it takes
        self.log_file.close()
        self.result.update(parse_log(self.log_path.read_text(errors="replace")))
        self.result["seconds_total"] = round(time.monotonic() - self.started, 1)


def load_encoder(models: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(models / smoke_cases.HYBRID_TARGET / "tokenizer.json"))
    return lambda text: tokenizer.encode(text).ids


def write(out: Path, wave: str, meta: dict, servers: list[Server]) -> None:
    data = {**meta, "cases": {server.case.name: server.result for server in servers}}
    path = out / f"wave-{wave}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def run_wave(wave: str, args: argparse.Namespace, deadline: float) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    encode = load_encoder(Path(args.models))
    cases = [case for case in smoke_cases.CASES if case.wave == wave and (not args.only or case.name in args.only)]
    meta = {"wave": wave, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_dry_run": args.cpu}
    servers: list[Server] = []
    for index, case in enumerate(cases):
        servers.append(Server(case, args.port_base + index, args))
    log(f"wave {wave}: started {len(servers)} servers")
    pending = list(servers)
    askers: list[threading.Thread] = []
    lock = threading.Lock()

    def serve(server: Server) -> None:
        try:
            server.ask(encode)
        except Exception as exc:  # noqa: BLE001 - recorded, the other cases go on
            server.result["ask_error"] = f"{type(exc).__name__}: {exc}"
        server.stop()
        with lock:
            write(out, wave, meta, servers)
        log(f"{server.case.name}: done ({server.result.get('seconds_to_health')} s to /health)")

    while pending and time.monotonic() < deadline:
        for server in list(pending):
            state = server.poll_health()
            if state is None:
                continue
            pending.remove(server)
            if state == "up":
                log(f"{server.case.name}: /health after {server.result['seconds_to_health']} s")
                thread = threading.Thread(target=serve, args=(server,))
                thread.start()
                askers.append(thread)
            else:
                server.stop()
                log(f"{server.case.name}: exited {server.result.get('exit_code')}: {server.result.get('error')}")
                with lock:
                    write(out, wave, meta, servers)
        time.sleep(0.5)
    for server in pending:
        server.result["timed_out"] = True
        server.stop()
        log(f"{server.case.name}: no /health before the deadline")
    for thread in askers:
        thread.join(timeout=max(5.0, deadline + 60 - time.monotonic()))
    write(out, wave, meta, servers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wave", action="append", required=True, choices=["A", "B", "C"])
    parser.add_argument("--site", required=True, help="the patched wheel, installed with pip --target")
    parser.add_argument("--stock-site", required=True, help="the same tree without patches 0005 and 0006")
    parser.add_argument("--models", required=True, help="folder holding every model the cases name")
    parser.add_argument("--out", required=True, help="wave-<W>.json goes here")
    parser.add_argument("--logs", required=True, help="one server log per case goes here")
    parser.add_argument("--work", default="/tmp/sf-smoke/work", help="caches (kept between waves)")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="stop starting and asking after this")
    parser.add_argument("--port-base", type=int, default=8100)
    parser.add_argument("--only", action="append", help="run just these cases (repeatable)")
    parser.add_argument(
        "--cpu", action="store_true", help="dry run of the mechanics on vLLM's CPU build (cases it can serve)"
    )
    args = parser.parse_args(argv)
    # Twenty-odd servers with their engines and compile workers open many files at once.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    deadline = time.monotonic() + args.deadline_s
    for wave in args.wave:
        run_wave(wave, args, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
