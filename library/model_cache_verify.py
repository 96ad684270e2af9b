#!/usr/bin/python3
"""Ansible module: check a model directory against its weights manifest (sizes and sha256)."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: model_cache_verify
short_description: Check a model directory on the host against its weights manifest
description:
  - Compares every file listed in a sparkfleet weights manifest with the directory on the host, first
    by size (a truncated file is caught without reading it), then by sha256.
  - With I(remove_bad), files that exist but do not match are deleted so the next transfer replaces them.
  - With I(required_free_check), fails before any transfer when the files still to come do not fit on
    the directory's filesystem, naming the path, the need and what is free.
options:
  path:
    description: The model directory (created by the caller).
    type: path
    required: true
  files:
    description: Manifest entries; each needs C(path), C(size) and C(sha256).
    type: list
    elements: dict
    required: true
  remove_bad:
    description: Delete files whose size or sha256 do not match.
    type: bool
    default: false
  required_free_check:
    description: Fail when the missing and bad files need more bytes than the filesystem has free.
    type: bool
    default: true
  workers:
    description: Files hashed in parallel.
    type: int
    default: 4
  create:
    description: Create I(path) (and its parents) as a directory, mode 0750, owned by root and I(group).
    type: bool
    default: false
  group:
    description: Group of the directory and the manifest file (must exist).
    type: str
  manifest:
    description:
      - The whole manifest to keep next to the directory as C(<path>.manifest.json), mode 0640, owned by
        root and I(group). Rewritten only when its content differs.
    type: dict
  chunk_bytes:
    description: In I(steps), a missing file this big is a step of its own; smaller ones are grouped.
    type: int
    default: 268435456
author: sparkfleet
"""

EXAMPLES = r"""
- name: Check the drafter's files, removing any that do not match
  model_cache_verify:
    path: /var/lib/sparkfleet/models/.hub/dflash-drafter/6c7242c934a9870d7c59c05240bdbb2467cc1394
    files: "{{ manifest.files }}"
    remove_bad: true
"""

RETURN = r"""
files:
  description: Number of files in the manifest.
  type: int
  returned: always
bytes:
  description: Total bytes of the files in the manifest.
  type: int
  returned: always
ok:
  description: Files present with the right size and sha256.
  type: list
  elements: str
  returned: always
missing:
  description: Files absent, or removed because they did not match (what a transfer must bring).
  type: list
  elements: str
  returned: always
steps:
  description: The missing files grouped into transfer steps, each with C(files) and C(bytes).
  type: list
  elements: dict
  returned: always
bad:
  description: Files that did not match, each with the reason.
  type: list
  elements: dict
  returned: always
bytes_needed:
  description: Bytes of the files in I(missing).
  type: int
  returned: always
free_bytes:
  description: Free bytes on the directory's filesystem.
  type: int
  returned: always
verified:
  description: True when every file is present and matches.
  type: bool
  returned: always
"""


HASH_BLOCK = 8 * 1024 * 1024


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            block = handle.read(HASH_BLOCK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def human(count):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024.0
    return f"{count:.1f} GiB"


def check_entries(files):
    """The manifest entries, validated; raises ValueError naming the bad entry."""
    entries = []
    for entry in files:
        name = entry.get("path")
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"manifest entry {entry!r}: path must be relative and inside the model directory")
        if not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"manifest entry {name!r}: needs an integer size and a sha256 (fetch the seed first)")
        entries.append((name, entry["size"], entry["sha256"]))
    return entries


def inspect(directory, entries, workers):
    """(ok, missing, bad) where bad is a list of {path, reason}."""
    ok, missing, bad, to_hash = [], [], [], []
    for name, size, sha256 in entries:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            missing.append(name)
            continue
        actual = os.path.getsize(path)
        if actual != size:
            bad.append({"path": name, "reason": f"size {actual}, expected {size} (truncated or grown)"})
        else:
            to_hash.append((name, path, sha256))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda item: sha256_of(item[1]), to_hash))
    for (name, _path, sha256), digest in zip(to_hash, digests, strict=True):
        if digest == sha256:
            ok.append(name)
        else:
            bad.append({"path": name, "reason": f"sha256 {digest}, expected {sha256} (corrupted)"})
    return ok, missing, bad


