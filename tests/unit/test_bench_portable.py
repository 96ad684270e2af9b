"""sparkfleet.hostlib.bench runs on a serving host from a copied directory, under the service venv's Python.

It imports the standard library, itself and the packages vLLM 0.23 brings into the service venv:
an explicit list, each pinned in the wheelhouse locks (the closure of vLLM 0.23 that hosts install),
so a host's venv has it. The clients always run with the service venv's Python (serve_bench's
``__serve_bench_python``, ``sparkfleet ops bench``), never with a bare interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

import sparkfleet
from sparkfleet.build import wheelhouse
from tests.unit.helpers import run

PACKAGE = Path(sparkfleet.__file__).parent
HOSTLIB = PACKAGE / "hostlib"
BENCH = HOSTLIB / "bench"

# import name -> distribution: the third-party packages sparkfleet.hostlib.bench may import. Each is in vLLM
# 0.23's closure (prometheus_client a requirement of vLLM's own; httpx through fastapi[standard]).
ALLOWED_THIRD_PARTY = {"prometheus_client": "prometheus-client", "httpx": "httpx"}


def locked(flavor: str) -> set[str]:
    return set(wheelhouse.load_lock(wheelhouse.FLAVORS[flavor].lock))


def test_bench_imports_only_stdlib_itself_and_the_allowed_packages() -> None:
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
                    and top not in ALLOWED_THIRD_PARTY
                    and not name.startswith("sparkfleet.hostlib.bench")
                    and name != "sparkfleet"
                ):
                    foreign.append(f"{path.name}: {name}")
    assert foreign == []


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_every_allowed_package_is_pinned_in_the_hosts_lock(flavor: str) -> None:
    pins = locked(flavor)
    assert [dist for dist in ALLOWED_THIRD_PARTY.values() if canonicalize_name(dist) not in pins] == []


# Runs the bench's __main__ and then lists the third-party top-level modules it loaded (the stdlib and
# whatever the interpreter loaded before it excluded) with the distributions that provide them.
RUN_AND_LIST = """
import importlib.metadata, json, runpy, sys
before, code = set(sys.modules), 0
try:
    runpy.run_module("sparkfleet.hostlib.bench", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
finally:
    tops = {name.split(".")[0] for name in set(sys.modules) - before}
    providers = importlib.metadata.packages_distributions()
    loaded = {
        top: providers.get(top, [])
        for top in sorted(tops)
        if top not in sys.stdlib_module_names and top != "sparkfleet"
    }
    bench = sys.modules["sparkfleet.hostlib.bench"].__file__
    print(json.dumps({"loaded": loaded, "bench": bench}), file=sys.stdout)
sys.exit(code)
"""


def test_runs_from_a_copied_directory(tmp_path: Path) -> None:
    copy = tmp_path / "sparkfleet"
    copy.mkdir()
    shutil.copy(PACKAGE / "__init__.py", copy / "__init__.py")
    (copy / "hostlib").mkdir()
    shutil.copy(HOSTLIB / "__init__.py", copy / "hostlib" / "__init__.py")
    shutil.copytree(BENCH, copy / "hostlib" / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(HOSTLIB / "data" / "workloads", copy / "hostlib" / "data" / "workloads")
    # this interpreter's own site-packages (the controller venv has prometheus_client and httpx, as a
    # host's service venv has), no user site, and of this checkout only the copy
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    argv = [sys.executable, "-c", RUN_AND_LIST, "e2e", "--base-url", "http://127.0.0.1:1", "--out", tmp_path / "r"]
    completed = run(argv, env=env, cwd=tmp_path, timeout=60)
    # it got as far as talking to the (absent) server: imports and workload files all resolved
    assert completed.returncode == 2, completed.stderr
    assert "is a server listening at http://127.0.0.1:1" in completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert Path(report["bench"]).is_relative_to(copy), "the bench ran from the copy, not the checkout"
    # every third-party module it loaded (the allowed packages and what they import) comes from a
    # distribution that the hosts' locks pin
    assert set(ALLOWED_THIRD_PARTY) <= set(report["loaded"])
    for flavor in ("cpu", "gpu"):
        pins = locked(flavor)
        unpinned = {
            top: dists
            for top, dists in report["loaded"].items()
            if not any(canonicalize_name(dist) in pins for dist in dists)
        }
        assert unpinned == {}, f"loaded, but not in the {flavor} lock"
