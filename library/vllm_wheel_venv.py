#!/usr/bin/python3
"""Ansible module ``vllm_wheel_venv``: verify a vLLM venv against its installed distributions' own
RECORD files, and reinstall from the wheelhouse what no longer matches.

Comparing versions (the role's ``__vllm_wheel_pins_check``) says a venv holds the right releases, not
that their files are the ones the wheels shipped: a line appended to ``vllm/envs.py`` or a ``.pth``
dropped into site-packages passes it unnoticed. Every wheel install writes a RECORD with the sha256 of
each file it put down, so the venv carries its own manifest; this module hashes the files against it
(in threads: hashlib releases the GIL, so a venv of ~40,000 files takes seconds, not minutes).

It runs on the host under the system python (stdlib and ansible.module_utils only) and never imports
anything from the venv: the distributions are read from their ``*.dist-info`` directories, and pip is
only started (as ``<venv>/bin/python -m pip``) to repair.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
import re
import subprocess
import time
from base64 import urlsafe_b64encode
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.parser import HeaderParser
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: vllm_wheel_venv
short_description: Verify a venv's files against its distributions' RECORD hashes and repair them
description:
  - Checks that every pin in O(pins) is installed in the venv at its version (same rules as pip's
    C(==) for a released version; a pin without a local label, e.g. C(torch==2.11.0), also matches
    C(2.11.0+cpu); a pin with one must match exactly). A pin that is off fails the task: the caller
    installs with pip before this module, so an off pin here is an error, not drift.
  - Hashes every file that a C(*.dist-info/RECORD) in site-packages lists with a hash and reports each
    one that is missing or whose digest differs. C(.pyc) files are not compared: Python writes them again
    from their (verified) source whenever it finds them stale, so their bytes change without tampering.
  - A file hashed and found matching is remembered in O(cache) by inode, size, mtime and ctime; on later
    runs a file whose four are unchanged is not read again (any write to a file moves its ctime, which
    no user call can set back), so a converged venv of 6 GB is verified in about a second. O(full)
    hashes every file again.
  - Reports C(*.pth) files directly in site-packages that no RECORD lists (a .pth runs code at every
    interpreter start).
  - With O(repair), reinstalls each tampered distribution at its installed version with
    C(pip install --force-reinstall --no-deps) (pip's options come in O(pip_env), e.g. C(PIP_NO_INDEX) and
    C(PIP_FIND_LINKS) naming the wheelhouse), deletes the unlisted .pth files, and verifies the
    reinstalled distributions again; fails naming the files that still do not match.
  - A venv that does not exist yet is not an error (the pip task before this one creates it and reports
    that change).
options:
  venv:
    description: The venv's directory (made by C(python3 -m venv)).
    type: path
    required: true
  pins:
    description:
      - C(NAME==VERSION) requirements that must be installed. Anything but an exact C(==) pin is reported
        as off (this module cannot evaluate it).
    type: list
    elements: str
    default: []
  repair:
    description: Reinstall tampered distributions and delete unlisted .pth files. Off, the module only reports.
    type: bool
    default: true
  pip_env:
    description: Environment variables for pip, on top of the module's own environment.
    type: dict
    default: {}
  workers:
    description: Files hashed in parallel threads.
    type: int
    default: 4
  cache:
    description:
      - Where the stat signatures of files found matching are kept (root's, mode 0600; written only
        outside check mode). Default C(<venv>/.sparkfleet-verified.json), so it goes with the venv.
    type: path
  full:
    description: Hash every file, ignoring the cache.
    type: bool
    default: false
  just_installed:
    description:
      - The venv was installed by pip in this run, from hash-checked wheels (its RECORD files were
        written in that same step). Files are checked by size and their signatures recorded in
        O(cache) without reading them; the next run compares against those.
    type: bool
    default: false
notes:
  - Supports check mode (and returns a diff): nothing is reinstalled or deleted, and C(changed) says
    whether a repair would run.
author: sparkfleet
"""

