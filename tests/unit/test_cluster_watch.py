"""The cluster watch (files/bin/sparkfleet-cluster-watch), run for real against local stand-ins.

The head's server is an http.server on 127.0.0.1 that answers, fails or hangs on command; the worker's head
is a listening TCP socket; systemd is a fake systemctl (SPARKFLEET_SYSTEMCTL) that answers `show` from a
file the test writes and logs every `restart`, after which it reports a new run of the unit, active from
now (as systemd does), so that --grace keeps the watch from restarting it again while a test looks.
Watch.round() is also driven in-process, for the rules that timing would make slow to show end to end.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "files" / "bin" / "sparkfleet-cluster-watch"
UNIT = "sparkfleet-vllm-dflash-tp2.service"
MODEL = "qwen3.5-122b"
KEY = "sk-test-4f1d9c0e7b2a"
SHOW_ARGV = ["show", "-p", "ActiveState", "-p", "ActiveEnterTimestampMonotonic", "-p", "InvocationID", UNIT]


def load_watch() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("cluster_watch", str(SCRIPT))
    spec = importlib.util.spec_from_loader("cluster_watch", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cluster_watch"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


watch_module = load_watch()


def monotonic_us() -> int:
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- a fake systemctl -------------------------------------------------------------------------------------

FAKE_SYSTEMCTL = """\
#!{python}
import json, os, sys, time
state = os.environ["FAKE_SYSTEMCTL_DIR"]
with open(os.path.join(state, "calls"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "show":
    with open(os.path.join(state, "show")) as show:
        sys.stdout.write(show.read())
elif sys.argv[1] == "restart":
    # systemd starts a new run of the unit, active from now
    now = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    text = f"ActiveState=active\\nActiveEnterTimestampMonotonic={{now}}\\nInvocationID=restarted{{now}}\\n"
    with open(os.path.join(state, "show.tmp"), "w") as show:
        show.write(text)
    os.replace(os.path.join(state, "show.tmp"), os.path.join(state, "show"))
else:
    sys.exit(f"fake systemctl: unexpected {{sys.argv[1:]}}")
"""


class Systemd:
    """The fake systemctl's directory: what `show` answers, and every call it got."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir()
        self.binary = directory / "systemctl"
        self.binary.write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
        self.binary.chmod(0o755)
        self.set("active", since_s=3600)

    def set(self, state: str, since_s: float, invocation: str = "0123abcd") -> None:
        """UNIT in state, entered since_s seconds ago (at least one microsecond after boot)."""
        since = max(1, monotonic_us() - int(since_s * 1e6))
        text = f"ActiveState={state}\nActiveEnterTimestampMonotonic={since}\nInvocationID={invocation}\n"
        (self.directory / "show.tmp").write_text(text)
        os.replace(self.directory / "show.tmp", self.directory / "show")

    def calls(self) -> list[list[str]]:
        path = self.directory / "calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def restarts(self) -> list[list[str]]:
        return [call for call in self.calls() if call[0] == "restart"]


@pytest.fixture
def systemd(tmp_path: Path) -> Systemd:
    return Systemd(tmp_path / "systemd")


# --- the watch as a process -------------------------------------------------------------------------------


@dataclass
class Watcher:
    process: subprocess.Popen[str]
    stdout: str = ""
    stderr: str = ""

    def stop(self) -> int:
        """SIGTERM; the exit status (it must come within 2 s)."""
        self.process.send_signal(signal.SIGTERM)
        self.stdout, self.stderr = self.process.communicate(timeout=2)
        return self.process.returncode

    def restart_lines(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if "restarting this node's server" in line]


@pytest.fixture
def start(systemd: Systemd) -> Iterator[Callable[..., Watcher]]:
    started: list[Watcher] = []

    def run(*args: str) -> Watcher:
        env = {**os.environ, "SPARKFLEET_SYSTEMCTL": str(systemd.binary), "FAKE_SYSTEMCTL_DIR": str(systemd.directory)}
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--unit", UNIT, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(Watcher(process))
        return started[-1]

    yield run
    for watcher in started:
        if watcher.process.poll() is None:
            watcher.process.kill()
            watcher.process.communicate()


# --- a stand-in for the head's API server -------------------------------------------------------------------


@dataclass
class Api:
    """What the server does with a completion ("ok", "500", "no-choices", "flap": 500 and 200 in turn, "hang")
    and what it got."""

    mode: str = "ok"
    requests: list[dict] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, since: int = 0) -> int:
        with self.lock:
            return len(self.requests) - since


def handler_for(api: Api) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with api.lock:
                api.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(body)}
                )
                mode, number = api.mode, len(api.requests)
            if mode == "hang":
                api.release.wait(15)  # longer than the watch's timeout (5 s)
                return
            if mode == "garbage":
                self.wfile.write(b"SPDY/9 what\r\n\r\n")
                return
            if mode == "not-json":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"<p")
                return
            if mode == "500" or (mode == "flap" and number % 2):
                self.reply(500, {"error": "engine dead"})
            elif mode == "no-choices":
                self.reply(200, {"choices": []})
            else:
                self.reply(200, {"id": "cmpl-1", "choices": [{"index": 0, "text": " 1"}]})

    return Handler


