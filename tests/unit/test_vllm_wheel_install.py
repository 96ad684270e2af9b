"""vllm_wheel's two long steps, run for real by ansible-playbook on this machine (connection local):

- the wheelhouse push (tasks/wheelhouse.yml): only the wheels the host lacks or holds different go over,
  one copy each, labelled "k of N, X of Y GiB"; check mode sends nothing and says what it would send; a
  converged host sends nothing (changed=0);
- the venv install (tasks/pip.yml): pip runs as an async job while a poll prints ``progress:`` lines
  (files/bin/sparkfleet-job-progress) that the sparkfleet_progress callback shows; the install is
  changed only when pip installed something, check mode installs nothing and says it would, a locked
  install is hash-checked, and ``__vllm_wheel_pip`` / ``__vllm_wheel_pip_locked`` say what changed.

The wheels are written here by hand (a fake ``vllm`` and a dependency); pip installs them offline.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from tests.unit.helpers import ROOT, needs_ansible_playbook, run_playbook, write_hosts, write_play

pytestmark = [
    needs_ansible_playbook,
    pytest.mark.skipif(os.geteuid() != 0, reason="the role installs files owned by root"),
]
HELPER = ROOT / "files" / "bin" / "sparkfleet-job-progress"
VERSION = "0.0.1+test"


def write_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel with one module, its METADATA, WHEEL and RECORD (sha256 of each file)."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {req}\n" for req in requires
    )
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sparkfleet-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in {**files, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return wheel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def play(tmp_path: Path, tasks_from: str, role_vars: dict, *flags: str) -> subprocess.CompletedProcess[str]:
    """The role's ``tasks_from`` on spark-x (this machine) with ``role_vars`` (extra vars), then what pip
    registered. An inventory of the test's own: the run lock is per inventory."""
    playbook = tmp_path / f"{tasks_from}-play.yml"
    report = {
        "ansible.builtin.debug": {
            "msg": "registered: pip {{ __vllm_wheel_pip is changed }} locked {{ __vllm_wheel_pip_locked is changed }}"
        },
        "when": tasks_from == "pip",
    }
    write_play(playbook, [{"ansible.builtin.include_role": {"name": "vllm_wheel", "tasks_from": tasks_from}}, report])
    extra = tmp_path / f"{tasks_from}-vars.json"
    extra.write_text(json.dumps(role_vars))
    proc = run_playbook(write_hosts(tmp_path / "inventory"), playbook, "-e", f"@{extra}", *flags)
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    return proc


def recap_changed(proc: subprocess.CompletedProcess[str]) -> int:
    return int(re.search(r"spark-x\s*: ok=\d+\s+changed=(\d+)", proc.stdout)[1])


# ------------------------------------------------------------------------------------------ the push


def pushed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The labels of the wheels the push sent (or, in check mode, would send)."""
    return re.findall(r"^changed: \[spark-x\] => \(item=(.*)\)$", proc.stdout, flags=re.M)


def test_the_push_sends_only_what_differs_counting_wheels_and_bytes(tmp_path: Path) -> None:
    source = tmp_path / "controller"
    wheels = [write_wheel(source, f"spark-dep-{n}", "1.0") for n in "abc"]
    (source / "torch.whl").write_bytes(os.urandom(3 * 2**20))  # sent last (by name)
    root = tmp_path / "host"
    host = root / "wheelhouse"
    role_vars = {"vllm_wheel_wheelhouse_src": str(source), "vllm_wheel_root": str(root)}

    checked = play(tmp_path, "wheelhouse", role_vars, "--check", "--diff")
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert len(pushed(checked)) == 4 and not root.exists(), "check mode sent something, or listed too little"

    first = play(tmp_path, "wheelhouse", role_vars)
    assert first.returncode == 0, first.stdout[-3000:]
    labels = pushed(first)  # "NAME: k of N, bytes sent of bytes to send"
    (sent, of), last = re.fullmatch(r"spark_dep_a-.*: 1 of 4, (.+) of (.+)", labels[0]).groups(), labels[-1]
    assert sent != of and re.fullmatch(rf"torch\.whl: 4 of 4, {re.escape(of)} of {re.escape(of)}", last), labels
    assert of == "3.00 MB", of  # 3 MiB and three wheels of a few hundred bytes
    assert {p.name: sha256(p) for p in host.iterdir()} == {p.name: sha256(p) for p in source.iterdir()}
    assert {oct(p.stat().st_mode & 0o777) for p in host.iterdir()} == {"0o644"}

    again = play(tmp_path, "wheelhouse", role_vars)
    assert again.returncode == 0 and recap_changed(again) == 0 and pushed(again) == [], again.stdout[-3000:]

    (host / wheels[1].name).write_bytes(b"not the wheel")  # content differs
    (host / wheels[2].name).chmod(0o600)  # mode differs
    (host / wheels[0].name).unlink()  # missing
    fixed = play(tmp_path, "wheelhouse", role_vars)
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    assert [label.split(":")[0] for label in pushed(fixed)] == [w.name for w in wheels]
    assert pushed(fixed)[-1].startswith(f"{wheels[2].name}: 3 of 3, ")
    assert {p.name: sha256(p) for p in host.iterdir()} == {p.name: sha256(p) for p in source.iterdir()}


# ------------------------------------------------------------------------------------------- the pip


@pytest.fixture(scope="module")
def system_venv_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The role makes venvs with ``/usr/bin/python3 -m venv`` (ensurepip: Debian's python3-venv)."""
    target = tmp_path_factory.mktemp("venv-probe") / "venv"
    made = subprocess.run(["/usr/bin/python3", "-m", "venv", str(target)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"/usr/bin/python3 -m venv fails here: {made.stderr.strip()[-200:]}")


def pip_vars(tmp_path: Path, **extra: object) -> dict:
    house = tmp_path / "wheelhouse"
    vllm = write_wheel(house, "vllm", VERSION, requires=("spark-dep-a",))
    write_wheel(house, "spark-dep-a", "1.0")
    root = tmp_path / "root"
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    (root / "venvs").mkdir(exist_ok=True)
    return {
        "__vllm_wheel": {"version": VERSION, "wheel": vllm.name, "sha256": sha256(vllm)},
        "vllm_wheel_root": str(root),
        "vllm_wheel_wheelhouse": str(house),
        "vllm_wheel_requirements": ["spark-dep-a==1.0"],
        "vllm_wheel_progress_interval": 1,
        **extra,
    }


def venv_of(tmp_path: Path) -> Path:
    return tmp_path / "root" / "venvs" / f"vllm-{VERSION}"


def progress_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("[spark-x] ")]


