"""A wheel's dependency closure for another machine, and what that machine still lacks.

pip's own resolver computes the closure (``pip install --dry-run --ignore-installed --report`` with
the target's ``--platform``/``--python-version``, binary wheels only): every distribution with its
version, file, sha256 and ``Requires-Dist``. This module reads that report and walks the
requirements from the root, with markers evaluated for the target machine and extras followed, to
answer: which of these does a machine that already has ``installed`` (name -> version, as its
``pip list`` reports) still need, and why.

A requirement is met by the machine when it has the distribution at a version the specifier admits
(local labels such as ``+cu130`` match ``==2.11.0``, as in pip). Otherwise the resolver's pick is
needed: ``missing`` (the machine has no such distribution) or ``conflict`` (it has one at a version
the requirement refuses; what is carried will shadow it). The walk goes through every distribution
the closure reaches, met or not, using the resolver pick's metadata, so nothing a needed package
requires is left out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


class ClosureError(ValueError):
    """A report or package list the closure cannot be computed from; the message names it."""


@dataclass(frozen=True)
class TargetMachine:
    """The marker environment of the machine the closure is for."""

    python_version: str  # "3.12" or "3.12.3"
    machine: str  # platform_machine: x86_64, aarch64
    manylinux: tuple[str, ...] = ()  # the glibc tags pip may pick, e.g. ("2_17", "2_28")

    def environment(self, extra: str = "") -> dict[str, str]:
        env = default_environment()
        full = self.python_version if self.python_version.count(".") == 2 else f"{self.python_version}.0"
        env.update(
            {
                "python_version": ".".join(full.split(".")[:2]),
                "python_full_version": full,
                "implementation_name": "cpython",
                "platform_python_implementation": "CPython",
                "platform_machine": self.machine,
                "platform_system": "Linux",
                "sys_platform": "linux",
                "os_name": "posix",
                "extra": extra,
            }
        )
        return env

    def pip_platform_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", "cp"]
        for tag in self.manylinux:
            args += ["--platform", f"manylinux_{tag}_{self.machine}"]
        legacy = {"2_5": "manylinux1", "2_12": "manylinux2010", "2_17": "manylinux2014"}
        for tag, name in legacy.items():
            if tag in self.manylinux:
                args += ["--platform", f"{name}_{self.machine}"]
        return args


@dataclass(frozen=True)
class Dist:
    """One distribution of a resolver report."""

    name: str  # canonical
    version: str
    filename: str
    url: str
    sha256: str
    requires_dist: tuple[str, ...]
    requires_python: str = ""


@dataclass
class Need:
    """Why a distribution of the closure has to be carried to the machine."""

    dist: Dist
    reason: str  # "missing" or "conflict"
    installed: str | None  # the machine's version, for a conflict
    required_by: list[str] = field(default_factory=list)  # "vllm (numba==0.65.0)"


def load_report(path: Path) -> dict[str, Dist]:
    """The distributions of a ``pip install --dry-run --report`` file, by canonical name."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        items = report["install"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClosureError(f"{path}: not a pip installation report ({exc}); make it with pip --report") from exc
    dists: dict[str, Dist] = {}
    for item in items:
        meta = item["metadata"]
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        name = canonicalize_name(meta["name"])
        dists[name] = Dist(
            name=name,
            version=str(meta["version"]),
            filename=info["url"].rsplit("/", 1)[-1].split("#", 1)[0],
            url=info["url"],
            sha256=str(hashes.get("sha256", "")),
            requires_dist=tuple(meta.get("requires_dist") or ()),
            requires_python=str(meta.get("requires_python") or ""),
        )
    return dists


def load_installed(entries: list[dict[str, str]]) -> dict[str, str]:
    """``pip list --format=json`` rows as canonical name -> version."""
    try:
        return {canonicalize_name(row["name"]): str(row["version"]) for row in entries}
    except (KeyError, TypeError) as exc:
        raise ClosureError(f"not a pip list --format=json array ({exc})") from exc


