"""Pinned Hugging Face weights, fetched once per fleet into a verified seed cache on the controller.

The controller downloads each model (the base checkpoint, the DFlash drafter) with the real
huggingface_hub client at a full 40-hex commit, into a seed cache in the hub's own layout
(``<seed>/models--org--name/snapshots/<revision>/``). Every file is checked against what the hub
says it is: the sha256 of LFS files, the git blob id of the others. A manifest (repo, revision, one
entry per file with its size, sha256 and git blob id) is written next to the cache; the
``model_cache`` role ships it with the files and checks every host's copy against it, so the hub is
asked for each byte once, however many hosts there are.

Why a full commit: a branch or tag moves. The DFlash drafter's ``main`` moved from 6c7242c (4 KV
heads, 4 layers, window 2048) to bce6f76 (8 KV heads, 6 layers, window 4096), whose KV pages vLLM 0.23
cannot unify with the hybrid target; a fleet that followed ``main`` stopped booting.

Resuming: the client resumes a cut transfer itself (HTTP Range); a run that was stopped keeps every
file it had finished (a pinned commit already in the cache is never asked for again), and a file in
the seed that no longer matches its recorded hash is deleted and fetched again.

CLI (``sparkfleet weights``):
    sparkfleet weights describe --repo ORG/NAME --revision SHA --seed-dir DIR [--allow-pattern P ...]
    sparkfleet weights fetch --manifest DIR/manifests/NAME@SHA.json --seed-dir DIR [--file PATH ...]
    sparkfleet weights verify --manifest M --dir DIR
    sparkfleet weights manifest --dir DIR --name NAME --revision KEY --seed-dir DIR
The last one describes a directory made on the seed (the dense profile's hybrid checkpoint, built there
by ``model_cache``) in the same manifest format, so it fans out and is verified like hub weights.
The token for gated repos comes from ``--token-file`` (Ansible writes it to a 0600 file for the run:
never in argv, in a logged environment or in module arguments), ``--token-stdin`` or huggingface_hub's
own ``HF_TOKEN``; it is never printed.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

FULL_REVISION = re.compile(r"[0-9a-f]{40}")
MANIFEST_FORMAT = 1
HASH_BLOCK = 8 * 1024 * 1024
# Known-good DFlash drafter commit (see the module docstring and docs/reference).
DFLASH_DRAFTER_REVISION = "6c7242c934a9870d7c59c05240bdbb2467cc1394"


class HubCacheError(Exception):
    """A one-line, user-facing error: names the value and the fix."""


@dataclass(frozen=True)
class ManifestFile:
    """One file of a pinned revision, as the hub describes it and as verified."""

    path: str
    size: int
    sha256: str | None  # the hub's LFS sha256, or computed once verified (non-LFS)
    git_blob_id: str | None  # the hub's blobId (of the LFS pointer for LFS files)
    lfs: bool


@dataclass(frozen=True)
class Manifest:
    """What one host must hold for one model: repo, revision and every file."""

    repo: str
    revision: str
    files: tuple[ManifestFile, ...]
    allow_patterns: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "repo": self.repo,
            "revision": self.revision,
            "allow_patterns": list(self.allow_patterns),
            "total_bytes": self.total_bytes,
            "files": [asdict(f) for f in self.files],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> Manifest:
        if data.get("format") != MANIFEST_FORMAT:
            raise HubCacheError(f"{where}: format {data.get('format')!r} is not {MANIFEST_FORMAT}; describe it again")
        files = tuple(ManifestFile(**entry) for entry in data["files"])
        return cls(data["repo"], data["revision"], files, tuple(data.get("allow_patterns") or ()))


def check_revision(repo: str, revision: str | None) -> str:
    """The revision if it is a full 40-hex commit; else a HubCacheError that says how to pin one."""
    if revision and FULL_REVISION.fullmatch(revision):
        return revision
    kind = "no revision"
    if revision:
        kind = "a short sha" if re.fullmatch(r"[0-9a-fA-F]{4,39}", revision) else "a branch or tag name"
        kind = f"revision {revision!r} is {kind}"
    raise HubCacheError(
        f"{repo}: {kind}, which can move; pin the full 40-hex commit instead (lower case), e.g. "
        f"revision: {DFLASH_DRAFTER_REVISION} - take it from the repo's commit history on the hub "
        f"or from `git ls-remote` of the repo"
    )


def repo_folder(repo: str) -> str:
    """The hub cache's folder name for a model repo (``models--org--name``)."""
    return "models--" + repo.replace("/", "--")