EXAMPLES = r"""
- name: Verify the vLLM venv against its RECORD hashes, reinstalling what changed
  vllm_wheel_venv:
    venv: "{{ __vllm_wheel_venv }}"
    pins: "{{ __vllm_wheel_pins }}"
    pip_env: "{{ __vllm_wheel_pip_env }}"
    workers: 8

- name: Only report (an audit run)
  vllm_wheel_venv:
    venv: /opt/sparkfleet/venvs/vllm-0.23.0
    repair: false
  register: venv_audit
"""

RETURN = r"""
tampered:
  description: Distribution name to its files that do not match, each C("relative/path: changed|missing").
  type: dict
  returned: always
  sample: {"vllm": ["vllm/envs.py: changed", "vllm/utils.py: missing"]}
unlisted_pth:
  description: C(.pth) files directly in site-packages that no RECORD lists.
  type: list
  elements: str
  returned: always
  sample: ["evil.pth"]
repaired:
  description: C(NAME==VERSION) of each distribution reinstalled (in check mode, that would be).
  type: list
  elements: str
  returned: always
  sample: ["vllm==0.23.0"]
files_checked:
  description: RECORD rows with a hash that were checked.
  type: int
  returned: always
bytes_hashed:
  description: Bytes read and hashed.
  type: int
  returned: always
seconds:
  description: Time the verification took.
  type: float
  returned: always
distributions:
  description: Number of C(*.dist-info) directories in site-packages.
  type: int
  returned: always
site_packages:
  description: The venv's site-packages directory.
  type: str
  returned: when the venv exists
diff:
  description: Before, one line per bad file or .pth; after, one line per distribution to reinstall or .pth to remove.
  type: dict
  returned: when something is tampered and O(repair) is on
"""

READ_BLOCK = 1024 * 1024
CACHE_VERSION = 1
# Algorithms the wheel spec allows in RECORD ("sha256 or better"); other rows are skipped.
HASHES = ("sha256", "sha384", "sha512")
LISTED_IN_MESSAGE = 5


def canonical(name: str) -> str:
    """PEP 503 normalisation, as pip and importlib.metadata compare names."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Dist:
    """One installed distribution: its metadata and the hashed rows of its RECORD."""

    name: str
    version: str
    info_dir: str
    rows: list[tuple[str, str, str, int | None]] = field(default_factory=list)  # (path, algo, digest, size)
    listed: set[str] = field(default_factory=set)  # every RECORD path, normalised, hashed or not
    record_missing: bool = False

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


def site_packages_of(venv: str) -> str:
    """``<venv>/lib/python3.X/site-packages``: the version pyvenv.cfg names, else the only one there."""
    try:
        with open(os.path.join(venv, "pyvenv.cfg")) as handle:
            for line in handle:
                key, _sep, value = line.partition("=")
                match = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)?\S*", value.strip())
                if key.strip() in ("version", "version_info") and match:
                    candidate = os.path.join(venv, "lib", f"python{match[1]}.{match[2]}", "site-packages")
                    if os.path.isdir(candidate):
                        return candidate
    except OSError:
        pass
    found = sorted(glob.glob(os.path.join(glob.escape(venv), "lib", "python3.*", "site-packages")))
    if len(found) != 1:
        raise ValueError(
            f"venv {venv}: expected one lib/python3.*/site-packages, found {len(found)}"
            + (f" ({', '.join(found)})" if found else "")
        )
    return found[0]


def read_metadata(path: str) -> tuple[str, str] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            headers = HeaderParser().parse(handle)
    except OSError:
        return None
    name, version = headers.get("Name"), headers.get("Version")
    return (name.strip(), version.strip()) if name and version else None


def normalised(site: str, path: str) -> str:
    """A RECORD path as a path relative to site-packages (``../../../bin/x`` stays relative)."""
    return os.path.normpath(os.path.relpath(os.path.join(site, path), site))


def load_dists(site: str) -> list[Dist]:
    """Every ``*.dist-info`` in site-packages, with its hashed RECORD rows (read with csv)."""
    dists = []
    for info in sorted(glob.glob(os.path.join(glob.escape(site), "*.dist-info"))):
        base = os.path.basename(info)[: -len(".dist-info")]
        meta = read_metadata(os.path.join(info, "METADATA"))
        if meta is None:  # no readable METADATA: the directory's name-version
            name, _sep, version = base.partition("-")
            meta = (name, version or "?")
        name, version = meta
        dist = Dist(name=name, version=version, info_dir=info)
        try:
            with open(os.path.join(info, "RECORD"), newline="", encoding="utf-8") as handle:
                for row in csv.reader(handle):
                    if not row or not row[0]:
                        continue
                    path = row[0]
                    dist.listed.add(normalised(site, path))
                    algo, _sep, digest = (row[1] if len(row) > 1 else "").partition("=")
                    if algo not in HASHES or not digest:
                        continue  # RECORD itself, and pyc files an installer did not hash
                    if path.endswith(".pyc"):
                        continue  # rewritten by Python from their source when stale (see DOCUMENTATION)
                    size = int(row[2]) if len(row) > 2 and row[2].isdigit() else None
                    dist.rows.append((path, algo, digest, size))
        except FileNotFoundError:
            dist.record_missing = True
        dists.append(dist)
    return dists


def load_eggs(site: str) -> dict[str, tuple[str, str]]:
    """``*.egg-info`` distributions (no RECORD to verify) so that pins still find them."""
    found = {}
    for info in glob.glob(os.path.join(glob.escape(site), "*.egg-info")):
        meta = read_metadata(os.path.join(info, "PKG-INFO") if os.path.isdir(info) else info)
        if meta:
            found[canonical(meta[0])] = meta
    return found


def pins_off(pins: list[str], installed: dict[str, tuple[str, str]]) -> list[str]:
    """The pins not satisfied, worded as the role's ``__vllm_wheel_pins_check`` words them."""
    off = []
    for pin in pins:
        name, sep, want = pin.partition("==")
        name, want = name.strip(), want.strip()
        if not sep or want.startswith("="):
            off.append(f"{pin}: not an exact pin, left to pip")
            continue
        have = installed.get(canonical(name), (None, None))[1]
        if have is None or (have != want and ("+" in want or have.split("+")[0] != want)):
            off.append(f"{name}: {have or 'missing'}, pinned {want}")
    return off


