"""library/vllm_wheel_venv.py run as Ansible runs it (JSON args in, JSON out), locally,
against a real venv: ``python3 -m venv`` (pip from ensurepip) with a wheel written here by hand and
installed offline from a directory, as the role installs from its wheelhouse.

A file changed or deleted in an installed distribution is found from its RECORD hash and reinstalled,
an unlisted .pth is removed, check mode and repair=false change nothing, pins off fail by name. The venv
is built once (seconds) and copied for each test, so a repair in one test never leaks into another.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "library" / "vllm_wheel_venv.py"
NAME, VERSION = "spark-demo", "1.0+cpu"  # a local label, as torch's 2.11.0+cpu
PIN = f"{NAME}=={VERSION}"
WHEEL = "spark_demo-1.0+cpu-py3-none-any.whl"
INFO = "spark_demo-1.0+cpu.dist-info"
PACKAGE = {
    "spark_demo/__init__.py": b'"""A two-module package for the venv check."""\n\nfrom spark_demo.core import answer\n',
    "spark_demo/core.py": b"def answer() -> int:\n    return 42\n",
}
METADATA = {
    f"{INFO}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\nSummary: test\n".encode(),
    f"{INFO}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sparkfleet-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(directory: Path) -> Path:
    """The wheel by hand: two modules, METADATA, WHEEL and a RECORD with their sha256 (RECORD's own row bare)."""
    files = {**PACKAGE, **METADATA}
    record = "".join(f"{path},{record_hash(data)},{len(data)}\n" for path, data in files.items()) + f"{INFO}/RECORD,,\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / WHEEL
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in {**files, f"{INFO}/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return wheel


def pip_env(wheels: Path) -> dict[str, str]:
    """Offline from one directory, as the role's __vllm_wheel_pip_env with no index."""
    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
    }


def make_venv(target: Path) -> None:
    """``/usr/bin/python3 -m venv`` as the role's pip task does; where that python has no ensurepip (Debian
    without python3-venv) the interpreter behind this test's own venv, else the test is skipped."""
    errors = []
    for python in dict.fromkeys(["/usr/bin/python3", getattr(sys, "_base_executable", sys.executable)]):
        if not os.access(python, os.X_OK):
            continue
        run = subprocess.run([python, "-m", "venv", str(target)], capture_output=True, text=True, check=False)
        if run.returncode == 0 and (target / "bin" / "python").exists():
            return
        errors.append(f"{python}: {run.stderr.strip()[-200:]}")
        shutil.rmtree(target, ignore_errors=True)
    pytest.skip("no python here makes a venv with pip (ensurepip): " + "; ".join(errors))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a venv with the demo wheel installed, the wheel directory), built once."""
    root = tmp_path_factory.mktemp("vllm_wheel_venv")
    wheels = root / "wheels"
    write_wheel(wheels)
    venv = root / "base"
    make_venv(venv)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", NAME],
        env={**os.environ, **pip_env(wheels)}, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return venv, wheels


@pytest.fixture()
def venv(built: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the built venv for one test (pip runs as ``<venv>/bin/python -m pip``, so a copy works)."""
    copy = tmp_path / "venv"
    shutil.copytree(built[0], copy, symlinks=True)
    return copy


@pytest.fixture()
def wheels(built: tuple[Path, Path]) -> Path:
    return built[1]


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3.*/site-packages")
    return found


