"""What several unit test files do alike: run a command or a playbook on this machine and hand back what
it printed, and the inventories and plays they run it against (one host, this machine, local connection)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.hostlib.bench import results

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
needs_ansible_playbook = pytest.mark.skipif(
    not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook is not in this venv"
)


def run(
    argv: Sequence[str | Path], *, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end, its output kept as text; the exit status is the caller's to assert on."""
    return subprocess.run(
        [str(part) for part in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_sparkfleet(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m sparkfleet ARGS`` from the checkout's root, as an operator types it."""
    return run([sys.executable, "-m", "sparkfleet", *args], timeout=timeout)


def ansible_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout's ansible.cfg, no colour, and ``extra``."""
    return {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", **extra}


def run_playbook(
    hosts: Path, playbook: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook -i HOSTS PLAYBOOK EXTRA`` from the checkout's root (``env``: ansible_env())."""
    return run(
        [ANSIBLE_PLAYBOOK, "-i", hosts, playbook, *extra], env=ansible_env() if env is None else env, timeout=timeout
    )


def local_host(**host_vars: object) -> dict[str, object]:
    """A host that is this machine: the local connection and this Python, with ``host_vars``."""
    return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **host_vars}


def write_hosts(inventory: Path, **host_vars: object) -> Path:
    """``inventory``/hosts.yml with one host, spark-x, on this machine; its path."""
    inventory.mkdir(parents=True, exist_ok=True)
    hosts = inventory / "hosts.yml"
    hosts.write_text(yaml.safe_dump({"all": {"hosts": {"spark-x": local_host(**host_vars)}}}))
    return hosts


def link_shared_group_vars(inventory: Path, site: dict) -> Path:
    """``inventory`` laid out like inventory/example: the shared group_vars linked, ``site`` over them."""
    group_vars = inventory / "group_vars" / "all"
    group_vars.mkdir(parents=True)
    for name in ("profiles.yml", "sparkfleet.yml"):
        (group_vars / f"00-{name}").symlink_to(ROOT / "inventory/group_vars/all" / name)
    (group_vars / "50-site.yml").write_text(yaml.safe_dump(site))
    return inventory


def write_play(path: Path, tasks: list[dict]) -> Path:
    """A playbook at ``path``: one play on all hosts, no facts gathered, ``tasks``."""
    path.write_text(yaml.safe_dump([{"hosts": "all", "gather_facts": False, "tasks": tasks}], sort_keys=False))
    return path


# The identity of a run as the bench clients record it (spark-01's dflash profile, vLLM 0.23.0).
RESULT_IDENTITY = {"base_url": "http://h:8000", "host": "spark-01", "profile": "dflash", "patch_set": "fc856daa00",
                   "served_name": "qwen", "model_root": None, "model_revision": "a" * 40, "drafter_revision": "b" * 40,
                   "vllm_version": "0.23.0", "settings": {}, "utc_time": "2026-06-24T10:00:00Z"}  # fmt: skip


def bench_result(kind: str = "decode", **fields: Any) -> dict[str, Any]:
    """A result skeleton as ``sparkfleet.hostlib.bench`` starts one, ``fields`` over RESULT_IDENTITY."""
    return results.new_result(kind, **{**RESULT_IDENTITY, **fields})