@pytest.mark.usefixtures("system_venv_works")
def test_pip_runs_as_a_job_with_progress_lines_and_changes_only_what_it_installs(tmp_path: Path) -> None:
    role_vars = pip_vars(tmp_path)

    checked = play(tmp_path, "pip", role_vars, "--check")
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert "registered: pip True locked False" in checked.stdout  # it would install
    assert not venv_of(tmp_path).exists(), "check mode made the venv"

    first = play(tmp_path, "pip", role_vars)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "registered: pip True locked False" in first.stdout
    site = next(venv_of(tmp_path).glob("lib/python3*/site-packages"))
    assert {p.name for p in site.glob("*.dist-info")} >= {f"vllm-{VERSION}.dist-info", "spark_dep_a-1.0.dist-info"}
    # the poll printed while pip ran (venv and pip's start take seconds; the interval is 1 s)
    shown = progress_lines(first)
    assert shown, first.stdout[-3000:]
    for line in shown:
        assert re.fullmatch(rf"\[spark-x\] pip into vllm-{re.escape(VERSION)}, \d+ s: .*installed.*; pip: .+", line)

    again = play(tmp_path, "pip", role_vars)
    assert again.returncode == 0 and recap_changed(again) == 0, again.stdout[-3000:]
    assert "registered: pip False locked False" in again.stdout


@pytest.mark.usefixtures("system_venv_works")
def test_a_locked_install_is_hash_checked(tmp_path: Path) -> None:
    role_vars = pip_vars(tmp_path)
    dep = tmp_path / "wheelhouse" / "spark_dep_a-1.0-py3-none-any.whl"
    lock = tmp_path / "lock.txt"
    lock.write_text(f"spark-dep-a==1.0 \\\n    --hash=sha256:{'0' * 64}\n")
    refused = play(tmp_path, "pip", {**role_vars, "vllm_wheel_lock": str(lock)})
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stdout, refused.stdout[-3000:]

    lock.write_text(f"spark-dep-a==1.0 \\\n    --hash=sha256:{sha256(dep)}\n")
    locked = play(tmp_path, "pip", {**role_vars, "vllm_wheel_lock": str(lock)})
    assert locked.returncode == 0, locked.stdout[-3000:]
    assert "registered: pip False locked True" in locked.stdout


# ---------------------------------------------------------------------------------------- the helper


def helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=30, check=False)