def digest_of(path: str, algo: str) -> tuple[str, int]:
    """(urlsafe base64 digest without padding, bytes read) of a file, read in 1 MiB blocks."""
    digest = hashlib.new(algo)
    count = 0
    with open(path, "rb") as handle:
        while block := handle.read(READ_BLOCK):
            digest.update(block)
            count += len(block)
    return urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii"), count


Signature = list  # [inode, size, mtime_ns, ctime_ns, "algo=digest"]


def signature(stat: os.stat_result, algo: str, digest: str) -> Signature:
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, f"{algo}={digest}"]


def load_cache(path: str) -> dict[str, Signature]:
    """The signatures of files found matching before; {} for a missing or unreadable cache."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
    return files if isinstance(files, dict) else {}


def save_cache(path: str, files: dict[str, Signature]) -> None:
    """Write the cache atomically, root's and 0600."""
    tmp = f"{path}.tmp{os.getpid()}"
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        json.dump({"version": CACHE_VERSION, "files": files}, handle, separators=(",", ":"))
    os.replace(tmp, path)


def check_row(
    site: str,
    row: tuple[str, str, str, int | None],
    cache: dict[str, Signature],
    seen: dict[str, Signature],
    trust: bool = False,
) -> tuple[str | None, int]:
    """(None when the file matches, else "changed"/"missing"/"unreadable (...)"; bytes hashed). A file
    whose signature equals its cached one (same inode, size, mtime, ctime and RECORD digest) is not
    read; every matching file's signature goes into ``seen``."""
    path, algo, want, size = row
    full = os.path.join(site, path)
    try:
        stat = os.stat(full)
        if size is not None and stat.st_size != size:
            return "changed", 0  # a grown or truncated file needs no read
        known = signature(stat, algo, want)
        if trust or cache.get(path) == known:
            seen[path] = known
            return None, 0
        digest, count = digest_of(full, algo)
    except (FileNotFoundError, NotADirectoryError):
        return "missing", 0
    except IsADirectoryError:
        return "changed", 0
    except OSError as error:
        return f"unreadable ({error.strerror})", 0
    if digest != want:
        return "changed", count
    seen[path] = known
    return None, count


@dataclass
class Verified:
    tampered: dict[str, list[str]]
    files: int
    bytes: int
    seconds: float