def transfer_steps(files, chunk_bytes):
    """Group (path, size) into steps: a file of chunk_bytes or more alone, smaller ones together."""
    steps, small, small_bytes = [], [], 0
    for path, size in files:
        if size >= chunk_bytes:
            steps.append({"files": [path], "bytes": size})
            continue
        small.append(path)
        small_bytes += size
        if small_bytes >= chunk_bytes:
            steps.append({"files": small, "bytes": small_bytes})
            small, small_bytes = [], 0
    if small:
        steps.append({"files": small, "bytes": small_bytes})
    return steps


def ensure_directory(path, gid):
    """Create path (with parents) owned by root:gid, mode 0750; True when something changed."""
    changed = False
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o750)
        changed = True
    info = os.stat(path)
    if (info.st_uid, info.st_gid) != (0, gid):
        os.chown(path, 0, gid)
        changed = True
    if info.st_mode & 0o7777 != 0o750:
        os.chmod(path, 0o750)
        changed = True
    return changed


def write_manifest(dest, manifest, gid, check_mode):
    """Write the manifest JSON (sorted keys) if it differs; fix owner and mode; True when changed."""
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    current = None
    if os.path.isfile(dest):
        with open(dest) as handle:
            current = handle.read()
    changed = current != text
    if changed and not check_mode:
        tmp = dest + ".tmp"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o640)
        os.chown(tmp, 0, gid)
        os.replace(tmp, dest)
    elif not changed:
        info = os.stat(dest)
        if (info.st_uid, info.st_gid, info.st_mode & 0o7777) != (0, gid, 0o640):
            changed = True
            if not check_mode:
                os.chown(dest, 0, gid)
                os.chmod(dest, 0o640)
    return changed


def build_module():
    return AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True},
            "remove_bad": {"type": "bool", "default": False},
            "required_free_check": {"type": "bool", "default": True},
            "workers": {"type": "int", "default": 4},
            "create": {"type": "bool", "default": False},
            "group": {"type": "str"},
            "manifest": {"type": "dict"},
            "chunk_bytes": {"type": "int", "default": 268435456},
        },
        supports_check_mode=True,
    )


def main():
    module = build_module()
    directory = module.params["path"]
    try:
        entries = check_entries(module.params["files"])
    except ValueError as error:
        module.fail_json(msg=str(error))
    changed = False
    gid = None
    if module.params["create"] or module.params["manifest"] is not None:
        if not module.params["group"]:
            module.fail_json(msg="group is required with create or manifest")
        try:
            gid = grp.getgrnam(module.params["group"]).gr_gid
        except KeyError:
            module.fail_json(msg=f"group {module.params['group']!r} does not exist on this host; create it first")
    if module.params["create"] and not (module.check_mode and not os.path.isdir(directory)):
        changed = ensure_directory(directory, gid) if not module.check_mode else False
    elif module.params["create"]:
        module.exit_json(changed=True, files=len(entries), bytes=sum(e[1] for e in entries), ok=[],
                         missing=[e[0] for e in entries], bad=[], steps=[], bytes_needed=0, free_bytes=0,
                         verified=False, msg="check mode: the directory would be created")  # fmt: skip
    if module.params["manifest"] is not None:
        manifest_changed = write_manifest(
            directory.rstrip("/") + ".manifest.json", module.params["manifest"], gid, module.check_mode
        )
        changed = changed or manifest_changed
    if not os.path.isdir(directory):
        module.fail_json(msg=f"{directory}: not a directory; create it before checking the model")
    ok, missing, bad = inspect(directory, entries, module.params["workers"])
    if bad and module.params["remove_bad"]:
        changed = True
        if not module.check_mode:
            for item in bad:
                os.unlink(os.path.join(directory, item["path"]))
        missing = missing + [item["path"] for item in bad]
    sizes = dict((name, size) for name, size, _sha in entries)
    needed = sum(sizes[name] for name in missing)
    free = shutil.disk_usage(directory).free
    result = {
        "changed": changed,
        "files": len(entries),
        "bytes": sum(sizes.values()),
        "ok": ok,
        "missing": missing,
        "bad": bad,
        "steps": transfer_steps([(name, sizes[name]) for name in missing], module.params["chunk_bytes"]),
        "bytes_needed": needed,
        "free_bytes": free,
        "verified": not missing and not bad,
    }
    if module.params["required_free_check"] and needed > free:
        module.fail_json(
            msg=f"{directory}: the model needs {human(needed)} ({needed} bytes) more for {len(missing)} files "
            f"but only {human(free)} ({free} bytes) is free there; free space or set model_cache_dir to a larger disk",
            **result,
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