def run_module(args: dict, check_mode: bool = False) -> dict:
    payload = {"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check_mode, "_ansible_diff": True}}
    result = subprocess.run(
        [sys.executable, str(MODULE)], input=json.dumps(payload), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def args(venv: Path, wheels: Path, **extra: object) -> dict:
    return {"venv": str(venv), "pins": [PIN], "pip_env": pip_env(wheels), **extra}


def test_a_clean_venv_matches_its_records(venv: Path, wheels: Path) -> None:
    result = run_module(args(venv, wheels, pins=["Spark_Demo==1.0", PIN]))  # PEP 503 names; 1.0 matches 1.0+cpu
    assert not result.get("failed") and not result["changed"], result["msg"]
    assert re.fullmatch(
        rf"venv {re.escape(str(venv))}: {result['distributions']} distributions, [\d,]+ files verified against "
        r"their RECORD hashes in [\d.]+ s \([\d.]+ [kMG]?B read, 0 files unchanged since their last check\): all match",
        result["msg"],
    ), result["msg"]
    assert result["distributions"] >= 2 and result["files_checked"] > 2 and result["bytes_hashed"] > 0
    assert f"{result['files_checked']:,} files" in result["msg"]
    assert result["tampered"] == {} and result["unlisted_pth"] == [] and result["repaired"] == []
    for path, data in PACKAGE.items():
        assert (site_packages(venv) / path).read_bytes() == data


def test_an_appended_line_is_found_then_reinstalled_from_the_wheelhouse(venv: Path, wheels: Path) -> None:
    core = site_packages(venv) / "spark_demo/core.py"
    tampered = PACKAGE["spark_demo/core.py"] + b"import os; os.system('true')\n"
    core.write_bytes(tampered)

    looked = run_module(args(venv, wheels), check_mode=True)
    assert looked["changed"] and not looked.get("failed"), looked["msg"]
    assert looked["tampered"] == {NAME: ["spark_demo/core.py: changed"]}
    assert looked["diff"] == {"before": f"{NAME}: spark_demo/core.py: changed\n", "after": f"would reinstall {PIN}\n"}
    assert looked["msg"].endswith(
        f": 1 file changed in {NAME} {VERSION} (spark_demo/core.py: changed): would reinstall {PIN}"
    )
    assert core.read_bytes() == tampered  # check mode reinstalls nothing

    fixed = run_module(args(venv, wheels))
    assert fixed["changed"] and not fixed.get("failed"), fixed["msg"]
    assert fixed["repaired"] == [PIN] and fixed["diff"] == looked["diff"]
    assert fixed["msg"].endswith(f"(spark_demo/core.py: changed): reinstalled {PIN} from the wheelhouse")
    assert core.read_bytes() == PACKAGE["spark_demo/core.py"]  # the wheel's copy again

    again = run_module(args(venv, wheels))
    assert not again["changed"] and again["msg"].endswith(": all match") and again["repaired"] == []


def test_a_deleted_file_is_missing_and_reinstalled(venv: Path, wheels: Path) -> None:
    init = site_packages(venv) / "spark_demo/__init__.py"
    init.unlink()
    result = run_module(args(venv, wheels))
    assert result["changed"] and not result.get("failed"), result["msg"]
    assert result["tampered"] == {NAME: ["spark_demo/__init__.py: missing"]} and result["repaired"] == [PIN]
    assert f": 1 file missing in {NAME} {VERSION} (spark_demo/__init__.py: missing): reinstalled {PIN}" in result["msg"]
    assert init.read_bytes() == PACKAGE["spark_demo/__init__.py"]


def test_an_unlisted_pth_is_reported_and_removed(venv: Path, wheels: Path) -> None:
    site = site_packages(venv)
    listed = sorted(path.name for path in site.glob("*.pth"))  # setuptools' distutils-precedence.pth, if any
    evil = site / "evil.pth"
    evil.write_text("import os; os.environ['PWNED'] = '1'\n")

    looked = run_module(args(venv, wheels), check_mode=True)
    assert looked["changed"] and looked["unlisted_pth"] == ["evil.pth"] and looked["tampered"] == {}
    assert looked["diff"] == {"before": "evil.pth: unlisted .pth\n", "after": "would remove evil.pth\n"}
    assert evil.exists()

    result = run_module(args(venv, wheels))
    assert result["changed"] and not result.get("failed"), result["msg"]
    assert result["unlisted_pth"] == ["evil.pth"] and result["repaired"] == []
    assert result["msg"].endswith(": unlisted .pth in site-packages: evil.pth: removed evil.pth")
    assert not evil.exists() and sorted(path.name for path in site.glob("*.pth")) == listed


@pytest.mark.parametrize(
    ("pin", "says"),
    [
        (f"{NAME}==1.1", f"{NAME}: {VERSION}, pinned 1.1"),
        ("no-such-dist-sparkfleet==1.0", "no-such-dist-sparkfleet: missing, pinned 1.0"),
        (f"{NAME}==1.0+cu128", f"{NAME}: {VERSION}, pinned 1.0+cu128"),  # a local label must match exactly
        (f"{NAME}>=1", f"{NAME}>=1: not an exact pin, left to pip"),
    ],
)
def test_a_pin_off_fails_naming_it_and_repairs_nothing(venv: Path, wheels: Path, pin: str, says: str) -> None:
    core = site_packages(venv) / "spark_demo/core.py"
    core.write_bytes(PACKAGE["spark_demo/core.py"] + b"# drift\n")
    result = run_module(args(venv, wheels, pins=["Spark.Demo==1.0", pin]))
    assert result["failed"] and result["msg"] == f"venv {venv}: pins not installed: {says}"
    assert core.read_bytes().endswith(b"# drift\n")  # failed before any repair


def test_repair_off_reports_and_changes_nothing(venv: Path, wheels: Path) -> None:
    site = site_packages(venv)
    core, evil = site / "spark_demo/core.py", site / "evil.pth"
    core.write_bytes(PACKAGE["spark_demo/core.py"] + b"# drift\n")
    evil.write_text("import sys\n")
    result = run_module(args(venv, wheels, repair=False))
    assert not result["changed"] and not result.get("failed") and "diff" not in result
    assert result["tampered"] == {NAME: ["spark_demo/core.py: changed"]} and result["unlisted_pth"] == ["evil.pth"]
    assert result["repaired"] == []
    assert result["msg"].endswith(
        f": 1 file changed in {NAME} {VERSION} (spark_demo/core.py: changed); "
        "unlisted .pth in site-packages: evil.pth: not repaired (repair is off)"
    )
    assert core.read_bytes().endswith(b"# drift\n") and evil.exists()


def test_a_repair_pip_cannot_do_fails_naming_the_distribution(venv: Path, tmp_path: Path) -> None:
    core = site_packages(venv) / "spark_demo/core.py"
    core.write_bytes(b"")
    empty = tmp_path / "empty-wheelhouse"
    empty.mkdir()
    result = run_module(args(venv, empty))
    assert result["failed"] and f": reinstalling {PIN} failed: pip exited 1: " in result["msg"]
    assert "(spark_demo/core.py: changed)" in result["msg"] and core.read_bytes() == b""


def test_no_venv_yet_is_not_an_error(tmp_path: Path, wheels: Path) -> None:
    missing = tmp_path / "venvs" / "vllm-0.23.0"
    result = run_module(args(missing, wheels))
    assert not result.get("failed") and not result["changed"]
    assert result["msg"] == f"venv {missing}: no venv yet, nothing to verify"
    assert not missing.exists() and not missing.parent.exists()


def test_a_second_run_reads_only_what_changed_since_the_first(venv: Path, wheels: Path) -> None:
    """Files found matching are remembered by inode, size, mtime and ctime: a converged venv is not read
    again, a write to a file (its ctime moves, whatever its mtime says) is, and full=true reads all."""
    first = run_module(args(venv, wheels))
    assert first["files_cached"] == 0 and first["bytes_hashed"] > 0
    cache = venv / ".sparkfleet-verified.json"
    assert cache.stat().st_mode & 0o777 == 0o600
    again = run_module(args(venv, wheels))
    assert (again["changed"], again["bytes_hashed"], again["files_cached"]) == (False, 0, again["files_checked"])
    assert f"{again['files_checked']:,} files unchanged since their last check" in again["msg"]

    core = site_packages(venv) / "spark_demo/core.py"
    before = core.stat()
    tampered = PACKAGE["spark_demo/core.py"][:-1] + b"X"  # same size
    core.write_bytes(tampered)
    os.utime(core, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back: ctime still moved
    looked = run_module(args(venv, wheels), check_mode=True)
    assert looked["changed"] and looked["tampered"] == {"spark-demo": ["spark_demo/core.py: changed"]}, looked
    assert core.read_bytes() == tampered, "check mode changed nothing"

    full = run_module(args(venv, wheels, full=True), check_mode=True)
    assert full["files_cached"] == 0 and full["bytes_hashed"] >= first["bytes_hashed"] - len(tampered)


def test_a_venv_pip_just_installed_is_recorded_without_reading_it(venv: Path, wheels: Path) -> None:
    seeded = run_module(args(venv, wheels, just_installed=True))
    assert (seeded["changed"], seeded["bytes_hashed"]) == (False, 0), seeded
    assert "just installed by pip from hash-checked wheels" in seeded["msg"]
    assert run_module(args(venv, wheels))["bytes_hashed"] == 0, "the next run compares against the record"
    core = site_packages(venv) / "spark_demo/core.py"
    core.write_bytes(PACKAGE["spark_demo/core.py"] + b"# tampered\n")
    assert run_module(args(venv, wheels), check_mode=True)["tampered"] == {
        "spark-demo": ["spark_demo/core.py: changed"]
    }
    # a size that does not match RECORD is caught even on the install's own run
    caught = run_module(args(venv, wheels, just_installed=True), check_mode=True)
    assert caught["changed"] and "spark_demo/core.py: changed" in caught["tampered"]["spark-demo"]