def verify(
    site: str, dists: list[Dist], workers: int, cache: dict[str, Signature] | None = None, trust: bool = False
) -> tuple[Verified, dict[str, Signature]]:
    """Check every hashed RECORD row of ``dists`` in ``workers`` threads (files whose signature is in
    ``cache`` unchanged are not read); also returns the signatures of the files that match."""
    started = time.monotonic()
    jobs = [(dist, row) for dist in dists for row in dist.rows]
    seen: dict[str, Signature] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        outcomes = list(pool.map(lambda job: check_row(site, job[1], cache or {}, seen, trust), jobs))
    tampered: dict[str, list[str]] = {}
    for dist in dists:
        if dist.record_missing:
            tampered.setdefault(dist.name, []).append(f"{os.path.basename(dist.info_dir)}/RECORD: missing")
    for (dist, row), (problem, _count) in zip(jobs, outcomes, strict=True):
        if problem:
            entry = f"{row[0]}: {problem}"
            if entry not in tampered.setdefault(dist.name, []):
                tampered[dist.name].append(entry)
    verified = Verified(
        tampered=tampered,
        files=len(jobs),
        bytes=sum(count for _problem, count in outcomes),
        seconds=time.monotonic() - started,
    )
    return verified, seen


def unlisted_pth(site: str, dists: list[Dist]) -> list[str]:
    listed = set().union(*(dist.listed for dist in dists)) if dists else set()
    return sorted(
        name
        for name in os.listdir(site)
        if name.endswith(".pth") and os.path.isfile(os.path.join(site, name)) and name not in listed
    )


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000.0
    return f"{count:.1f} GB"


def describe(dist: Dist, problems: list[str]) -> str:
    """``2 files changed in vllm 0.23.0 (vllm/envs.py: changed, vllm/x.py: changed)``."""
    kinds = {problem.rsplit(": ", 1)[1] for problem in problems}
    what = "missing" if kinds == {"missing"} else "changed" if kinds == {"changed"} else "changed or missing"
    shown = ", ".join(problems[:LISTED_IN_MESSAGE])
    more = f", and {len(problems) - LISTED_IN_MESSAGE} more" if len(problems) > LISTED_IN_MESSAGE else ""
    noun = "file" if len(problems) == 1 else "files"
    return f"{len(problems)} {noun} {what} in {dist.name} {dist.version} ({shown}{more})"


def pip_reinstall(venv: str, pin: str, pip_env: dict[str, Any]) -> str | None:
    """Reinstall one distribution at its version; None on success, else pip's last lines."""
    env = dict(os.environ)
    env.update({key: str(value) for key, value in pip_env.items()})
    command = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--force-reinstall", "--no-deps", pin]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if run.returncode == 0:
        return None
    tail = [line.strip() for line in (run.stderr or run.stdout).splitlines() if line.strip()][-3:]
    return f"pip exited {run.returncode}: " + " / ".join(tail)


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "venv": {"type": "path", "required": True},
            "pins": {"type": "list", "elements": "str", "default": []},
            "repair": {"type": "bool", "default": True},
            "pip_env": {"type": "dict", "default": {}},
            "workers": {"type": "int", "default": 4},
            "cache": {"type": "path"},
            "full": {"type": "bool", "default": False},
            "just_installed": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )


