"""Shipped prompt sets: generated, up to date, loadable, and the scale knob."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.hostlib.bench import workloads as wl

GENERATOR = wl.WORKLOAD_DIR / "make_workloads.py"


def test_committed_files_match_the_generator() -> None:
    completed = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_decode_sets_and_albond_max_tokens() -> None:
    assert set(wl.DECODE_WORKLOADS) <= set(wl.available_workloads())
    for name in wl.DECODE_WORKLOADS:
        workload = wl.load_workload(name)
        assert workload.requests and all(r.messages[-1]["role"] == "user" for r in workload.requests)
    e2e = wl.load_workload(wl.E2E_WORKLOAD)
    assert [r.max_tokens for r in e2e.requests] == [256, 512, 1024, 64, 2048]


def test_agent_set_is_marked_synthetic_in_data_and_readme() -> None:
    agent = wl.load_workload("agent")
    assert "SYNTHETIC" in agent.description
    assert "<tool_call>" in agent.requests[0].messages[2]["content"]
    readme = (wl.WORKLOAD_DIR / "README.md").read_text()
    assert "synthetic" in readme.lower() and "agent" in readme


def test_sharegpt_dataset_shape() -> None:
    data = json.loads(wl.SHAREGPT_DATASET.read_text())
    assert len(data) >= 64
    assert all(e["conversations"][0]["from"] == "human" and e["conversations"][1]["from"] == "gpt" for e in data)


def test_scale_and_limit() -> None:
    assert wl.scaled_max_tokens(2048, 0.125) == 256
    assert wl.scaled_max_tokens(64, 0.001) == 1
    assert len(wl.load_workload("prose", limit=2).requests) == 2
    with pytest.raises(wl.WorkloadError, match="must be > 0"):
        wl.load_workload("prose", max_tokens_scale=0)
    with pytest.raises(wl.WorkloadError, match="limit"):
        wl.load_workload("prose", limit=0)


def test_bad_workload_file_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x", "requests": [{"id": "a"}]}')
    with pytest.raises(wl.WorkloadError, match="not in the workload format"):
        wl.load_workload(str(path))
    with pytest.raises(wl.WorkloadError, match="use one of .*prose"):
        wl.load_workload("nosuch")