def test_the_helper_reports_the_pins_in_place_and_pips_last_step(tmp_path: Path) -> None:
    job = tmp_path / "j1.2"
    job.write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": "j1.2"}))
    os.utime(job, (time.time() - 5, time.time() - 5))  # the job began 5 s ago
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    old = site / "Jinja2-3.1.6.dist-info"
    old.mkdir(parents=True)
    os.utime(old, (time.time() - 60, time.time() - 60))  # there before the job
    (site / "torch-2.11.0+cpu.dist-info").mkdir()  # installed by it
    log = tmp_path / "pip.log"
    log.write_text(
        "2026-12-05T17:17:43,104 Local files found: /w/triton-3.6.0-cp312-none-any.whl\n"
        "2026-12-05T17:17:43,109 Processing /w/triton-3.6.0-cp312-none-any.whl (from torch)\n"
        "2026-12-05T17:17:43,110   Added triton from file:///w/triton-3.6.0-cp312-none-any.whl to build tracker\n"
    )
    began = time.monotonic()
    out = helper(str(job), "1", "pip into vllm-0.23.0", "--pip", str(tmp_path / "venv"), str(log),
                 "torch==2.11.0", "jinja2==3.1.6", "triton==3.6.0")  # fmt: skip
    assert out.returncode == 3, out
    assert time.monotonic() - began >= 1.0  # it waited its interval for the job first
    assert re.fullmatch(
        r"progress: pip into vllm-0\.23\.0, \d+ s: 2 of 3 pins in place, 1 installed \(last torch 2\.11\.0\+cpu\); "
        r"pip: Processing /w/triton-3\.6\.0-cp312-none-any\.whl \(from torch\)\n",
        out.stdout,
    ), out.stdout

    job.write_text(json.dumps({"changed": True, "rc": 0}))  # finished: nothing to print
    assert helper(str(job), "5", "x", "--file", str(tmp_path / "none")).stdout == ""

    assert helper(str(job), "x", "label", "--file").returncode == 2


def test_the_helper_prints_the_line_a_job_keeps_in_its_progress_file(tmp_path: Path) -> None:
    job = tmp_path / "j3.4"
    job.write_text(json.dumps({"started": 1, "finished": 0}))
    progress = tmp_path / "build.progress"
    out = helper(str(job), "0", "checkpoint dense", "--file", str(progress))
    assert out.returncode == 3 and re.fullmatch(r"progress: checkpoint dense, \d+ s: starting\n", out.stdout)
    progress.write_text("2/4 shards, 10 of 20 tensors, 0.50 of 1.00 GB written, 100 MB/s\n")
    out = helper(str(job), "0", "checkpoint dense", "--file", str(progress))
    assert out.stdout.endswith(" s: 2/4 shards, 10 of 20 tensors, 0.50 of 1.00 GB written, 100 MB/s\n"), out.stdout


def test_a_build_that_removed_its_progress_file_and_is_ending_is_not_shown_as_starting(tmp_path: Path) -> None:
    """The builder removes its progress file as it ends, a moment before Ansible's async wrapper writes the
    job's result (CI saw ``checkpoint fake, 11 s: starting`` for a build that had just finished). A poll
    that finds no progress file looks again for a few seconds: the job's result ends the wait (exit 0, no
    line), a progress file that appears is printed, and only then is the job said to be starting."""
    job = tmp_path / "j5.6"
    job.write_text(json.dumps({"started": 1, "finished": 0}))
    progress = tmp_path / "build.progress"
    finish = threading.Timer(1.0, lambda: job.write_text(json.dumps({"changed": True, "rc": 0})))
    finish.start()
    try:
        out = helper(str(job), "0", "checkpoint fake", "--file", str(progress))
    finally:
        finish.join()
    assert (out.returncode, out.stdout) == (0, ""), out

    job.write_text(json.dumps({"started": 1, "finished": 0}))
    appear = threading.Timer(1.0, lambda: progress.write_text("1/4 shards, 3 of 20 tensors\n"))
    appear.start()
    try:
        out = helper(str(job), "0", "checkpoint fake", "--file", str(progress))
    finally:
        appear.join()
    assert out.returncode == 3 and out.stdout.endswith(" s: 1/4 shards, 3 of 20 tensors\n"), out


def test_a_job_that_died_without_a_result_ends_the_wait_instead_of_the_timeout(tmp_path: Path) -> None:
    """A job that could not write its result (seen with a full disk: Ansible's async result file left
    empty) is over: the helper says finished (the task collecting the result then fails within its own
    retries) rather than polling until the install's timeout. A result file is written whole and renamed
    into place, so an unreadable one that is still there after a while is no write in progress."""
    progress = tmp_path / "progress"
    progress.write_text("copying\n")
    dead = tmp_path / "j9.1"
    dead.write_text("")
    os.utime(dead, (time.time() - 120, time.time() - 120))
    assert helper(str(dead), "1", "pip into v", "--file", str(progress)).returncode == 0
    # just written (a rename in progress, or the job starting): look again
    fresh = tmp_path / "j9.2"
    fresh.write_text("")
    waited = helper(str(fresh), "1", "pip into v", "--file", str(progress))
    assert waited.returncode == 3 and waited.stdout.startswith("progress: pip into v, "), waited
    # a job that runs long keeps a valid result file, however old: still running
    running = tmp_path / "j9.3"
    running.write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": "j9.3"}))
    os.utime(running, (time.time() - 3600, time.time() - 3600))
    assert helper(str(running), "1", "pip into v", "--file", str(progress)).returncode == 3