def main() -> None:
    module = build_module()
    venv = module.params["venv"].rstrip("/") or "/"
    empty: dict[str, Any] = {
        "tampered": {},
        "unlisted_pth": [],
        "repaired": [],
        "files_checked": 0,
        "bytes_hashed": 0,
        "seconds": 0.0,
        "distributions": 0,
    }
    if not os.path.isdir(venv):
        module.exit_json(changed=False, msg=f"venv {venv}: no venv yet, nothing to verify", **empty)
    try:
        site = site_packages_of(venv)
    except ValueError as error:
        module.fail_json(msg=str(error), **empty)
    dists = load_dists(site)
    installed = load_eggs(site)
    installed.update({canonical(dist.name): (dist.name, dist.version) for dist in dists})
    off = pins_off(module.params["pins"], installed)
    if off:
        module.fail_json(msg=f"venv {venv}: pins not installed: " + "; ".join(off), site_packages=site, **empty)

    cache_path = module.params["cache"] or os.path.join(venv, ".sparkfleet-verified.json")
    cache = {} if module.params["full"] else load_cache(cache_path)
    trust = module.params["just_installed"] and not module.params["full"]
    checked, seen = verify(site, dists, module.params["workers"], cache, trust)
    cached = len(seen) if trust else sum(1 for path, known in seen.items() if cache.get(path) == known)
    if not module.check_mode and seen != cache:
        try:
            save_cache(cache_path, seen)
        except OSError as error:
            module.warn(f"could not write the verification cache {cache_path}: {error.strerror}")
    pth = unlisted_pth(site, dists)
    by_name = {dist.name: dist for dist in dists}
    result: dict[str, Any] = {
        "changed": False,
        "files_cached": cached,
        "tampered": checked.tampered,
        "unlisted_pth": pth,
        "repaired": [],
        "files_checked": checked.files,
        "bytes_hashed": checked.bytes,
        "seconds": round(checked.seconds, 3),
        "distributions": len(dists),
        "site_packages": site,
    }
    head = (
        f"venv {venv}: {len(dists)} distributions, {checked.files:,} files just installed by pip from "
        f"hash-checked wheels: sizes checked, signatures recorded for the next verification"
        if trust
        else f"venv {venv}: {len(dists)} distributions, {checked.files:,} files verified against their RECORD "
        f"hashes in {checked.seconds:.1f} s ({human_bytes(checked.bytes)} read, {cached:,} files unchanged "
        f"since their last check)"
    )
    if not checked.tampered and not pth:
        module.exit_json(msg=f"{head}: all match", **result)

    findings = [describe(by_name[name], problems) for name, problems in checked.tampered.items()]
    if pth:
        findings.append(f"unlisted .pth in site-packages: {', '.join(pth)}")
    found = f"{head}: " + "; ".join(findings)
    if not module.params["repair"]:
        module.exit_json(msg=f"{found}: not repaired (repair is off)", **result)

    to_reinstall = [by_name[name] for name in checked.tampered]
    result["repaired"] = [dist.pin for dist in to_reinstall]
    result["changed"] = True
    result["diff"] = {
        "before": "".join(
            [f"{name}: {problem}\n" for name, problems in checked.tampered.items() for problem in problems]
            + [f"{name}: unlisted .pth\n" for name in pth]
        ),
        "after": "".join(
            [f"would reinstall {dist.pin}\n" for dist in to_reinstall] + [f"would remove {name}\n" for name in pth]
        ),
    }
    actions = []
    if module.check_mode:
        actions += [f"would reinstall {dist.pin}" for dist in to_reinstall]
        actions += [f"would remove {name}" for name in pth]
        module.exit_json(msg=f"{found}: " + ", ".join(actions), **result)

    for dist in to_reinstall:
        error = pip_reinstall(venv, dist.pin, module.params["pip_env"])
        if error:
            module.fail_json(msg=f"{found}: reinstalling {dist.pin} failed: {error}", **result)
    for name in pth:
        try:
            os.unlink(os.path.join(site, name))
        except FileNotFoundError:
            pass
        except OSError as error:
            module.fail_json(msg=f"{found}: could not remove {name}: {error.strerror}", **result)

    wanted = {canonical(dist.name) for dist in to_reinstall}
    again = [dist for dist in load_dists(site) if canonical(dist.name) in wanted]
    recheck, _seen = verify(site, again, module.params["workers"])
    gone = sorted(wanted - {canonical(dist.name) for dist in again})
    still = [f"{name}: {problem}" for name, problems in recheck.tampered.items() for problem in problems]
    still += [f"{name}: not installed after the reinstall" for name in gone]
    still += [f"{name}: still there" for name in pth if os.path.exists(os.path.join(site, name))]
    if still:
        module.fail_json(msg=f"{found}: still bad after the repair: " + ", ".join(still), **result)
    if to_reinstall:
        actions.append("reinstalled " + ", ".join(dist.pin for dist in to_reinstall) + " from the wheelhouse")
    if pth:
        actions.append("removed " + ", ".join(pth))
    module.exit_json(msg=f"{found}: " + ", ".join(actions), **result)


if __name__ == "__main__":
    main()