def _admits(requirement: Requirement, version: str) -> bool:
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def needed(
    dists: dict[str, Dist],
    requirements: list[str],
    target: TargetMachine,
    installed: dict[str, str],
    parent: str = "(root)",
    keep: frozenset[str] = frozenset(),
) -> tuple[list[Need], dict[str, str]]:
    """Walk the closure of ``requirements`` (Requires-Dist lines of ``parent``) through ``dists``.

    Returns the distributions that must be carried, in walk order, and those of the closure the
    machine already meets (name -> its version). ``keep`` names installed packages to use as they
    are even where a requirement refuses their version (they count as met; the caller says why).
    """
    needs: dict[str, Need] = {}
    met: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    queue: list[tuple[Requirement, str]] = []

    def enqueue(lines: list[str] | tuple[str, ...], owner: str, extras: set[str], where: str) -> None:
        for line in lines:
            try:
                child = Requirement(line)
            except InvalidRequirement as exc:
                raise ClosureError(f"{where}: requirement {line!r} does not parse ({exc})") from exc
            if child.marker is not None and not any(child.marker.evaluate(target.environment(e)) for e in extras):
                continue
            queue.append((child, owner))

    enqueue(requirements, parent, {""}, parent)
    while queue:
        requirement, owner = queue.pop(0)
        name = canonicalize_name(requirement.name)
        dist = dists.get(name)
        why = f"{owner} ({requirement})"
        have = installed.get(name)
        if dist is None:
            if have is not None and _admits(requirement, have):
                met[name] = have  # kept as installed: pip listed nothing for it
                continue
            raise ClosureError(
                f"{owner} requires {requirement} but the report has no {name}: re-run the resolver for this target"
            )
        if name in needs:
            needs[name].required_by.append(why)
        elif have is not None and (name in keep or _admits(requirement, have)):
            met[name] = have
        else:
            met.pop(name, None)
            needs[name] = Need(dist, "missing" if have is None else "conflict", have, [why])
        if name in met and Version(met[name]).public != Version(dist.version).public:
            continue  # the machine's own version stays: the report's metadata is another version's
        seen = extras_seen.setdefault(name, set())
        new_extras = (set(requirement.extras) | {""}) - seen
        if not new_extras:
            continue
        seen |= new_extras
        enqueue(dist.requires_dist, f"{dist.name}=={dist.version}", new_extras, dist.filename)
    return list(needs.values()), met


def fake_environment(directory: Path, python: str, installed: dict[str, str]) -> Path:
    """A venv of ``python`` whose site-packages holds a bare dist-info for every installed package.

    pip, asked to install into it, sees the machine's packages as installed (name and version; no
    requirements of their own) and does what it would do there: keep each one that satisfies, and
    list what it would add, upgrade or downgrade. Returns the venv's interpreter.
    """
    if directory.exists():
        shutil.rmtree(directory)
    subprocess.run([python, "-m", "venv", "--without-pip", str(directory)], check=True)
    interpreter = directory / "bin" / "python"
    site = subprocess.run(
        [str(interpreter), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for name, version in installed.items():
        info = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
        (info / "INSTALLER").write_text("sparkfleet-closure\n", encoding="utf-8")
        (info / "RECORD").write_text("", encoding="utf-8")
    return interpreter


def resolve(
    requirements: list[str],
    target: TargetMachine,
    report: Path,
    *,
    installed: dict[str, str],
    python: str = sys.executable,
) -> dict[str, Dist]:
    """What ``pip install REQUIREMENTS`` would add to a machine that has ``installed``, by pip's resolver.

    pip runs against a venv of ``python`` holding the machine's packages (``fake_environment``), so
    it evaluates markers for that Python and keeps every installed version that satisfies, as it
    would on the machine itself; ``python`` must therefore be the target's Python version (checked).
    Wheels are limited to binaries for this host's platform tags, which must be those of the target
    (same architecture; a glibc at least as new as the target's wheels need).
    """
    probe = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    )
    wanted = ".".join(target.python_version.split(".")[:2])
    if probe.returncode != 0 or probe.stdout.strip() != wanted:
        raise ClosureError(
            f"{python} is Python {probe.stdout.strip() or '?'}, the target runs {wanted}: pip evaluates markers "
            f"with its own interpreter; pass a Python {wanted} (--python)"
        )
    report.parent.mkdir(parents=True, exist_ok=True)
    interpreter = fake_environment(report.parent / "machine-venv", python, installed)
    command = [sys.executable, "-m", "pip", "--python", str(interpreter), "install", "--dry-run", "--quiet"]
    command += ["--only-binary=:all:", "--report", str(report), *requirements]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        raise ClosureError(f"pip could not resolve {' '.join(requirements)} onto the machine: {' '.join(errors[-12:])}")
    return load_report(report)
