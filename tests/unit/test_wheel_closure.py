"""sparkfleet.build.wheel_closure: what a machine lacks of a closure, walked from the wheels' own metadata."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparkfleet.build import wheel_closure as wc

X86 = wc.TargetMachine("3.12", "x86_64")
ARM = wc.TargetMachine("3.12", "aarch64")


def dist(name: str, version: str, *requires: str) -> wc.Dist:
    return wc.Dist(name, version, f"{name}-{version}-py3-none-any.whl", f"https://index/{name}", "0" * 64, requires)


DISTS = {
    d.name: d
    for d in (
        dist("a", "1.5"),
        dist("b", "2.0", "c==2.0; extra == 'x'", "e>=1"),
        dist("c", "2.0"),
        dist("d", "1.0"),
        dist("e", "1.0"),
        dist("numba", "0.65.0", "llvmlite<0.48"),
        dist("llvmlite", "0.47.0"),
    )
}
ROOT = ["a>=1", "b[x]", "d; platform_machine == 'x86_64'", "numba==0.65.0"]


def names(needs: list[wc.Need]) -> dict[str, str]:
    return {need.dist.name: need.reason for need in needs}


def test_missing_and_conflicting_are_told_apart_and_extras_and_markers_followed() -> None:
    installed = {"a": "1.5", "c": "1.0", "numba": "0.68.0", "llvmlite": "0.50.0"}
    needs, met = wc.needed(DISTS, ROOT, X86, installed, parent="vllm")
    assert names(needs) == {
        "b": "missing",
        "c": "conflict",  # b[x] needs c==2.0, the machine has 1.0
        "e": "missing",
        "d": "missing",
        "numba": "conflict",
        "llvmlite": "conflict",  # only because the carried numba 0.65 needs llvmlite<0.48
    }
    assert met == {"a": "1.5"}
    c = next(n for n in needs if n.dist.name == "c")
    assert c.installed == "1.0" and c.required_by == ['b==2.0 (c==2.0; extra == "x")']


def test_a_kept_package_stays_and_its_other_version_s_requirements_are_not_walked() -> None:
    installed = {"a": "1.5", "c": "2.0", "numba": "0.68.0", "llvmlite": "0.50.0"}
    needs, met = wc.needed(DISTS, ROOT, ARM, installed, keep=frozenset({"numba"}))
    assert names(needs) == {"b": "missing", "e": "missing"}  # d: x86_64 only; llvmlite: numba 0.68 stays
    assert met == {"a": "1.5", "c": "2.0", "numba": "0.68.0"}


def test_local_labels_meet_public_pins() -> None:
    needs, met = wc.needed({"torch": dist("torch", "2.11.0")}, ["torch==2.11.0"], X86, {"torch": "2.11.0+cu130"})
    assert needs == [] and met == {"torch": "2.11.0+cu130"}


def test_a_requirement_the_report_cannot_answer_is_refused() -> None:
    with pytest.raises(wc.ClosureError, match="vllm requires zzz>=1 but the report has no zzz: re-run the resolver"):
        wc.needed(DISTS, ["zzz>=1"], X86, {}, parent="vllm")


def test_bad_reports_and_package_lists_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"not": "a report"}))
    with pytest.raises(wc.ClosureError, match="report.json: not a pip installation report"):
        wc.load_report(bad)
    with pytest.raises(wc.ClosureError, match="not a pip list --format=json array"):
        wc.load_installed([{"version": "1"}])


def test_a_report_is_read_with_hashes_and_requirements(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    item = {
        "metadata": {"name": "Foo_Bar", "version": "1.0", "requires_dist": ["baz>=2"]},
        "download_info": {
            "url": "https://index/foo_bar-1.0-py3-none-any.whl",
            "archive_info": {"hashes": {"sha256": "ab"}},
        },
    }
    report.write_text(json.dumps({"install": [item]}))
    assert wc.load_report(report) == {
        "foo-bar": wc.Dist(
            "foo-bar", "1.0", "foo_bar-1.0-py3-none-any.whl", item["download_info"]["url"], "ab", ("baz>=2",)
        )
    }


def test_resolve_refuses_another_python_than_the_target_s(tmp_path: Path) -> None:
    other = wc.TargetMachine("2.7", "x86_64")
    with pytest.raises(wc.ClosureError, match=r"is Python 3\.\d+, the target runs 2\.7: .* pass a Python 2\.7"):
        wc.resolve(["a"], other, tmp_path / "r.json", installed={}, python=sys.executable)


def test_the_fake_environment_shows_pip_the_machine_s_packages(tmp_path: Path) -> None:
    python = wc.fake_environment(tmp_path / "venv", sys.executable, {"torch": "2.11.0+cu130", "numpy": "2.5.2"})
    from importlib.metadata import distributions

    site = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    seen = {d.metadata["Name"]: d.version for d in distributions(path=[str(site)])}
    assert seen == {"torch": "2.11.0+cu130", "numpy": "2.5.2"} and python.is_file()