@pytest.fixture
def api() -> Iterator[tuple[Api, str]]:
    state = Api()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    state.release.set()
    server.shutdown()
    server.server_close()


def head_args(url: str, *extra: str) -> list[str]:
    return ["--role", "head", "--url", url, "--model", MODEL, "--interval", "0.2", *extra]


# --- head ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "reason"), [("500", "HTTP 500"), ("no-choices", "HTTP 200 without choices")])
def test_head_restarts_once_after_failures_in_a_row(
    systemd: Systemd, start: Callable[..., Watcher], api: tuple[Api, str], tmp_path: Path, mode: str, reason: str
) -> None:
    server, url = api
    key_file = tmp_path / "secrets.env"
    key_file.write_text(f"# the unit's secrets\nHF_TOKEN=hf_other\nVLLM_API_KEY={KEY}\n")
    key_file.chmod(0o600)
    watcher = start(*head_args(url, "--failures", "3", "--grace", "30", "--key-file", str(key_file)))
    wait_for(lambda: server.count() >= 5, "five answered probes")
    assert systemd.restarts() == []
    assert systemd.calls()[0] == SHOW_ARGV
    with server.lock:
        assert {r["path"] for r in server.requests} == {"/v1/completions"}
        assert {r["auth"] for r in server.requests} == {f"Bearer {KEY}"}
        assert server.requests[0]["body"] == {"model": MODEL, "prompt": "1", "max_tokens": 1, "temperature": 0}
        server.mode, answered = mode, len(server.requests)
    wait_for(lambda: systemd.restarts(), "a restart")
    time.sleep(1)  # five more rounds: the new run is within --grace, so no more probes and no more restarts
    assert systemd.restarts() == [["restart", UNIT]]
    assert server.count(since=answered) == 3
    assert watcher.stop() == 0
    assert watcher.restart_lines() == [
        f"sparkfleet-cluster-watch: {UNIT}: 3 one-token completions through every stage failed (last: {reason}): "
        "a cluster member is lost; restarting this node's server"
    ]
    assert KEY not in watcher.stdout + watcher.stderr


def test_a_probe_that_answers_resets_the_count(
    systemd: Systemd, start: Callable[..., Watcher], api: tuple[Api, str]
) -> None:
    server, url = api
    server.mode = "flap"  # failed, answered, failed, ...: never 2 failures in a row
    watcher = start(*head_args(url, "--failures", "2", "--grace", "30"))
    wait_for(lambda: server.count() >= 10, "ten probes", timeout=15)
    assert systemd.restarts() == []
    with server.lock:
        assert {r["auth"] for r in server.requests} == {None}  # no --key-file, no header
        server.mode = "500"
    wait_for(lambda: systemd.restarts(), "a restart")
    assert watcher.stop() == 0
    assert len(watcher.restart_lines()) == 1
    assert systemd.restarts() == [["restart", UNIT]]


def test_a_hanging_head_is_restarted_after_timeouts(
    systemd: Systemd, start: Callable[..., Watcher], api: tuple[Api, str]
) -> None:
    # the measured failure: /health answers, a completion hangs; the timeout is max(--interval, 5 s)
    server, url = api
    watcher = start(*head_args(url, "--failures", "2", "--grace", "30"))
    wait_for(lambda: server.count() >= 3, "three answered probes")
    with server.lock:
        server.mode, answered = "hang", len(server.requests)
    wait_for(lambda: server.count(since=answered) == 1, "the first hanging probe")
    time.sleep(5.5)  # the first probe timed out, the second hangs: one failure is not enough
    assert server.count(since=answered) == 2
    assert systemd.restarts() == []
    wait_for(lambda: systemd.restarts(), "a restart")
    time.sleep(0.5)
    assert systemd.restarts() == [["restart", UNIT]]
    assert server.count(since=answered) == 2
    assert watcher.stop() == 0
    assert watcher.restart_lines() == [
        f"sparkfleet-cluster-watch: {UNIT}: 2 one-token completions through every stage failed "
        "(last: timed out after 5 s): a cluster member is lost; restarting this node's server"
    ]


