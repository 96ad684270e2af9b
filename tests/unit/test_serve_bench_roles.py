"""The serve_bench and serve_health roles, run for real by ansible-playbook against local stub servers.

No sandbox and no vLLM: the roles run on localhost (connection local) against small HTTP stubs that
answer like vLLM's OpenAI server and expose vLLM's /metrics counters:

- serve_bench (decode + e2e through the real ``sparkfleet.hostlib.bench`` clients, copied by the role): the
  result JSON lands on the "host" and under ``<fetch dir>/<host>/`` with its identity fields, every
  figure and baseline check is printed, a regression fails the run, and a baseline naming no figure
  is refused before anything is written;
- serve_health: the tool-call request, the acceptance length from /metrics deltas and the smoke
  completion scored by the target alone (its greedy choice at every token) pass on a healthy stub,
  and each fails with a message naming what failed (a near tie is reported, not failed);
- both roles: ``meta/argument_specs.yml`` documents exactly the variables ``defaults/main.yml`` sets;
- serve_health's ``sparkfleet_prometheus_sum`` filter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.bench_stub import StubState, make_handler, send

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
ROLES = ("serve_bench", "serve_health")

pytestmark = pytest.mark.skipif(not ANSIBLE_PLAYBOOK.is_file(), reason="ansible-playbook is not in this venv")


# ----------------------------------------------------------------------------------------- helpers


def run_play(tmp_path: Path, role: str, role_vars: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Run ``role`` on localhost with ``role_vars`` (as extra vars, so they win); output is echoed."""
    playbook = tmp_path / f"{role}-play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [{"name": f"Run {role}", "hosts": "localhost", "gather_facts": False, "roles": [{"role": role}]}]
        ),
        encoding="utf-8",
    )
    extra = tmp_path / f"{role}-vars.json"
    extra.write_text(json.dumps(role_vars), encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
        "ANSIBLE_REMOTE_TEMP": str(tmp_path / "ansible-tmp"),
    }
    cmd = [
        str(ANSIBLE_PLAYBOOK),
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        f"@{extra}",
        str(playbook),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    print(proc.stdout[-8000:], proc.stderr[-3000:])
    return proc


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"{httpd.server_address[1]}"


# --------------------------------------------------------------------------------------- serve_bench


@pytest.fixture
def bench_stub() -> Iterator[tuple[StubState, int]]:
    """tests/unit/bench_stub.py's server (vLLM-like timings and counters) plus the /health vLLM has."""
    state = StubState(
        token_gap_s=0.004,
        prefill_s=0.01,
        accepted_per_step=2,
        draft_len=3,
        first_run_extra_s=0.0,
        record_delay_s=0.02,
        merge_first=1,
    )
    base = make_handler(state)

    class WithHealth(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            else:
                super().do_GET()

    httpd, port = serve(WithHealth)
    try:
        yield state, int(port)
    finally:
        httpd.shutdown()
        httpd.server_close()


def bench_vars(tmp_path: Path, port: int, **overrides: Any) -> dict[str, Any]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    if not python.exists():
        # this venv's Python, its site-packages included (a symlink would start the bare base interpreter):
        # the clients import httpx and prometheus_client, which a host's service venv has from vLLM
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', encoding="utf-8")
        python.chmod(0o755)
    return {
        "serve_bench_port": port,
        "serve_bench_served_model_name": "stub",
        "serve_bench_venv": str(venv),
        "serve_bench_profile": "dflash",
        "serve_bench_patchset_id": "sf-test",
        "serve_bench_model_revision": "b" * 40,
        "serve_bench_drafter_revision": "c" * 40,
        "serve_bench_methods": ["decode", "e2e"],
        "serve_bench_quick": True,
        "serve_bench_quick_max_tokens_scale": 0.05,
        "serve_bench_quick_decode_max_requests": 2,
        "serve_bench_decode_workloads": ["counting"],
        "serve_bench_lib_dir": str(tmp_path / "host" / "lib"),
        "serve_bench_results_dir": str(tmp_path / "host" / "bench"),
        "serve_bench_fetch_dir": str(tmp_path / "results"),
        "serve_bench_package_src": str(ROOT / "sparkfleet"),
        **overrides,
    }


def test_bench_writes_fetches_and_reports_results(tmp_path: Path, bench_stub: tuple[StubState, int]) -> None:
    _, port = bench_stub
    # generous baselines the stub beats, one per method, and one the run cannot check (serving)
    baselines = {"decode_tok_s_median": 1.0, "e2e_tok_s": 1.0, "serving_output_tok_s": 1.0, "acceptance_rate": None}
    proc = run_play(tmp_path, "serve_bench", bench_vars(tmp_path, port, serve_bench_baselines=baselines))
    assert proc.returncode == 0, proc.stdout[-3000:]

    host_files = sorted((tmp_path / "host" / "bench").glob("*.json"))
    names = [p.name for p in host_files]
    assert "latest.json" in names
    stamped = [n for n in names if n != "latest.json"]
    assert len(stamped) == 2 and stamped[0].endswith("-decode.json") and stamped[1].endswith("-e2e.json"), names
    assert stamped[0].split("-")[0] == stamped[1].split("-")[0]  # one stamp per run
    # latest.json is the last method's result
    assert (tmp_path / "host" / "bench" / "latest.json").read_text() == host_files[names.index(stamped[1])].read_text()

    fetched = sorted((tmp_path / "results" / "localhost").glob("*.json"))
    assert [p.name for p in fetched] == stamped
    for path in fetched:
        result = json.loads(path.read_text())
        assert result["host"] == "localhost"
        assert result["profile"] == "dflash"
        assert result["patch_set"] == "sf-test"
        assert result["model"]["revision"] == "b" * 40
        assert result["drafter"]["revision"] == "c" * 40
        assert result["vllm_version"] == "0.23.0+stub"
        assert result["comparison"]["passed"] is True
        # each method checked only the baselines it produces; the null one is not checked at all
        checked = [c["figure"] for c in result["comparison"]["checks"]]
        assert checked == (["decode_tok_s_median"] if result["kind"] == "decode" else ["e2e_tok_s"])
    decode = json.loads(fetched[0].read_text())
    assert decode["settings"]["max_requests"] == 2 and decode["settings"]["workloads"] == ["counting"]
    assert decode["settings"]["max_tokens_scale"] == 0.05
    assert decode["figures"]["acceptance_length[counting]"] == pytest.approx(3.0)  # 1 + 2 accepted per draft

    out = proc.stdout
    assert "decode_tok_s_median = " in out and "e2e_tok_s = " in out
    assert "honesty: client TPOT vs server /metrics: median per-request difference" in out
    assert "client CPU share" in out
    assert "baseline decode_tok_s_median: " in out and "baseline e2e_tok_s: " in out
    assert "baselines not checked by decode/e2e: serving_output_tok_s" in out


def test_bench_fails_on_a_regression_and_names_it(tmp_path: Path, bench_stub: tuple[StubState, int]) -> None:
    _, port = bench_stub
    role_vars = bench_vars(tmp_path, port, serve_bench_methods=["e2e"], serve_bench_baselines={"e2e_tok_s": 1e9})
    proc = run_play(tmp_path, "serve_bench", role_vars)
    assert proc.returncode != 0
    assert "regressed beyond 5.0%" in proc.stdout
    assert "e2e_tok_s:" in proc.stdout and "REGRESSION" in proc.stdout
    # the result is still written and fetched, with the failed comparison in it
    fetched = list((tmp_path / "results" / "localhost").glob("*-e2e.json"))
    assert len(fetched) == 1
    assert json.loads(fetched[0].read_text())["comparison"]["passed"] is False


def test_bench_refuses_a_baseline_that_names_no_figure(tmp_path: Path, bench_stub: tuple[StubState, int]) -> None:
    state, port = bench_stub
    role_vars = bench_vars(tmp_path, port, serve_bench_baselines={"serving_decode_tok_s": 107.43})
    proc = run_play(tmp_path, "serve_bench", role_vars)
    assert proc.returncode != 0
    assert "baselines ['serving_decode_tok_s'] of profile dflash name no figure" in proc.stdout
    assert not (tmp_path / "host").exists()  # refused before anything was copied or run
    assert state.bodies == []


# -------------------------------------------------------------------------------------- serve_health


class HealthStub:
    """A vLLM-like server for serve_health: completions, a tool call, and spec-decode counters."""

    PROMPT_IDS = [10, 11, 12, 13, 14]  # "The capital of France is", as the stub tokenizes it
    COMPLETION_IDS = [20, 21, 22]  # " Paris."

    def __init__(
        self,
        tool_name: str = "get_weather",
        acceptance_length: float = 4.0,
        off_greedy: tuple[int, float] | None = None,
    ) -> None:
        self.tool_name = tool_name
        self.acceptance_length = acceptance_length
        # (completion position, how many nats the target's first choice there beats the served token)
        self.off_greedy = off_greedy
        self.drafts = 10.0
        self.accepted = 25.0
        self.generated = 100.0
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def metrics(self) -> str:
        lines = []
        for name, value in (("num_drafts", self.drafts), ("num_accepted_tokens", self.accepted)):
            metric = f"vllm:spec_decode_{name}"
            lines += [
                f"# TYPE {metric} counter",
                f'{metric}_total{{engine="0",model_name="qwen"}} {value / 2}',
                f'{metric}_total{{engine="1",model_name="qwen"}} {value / 2}',
                f'{metric}_created{{engine="0",model_name="qwen"}} 1.7e9',
            ]
        lines.append(f'vllm:generation_tokens_total{{engine="0",model_name="qwen"}} {self.generated}')
        return "\n".join(lines) + "\n"

    def score(self, ids: list[int]) -> list[Any]:
        """vLLM's prompt_logprobs (prompt_logprobs=1) of ``ids``: each token's logprob and rank."""
        scored: list[Any] = [None]
        for index, token in enumerate(ids[1:], 1):
            entry = {str(token): {"logprob": -0.01, "rank": 1, "decoded_token": f"t{token}"}}
            position = index - len(self.PROMPT_IDS)
            if self.off_greedy is not None and position == self.off_greedy[0]:
                gap = self.off_greedy[1]
                entry = {
                    str(token): {"logprob": -0.01 - gap, "rank": 2, "decoded_token": f"t{token}"},
                    "99": {"logprob": -0.01, "rank": 1, "decoded_token": "t99"},
                }
            scored.append(entry)
        return scored

    def handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def reply(self, status: int, payload: Any, content_type: str = "application/json") -> None:
                body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                send(self, status, body, content_type)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self.reply(200, "")
                elif self.path == "/v1/models":
                    self.reply(200, {"data": [{"id": "qwen"}]})
                elif self.path == "/metrics":
                    with stub.lock:
                        self.reply(200, stub.metrics(), "text/plain")
                else:
                    self.reply(404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.bodies.append({"path": self.path, **body})
                tokens = int(body["max_tokens"])
                with stub.lock:  # every generated token was drafted and verified at the stub's acceptance
                    drafts = tokens / stub.acceptance_length
                    stub.drafts += drafts
                    stub.accepted += drafts * (stub.acceptance_length - 1)
                    stub.generated += tokens
                if self.path == "/v1/completions" and body.get("prompt_logprobs"):
                    self.reply(200, {"choices": [{"text": "", "prompt_logprobs": stub.score(body["prompt"])}]})
                elif self.path == "/v1/completions":
                    choice = {"text": " Paris."}
                    if body.get("return_token_ids"):
                        choice.update(prompt_token_ids=stub.PROMPT_IDS, token_ids=stub.COMPLETION_IDS)
                    self.reply(200, {"choices": [choice], "usage": {"completion_tokens": tokens}})
                elif self.path == "/v1/chat/completions" and body.get("tools"):
                    call = {
                        "id": "call-1",
                        "type": "function",
                        "function": {"name": stub.tool_name, "arguments": '{"city": "Paris"}'},
                    }
                    message = {"role": "assistant", "content": None, "tool_calls": [call]}
                    self.reply(200, {"choices": [{"message": message, "finish_reason": "tool_calls"}]})
                else:
                    self.reply(400, {"error": "unexpected request"})

        return Handler


def health_vars(port: str, **overrides: Any) -> dict[str, Any]:
    return {
        "serve_health_port": int(port),
        "serve_health_timeout": 10,
        "serve_health_tool_call_check": True,
        "serve_health_min_acceptance_length": 3.5,
        **overrides,
    }


@pytest.mark.parametrize(
    ("stub_kwargs", "overrides", "message", "acceptance_runs"),
    [
        ({}, {}, None, 1),
        (
            {"tool_name": "get_time"},
            {},
            'failed on localhost at "Run a chat request offering a tool, expect a call of get_weather"',
            0,  # stopped at the tool call
        ),
        ({"acceptance_length": 1.5}, {}, "mean acceptance length 1.5 (1 + 21 accepted / 42 drafts over 64 tokens", 1),
        (
            {"off_greedy": (1, 4.0)},
            {},
            "is not the target's greedy output: [1] of its 3 tokens are not the target's first choice there",
            0,  # stopped at the greedy check
        ),
        ({"off_greedy": (2, 0.02)}, {}, None, 1),  # a near tie between prefill and decode rounding
        (
            {"tool_name": "get_time", "acceptance_length": 1.5},
            {"serve_health_tool_call_expect_name": "", "serve_health_min_acceptance_length": 0},
            None,
            0,  # acceptance check off
        ),
    ],
    ids=["healthy", "wrong-tool", "low-acceptance", "off-greedy", "near-tie", "checks-relaxed"],
)
def test_health_tool_call_and_acceptance(
    tmp_path: Path, stub_kwargs: dict[str, Any], overrides: dict[str, Any], message: str | None, acceptance_runs: int
) -> None:
    stub = HealthStub(**stub_kwargs)
    httpd, port = serve(stub.handler())
    try:
        proc = run_play(tmp_path, "serve_health", health_vars(port, **overrides))
    finally:
        httpd.shutdown()
        httpd.server_close()
    if message is None:
        assert proc.returncode == 0, proc.stdout[-3000:]
    else:
        assert proc.returncode != 0
        assert message in proc.stdout + proc.stderr, proc.stdout[-3000:]
    scored = [b for b in stub.bodies if b.get("prompt_logprobs")]
    assert [b["prompt"] for b in scored] == [stub.PROMPT_IDS + stub.COMPLETION_IDS]
    assert scored[0]["max_tokens"] == 1 and scored[0]["prompt_logprobs"] == 1
    tool_requests = [b for b in stub.bodies if b["path"] == "/v1/chat/completions"]
    if stub.off_greedy is not None and stub.off_greedy[1] > 0.05:
        assert tool_requests == []  # the gate stopped at the greedy check
        return
    assert len(tool_requests) == 1
    assert tool_requests[0]["tool_choice"] == "auto" and tool_requests[0]["temperature"] == 0
    assert tool_requests[0]["tools"][0]["function"]["name"] == "get_weather"
    assert len([b for b in stub.bodies if b.get("prompt") == "1 2 3 4 5 6 7 8"]) == acceptance_runs


# ------------------------------------------------------------------------------ contracts and filter


@pytest.mark.parametrize("role", ROLES)
def test_argument_specs_match_defaults(role: str) -> None:
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(options) == set(defaults), set(options) ^ set(defaults)
    for name, option in options.items():
        assert name.startswith(f"{role}_")
        if "{{" not in str(defaults[name]):
            assert option.get("default") == defaults[name], name


def load_health_filter(name: str) -> Any:
    """One of serve_health's filter plugin files, imported as a module (no Ansible needed)."""
    path = ROOT / "filter_plugins" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"serve_health_{name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prometheus_sum_adds_every_label_set_and_skips_lookalikes() -> None:
    module = load_health_filter("prometheus_text")
    text = (
        HealthStub().metrics()
        + "vllm:spec_decode_num_drafts_total_other 99\nvllm:spec_decode_num_drafts_total 1 1700\n"
    )
    assert module.sparkfleet_prometheus_sum(text, "vllm:spec_decode_num_drafts_total") == 11.0
    assert module.sparkfleet_prometheus_sum(text, "vllm:absent_total") == 0.0


@pytest.mark.parametrize(
    ("text", "name", "fragment"),
    [
        (None, "vllm:x_total", "expected the /metrics text, got NoneType"),
        ("", "not a name", "'not a name' is not a Prometheus metric name"),
        ('vllm:x_total{a="1" 3\n', "vllm:x_total", "unterminated labels"),
        ("vllm:x_total{} abc\n", "vllm:x_total", "value 'abc'"),
    ],
)
def test_prometheus_sum_names_bad_input(text: Any, name: str, fragment: str) -> None:
    module = load_health_filter("prometheus_text")
    with pytest.raises(module.AnsibleFilterError, match=fragment.replace("(", r"\(")):
        module.sparkfleet_prometheus_sum(text, name)


def test_payload_is_what_ops_bench_ships() -> None:
    """The role copies the same files as `sparkfleet ops bench` (one list of what the clients need)."""
    from sparkfleet.fleet.fleet_ops import BENCH_PAYLOAD_GLOBS

    role_vars = yaml.safe_load((ROOT / "roles" / "serve_bench" / "vars" / "main.yml").read_text())
    for pattern in BENCH_PAYLOAD_GLOBS:
        assert f"serve_bench_package_src ~ '/{pattern}'" in role_vars["__serve_bench_payload"], pattern


def test_greedy_check_names_each_token_that_is_not_the_first_choice() -> None:
    module = load_health_filter("greedy_check")
    stub = HealthStub(off_greedy=(0, 1.0))
    scored = stub.score(stub.PROMPT_IDS + stub.COMPLETION_IDS)
    result = module.sparkfleet_greedy_check(scored, len(stub.PROMPT_IDS), stub.COMPLETION_IDS, 0.05)
    assert result == {
        "ok": False,
        "tokens": 3,
        "mismatches": [
            {"position": 0, "token": 20, "rank": 2, "logprob": -1.01, "top_token": 99, "top_logprob": -0.01}
        ],
        "ties": [],
    }
    healthy = HealthStub().score(stub.PROMPT_IDS + stub.COMPLETION_IDS)
    assert module.sparkfleet_greedy_check(healthy, 5, stub.COMPLETION_IDS) == {
        "ok": True,
        "tokens": 3,
        "mismatches": [],
        "ties": [],
    }
    tie = module.sparkfleet_greedy_check(scored, 5, stub.COMPLETION_IDS, 2.0)
    assert tie["ok"] and [t["position"] for t in tie["ties"]] == [0]


@pytest.mark.parametrize(
    ("logprobs", "prompt_len", "completion", "fragment"),
    [
        (None, 5, [1], "expected the response's prompt_logprobs list, got NoneType"),
        ([None, {}], 1, ["a"], "completion_ids must be token ids"),
        ([None, {"7": {"logprob": -1, "rank": 1}}], 5, [7], "no entry for position 5"),
        ([None, {"7": {"logprob": -1, "rank": 1}}], 1, [8], "token 8 is not in its prompt_logprobs entry"),
    ],
)
def test_greedy_check_names_bad_input(logprobs: Any, prompt_len: int, completion: Any, fragment: str) -> None:
    module = load_health_filter("greedy_check")
    with pytest.raises(module.AnsibleFilterError, match=fragment):
        module.sparkfleet_greedy_check(logprobs, prompt_len, completion)


PARTITION = "{{ __serve_bench_baselines_by_method | to_json }}"


def test_each_method_gets_only_the_baselines_it_writes(tmp_path: Path) -> None:
    """decode's per-workload acceptance_length[<workload>] never reaches serving, whose per-concurrency
    acceptance is serving_acceptance_length[conc<N>] (else every serving run fails "not measured")."""
    playbook = tmp_path / "partition.yml"
    role = ROOT / "roles" / "serve_bench"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars_files": [str(role / "defaults" / "main.yml"), str(role / "vars" / "main.yml")],
                    "tasks": [{"ansible.builtin.debug": {"msg": "PARTITION" + PARTITION}}],
                }
            ]
        )
    )
    baselines = {"acceptance_length[prose]": 2.0, "serving_acceptance_length[conc2]": 1.0, "acceptance_length": 3.0}
    proc = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", "-c", "local", str(playbook), "-e",
         json.dumps({"serve_bench_baselines": baselines})],
        capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "PARTITION" in x)
    partition = json.loads(yaml.safe_load(line.strip())["msg"].removeprefix("PARTITION"))  # a YAML result line
    assert partition["decode"] == {"acceptance_length[prose]": 2.0}
    assert partition["serving"] == {"acceptance_length": 3.0, "serving_acceptance_length[conc2]": 1.0}
    assert partition["e2e"] == {"acceptance_length": 3.0}
