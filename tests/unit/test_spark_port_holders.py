"""spark_port_holders reads listeners from /proc: a recorded tree, and this machine's own /proc."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("spark_port_holders", ROOT / "library/spark_port_holders.py")
holders_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(holders_mod)

# /proc/net/tcp as the kernel writes it: 0.0.0.0:8000 and 127.0.0.1:8011 listening, one connection on 8000
TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 5001 1 0 100 0 0 10 0
   1: 0100007F:1F4B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5002 1 0 100 0 0 10 0
   2: 0100007F:1F40 0100007F:D431 01 00000000:00000000 00:00000000 00000000   999        0 5003 1 0 100 0 0 10 0
"""
TCP6 = (
    "  sl  local_address                         remote_address                        st tx_queue rx_queue\n"
    "   0: 00000000000000000000000000000000:1F4B 00000000000000000000000000000000:0000 0A "
    "00000000:00000000 00:00000000 00000000     0        0 5004 1 0 100 0 0 10 0\n"
)


def proc_tree(root: Path, procs: dict[int, tuple[str, str, list[int]]]) -> Path:
    (root / "net").mkdir(parents=True)
    (root / "net/tcp").write_text(TCP)
    (root / "net/tcp6").write_text(TCP6)
    for pid, (comm, cgroup, inodes) in procs.items():
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "comm").write_text(comm + "\n")
        (root / str(pid) / "cgroup").write_text(cgroup)
        for fd, inode in enumerate(inodes, start=3):
            os.symlink(f"socket:[{inode}]", root / str(pid) / "fd" / str(fd))
        os.symlink("/dev/null", root / str(pid) / "fd" / "0")
    (root / "self").mkdir()
    return root


def test_listeners_on_the_ports_with_their_process_and_unit(tmp_path: Path) -> None:
    proc = proc_tree(
        tmp_path / "proc",
        {
            101: ("vllm", "0::/system.slice/sparkfleet-vllm-dflash.service\n", [5001]),
            202: ("python3", "0::/system.slice/squatter.service\n", [5002, 5004]),
            303: ("sshd", "0::/user.slice/user-0.slice/session-3.scope\n", [5003]),  # connected, not listening
        },
    )
    assert holders_mod.port_holders(proc, [8000]) == [
        {"port": 8000, "pid": 101, "comm": "vllm", "unit": "sparkfleet-vllm-dflash.service"}
    ]
    assert holders_mod.port_holders(proc, [8011]) == [
        {"port": 8011, "pid": 202, "comm": "python3", "unit": "squatter.service"}
    ]
    assert holders_mod.port_holders(proc, [9999]) == []


def test_a_listener_of_an_unseen_process_is_still_reported(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path / "proc", {})
    assert holders_mod.port_holders(proc, [8000]) == [{"port": 8000, "pid": None, "comm": "?", "unit": ""}]


def test_cgroup_v1_and_v2_lines_give_the_innermost_unit() -> None:
    v1 = "12:pids:/system.slice/foo.service\n1:name=systemd:/system.slice/foo.service\n"
    assert holders_mod.unit_of(v1) == "foo.service"
    assert holders_mod.unit_of("0::/user.slice/user-0.slice/user@0.service/app.slice/run-r1.scope\n") == "run-r1.scope"
    assert holders_mod.unit_of("0::/\n") is None


def test_this_machine_s_own_listener_is_found_and_then_gone() -> None:
    code = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(60)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        found = holders_mod.port_holders(Path("/proc"), [port])
        assert [(h["port"], h["pid"]) for h in found] == [(port, server.pid)]
        assert found[0]["comm"].startswith("python")
    finally:
        server.kill()
        server.wait()
    deadline = time.time() + 5
    while holders_mod.port_holders(Path("/proc"), [port]) and time.time() < deadline:
        time.sleep(0.1)
    assert holders_mod.port_holders(Path("/proc"), [port]) == []
