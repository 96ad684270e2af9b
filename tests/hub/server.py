"""A local stand-in for the Hugging Face Hub: the endpoints the real huggingface_hub client calls.

The hub cannot be reached from here, so tests point the real client (``HfApi``, ``hf_hub_download``)
at this server through ``endpoint=`` or ``HF_ENDPOINT``. It serves model repos built from local model
directories, each at a revision derived deterministically from its content (a 40-hex sha1 over the
repo id, the parent revision and every file's git blob id), so a test can name revisions in advance.

Served, as the client reads them (huggingface_hub 1.x, file_download.py and hf_api.py):
- ``HEAD|GET /<org>/<repo>/resolve/<revision>/<path>``: ``X-Repo-Commit``, ``ETag`` (the git blob id,
  or for LFS files the sha256, also in ``X-Linked-Etag``), ``X-Linked-Size``, ``Content-Length``,
  ``Accept-Ranges``; ``Range: bytes=N-`` answers 206 with ``Content-Range`` (how the client resumes).
- ``GET /api/models/<org>/<repo>[/revision/<revision>]``: id, sha, siblings with ``size``, ``blobId``
  and ``lfs {sha256, size, pointerSize}`` (``?blobs=true`` is accepted; sizes are always there).
- Errors with the hub's ``X-Error-Code`` (RevisionNotFound, EntryNotFound, RepoNotFound, GatedRepo).

Test switches: ``cut`` (close the connection after N body bytes, for the next K responses of a file),
``corrupt`` (serve the file with one byte flipped, for the next K responses), ``fail`` (answer an
HTTP status for the next K requests of a file). Every request is counted with the body bytes sent.
A gated repo answers 401 unless the request carries ``Authorization: Bearer <token>``.

Run standalone: ``python -m tests.hub.server --port 18500 --repo org/name=DIR [--repo org/name=DIR2]``
(a repeated repo id adds a revision on top, which ``main`` then points at).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".msgpack", ".h5")
RESOLVE_PATH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)$")
API_PATH = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<revision>[^/]+))?$")


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob with this content (what the hub reports as ``blobId``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class RepoFile:
    """One file of one revision."""

    path: str
    data: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        """The git blob id: of the content, or of the LFS pointer for LFS files (as on the hub)."""
        return git_blob_id(lfs_pointer(self.sha256, self.size) if self.lfs else self.data)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else git_blob_id(self.data)

    def sibling(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"rfilename": self.path, "size": self.size, "blobId": self.blob_id}
        if self.lfs:
            entry["lfs"] = {
                "sha256": self.sha256,
                "size": self.size,
                "pointerSize": len(lfs_pointer(self.sha256, self.size)),
            }
        return entry


@dataclass
class Revision:
    """A commit of a repo: its sha and files."""

    sha: str
    files: dict[str, RepoFile]


@dataclass
class Repo:
    """A repo: its commits in order (the last is ``main``) and whether it is gated."""

    repo_id: str
    revisions: list[Revision] = field(default_factory=list)
    gated_token: str | None = None

    def resolve(self, revision: str) -> Revision | None:
        if revision == "main" and self.revisions:
            return self.revisions[-1]
        for candidate in self.revisions:
            if candidate.sha == revision:
                return candidate
        return None


def files_from_directory(directory: Path) -> dict[str, RepoFile]:
    """Every regular file under directory (dot files skipped), keyed by its repo path."""
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and not any(part.startswith(".") for part in relative.split("/")):
            files[relative] = RepoFile(relative, path.read_bytes(), relative.endswith(LFS_SUFFIXES))
    return files


def revision_sha(repo_id: str, parent: str | None, files: dict[str, RepoFile]) -> str:
    """A deterministic 40-hex commit id for these files on top of parent."""
    digest = hashlib.sha1(f"{repo_id}\n{parent or ''}\n".encode())
    for name in sorted(files):
        digest.update(f"{name} {files[name].blob_id}\n".encode())
    return digest.hexdigest()


@dataclass
class Switch:
    """A fault armed for the next ``times`` responses of one file."""

    times: int
    value: int = 0


@dataclass(frozen=True)
class Served:
    """One request as the hub saw it."""

    method: str
    kind: str  # "file", "api" or "other"
    repo: str | None
    path: str | None
    status: int
    body_bytes: int
    range_start: int
    authorized: bool


class HubDouble:
    """The hub: repos, fault switches and a request log, served by a threaded HTTP server."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Served] = []
        self._cuts: dict[tuple[str, str], Switch] = {}
        self._corrupt: dict[tuple[str, str], Switch] = {}
        self._fail: dict[tuple[str, str], Switch] = {}
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer((host, port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- repos -----------------------------------------------------------------------------------
    def add_revision(self, repo_id: str, source: Path | dict[str, bytes]) -> str:
        """Add a commit with the files of a model directory (or a {path: bytes} dict); main moves to it."""
        if isinstance(source, dict):
            files = {name: RepoFile(name, data, name.endswith(LFS_SUFFIXES)) for name, data in source.items()}
        else:
            files = files_from_directory(Path(source))
        if not files:
            raise ValueError(f"{repo_id}: {source} has no files to serve")
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        parent = repo.revisions[-1].sha if repo.revisions else None
        sha = revision_sha(repo_id, parent, files)
        repo.revisions.append(Revision(sha, files))
        return sha

    def gate(self, repo_id: str, token: str) -> None:
        """Make a repo gated: only requests with this bearer token get in."""
        self.repos[repo_id].gated_token = token

    # -- switches ----------------------------------------------------------------------------------
    def cut(self, repo_id: str, path: str, after_bytes: int, times: int = 1) -> None:
        """Drop the connection after ``after_bytes`` body bytes, for the next ``times`` GETs of the file."""
        self._cuts[(repo_id, path)] = Switch(times, after_bytes)

    def corrupt(self, repo_id: str, path: str, times: int = 1) -> None:
        """Serve the file with its middle byte flipped (same size) for the next ``times`` GETs."""
        self._corrupt[(repo_id, path)] = Switch(times)

    def fail(self, repo_id: str, path: str, status: int, times: int = 1) -> None:
        """Answer ``status`` to the next ``times`` requests (HEAD or GET) of the file."""
        self._fail[(repo_id, path)] = Switch(times, status)

    def _take(self, switches: dict[tuple[str, str], Switch], key: tuple[str, str]) -> Switch | None:
        with self._lock:
            switch = switches.get(key)
            if switch is None or switch.times <= 0:
                return None
            switch.times -= 1
            return switch

    # -- counters ----------------------------------------------------------------------------------
    def record(self, served: Served) -> None:
        """Log a request. Handlers call it before the response goes out: a client that has its answer
        (and a test that checks the log right after) always finds the request logged."""
        with self._lock:
            self.log.append(served)

    def file_bytes_served(self, repo_id: str | None = None) -> int:
        """Body bytes of file GETs (the model's bytes as the hub paid for them)."""
        return sum(s.body_bytes for s in list(self.log) if s.kind == "file" and (repo_id is None or s.repo == repo_id))

    def file_gets(self, repo_id: str | None = None, path: str | None = None) -> list[Served]:
        return [
            s
            for s in list(self.log)
            if s.kind == "file"
            and s.method == "GET"
            and (repo_id is None or s.repo == repo_id)
            and (path is None or s.path == path)
        ]

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    # -- server ------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubDouble:
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-double", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        # close kept-alive client connections too: a pooled connection would otherwise go on being
        # served by this (stopped) hub's handler thread
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _make_handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class HubHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "hub-double/1"

        def setup(self) -> None:
            super().setup()
            with hub._lock:
                hub._connections.add(self.connection)

        def finish(self) -> None:
            with hub._lock:
                hub._connections.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # the hub's log is hub.log

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._dispatch(head=True)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._dispatch(head=False)

        # -- helpers -------------------------------------------------------------------------------
        def _authorized(self, repo: Repo) -> bool:
            if repo.gated_token is None:
                return True
            return self.headers.get("Authorization", "") == f"Bearer {repo.gated_token}"

        def _error(self, status: int, code: str, message: str, kind: str, repo: str | None, path: str | None):
            body = json.dumps({"error": message}).encode()
            hub.record(Served(self.command, kind, repo, path, status, 0, 0, False))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo_or_error(self, repo_id: str, kind: str, path: str | None) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}.", kind, repo_id, path)
                return None
            if not self._authorized(repo):
                self._error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it.",
                    kind,
                    repo_id,
                    path,
                )
                return None
            return repo

        def _dispatch(self, head: bool) -> None:
            url_path = unquote(urlsplit(self.path).path)
            match = RESOLVE_PATH.match(url_path)
            if match:
                self._resolve(match["repo"], match["revision"], match["path"], head)
                return
            match = API_PATH.match(url_path)
            if match and not head:
                self._model_info(match["repo"], match["revision"] or "main")
                return
            self._error(404, "NotFound", f"no such endpoint: {url_path}", "other", None, None)

        def _commit_or_error(
            self, repo_id: str, revision: str, kind: str, path: str | None
        ) -> tuple[Repo, Revision] | None:
            """The repo and the commit ``revision`` names in it, or None once the hub's error is sent."""
            repo = self._repo_or_error(repo_id, kind, path)
            if repo is None:
                return None
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", kind, repo_id, path)
                return None
            return repo, commit

        def _model_info(self, repo_id: str, revision: str) -> None:
            found = self._commit_or_error(repo_id, revision, "api", None)
            if found is None:
                return
            repo, commit = found
            body = json.dumps(
                {
                    "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit.sha,
                    "private": False,
                    "gated": "manual" if repo.gated_token else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [commit.files[name].sibling() for name in sorted(commit.files)],
                }
            ).encode()
            hub.record(Served("GET", "api", repo_id, None, 200, len(body), 0, True))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
            found = self._commit_or_error(repo_id, revision, "file", path)
            if found is None:
                return
            _, commit = found
            entry = commit.files.get(path)
            if entry is None:
                self._error(404, "EntryNotFound", f"{path} does not exist at {revision}", "file", repo_id, path)
                return
            failure = hub._take(hub._fail, (repo_id, path))
            if failure is not None:
                self._error(failure.value, "Injected", f"injected {failure.value}", "file", repo_id, path)
                return
            data = entry.data
            start = 0
            status = 200
            range_header = self.headers.get("Range")
            if range_header and not head:
                found = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
                if not found or int(found[1]) >= len(data):
                    self._error(416, "RangeNotSatisfiable", f"bad range {range_header}", "file", repo_id, path)
                    return
                start = int(found[1])
                status = 206
            if not head and hub._take(hub._corrupt, (repo_id, path)) is not None:
                middle = len(data) // 2
                data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
            body = data[start:]
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit.sha)
            self.send_header("ETag", f'"{entry.etag}"')
            if entry.lfs:
                self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
                self.send_header("X-Linked-Size", str(entry.size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            cut = hub._take(hub._cuts, (repo_id, path)) if not head else None
            cut_short = cut is not None and cut.value < len(body)
            sent = 0 if head else cut.value if cut_short else len(body)
            hub.record(Served(self.command, "file", repo_id, path, status, sent, start, True))
            self.end_headers()
            if head:
                return
            if cut_short:
                self.wfile.write(body[: cut.value])
                self.wfile.flush()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(body)

    return HubHandler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--repo", action="append", default=[], metavar="ORG/NAME=DIR", help="add a revision")
    args = parser.parse_args(argv)
    hub = HubDouble(args.host, args.port)
    for spec in args.repo:
        repo_id, _, directory = spec.partition("=")
        print(f"{repo_id} {hub.add_revision(repo_id, Path(directory))} {directory}", flush=True)
    print(f"serving {hub.endpoint}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        hub._server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
