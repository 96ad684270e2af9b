"""sparkfleet.bench runs on a serving host from a copied directory, with the standard library only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import sparkfleet

PACKAGE = Path(sparkfleet.__file__).parent
BENCH = PACKAGE / "bench"


def test_bench_imports_only_stdlib_and_itself() -> None:
    foreign = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if (
                    top not in sys.stdlib_module_names
                    and not name.startswith("sparkfleet.bench")
                    and name != "sparkfleet"
                ):
                    foreign.append(f"{path.name}: {name}")
    assert foreign == []


def test_runs_from_a_copied_directory(tmp_path: Path) -> None:
    copy = tmp_path / "sparkfleet"
    copy.mkdir()
    shutil.copy(PACKAGE / "__init__.py", copy / "__init__.py")
    shutil.copytree(BENCH, copy / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PACKAGE / "data" / "workloads", copy / "data" / "workloads")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)}
    # -S: no site-packages at all, so a stray third-party import would fail here
    completed = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "sparkfleet.bench",
            "e2e",
            "--base-url",
            "http://127.0.0.1:1",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    # it got as far as talking to the (absent) server: imports and workload files all resolved
    assert completed.returncode == 2, completed.stderr
    assert "is a server listening at http://127.0.0.1:1" in completed.stderr
