"""What the model_cache fleet tests share: the test's cache paths, group and copy account, the play, the
fleet fixture's clean-up and the run's variables. Only paths under /var/lib/sparkfleet-test and the test
group and account are touched; no service is."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.hub.server import HubDouble

CACHE_DIR = "/var/lib/sparkfleet-test/models"
GROUP = "sfcachetest"
FANOUT_USER = "sfcachecopy"
HOSTS = ["spark-01", "spark-02", "spark-03"]

PLAYBOOK = """
- name: Cache hub models (test)
  hosts: "{{ test_hosts }}"
  become: true
  gather_facts: false
  roles:
    - role: model_cache
"""


def clean_fleet(sandbox_fleet: Any) -> Any:
    """The sandbox fleet with the test's cache removed from every host (skips when a host is missing)."""
    missing = [host for host in HOSTS if host not in sandbox_fleet.names]
    if missing:
        pytest.skip(f"the sandbox fleet lacks {missing}")
    for host in HOSTS:
        sandbox_fleet.ssh(host, f"rm -rf {shlex.quote(str(Path(CACHE_DIR).parent))}")
    return sandbox_fleet


def write_run(tmp: Path, hub: HubDouble, models: list[dict[str, Any]], **extra: object) -> list[str]:
    """Write the play and its variables under ``tmp`` (the seed goes in tmp/seed); the playbook arguments."""
    (tmp / "play.yml").write_text(PLAYBOOK)
    variables = {
        "test_hosts": ",".join(HOSTS),
        "model_cache_dir": CACHE_DIR,
        "model_cache_group": GROUP,
        "model_cache_fanout_user": FANOUT_USER,
        "model_cache_hub_seed_dir": str(tmp / "seed"),
        "model_cache_hub_endpoint": hub.endpoint,
        "model_cache_models": models,
        **extra,
    }
    (tmp / "vars.json").write_text(json.dumps(variables))
    return [str(tmp / "play.yml"), "-e", f"@{tmp / 'vars.json'}", "--limit", ",".join(HOSTS)]


def sha256_on(fleet: Any, host: str, path: str) -> str:
    out = fleet.ssh(host, f"sha256sum {shlex.quote(path)}")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]