# --- worker -------------------------------------------------------------------------------------------------


def listener(family: socket.AddressFamily, address: str) -> tuple[socket.socket, list[int]]:
    """A listening socket that accepts (and counts) connections in a thread."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(16)
    accepted: list[int] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = sock.accept()
            except OSError:
                return  # closed
            accepted.append(1)
            connection.close()

    threading.Thread(target=accept, daemon=True).start()
    return sock, accepted


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("family", "address"),
    [
        (socket.AF_INET, "127.0.0.1"),
        pytest.param(
            socket.AF_INET6,
            "::1",
            marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
    ids=["ipv4", "ipv6"],
)
def test_worker_restarts_once_when_the_heads_master_port_closes(
    systemd: Systemd, start: Callable[..., Watcher], family: socket.AddressFamily, address: str
) -> None:
    sock, accepted = listener(family, address)
    port = sock.getsockname()[1]
    master = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
    watcher = start("--role", "worker", "--master", master, "--interval", "0.2", "--failures", "2", "--grace", "30")
    wait_for(lambda: len(accepted) >= 5, "five connects")
    assert systemd.restarts() == []
    sock.close()
    wait_for(lambda: systemd.restarts(), "a restart")
    time.sleep(1)
    assert systemd.restarts() == [["restart", UNIT]]
    assert watcher.stop() == 0
    assert watcher.restart_lines() == [
        f"sparkfleet-cluster-watch: {UNIT}: 2 connects to the head's master port {master} failed "
        "(last: connection refused): the head is gone; restarting this node's server"
    ]


# --- grace and inactive units -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "since_s"),
    [("active", 0), ("activating", 3600), ("inactive", 3600), ("failed", 3600)],
    ids=["active-within-grace", "activating", "inactive", "failed"],
)
def test_no_probe_and_no_restart_while_starting_or_not_active(
    systemd: Systemd, start: Callable[..., Watcher], api: tuple[Api, str], state: str, since_s: float
) -> None:
    server, url = api
    server.mode = "500"
    systemd.set(state, since_s=since_s)
    watcher = start(*head_args(url, "--failures", "2", "--grace", "20"))
    wait_for(lambda: len(systemd.calls()) >= 6, "six rounds")
    assert systemd.restarts() == []
    assert server.count() == 0
    systemd.set("active", since_s=21)  # the same unit, now past --grace: the failures count
    wait_for(lambda: systemd.restarts(), "a restart")
    assert server.count() == 2
    assert watcher.stop() == 0
    assert len(watcher.restart_lines()) == 1


# --- usage and signals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ([], "--unit"),
        (["--unit", UNIT], "--role"),
        (["--unit", UNIT, "--role", "leader"], "'leader'"),
        (["--unit", UNIT, "--role", "head", "--model", MODEL], "--url"),
        (["--unit", UNIT, "--role", "head", "--url", "http://127.0.0.1:8000"], "--model"),
        (["--unit", UNIT, "--role", "head", "--url", "127.0.0.1:8000", "--model", MODEL], "'127.0.0.1:8000'"),
        (["--unit", UNIT, "--role", "worker"], "--master"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1"], "'10.0.0.1'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:99999"], "'10.0.0.1:99999'"),
        (["--unit", UNIT, "--role", "worker", "--master", "fe80::1:29501"], "'fe80::1:29501'"),
        (["--unit", UNIT, "--role", "worker", "--master", "[10.0.0.1]:29501"], "'[10.0.0.1]:29501'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--interval", "0"], "'0'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--interval", "-1"], "'-1'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--interval", "soon"], "'soon'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--failures", "0"], "'0'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--failures", "1.5"], "'1.5'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--grace", "nan"], "'nan'"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--model", MODEL], "--model"),
        (["--unit", UNIT, "--role", "worker", "--master", "10.0.0.1:29501", "--every", "5"], "'--every'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], named: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("sparkfleet-cluster-watch: ")
    assert named in done.stderr


@pytest.mark.parametrize("during", ["sleep", "probe"])
def test_sigterm_exits_0_at_once(
    systemd: Systemd, start: Callable[..., Watcher], api: tuple[Api, str], during: str
) -> None:
    server, url = api
    if during == "probe":
        server.mode = "hang"  # the probe blocks for up to 5 s
        watcher = start(*head_args(url))
        wait_for(lambda: server.count() == 1, "a probe in flight")
    else:
        watcher = start(*head_args(url)[:-2], "--interval", "60")
        wait_for(lambda: server.count() == 1, "the first probe")
        time.sleep(0.2)  # now in its 60 s sleep
    began = time.monotonic()
    assert watcher.stop() == 0  # communicate(timeout=2) raises past 2 s
    assert time.monotonic() - began < 2
    assert "Traceback" not in watcher.stderr
    assert watcher.stdout.startswith(f"sparkfleet-cluster-watch: watching {UNIT} (head): ")


# --- Watch.round in-process: the rules, with an injected systemd, probe and clock ----------------------------


class Rig:
    """A Watch with a scripted unit state, probe results and clock."""

    def __init__(self, failures: int = 2, grace: float = 60) -> None:
        self.state = {"ActiveState": "active", "ActiveEnterTimestampMonotonic": str(10**9), "InvocationID": "a"}
        self.now = 10_000.0
        self.result: str | None = None
        self.restarts = 0
        self.lines: list[str] = []
        options = watch_module.Options(unit=UNIT, role="worker", failures=failures, grace=grace, master=("::1", 29501))
        self.watch = watch_module.Watch(
            options,
            show=lambda: dict(self.state),
            probe=lambda: self.result,
            restart=self.restart,
            clock=lambda: self.now,
            note=self.lines.append,
        )

    def restart(self) -> None:
        self.restarts += 1

    def rounds(self, count: int, result: str | None) -> None:
        self.result = result
        for _ in range(count):
            self.watch.round()


def test_a_new_run_of_the_unit_counts_afresh() -> None:
    rig = Rig(failures=3)
    rig.rounds(2, "connection refused")
    rig.state["InvocationID"] = "b"  # systemd restarted the unit in between: its failures start from 0
    rig.rounds(2, "connection refused")
    assert rig.restarts == 0
    rig.rounds(1, "connection refused")
    assert rig.restarts == 1
    assert rig.lines == [
        f"sparkfleet-cluster-watch: {UNIT}: 3 connects to the head's master port [::1]:29501 failed "
        "(last: connection refused): the head is gone; restarting this node's server"
    ]


def test_grace_is_measured_on_the_monotonic_clock_in_microseconds() -> None:
    rig = Rig(failures=1, grace=60)
    rig.state["ActiveEnterTimestampMonotonic"] = str(int((rig.now - 59.5) * 1e6))
    rig.rounds(3, "connection refused")
    assert rig.restarts == 0
    rig.now += 1  # 60.5 s since the start
    rig.rounds(1, "connection refused")
    assert rig.restarts == 1


def test_a_round_outside_active_resets_the_count() -> None:
    rig = Rig(failures=2)
    rig.rounds(1, "timed out after 5 s")
    rig.state["ActiveState"] = "deactivating"
    rig.rounds(1, "timed out after 5 s")
    rig.state["ActiveState"] = "active"
    rig.rounds(1, "timed out after 5 s")
    assert rig.restarts == 0
    rig.rounds(1, "timed out after 5 s")
    assert rig.restarts == 1


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("ok", None),
        ("500", "HTTP 500"),
        ("no-choices", "HTTP 200 without choices"),
        ("not-json", "HTTP 200 with a body that is not a JSON object"),
        ("garbage", "not an HTTP answer (BadStatusLine)"),
    ],
)
def test_a_head_probe_says_why_it_failed(api: tuple[Api, str], mode: str, reason: str | None) -> None:
    server, url = api
    server.mode = mode
    assert watch_module.probe_head(url, MODEL, KEY, 5) == reason
    assert server.requests[0]["auth"] == f"Bearer {KEY}"


def test_a_key_that_cannot_be_sent_is_not_shown(api: tuple[Api, str]) -> None:
    _server, url = api
    reason = watch_module.probe_head(url, MODEL, f"{KEY}\r\nX-Injected: 1", 5)
    assert reason == "the request could not be sent (ValueError)"


def test_a_head_probe_of_a_closed_port_is_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert watch_module.probe_head(f"http://127.0.0.1:{port}", MODEL, None, 5) == "connection refused"


def test_the_key_file_gives_the_vllm_api_key(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    path.write_text('# Secrets for sparkfleet-vllm-dflash-tp2.service\nHF_TOKEN=hf_abc\nVLLM_API_KEY="sk-quoted"\n')
    assert watch_module.read_api_key(str(path)) == "sk-quoted"
    path.write_text("HF_TOKEN=hf_abc\n")
    assert watch_module.read_api_key(str(path)) is None


def test_show_output_is_parsed_as_key_value_lines() -> None:
    text = "ActiveState=active\nActiveEnterTimestampMonotonic=123456789\nInvocationID=9f2c\n"
    assert watch_module.parse_show(text) == {
        "ActiveState": "active",
        "ActiveEnterTimestampMonotonic": "123456789",
        "InvocationID": "9f2c",
    }