def snapshot_dir(seed_dir: Path, repo: str, revision: str) -> Path:
    """Where the files of one revision appear in the seed cache (symlinks into blobs/)."""
    return Path(seed_dir) / repo_folder(repo) / "snapshots" / revision


def manifest_path(seed_dir: Path, repo: str, revision: str) -> Path:
    return Path(seed_dir) / "manifests" / f"{repo.replace('/', '--')}@{revision}.json"


def git_blob_id_of_file(path: Path, size: int) -> str:
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem holding path (or its nearest parent)."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_space(path: Path, needed: int, what: str) -> None:
    free = free_bytes(path)
    if needed > free:
        raise HubCacheError(
            f"{path}: {what} needs {human_bytes(needed)} ({needed} bytes) but only {human_bytes(free)} "
            f"({free} bytes) is free there; free space or point the seed cache at a larger disk"
        )


def _hub_api(endpoint: str | None, token: str | bool | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token)


def _matches(path: str, patterns: Iterable[str]) -> bool:
    patterns = list(patterns)
    return not patterns or any(fnmatch.fnmatch(path, pattern) for pattern in patterns)


def describe(
    repo: str,
    revision: str,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
    allow_patterns: Iterable[str] = (),
) -> Manifest:
    """Ask the hub for the files of ``repo`` at a pinned commit: sizes, blob ids, LFS sha256."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    check_revision(repo, revision)
    patterns = tuple(allow_patterns)
    try:
        info = _hub_api(endpoint, token).model_info(repo, revision=revision, files_metadata=True)
    except HfHubHTTPError as error:
        first_line = str(error).splitlines()[0]
        raise HubCacheError(f"{repo}@{revision}: the hub refused the file list: {first_line}") from error
    except httpx.HTTPError as error:
        raise HubCacheError(
            f"{repo}@{revision}: cannot reach the hub at {endpoint or 'the default endpoint'} ({error}); "
            "check HF_ENDPOINT / model_cache_hub_endpoint and the network"
        ) from error
    if info.sha != revision:
        raise HubCacheError(f"{repo}@{revision}: the hub answered with commit {info.sha}; refusing a moved revision")
    files = tuple(
        ManifestFile(
            path=sibling.rfilename,
            size=int(sibling.size or 0),
            sha256=sibling.lfs.sha256 if sibling.lfs else None,
            git_blob_id=sibling.blob_id,
            lfs=sibling.lfs is not None,
        )
        for sibling in info.siblings or []
        if _matches(sibling.rfilename, patterns)
    )
    if not files:
        raise HubCacheError(f"{repo}@{revision}: no file matches allow_patterns {list(patterns)}; fix the patterns")
    for entry in files:
        if entry.sha256 is None and entry.git_blob_id is None:
            raise HubCacheError(f"{repo}@{revision}: the hub gave no hash for {entry.path}; cannot verify it")
    return Manifest(repo, revision, files, patterns)


@dataclass
class VerifyRecord:
    """What was verified about one seed file, so an unchanged file is not hashed again."""

    size: int
    mtime_ns: int
    sha256: str


class SeedCache:
    """The controller's seed cache: the hub's cache layout plus manifests and verification records."""

    def __init__(self, seed_dir: Path) -> None:
        self.seed_dir = Path(seed_dir)

    def snapshot(self, manifest: Manifest) -> Path:
        return snapshot_dir(self.seed_dir, manifest.repo, manifest.revision)

    def _records_path(self, manifest: Manifest) -> Path:
        return self.seed_dir / "verified" / f"{manifest.repo.replace('/', '--')}@{manifest.revision}.json"

    def load_records(self, manifest: Manifest) -> dict[str, VerifyRecord]:
        path = self._records_path(manifest)
        if not path.is_file():
            return {}
        try:
            return {name: VerifyRecord(**entry) for name, entry in json.loads(path.read_text()).items()}
        except (ValueError, TypeError):
            return {}  # unreadable records only cost a re-hash

    def save_records(self, manifest: Manifest, records: dict[str, VerifyRecord]) -> None:
        path = self._records_path(manifest)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({name: asdict(r) for name, r in sorted(records.items())}, indent=1))
        tmp.replace(path)

    def write_manifest(self, manifest: Manifest) -> Path:
        path = manifest_path(self.seed_dir, manifest.repo, manifest.revision)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n"
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        return path

    def still_verified(self, manifest: Manifest, entry: ManifestFile, records: dict[str, VerifyRecord]) -> bool:
        """True when the file was verified and has not changed since (same size and mtime)."""
        path = self.snapshot(manifest) / entry.path
        record = records.get(entry.path)
        if record is None or not path.is_file():
            return False
        stat = path.stat()
        return stat.st_size == record.size == entry.size and stat.st_mtime_ns == record.mtime_ns

    def has_content(self, manifest: Manifest, entry: ManifestFile) -> bool:
        """True when the file is in the cache already (its snapshot link, or its blob under the hub's etag)."""
        etag = entry.sha256 if entry.lfs else entry.git_blob_id
        blob = self.seed_dir / repo_folder(manifest.repo) / "blobs" / str(etag)
        return (self.snapshot(manifest) / entry.path).is_file() or blob.is_file()

    def remove(self, manifest: Manifest, entry: ManifestFile) -> None:
        """Delete a file's snapshot link and the blob it points at (so the client fetches it again)."""
        link = self.snapshot(manifest) / entry.path
        if link.is_symlink():
            blob = link.resolve()
            link.unlink()
            blob.unlink(missing_ok=True)
        elif link.exists():
            link.unlink()


@dataclass
class FetchReport:
    """What one fetch did."""

    repo: str
    revision: str
    files: int
    bytes: int
    downloaded_files: int
    downloaded_bytes: int
    replaced_files: int
    verified: bool
    manifest: str
    snapshot: str

    def line(self) -> str:
        return (
            f"{self.repo}@{self.revision[:12]}: {self.files} files, {human_bytes(self.bytes)}, "
            f"downloaded {self.downloaded_files} ({human_bytes(self.downloaded_bytes)}), "
            f"replaced {self.replaced_files}, verified={'yes' if self.verified else 'NO'}"
        )


def verify_seed_file(path: Path, entry: ManifestFile) -> tuple[bool, str, str]:
    """(ok, sha256, why-not) for one downloaded file against the hub's size and hash."""
    if not path.is_file():
        return False, "", "missing"
    size = path.stat().st_size
    if size != entry.size:
        return False, "", f"size {size} != {entry.size}"
    sha256 = sha256_of_file(path)
    if entry.lfs:
        if sha256 != entry.sha256:
            return False, sha256, f"sha256 {sha256} != {entry.sha256}"
    else:
        blob_id = git_blob_id_of_file(path, size)
        if blob_id != entry.git_blob_id:
            return False, sha256, f"git blob id {blob_id} != {entry.git_blob_id}"
    return True, sha256, ""


def fetch(
    manifest: Manifest,
    seed_dir: Path,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
    only: Iterable[str] = (),
    attempts: int = 2,
    progress: Callable[[str], None] | None = None,
) -> FetchReport:
    """Download (or find) every file of the manifest in the seed cache, verified; write the manifest.

    ``only`` limits the run to some files (the role loops file by file to show progress); the manifest
    written is always the whole one, with the sha256 of every file the cache holds verified.
    A file that fails verification is deleted and downloaded again, up to ``attempts`` times.
    """
    import httpx
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    say = progress or (lambda line: None)
    seed = SeedCache(seed_dir)
    wanted = set(only)
    unknown = wanted - {entry.path for entry in manifest.files}
    if unknown:
        raise HubCacheError(f"{manifest.repo}@{manifest.revision}: {sorted(unknown)} not in the manifest")
    records = seed.load_records(manifest)
    snapshot = seed.snapshot(manifest)
    selected = [entry for entry in manifest.files if not wanted or entry.path in wanted]

    def still_verified(entry: ManifestFile) -> bool:
        return seed.still_verified(manifest, entry, records)

    missing = [entry for entry in selected if not seed.has_content(manifest, entry)]
    needed = sum(entry.size for entry in missing)
    if needed:
        check_free_space(seed.seed_dir, needed, f"{manifest.repo}@{manifest.revision[:12]} ({len(missing)} files)")

    downloaded_files = downloaded_bytes = replaced = 0
    for index, entry in enumerate(selected, 1):
        label = f"[{index}/{len(selected)}] {manifest.repo} {entry.path} ({human_bytes(entry.size)})"
        if still_verified(entry):
            continue
        for attempt in range(1, attempts + 1):
            present = seed.has_content(manifest, entry)
            if not present:
                say(f"{label}: downloading")
                started = time.monotonic()
            try:
                local = hf_hub_download(
                    manifest.repo,
                    entry.path,
                    revision=manifest.revision,
                    cache_dir=str(seed.seed_dir),
                    endpoint=endpoint,
                    token=token,
                )
            except (HfHubHTTPError, httpx.HTTPError, OSError) as error:
                first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise HubCacheError(
                    f"{manifest.repo}@{manifest.revision}: {entry.path}: download failed: {first_line}; "
                    "run again to resume (finished files are kept)"
                ) from error
            if not present:
                downloaded_files += 1
                downloaded_bytes += entry.size
                seconds = max(time.monotonic() - started, 1e-6)
                held = sum(e.size for e in manifest.files if seed.has_content(manifest, e))
                say(
                    f"{label}: downloaded in {seconds:.1f} s ({human_bytes(entry.size / seconds)}/s); "
                    f"{manifest.repo}: {human_bytes(held)} of {human_bytes(manifest.total_bytes)} in the seed "
                    f"({100 * held / max(manifest.total_bytes, 1):.0f}%)"
                )
            ok, sha256, why = verify_seed_file(Path(local), entry)
            if ok:
                stat = Path(local).stat()
                records[entry.path] = VerifyRecord(stat.st_size, stat.st_mtime_ns, sha256)
                seed.save_records(manifest, records)
                break
            say(f"{label}: does not match the hub ({why}); deleting it and downloading again")
            records.pop(entry.path, None)
            seed.remove(manifest, entry)
            replaced += 1
            if attempt == attempts:
                raise HubCacheError(
                    f"{manifest.repo}@{manifest.revision}: {entry.path} still fails verification after "
                    f"{attempts} downloads ({why}); the hub or the network corrupts it"
                )

    complete = all(entry.path in records for entry in manifest.files)
    files = tuple(
        ManifestFile(e.path, e.size, records[e.path].sha256 if e.path in records else e.sha256, e.git_blob_id, e.lfs)
        for e in manifest.files
    )
    written = seed.write_manifest(Manifest(manifest.repo, manifest.revision, files, manifest.allow_patterns))
    return FetchReport(
        repo=manifest.repo,
        revision=manifest.revision,
        files=len(selected),
        bytes=sum(entry.size for entry in selected),
        downloaded_files=downloaded_files,
        downloaded_bytes=downloaded_bytes,
        replaced_files=replaced,
        verified=all(entry.path in records for entry in selected),
        manifest=str(written) if complete else "",
        snapshot=str(snapshot),
    )


def transfer_batches(files: Iterable[tuple[str, int]], chunk_bytes: int) -> list[list[str]]:
    """Group (path, size) into transfer steps: a file of ``chunk_bytes`` or more alone, smaller ones together.

    Each step is one task iteration in Ansible, so a long transfer shows progress file by file while a
    tokenizer and its config files do not cost one round trip each.
    """
    steps: list[list[str]] = []
    small: list[str] = []
    small_bytes = 0
    for path, size in files:
        if size >= chunk_bytes:
            steps.append([path])
            continue
        small.append(path)
        small_bytes += size
        if small_bytes >= chunk_bytes:
            steps.append(small)
            small, small_bytes = [], 0
    if small:
        steps.append(small)
    return steps


def load_manifest(path: Path) -> Manifest:
    try:
        return Manifest.from_dict(json.loads(Path(path).read_text()), where=str(path))
    except FileNotFoundError as error:
        raise HubCacheError(f"{path}: no such manifest; run `sparkfleet weights describe` first") from error
    except (ValueError, KeyError, TypeError) as error:
        raise HubCacheError(f"{path}: not a sparkfleet weights manifest ({error}); describe it again") from error


def verify_directory(manifest: Manifest, directory: Path) -> list[str]:
    """Problems of a plain model directory against a complete manifest (empty when it matches)."""
    problems = []
    for entry in manifest.files:
        path = Path(directory) / entry.path
        if not path.is_file():
            problems.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.path}: size {path.stat().st_size} != {entry.size}")
        elif entry.sha256 is None:
            problems.append(f"{entry.path}: the manifest has no sha256 (fetch it first)")
        elif sha256_of_file(path) != entry.sha256:
            problems.append(f"{entry.path}: sha256 differs from the manifest")
    return problems


