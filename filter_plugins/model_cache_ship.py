"""Ansible filter: which local model directories a host lacks, from one checksummed listing.

``copy`` of a directory stats and checksums every file on the host in a round trip of its own
(~29 for the sandbox's two tiny models, ~9 s per run). The role lists the host's copies once with
``find`` (``get_checksum``) and ships only the models this filter names.

``model_cache_ship_plan(local_models, host_files, cache_dir, owner, group, mode)``:

    local_models: the role's local models, each ``{"name": ..., "path": <controller directory>}``
    host_files:   ``find``'s ``files`` for ``<cache_dir>/<name>`` (recursive, hidden, checksummed)
    cache_dir:    the host's model cache directory
    owner, group, mode: what ``copy`` would set on each file (``mode`` as an octal string)

Returns ``{"stale": [names], "files": n, "bytes": n}``: a model is stale when any of its controller
files is missing on the host, differs in sha1 (``copy``'s and ``find``'s checksum) or in owner, group
or mode; ``files``/``bytes`` count the controller's files, which is what a host holds once the copy
has succeeded. A model the listing cannot vouch for is always stale, so the filter can only make a
run copy more than needed, never less. Pure and standard library only.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # the unit tests import this file without Ansible on the path

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        """Stand-in when Ansible is not importable."""


_CHUNK = 1 << 20


def _sha1(path: str) -> str:
    digest = hashlib.sha1()  # noqa: S324 - copy's and find's checksum, not a security boundary
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _controller_files(root: str) -> dict[str, str]:
    """relative path -> absolute path of every file ``copy`` sends from ``root/`` (links followed)."""
    if not os.path.isdir(root):
        raise AnsibleFilterError(
            f"model_cache_ship_plan: local model directory {root!r} does not exist on the controller"
        )
    files: dict[str, str] = {}
    for base, _dirs, names in os.walk(root, followlinks=True):
        for name in names:
            path = os.path.join(base, name)
            if os.path.isfile(path):
                files[os.path.relpath(path, root)] = path
    return files


def _mode(value: Any) -> int | None:
    try:
        return int(str(value), 8)
    except ValueError:
        return None


def model_cache_ship_plan(
    local_models: Any, host_files: Any, cache_dir: Any, owner: Any, group: Any, mode: Any
) -> dict[str, Any]:
    """The local models a host must be sent, and the size of what it holds (see the module docstring)."""
    if not isinstance(local_models, (list, tuple)) or not all(
        isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("path"), str) for m in local_models
    ):
        raise AnsibleFilterError(
            f"model_cache_ship_plan: local_models must be a list of {{name, path}}, got {local_models!r}"
        )
    if not isinstance(host_files, (list, tuple)):
        raise AnsibleFilterError(f"model_cache_ship_plan: host_files must be find's files list, got {host_files!r}")
    want_mode = _mode(mode)
    if want_mode is None:
        raise AnsibleFilterError(f"model_cache_ship_plan: mode {mode!r} is not an octal mode such as '0640'")
    on_host = {str(f.get("path")): f for f in host_files if isinstance(f, dict)}
    cache_dir = str(cache_dir).rstrip("/")
    stale: list[str] = []
    count = size = 0
    for model in local_models:
        files = _controller_files(model["path"])
        count += len(files)
        size += sum(os.path.getsize(path) for path in files.values())
        for relative, path in sorted(files.items()):
            there = on_host.get(f"{cache_dir}/{model['name']}/{relative}")
            if (
                there is None
                or not there.get("isreg", False)
                or there.get("checksum") != _sha1(path)
                or there.get("pw_name") != owner
                or there.get("gr_name") != group
                or _mode(there.get("mode", "")) != want_mode
            ):
                stale.append(model["name"])
                break
    return {"stale": stale, "files": count, "bytes": size}


class FilterModule:
    """The ship plan of the model_cache role's local models."""

    def filters(self) -> dict[str, Any]:
        return {"model_cache_ship_plan": model_cache_ship_plan}