def describe_directory(directory: Path, name: str, revision: str, seed_dir: Path) -> Manifest:
    """The manifest of a directory the seed made itself (every file's size and sha256).

    The repo is ``built/<name>`` and the revision a 40-hex key of the build's inputs. A file hashed
    before and unchanged since (same size and mtime) is not read again, so a re-run costs no hashing.
    """
    check_revision(f"built/{name}", revision)
    directory = Path(directory)
    if not directory.is_dir():
        raise HubCacheError(f"{directory}: no such directory; build it first")
    probe = Manifest(f"built/{name}", revision, ())
    seed = SeedCache(seed_dir)
    records = seed.load_records(probe)
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        stat = path.stat()
        record = records.get(relative)
        if record is None or (record.size, record.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
            record = VerifyRecord(stat.st_size, stat.st_mtime_ns, sha256_of_file(path))
            records[relative] = record
        files.append(ManifestFile(relative, stat.st_size, record.sha256, None, False))
    if not files:
        raise HubCacheError(f"{directory}: empty; the build wrote nothing")
    records = {f.path: records[f.path] for f in files}
    seed.save_records(probe, records)
    return Manifest(probe.repo, revision, tuple(files))


# -- CLI ---------------------------------------------------------------------------------------------


def _read_token(args: argparse.Namespace, stdin: TextIO) -> str | None:
    """The hub token from --token-file or --token-stdin; None lets huggingface_hub read HF_TOKEN itself."""
    token_file = getattr(args, "token_file", None)
    if token_file:
        try:
            text = Path(token_file).read_text()
        except OSError as error:
            raise HubCacheError(f"{token_file}: cannot read the token file ({error.strerror})") from error
        return text.strip() or None
    if getattr(args, "token_stdin", False):
        return stdin.readline().strip() or None
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("weights", help="pinned hub weights: pin, describe, fetch, verify (the seed cache)")
    actions = parser.add_subparsers(dest="weights_command", metavar="ACTION", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--seed-dir", type=Path, required=True, help="the seed cache (hub layout)")
        sub.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None, help="hub URL (HF_ENDPOINT)")
        sub.add_argument("--token-stdin", action="store_true", help="read a hub token from the first stdin line")
        sub.add_argument("--token-file", type=Path, help="read a hub token from this (private) file")
        sub.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    describe_parser = actions.add_parser("describe", help="write the manifest of a pinned revision")
    describe_parser.add_argument("--repo", required=True)
    describe_parser.add_argument("--revision", required=True, help="a full 40-hex commit")
    describe_parser.add_argument("--allow-pattern", action="append", default=[], dest="allow_patterns")
    describe_parser.add_argument(
        "--chunk-bytes", type=int, default=256 * 1024 * 1024, help="files this big download as their own step"
    )
    common(describe_parser)
    describe_parser.set_defaults(func=run_describe)

    fetch_parser = actions.add_parser("fetch", help="download and verify the files of a manifest")
    fetch_parser.add_argument("--manifest", type=Path, required=True)
    fetch_parser.add_argument("--file", action="append", default=[], dest="files", help="only this file")
    fetch_parser.add_argument(
        "--progress", action="store_true", help='progress lines on stdout, each starting "progress: " (else stderr)'
    )
    common(fetch_parser)
    fetch_parser.set_defaults(func=run_fetch)

    verify_parser = actions.add_parser("verify", help="check a plain model directory against a manifest")
    verify_parser.add_argument("--manifest", type=Path, required=True)
    verify_parser.add_argument("--dir", type=Path, required=True)
    verify_parser.set_defaults(func=run_verify)

    manifest_parser = actions.add_parser("manifest", help="write the manifest of a directory built on the seed")
    manifest_parser.add_argument("--dir", type=Path, required=True, help="the built directory")
    manifest_parser.add_argument("--name", required=True, help="the model name (the manifest's repo: built/NAME)")
    manifest_parser.add_argument("--revision", required=True, help="a 40-hex key of the build's inputs")
    manifest_parser.add_argument("--seed-dir", type=Path, required=True, help="the seed cache")
    manifest_parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    manifest_parser.set_defaults(func=run_manifest)

    from sparkfleet.serving import model_pins

    model_pins.add_parser(actions)


def _command(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` as a CLI action: a HubCacheError is one line on stderr and exit code 1."""

    @functools.wraps(run)
    def action(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except HubCacheError as error:
            print(f"sparkfleet weights: {error}", file=sys.stderr)
            return 1

    return action


@_command
def run_describe(args: argparse.Namespace) -> int:
    token = _read_token(args, sys.stdin)
    manifest = describe(args.repo, args.revision, endpoint=args.endpoint, token=token,
                        allow_patterns=args.allow_patterns)  # fmt: skip
    seed = SeedCache(args.seed_dir)
    snapshot = seed.snapshot(manifest)
    missing = [e for e in manifest.files if not (snapshot / e.path).is_file()]
    need = sum(e.size for e in missing)
    if need:
        check_free_space(args.seed_dir, need, f"{args.repo}@{args.revision[:12]} ({len(missing)} files)")
    previous = manifest_path(args.seed_dir, manifest.repo, manifest.revision)
    # keep the verified sha256 of a previous complete fetch; describe alone never downgrades it
    if previous.is_file():
        old = {f.path: f for f in load_manifest(previous).files}
        manifest = Manifest(
            manifest.repo,
            manifest.revision,
            tuple(
                ManifestFile(
                    f.path, f.size, f.sha256 or getattr(old.get(f.path), "sha256", None), f.git_blob_id, f.lfs
                )  # fmt: skip
                for f in manifest.files
            ),
            manifest.allow_patterns,
        )
    path = seed.write_manifest(manifest)
    records = seed.load_records(manifest)
    complete = all(seed.still_verified(manifest, e, records) for e in manifest.files)
    sizes = {f.path: f.size for f in manifest.files}
    result = {
        "repo": manifest.repo,
        "revision": manifest.revision,
        "manifest": str(path),
        "snapshot": str(snapshot),
        "files": [asdict(f) for f in manifest.files],
        "missing": [f.path for f in missing],
        "missing_bytes": need,
        "complete": complete,
        "steps": [
            {"files": step, "bytes": sum(sizes[name] for name in step)}
            for step in transfer_batches(((f.path, f.size) for f in missing), args.chunk_bytes)
        ],
        "total_bytes": manifest.total_bytes,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{manifest.repo}@{manifest.revision[:12]}: {len(manifest.files)} files, "
            f"{human_bytes(manifest.total_bytes)}; {len(missing)} to download ({human_bytes(need)}); {path}"
        )
    return 0


@_command
def run_fetch(args: argparse.Namespace) -> int:
    token = _read_token(args, sys.stdin)
    manifest = load_manifest(args.manifest)
    report = fetch(
        manifest,
        args.seed_dir,
        endpoint=args.endpoint,
        token=token,
        only=args.files,
        progress=(
            (lambda line: print(f"progress: {line}", flush=True))
            if args.progress
            else (lambda line: print(line, file=sys.stderr, flush=True))
        ),
    )
    print(json.dumps(asdict(report)) if args.json else report.line())
    return 0


@_command
def run_verify(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    problems = verify_directory(manifest, args.dir)
    for problem in problems:
        print(f"{args.dir}: {problem}", file=sys.stderr)
    print(
        f"{args.dir}: {len(manifest.files)} files, {human_bytes(manifest.total_bytes)}, "
        f"verified={'yes' if not problems else 'NO'}"
    )
    return 0 if not problems else 1


@_command
def run_manifest(args: argparse.Namespace) -> int:
    manifest = describe_directory(args.dir, args.name, args.revision, args.seed_dir)
    path = SeedCache(args.seed_dir).write_manifest(manifest)
    result = {
        "manifest": str(path),
        "snapshot": str(args.dir),
        "revision": manifest.revision,
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
    }
    print(json.dumps(result) if args.json else f"{args.dir}: {len(manifest.files)} files, "
          f"{human_bytes(manifest.total_bytes)}; {path}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkfleet")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["weights", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
