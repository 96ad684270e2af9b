#!/usr/bin/env python3
"""The sparkfleet sandbox fleet: a few Debian hosts booted with systemd-nspawn on this machine.

Every host is an overlayfs copy of one debootstrapped Debian bookworm rootfs, runs real systemd
as PID 1 in its own network namespace (a veth on the bridge ``sfbr0``, no route out), and is
reached by Ansible over real SSH with strict host key checking. A local flat apt repository and
the wheelhouse are bind-mounted read-only, because the hosts have no internet.

Subcommands: ``rootfs``, ``aptrepo``, ``up [--hosts N]``, ``down [--purge]``, ``status``,
``exec NAME -- CMD...``. Run as root. Standard library only (Python 3.11). See README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

# Bump when the rootfs configuration or the apt repo layout written by this script changes:
# it is part of the cache stamps, so the next run rebuilds what it must.
ROOTFS_SCRIPT_VERSION = "2"
APTREPO_SCRIPT_VERSION = "1"

REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBOX_DIR = REPO_ROOT / "build" / "sandbox"
ROOTFS_DIR = SANDBOX_DIR / "rootfs"
APT_REPO_DIR = SANDBOX_DIR / "apt"
HOSTS_DIR = SANDBOX_DIR / "hosts"
SSH_DIR = SANDBOX_DIR / "ssh"
CLIENT_KEY = SSH_DIR / "id_ed25519"
KNOWN_HOSTS = SSH_DIR / "known_hosts"
LOCK_FILE = SANDBOX_DIR / "fleet.lock"
WHEELHOUSE_DIR = REPO_ROOT / "build" / "wheelhouse"
INVENTORY_FILE = REPO_ROOT / "inventory" / "sandbox" / "hosts.yml"
PACKAGES_FILE = Path(__file__).with_name("packages.txt")
NVIDIA_SMI_FILE = Path(__file__).with_name("nvidia-smi")

SUITE = "bookworm"
BRIDGE = "sfbr0"
SUBNET = "10.213.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"
HOST_ADDRESS_OFFSET = 10  # spark-01 -> .11
MAX_HOSTS = 40
NETNS_PREFIX = "sf-"
VETH_PREFIX = "sfv-"
HOST_WHEELHOUSE = "/srv/sparkfleet/wheelhouse"
HOST_APT_REPO = "/srv/sparkfleet/apt"
HOST_APT_SOURCE = f"deb [trusted=yes] file:{HOST_APT_REPO} ./\n"
CONSOLE_LOG_ROTATE_BYTES = 4 * 2**20  # keep one older console log per host
REBOOT_EXIT_CODE = 133  # systemd-nspawn's exit status when the container asked for a reboot
# apt lists older than any cache_valid_time, so Ansible's apt module refreshes them on first use
APT_LISTS_MTIME = 946684800  # 2000-01-01

TOOL_INSTALL_HINTS = {
    "debootstrap": "apt-get install debootstrap",
    "systemd-nspawn": "apt-get install systemd-container",
    "ip": "apt-get install iproute2",
    "ssh": "apt-get install openssh-client",
    "ssh-keygen": "apt-get install openssh-client",
    "dpkg-scanpackages": "apt-get install dpkg-dev",
    "mount": "apt-get install mount",
    "chroot": "apt-get install coreutils",
}


class FleetError(Exception):
    """A failure with a one-line message that names the problem and the fix."""


def log(message: str) -> None:
    """Print one progress line, flushed at once (output is often piped)."""
    print(message, flush=True)


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    capture: bool = True,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command from an argument list; on failure raise FleetError with its stderr."""
    argv_text = [str(arg) for arg in argv]
    completed = subprocess.run(
        argv_text,
        check=False,
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        timeout=timeout,
        env=env,
    )
    if check and completed.returncode != 0:
        detail = (completed.stderr or completed.stdout or "").strip().splitlines()
        raise FleetError(
            f"`{shlex.join(argv_text)}` failed (rc={completed.returncode}): {detail[-1] if detail else ''}"
        )
    return completed


def require_root_and_tools(*tools: str) -> None:
    """Fail with a one-line fix when not root or when a needed tool is missing."""
    if os.geteuid() != 0:
        raise FleetError("the sandbox fleet needs root (mounts, namespaces, nspawn): run it with sudo")
    for tool in tools:
        if shutil.which(tool) is None:
            raise FleetError(f"`{tool}` is not installed: {TOOL_INSTALL_HINTS.get(tool, 'install it')}")


@contextlib.contextmanager
def fleet_lock() -> Iterator[None]:
    """Serialize commands that change the fleet (several people may share this machine)."""
    SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("fleet: waiting for another fleet command to finish...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------- package lists


def read_package_sections(path: Path = PACKAGES_FILE) -> dict[str, list[str]]:
    """Parse packages.txt: ``[section]`` headers, one package per line, ``#`` comments."""
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for number, raw_line in enumerate(path.read_text().splitlines(), start=1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
            sections.setdefault(current, [])
        elif current is None:
            raise FleetError(f"{path.name}:{number}: package {line!r} before any [section]; add [rootfs]")
        elif not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", line):
            raise FleetError(f"{path.name}:{number}: {line!r} is not a Debian package name")
        else:
            sections[current].append(line)
    for required in ("rootfs", "aptrepo"):
        if not sections.get(required):
            raise FleetError(f"{path.name}: section [{required}] is missing or empty")
    return sections


def stamp_digest(*parts: str) -> str:
    """A sha256 over the given text parts (cache stamps)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def rootfs_stamp(sections: dict[str, list[str]]) -> str:
    """The stamp the rootfs must carry to be current."""
    return stamp_digest("rootfs", ROOTFS_SCRIPT_VERSION, SUITE, *sections["rootfs"])


def aptrepo_stamp(sections: dict[str, list[str]]) -> str:
    """The stamp the apt repository must carry to be current (it depends on the rootfs)."""
    return stamp_digest("aptrepo", APTREPO_SCRIPT_VERSION, rootfs_stamp(sections), *sections["aptrepo"])


def read_stamp(path: Path) -> str | None:
    """The text of a stamp file, or None when it does not exist."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------- apt sources


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` source of the machine's apt configuration."""

    uri: str
    suite: str
    components: tuple[str, ...]
    signed_by: str | None
    origin: str


def parse_one_line_sources(text: str, origin: str) -> list[AptSource]:
    """Parse the one-line format (``deb [opts] uri suite component...``) of sources.list."""
    sources: list[AptSource] = []
    for raw_line in text.splitlines():
        line = raw_line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        options: dict[str, str] = {}
        rest = line[4:].strip()
        if rest.startswith("["):
            options_text, _, rest = rest[1:].partition("]")
            for option in options_text.split():
                key, _, value = option.partition("=")
                options[key.strip()] = value.strip()
        fields = rest.split()
        if len(fields) < 2:
            continue
        sources.append(
            AptSource(
                uri=fields[0].rstrip("/"),
                suite=fields[1],
                components=tuple(fields[2:]),
                signed_by=options.get("signed-by"),
                origin=origin,
            )
        )
    return sources


def parse_deb822_sources(text: str, origin: str) -> list[AptSource]:
    """Parse the deb822 format (``Types:``/``URIs:``/``Suites:`` stanzas) of *.sources files."""
    sources: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        entries: dict[str, str] = {}
        last_key: str | None = None
        for raw_line in stanza.splitlines():
            if raw_line.startswith("#"):
                continue
            if raw_line[:1] in (" ", "\t") and last_key is not None:
                entries[last_key] += "\n" + raw_line.strip()
                continue
            key, separator, value = raw_line.partition(":")
            if separator:
                last_key = key.strip().lower()
                entries[last_key] = value.strip()
        if "deb" not in entries.get("types", "").split():
            continue
        if entries.get("enabled", "yes").lower() == "no":
            continue
        signed_by = entries.get("signed-by")
        if signed_by is not None and not signed_by.startswith("/"):
            signed_by = None  # an inline key block: debootstrap falls back to its default keyring
        for uri in entries.get("uris", "").split():
            for suite in entries.get("suites", "").split():
                sources.append(
                    AptSource(
                        uri=uri.rstrip("/"),
                        suite=suite,
                        components=tuple(entries.get("components", "").split()),
                        signed_by=signed_by,
                        origin=origin,
                    )
                )
    return sources


def read_apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every enabled ``deb`` source of this machine, in apt's reading order."""
    sources: list[AptSource] = []
    main_list = etc_apt / "sources.list"
    if main_list.is_file():
        sources += parse_one_line_sources(main_list.read_text(), str(main_list))
    parts_dir = etc_apt / "sources.list.d"
    if parts_dir.is_dir():
        for part in sorted(parts_dir.iterdir()):
            if part.suffix == ".list":
                sources += parse_one_line_sources(part.read_text(), str(part))
            elif part.suffix == ".sources":
                sources += parse_deb822_sources(part.read_text(), str(part))
    return sources


def pick_debian_mirror(sources: Sequence[AptSource], suite: str = SUITE) -> AptSource:
    """The Debian main archive for ``suite`` (not -updates/-security, not a third-party repo)."""
    for source in sources:
        scheme = source.uri.split(":", 1)[0]
        if source.suite == suite and "main" in source.components and scheme in ("http", "https", "file"):
            return source
    raise FleetError(
        f"no `deb <mirror> {suite} main` source in this machine's apt configuration "
        f"(/etc/apt/sources.list, /etc/apt/sources.list.d/): add one, or set SPARKFLEET_DEBIAN_MIRROR"
    )


def debian_mirror() -> AptSource:
    """The mirror to debootstrap from: SPARKFLEET_DEBIAN_MIRROR if set, else this machine's apt sources."""
    override = os.environ.get("SPARKFLEET_DEBIAN_MIRROR")
    if override:
        return AptSource(override.rstrip("/"), SUITE, ("main",), None, "SPARKFLEET_DEBIAN_MIRROR")
    return pick_debian_mirror(read_apt_sources())


# --------------------------------------------------------------------------- rootfs

DEBOOTSTRAP_INDEX_FILES = ("InRelease", "Release", "Release.gpg", "Packages")


def debootstrap_phase(line: str) -> str | None:
    """The phase a debootstrap ``I: ...`` output line belongs to (None for other lines)."""
    words = line[3:].split() if line.startswith("I: ") else []
    if not words:
        return None
    verb = words[0]
    if verb == "Retrieving":
        return "downloading the index" if words[1:2] and words[1] in DEBOOTSTRAP_INDEX_FILES else "downloading"
    if verb in (
        "Unpacking",
        "Configuring",
    ):  # "... required packages", "... the base system", not "... libc6"
        return " ".join(words[:4]).lower().rstrip(".") if words[1:2] in (["required"], ["the"]) else None
    return {
        "Resolving": "resolving dependencies",
        "Extracting": "extracting",
        "Installing": "installing the core packages",
        "Base": "base system installed",
    }.get(verb)


SSHD_SANDBOX_CONFIG = """\
# sparkfleet sandbox host: key-only root login, one per-host ed25519 host key (made by fleet.py up)
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""

APT_SANDBOX_CONFIG = """\
// sparkfleet sandbox host: the local flat repo has no Recommends closure, so don't ask for them
APT::Install-Recommends "false";
APT::Install-Suggests "false";
"""


def run_debootstrap(target: Path, packages: Sequence[str], mirror: AptSource, log_path: Path) -> None:
    """Debootstrap minbase + packages into target, showing one line per phase."""
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        "--components=main",
    ]
    if mirror.signed_by and Path(mirror.signed_by).is_file():
        argv.append(f"--keyring={mirror.signed_by}")
    argv += [SUITE, str(target), mirror.uri]
    last_phase = None
    with log_path.open("w") as log_file:
        log_file.write(f"$ {shlex.join(argv)}\n")
        log_file.flush()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log_file.write(line)
            phase = debootstrap_phase(line)
            if phase and phase != last_phase:
                log(f"rootfs: debootstrap: {phase}")
                last_phase = phase
        returncode = process.wait()
    if returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-1:]
        raise FleetError(f"debootstrap failed (rc={returncode}), see {log_path}: {' '.join(tail)}")


def configure_rootfs(root: Path) -> None:
    """Make the debootstrapped tree a sandbox host template (shared, read-only lower layer)."""
    # apt: the local repo only (the hosts have no internet)
    (root / "etc/apt/sources.list").write_text(HOST_APT_SOURCE)
    for part in (root / "etc/apt/sources.list.d").glob("*"):
        part.unlink()
    (root / "etc/apt/apt.conf.d/90sparkfleet-sandbox").write_text(APT_SANDBOX_CONFIG)
    # SSH: host keys are per host (generated at first `up` into the host's upper layer)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
    (root / "etc/ssh/sshd_config.d/sparkfleet-sandbox.conf").write_text(SSHD_SANDBOX_CONFIG)
    # identity is per host too
    (root / "etc/machine-id").write_text("uninitialized\n")
    with contextlib.suppress(FileNotFoundError):
        (root / "var/lib/dbus/machine-id").unlink()
    (root / "etc/hostname").write_text("sandbox\n")
    # no DNS in the sandbox (debootstrap copied the controller's resolv.conf); peers are in /etc/hosts
    resolv_conf = root / "etc/resolv.conf"
    if resolv_conf.is_symlink():
        resolv_conf.unlink()
    resolv_conf.write_text("# sparkfleet sandbox host: no DNS; fleet peers are in /etc/hosts\n")
    # apt's daily timers would only find the offline repo, and would hold the dpkg lock under Ansible
    run(["chroot", root, "systemctl", "disable", "apt-daily.timer", "apt-daily-upgrade.timer"])
    for mount_point in (HOST_WHEELHOUSE, HOST_APT_REPO):
        (root / mount_point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    root_ssh = root / "root/.ssh"
    root_ssh.mkdir(mode=0o700, exist_ok=True)
    run(["chroot", root, "apt-get", "clean"])
    for list_file in (root / "var/lib/apt/lists").glob("*"):
        if list_file.is_file():
            list_file.unlink()


def build_rootfs(force: bool = False) -> bool:
    """Build build/sandbox/rootfs unless its stamp is current; True when it was (re)built."""
    sections = read_package_sections()
    wanted = rootfs_stamp(sections)
    stamp_file = ROOTFS_DIR / ".sparkfleet-rootfs-stamp"
    if not force and read_stamp(stamp_file) == wanted:
        log(f"rootfs: up to date ({ROOTFS_DIR.relative_to(REPO_ROOT)}), nothing to do")
        return False
    require_root_and_tools("debootstrap", "chroot")
    refuse_while_hosts_run("rebuild the rootfs")
    mirror = debian_mirror()
    started = time.monotonic()
    log(f"rootfs: debootstrap {SUITE} minbase + {len(sections['rootfs'])} packages from {mirror.origin}")
    building = SANDBOX_DIR / "rootfs.building"
    if building.exists():
        shutil.rmtree(building)
    SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
    run_debootstrap(building, sections["rootfs"], mirror, SANDBOX_DIR / "rootfs.log")
    log("rootfs: configuring (apt source, sshd, per-host identity left out)")
    configure_rootfs(building)
    (building / ".sparkfleet-rootfs-stamp").write_text(wanted + "\n")
    if ROOTFS_DIR.exists():
        shutil.rmtree(ROOTFS_DIR)
    building.rename(ROOTFS_DIR)
    # the apt repo's closure was computed against the old rootfs
    with contextlib.suppress(FileNotFoundError):
        (APT_REPO_DIR / ".sparkfleet-aptrepo-stamp").unlink()
    size = disk_usage(ROOTFS_DIR)
    log(
        f"rootfs: built {ROOTFS_DIR.relative_to(REPO_ROOT)} in {time.monotonic() - started:.0f} s, "
        f"{size / 2**20:.0f} MiB"
    )
    return True


# --------------------------------------------------------------------------- apt repo


@contextlib.contextmanager
def bind_mount(source: Path, target: Path, read_only: bool = True) -> Iterator[None]:
    """Bind-mount source on target for the duration of the block."""
    target.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", source, target])
    try:
        if read_only:
            run(["mount", "-o", "remount,bind,ro", target])
        yield
    finally:
        run(["umount", target], check=False)


@contextlib.contextmanager
def temporary_file_content(path: Path, content: bytes) -> Iterator[None]:
    """Replace a file's content for the duration of the block, then put the original back."""
    original = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    link_target = os.readlink(path) if path.is_symlink() else None
    if path.is_symlink():
        path.unlink()
    path.write_bytes(content)
    try:
        yield
    finally:
        path.unlink()
        if link_target is not None:
            path.symlink_to(link_target)
        elif original is not None:
            path.write_bytes(original)


def write_release_file(repo: Path) -> None:
    """An (unsigned) Release for the flat repo, so apt needs no insecure-repository exceptions."""
    lines = [
        "Origin: sparkfleet-sandbox",
        "Label: sparkfleet-sandbox",
        "Suite: sandbox",
        "Codename: sandbox",
        f"Date: {formatdate(usegmt=True)}",
        "Architectures: amd64 all",
        "Description: packages the sparkfleet roles install on offline sandbox hosts",
    ]
    for title, algorithm in (("MD5Sum", "md5"), ("SHA256", "sha256")):
        lines.append(f"{title}:")
        for name in ("Packages", "Packages.gz"):
            data = (repo / name).read_bytes()
            lines.append(f" {hashlib.new(algorithm, data).hexdigest()} {len(data)} {name}")
    (repo / "Release").write_text("\n".join(lines) + "\n")


def index_apt_repo(repo: Path) -> int:
    """Write Packages, Packages.gz and Release for the .debs in repo; return the package count."""
    # dpkg-scanpackages writes Filename: relative to its working directory: run it in the repo
    completed = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", ".", "/dev/null"],
        cwd=repo,
        check=False,
        text=True,
        capture_output=True,
    )
    if completed.returncode != 0:
        raise FleetError(f"dpkg-scanpackages failed in {repo}: {completed.stderr.strip()}")
    (repo / "Packages").write_text(completed.stdout)
    with gzip.open(repo / "Packages.gz", "wb", compresslevel=9) as handle:
        handle.write(completed.stdout.encode())
    write_release_file(repo)
    return completed.stdout.count("\nPackage: ") + completed.stdout.startswith("Package: ")


def refresh_rootfs_apt_lists() -> None:
    """Index the local repo into the rootfs's apt lists, backdated so Ansible still refreshes them."""
    lists_dir = ROOTFS_DIR / "var/lib/apt/lists"
    for list_file in lists_dir.glob("*"):
        if list_file.is_file():
            list_file.unlink()
    with bind_mount(APT_REPO_DIR, ROOTFS_DIR / HOST_APT_REPO.lstrip("/")):
        run(["chroot", ROOTFS_DIR, "apt-get", "-q", "update"])
    with contextlib.suppress(FileNotFoundError):
        (ROOTFS_DIR / "var/lib/apt/periodic/update-success-stamp").unlink()
    for path in [*lists_dir.rglob("*"), lists_dir]:
        os.utime(path, (APT_LISTS_MTIME, APT_LISTS_MTIME), follow_symlinks=False)


def build_aptrepo(force: bool = False) -> bool:
    """Build build/sandbox/apt unless its stamp is current; True when it was (re)built."""
    sections = read_package_sections()
    if read_stamp(ROOTFS_DIR / ".sparkfleet-rootfs-stamp") != rootfs_stamp(sections):
        raise FleetError("the rootfs is missing or out of date: run `python3 tests/sandbox/fleet.py rootfs`")
    wanted = aptrepo_stamp(sections)
    stamp_file = APT_REPO_DIR / ".sparkfleet-aptrepo-stamp"
    if not force and read_stamp(stamp_file) == wanted:
        log(f"aptrepo: up to date ({APT_REPO_DIR.relative_to(REPO_ROOT)}), nothing to do")
        return False
    require_root_and_tools("chroot", "dpkg-scanpackages", "mount")
    refuse_while_hosts_run("rebuild the apt repo")
    mirror = debian_mirror()
    started = time.monotonic()
    packages = sections["aptrepo"]
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    options = f"[signed-by={keyring}]" if (ROOTFS_DIR / keyring.lstrip("/")).is_file() else "[trusted=yes]"
    upstream = f"deb {options} {mirror.uri} {SUITE} main\n".encode()
    resolv_conf = Path("/etc/resolv.conf").read_bytes() if Path("/etc/resolv.conf").exists() else b""
    archives = ROOTFS_DIR / "var/cache/apt/archives"
    apt_get = [
        "chroot",
        ROOTFS_DIR,
        "apt-get",
        "-q",
        "-o",
        "Acquire::Check-Valid-Until=false",
        "-o",
        "APT::Install-Recommends=false",
    ]
    log(f"aptrepo: resolving {len(packages)} packages and their closure against the rootfs ({mirror.origin})")
    with (
        temporary_file_content(ROOTFS_DIR / "etc/apt/sources.list", upstream),
        temporary_file_content(ROOTFS_DIR / "etc/resolv.conf", resolv_conf),
    ):
        run([*apt_get, "update"])
        run([*apt_get, "clean"])
        log("aptrepo: downloading")
        run([*apt_get, "install", "--download-only", "--yes", *packages])
    debs = sorted(archives.glob("*.deb"))
    if not debs:
        raise FleetError("apt-get downloaded no package: are they all in the rootfs already? check packages.txt")
    building = SANDBOX_DIR / "apt.building"
    if building.exists():
        shutil.rmtree(building)
    building.mkdir(parents=True)
    for deb in debs:
        shutil.move(deb, building / deb.name)
    run(["chroot", ROOTFS_DIR, "apt-get", "clean"])
    log(f"aptrepo: indexing {len(debs)} packages")
    count = index_apt_repo(building)
    (building / ".sparkfleet-aptrepo-stamp").write_text(wanted + "\n")
    if APT_REPO_DIR.exists():
        shutil.rmtree(APT_REPO_DIR)
    building.rename(APT_REPO_DIR)
    log("aptrepo: indexing the local repo into the rootfs's apt lists (backdated)")
    refresh_rootfs_apt_lists()
    size = disk_usage(APT_REPO_DIR)
    log(
        f"aptrepo: built {APT_REPO_DIR.relative_to(REPO_ROOT)} with {count} packages "
        f"({size / 2**20:.0f} MiB) in {time.monotonic() - started:.0f} s"
    )
    return True


# --------------------------------------------------------------------------- hosts: model


@dataclass(frozen=True)
class Host:
    """One sandbox host: its name, address and the paths of its state."""

    index: int

    @property
    def name(self) -> str:
        return f"spark-{self.index:02d}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{HOST_ADDRESS_OFFSET + self.index}"

    @property
    def mac_address(self) -> str:
        return f"02:73:66:00:00:{self.index:02x}"  # locally administered; 73:66 = "sf"

    @property
    def netns(self) -> str:
        return f"{NETNS_PREFIX}{self.name}"

    @property
    def veth(self) -> str:
        return f"{VETH_PREFIX}{self.name}"

    @property
    def state_dir(self) -> Path:
        return HOSTS_DIR / self.name

    @property
    def upper(self) -> Path:
        return self.state_dir / "upper"

    @property
    def work(self) -> Path:
        return self.state_dir / "work"

    @property
    def merged(self) -> Path:
        return self.state_dir / "merged"

    @property
    def supervisor_pid_file(self) -> Path:
        return self.state_dir / "supervisor.pid"

    @property
    def nspawn_pid_file(self) -> Path:
        return self.state_dir / "nspawn.pid"

    @property
    def stop_flag(self) -> Path:
        return self.state_dir / "stopping"

    @property
    def rootfs_stamp_file(self) -> Path:
        return self.state_dir / "rootfs-stamp"

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"


def host_from_name(name: str) -> Host:
    """The Host called ``name`` (spark-01 ... spark-40)."""
    match = re.fullmatch(r"spark-(\d{2})", name)
    if not match or not 1 <= int(match.group(1)) <= MAX_HOSTS:
        raise FleetError(f"unknown host {name!r}: sandbox hosts are spark-01 ... spark-{MAX_HOSTS:02d}")
    return Host(int(match.group(1)))


def known_host_indexes() -> set[int]:
    """Indexes of every host with state on disk or live kernel objects (netns, veth)."""
    indexes: set[int] = set()
    if HOSTS_DIR.is_dir():
        for entry in HOSTS_DIR.iterdir():
            match = re.fullmatch(r"spark-(\d{2})", entry.name)
            if match:
                indexes.add(int(match.group(1)))
    for name in list_netns():
        match = re.fullmatch(rf"{NETNS_PREFIX}spark-(\d{{2}})", name)
        if match:
            indexes.add(int(match.group(1)))
    for name in list_links():
        match = re.fullmatch(rf"{VETH_PREFIX}spark-(\d{{2}})", name)
        if match:
            indexes.add(int(match.group(1)))
    return indexes


# --------------------------------------------------------------------------- processes and mounts


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, or None."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def process_cmdline(pid: int) -> list[str]:
    """A process's argument list ([] when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def is_zombie(pid: int) -> bool:
    """Whether pid exited but was not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def supervisor_pid(host: Host) -> int | None:
    """The live supervisor of host, or None (a stale pid file is ignored)."""
    pid = read_pid(host.supervisor_pid_file)
    if pid is None or is_zombie(pid):
        return None
    return pid if process_cmdline(pid)[3:5] == [SUPERVISOR_NAME, host.name] else None


def nspawn_pid(host: Host) -> int | None:
    """The live systemd-nspawn of host, or None."""
    pid = read_pid(host.nspawn_pid_file)
    if pid is None or is_zombie(pid):
        return None
    cmdline = process_cmdline(pid)
    if cmdline and Path(cmdline[0]).name == "systemd-nspawn" and f"--machine={host.name}" in cmdline:
        return pid
    return None


def processes_in_netns(netns: str) -> list[int]:
    """Pids that live in the named network namespace (the container's processes)."""
    try:
        namespace_inode = os.stat(f"/run/netns/{netns}").st_ino
    except FileNotFoundError:
        return []
    wanted = f"net:[{namespace_inode}]"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns/net") == wanted:
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def fleet_processes() -> list[int]:
    """Every supervisor and nspawn process of the fleet (for leak checks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = process_cmdline(int(entry.name))
        if not cmdline or is_zombie(int(entry.name)):
            continue
        is_supervisor = cmdline[3:4] == [SUPERVISOR_NAME]
        is_nspawn = Path(cmdline[0]).name == "systemd-nspawn" and any(
            arg.startswith(f"--network-namespace-path=/run/netns/{NETNS_PREFIX}") for arg in cmdline
        )
        if is_supervisor or is_nspawn:
            pids.append(int(entry.name))
    return pids


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below directory, deepest first."""
    prefix = str(directory)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def is_mounted(path: Path) -> bool:
    """Whether path is a mount point."""
    return str(path) in mounts_under(path)


def process_rss_bytes(pid: int) -> int:
    """Resident set size of pid in bytes (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def process_pss_bytes(pid: int) -> int:
    """Proportional set size of pid in bytes (shared pages split among their users; 0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def disk_usage(path: Path) -> int:
    """Bytes allocated under path (like du), not following symlinks, staying on one filesystem."""
    total = 0
    if not path.exists():
        return 0
    device = path.lstat().st_dev
    for directory, subdirectories, files in os.walk(path):
        kept = []
        for name in subdirectories:
            full = os.path.join(directory, name)
            try:
                info = os.lstat(full)
            except FileNotFoundError:
                continue
            if info.st_dev == device:
                kept.append(name)
                total += info.st_blocks * 512
        subdirectories[:] = kept
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def wait_for_exit(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait until the pids exit; return those still alive after timeout."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if not is_zombie(pid)]
        if alive:
            time.sleep(0.1)
    return alive


def send_signal(pid: int, signal_number: int) -> None:
    """Signal pid, ignoring one that is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal_number)


# --------------------------------------------------------------------------- network


def list_netns() -> list[str]:
    """Names of the named network namespaces."""
    completed = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in completed.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the root namespace's network interfaces."""
    completed = run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in completed.stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        names.append(name)
    return names


def ensure_bridge() -> None:
    """Create the bridge sfbr0 with the controller's address on the sandbox subnet."""
    if BRIDGE not in list_links():
        routes = run(["ip", "-4", "route", "show", "to", "match", BRIDGE_ADDRESS]).stdout
        for route in routes.splitlines():
            if route.startswith(f"{SUBNET}.") and f"dev {BRIDGE}" not in route:
                raise FleetError(
                    f"the sandbox subnet {SUBNET}.0/24 is already routed here ({route.strip()}): "
                    f"free it, or change SUBNET in {Path(__file__).name}"
                )
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    addresses = run(["ip", "-4", "-o", "addr", "show", "dev", BRIDGE]).stdout
    if f"{BRIDGE_ADDRESS}/24" not in addresses:
        run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def ensure_host_network(host: Host) -> None:
    """The host's network namespace, a veth into it on the bridge, and its address (no route out)."""
    if host.netns not in list_netns():
        run(["ip", "netns", "add", host.netns])
    if host.veth not in list_links():
        # eth0 gets a fixed MAC (like a real NIC): neighbour caches stay right across restarts
        run(
            [
                *("ip", "link", "add", host.veth, "type", "veth"),
                *("peer", "name", "eth0", "address", host.mac_address, "netns", host.netns),
            ]
        )
    run(["ip", "neigh", "flush", "to", host.address, "dev", BRIDGE], check=False)
    run(["ip", "link", "set", host.veth, "master", BRIDGE, "up"])
    inside = ["ip", "-n", host.netns]
    run([*inside, "link", "set", "lo", "up"])
    if f"{host.address}/24" not in run([*inside, "-4", "-o", "addr", "show", "dev", "eth0"]).stdout:
        run([*inside, "addr", "add", f"{host.address}/24", "dev", "eth0"])
    run([*inside, "link", "set", "eth0", "up"])


def remove_host_network(host: Host) -> bool:
    """Delete the host's netns and veth; True when something was there."""
    removed = False
    if host.veth in list_links():
        run(["ip", "link", "del", host.veth], check=False)
        removed = True
    if host.netns in list_netns():
        run(["ip", "netns", "del", host.netns])
        removed = True
    return removed


# --------------------------------------------------------------------------- ssh


def ensure_client_key() -> None:
    """The fleet's one ed25519 client key (build/sandbox/ssh/id_ed25519)."""
    SSH_DIR.mkdir(parents=True, exist_ok=True)
    SSH_DIR.chmod(0o700)
    if not CLIENT_KEY.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkfleet-sandbox", "-f", CLIENT_KEY])


def ssh_base_argv(host: Host, connect_timeout: int = 5, known_hosts: Path = KNOWN_HOSTS) -> list[str]:
    """ssh options for talking to host: the fleet key, the fleet's known_hosts, strict checking."""
    return [
        "ssh",
        "-i",
        str(CLIENT_KEY),
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"ConnectTimeout={connect_timeout}",
        "-o",
        "LogLevel=ERROR",
        f"root@{host.address}",
    ]


def ssh_run(
    host: Host, command: str, timeout: float = 60, connect_timeout: int = 5
) -> subprocess.CompletedProcess[str]:
    """Run a shell command on host over ssh and capture its output (never raises on rc)."""
    return subprocess.run(
        [*ssh_base_argv(host, connect_timeout), "--", command],
        check=False,
        text=True,
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def host_public_key(host: Host) -> str | None:
    """The host's ed25519 public key line (from its upper layer), or None before its first up."""
    key_file = host.upper / "etc/ssh/ssh_host_ed25519_key.pub"
    try:
        key_type, key_data = key_file.read_text().split()[:2]
    except (FileNotFoundError, ValueError):
        return None
    return f"{key_type} {key_data}"


def write_known_hosts(hosts: Sequence[Host]) -> None:
    """known_hosts from the hosts' own public keys (no trust on first use)."""
    lines = []
    for host in hosts:
        key = host_public_key(host)
        if key:
            lines.append(f"{host.address},{host.name} {key}\n")
    write_if_changed(KNOWN_HOSTS, "".join(lines), 0o644)


# --------------------------------------------------------------------------- inventory


def inventory_text(hosts: Sequence[Host]) -> str:
    """The Ansible inventory of the running fleet (YAML; strings JSON-quoted)."""
    common_args = (
        f"-o UserKnownHostsFile={KNOWN_HOSTS} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes "
        "-o ControlMaster=auto -o ControlPersist=60s"
    )
    lines = [
        "# Generated by tests/sandbox/fleet.py `up`: do not edit, it is rewritten on every `up`.",
        "# The sandbox fleet: systemd-nspawn hosts on this machine (see tests/sandbox/README.md).",
        "all:",
        "  children:",
        "    spark:",
        "      hosts:",
    ]
    for host in hosts:
        lines += [
            f"        {host.name}:",
            f'          ansible_host: "{host.address}"',
            "          ansible_user: root",
            f'          ansible_ssh_private_key_file: "{CLIENT_KEY}"',
            f'          ansible_ssh_common_args: "{common_args}"',
            "          ansible_python_interpreter: /usr/bin/python3",
            "          sparkfleet_sandbox: true",
        ]
    if not hosts:
        lines[-1] = "      hosts: {}"
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, content: str | bytes, mode: int) -> bool:
    """Write path only when its content or mode differs; True when it changed."""
    data = content.encode() if isinstance(content, str) else content
    try:
        if path.read_bytes() == data and (path.stat().st_mode & 0o7777) == mode:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    temporary.chmod(mode)
    temporary.replace(path)
    return True


# --------------------------------------------------------------------------- host lifecycle


def host_is_running(host: Host) -> bool:
    """Supervisor and nspawn alive, overlay mounted, network present."""
    return (
        supervisor_pid(host) is not None
        and nspawn_pid(host) is not None
        and is_mounted(host.merged)
        and host.netns in list_netns()
    )


def running_hosts() -> list[Host]:
    """The hosts that run now, in index order."""
    return [Host(index) for index in sorted(known_host_indexes()) if host_is_running(Host(index))]


def provision_host_files(host: Host, fleet: Sequence[Host]) -> None:
    """Per-host identity and access, written into the merged tree (lands in the upper layer)."""
    root = host.merged
    machine_id = host.upper / "etc/machine-id"
    if not machine_id.exists():
        write_if_changed(root / "etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
    write_if_changed(root / "etc/hostname", host.name + "\n", 0o644)
    hosts_lines = [
        "127.0.0.1\tlocalhost",
        f"127.0.1.1\t{host.name}",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    hosts_lines += [f"{peer.address}\t{peer.name}" for peer in fleet]
    hosts_lines.append(f"{BRIDGE_ADDRESS}\tsparkfleet-controller")
    write_if_changed(root / "etc/hosts", "\n".join(hosts_lines) + "\n", 0o644)
    host_key = root / "etc/ssh/ssh_host_ed25519_key"
    if not host_key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host.name}", "-f", host_key])
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    public_key = CLIENT_KEY.with_suffix(".pub").read_text()
    write_if_changed(ssh_dir / "authorized_keys", public_key, 0o600)
    if NVIDIA_SMI_FILE.is_file():
        write_if_changed(root / "usr/bin/nvidia-smi", NVIDIA_SMI_FILE.read_bytes(), 0o755)


# One host's supervisor (bash: ~4 MiB instead of a Python interpreter per host). It runs nspawn and
# starts it again when the container asked for a reboot (exit 133), unless `down` is stopping it;
# SIGTERM is passed on to nspawn, which turns it into an orderly poweroff of the container.
# nspawn is started inside the host's own cgroups (CGROUPS, colon-separated): with --keep-unit and
# no systemd on this machine, nspawn makes its "payload" cgroup next to its own, so hosts started
# from one cgroup would share one tree and their systemds would remove each other's units' cgroups
# (seen: units failing with 219/CGROUP). Empty cgroups left by a boot are removed before the next.
# Arguments: NAME STATE_DIR REBOOT_EXIT_CODE CGROUPS NSPAWN_ARGV...
SUPERVISOR_NAME = "sparkfleet-supervisor"
SUPERVISOR_SCRIPT = r"""
set -u
name=$1 state=$2 reboot_code=$3
IFS=: read -r -a cgroups <<< "$4"
shift 4
child=
on_term() { : > "$state/stopping"; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null; }
trap on_term TERM INT
clean_cgroups() {
    for cgroup in "${cgroups[@]}"; do
        [ -d "$cgroup" ] && find "$cgroup" -mindepth 1 -depth -type d -exec rmdir {} + 2> /dev/null
    done
    return 0
}
boot=0
while :; do
    boot=$((boot + 1))
    echo "supervisor: $name: boot #$boot"
    clean_cgroups
    (
        for cgroup in "${cgroups[@]}"; do
            mkdir -p "$cgroup" && echo "$BASHPID" > "$cgroup/cgroup.procs"
        done
        exec "$@"
    ) < /dev/null &
    child=$!
    echo "$child" > "$state/nspawn.pid"
    wait "$child"; rc=$?
    while kill -0 "$child" 2> /dev/null; do wait "$child"; rc=$?; done
    if [ "$rc" -eq "$reboot_code" ] && [ ! -e "$state/stopping" ]; then
        echo "supervisor: $name: the container rebooted (exit $rc), starting it again"
        continue
    fi
    echo "supervisor: $name: the container exited (rc=$rc), supervisor exits"
    clean_cgroups
    rm -f "$state/nspawn.pid"
    exit 0
done
"""
CGROUP_GROUP = "sparkfleet"  # hosts' cgroups: <hierarchy>/sparkfleet/spark-NN


def systemd_cgroup_hierarchies() -> list[Path]:
    """Mount points of the hierarchies systemd tracks units in: cgroup2 and v1 ``name=systemd``."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        filesystem, super_options = fields[separator + 1], fields[separator + 3].split(",")
        if filesystem == "cgroup2" or (filesystem == "cgroup" and "name=systemd" in super_options):
            points.append(Path(fields[4]))
    return points


def host_cgroups(host: Host) -> list[Path]:
    """The cgroups host's nspawn runs in, one per systemd hierarchy."""
    return [point / CGROUP_GROUP / host.name for point in systemd_cgroup_hierarchies()]


def remove_cgroup_tree(cgroup: Path) -> bool:
    """rmdir a cgroup and its children, deepest first (they must hold no process); True if removed."""
    if not cgroup.is_dir():
        return False
    for directory, _subdirectories, _files in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    return not cgroup.exists()


def nspawn_argv(host: Host) -> list[str]:
    """The systemd-nspawn command that boots host."""
    argv = [
        "systemd-nspawn",
        "--boot",
        "--register=no",
        "--keep-unit",
        f"--network-namespace-path=/run/netns/{host.netns}",
        f"--directory={host.merged}",
        f"--machine={host.name}",
        "--console=read-only",
        "--link-journal=no",
        "--resolv-conf=off",
        # Each host has its own network namespace, so this reaches only the host's own network:
        # enough for the serving role's nftables allow-list, nothing of the machine's.
        "--capability=CAP_NET_ADMIN",
        f"--bind-ro={APT_REPO_DIR}:{HOST_APT_REPO}",
    ]
    if WHEELHOUSE_DIR.is_dir():
        argv.append(f"--bind-ro={WHEELHOUSE_DIR}:{HOST_WHEELHOUSE}")
    return argv


def start_host(host: Host, fleet: Sequence[Host]) -> None:
    """Mount, network and boot host under its supervisor (it must not be running)."""
    rootfs_stamp_now = read_stamp(ROOTFS_DIR / ".sparkfleet-rootfs-stamp") or ""
    if host.upper.exists() and read_stamp(host.rootfs_stamp_file) != rootfs_stamp_now:
        # an upper layer made over another rootfs would shadow the new one's files (dpkg status...)
        log(f"up: {host.name}: its state was made on an older rootfs, starting it fresh")
        shutil.rmtree(host.upper)
        shutil.rmtree(host.work, ignore_errors=True)
    for directory in (host.upper, host.work, host.merged):
        directory.mkdir(parents=True, exist_ok=True)
    host.rootfs_stamp_file.write_text(rootfs_stamp_now + "\n")
    if not is_mounted(host.merged):
        run(
            [
                "mount",
                "-t",
                "overlay",
                f"sparkfleet-{host.name}",
                "-o",
                f"lowerdir={ROOTFS_DIR},upperdir={host.upper},workdir={host.work}",
                host.merged,
            ]
        )
    provision_host_files(host, fleet)
    ensure_host_network(host)
    with contextlib.suppress(FileNotFoundError):
        host.stop_flag.unlink()
    if host.console_log.exists() and host.console_log.stat().st_size > CONSOLE_LOG_ROTATE_BYTES:
        host.console_log.replace(host.console_log.with_name("console.log.1"))
    console = host.console_log.open("ab")
    supervisor = subprocess.Popen(
        [
            "bash",
            "-c",
            SUPERVISOR_SCRIPT,
            SUPERVISOR_NAME,
            host.name,
            str(host.state_dir),
            str(REBOOT_EXIT_CODE),
            ":".join(str(cgroup) for cgroup in host_cgroups(host)),
            *nspawn_argv(host),
        ],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=console,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
    )
    console.close()
    host.supervisor_pid_file.write_text(f"{supervisor.pid}\n")


def stop_hosts(hosts: Sequence[Host], timeout: float = 30.0) -> list[str]:
    """Stop hosts and remove their mounts, netns and veths; return what was done, per host."""
    actions: dict[str, list[str]] = {host.name: [] for host in hosts}
    supervisors: dict[str, int] = {}
    for host in hosts:
        pid = supervisor_pid(host)
        if pid is not None:
            host.stop_flag.write_text("down\n")
            send_signal(pid, signal.SIGTERM)
            supervisors[host.name] = pid
        elif (nspawn := nspawn_pid(host)) is not None:
            send_signal(nspawn, signal.SIGTERM)
            supervisors[host.name] = nspawn
    still_alive = set(wait_for_exit(list(supervisors.values()), timeout))
    for host in hosts:
        if host.name in supervisors:
            forced = supervisors[host.name] in still_alive
            actions[host.name].append("killed (no clean poweroff in time)" if forced else "powered off")
        for pid in (nspawn_pid(host), supervisor_pid(host)):
            if pid is not None:
                send_signal(pid, signal.SIGKILL)
        leftovers = processes_in_netns(host.netns)
        for pid in leftovers:
            send_signal(pid, signal.SIGKILL)
        if leftovers:
            wait_for_exit(leftovers, 5)
            actions[host.name].append(f"killed {len(leftovers)} leftover processes")
        for point in mounts_under(host.merged):
            if run(["umount", point], check=False).returncode != 0:
                time.sleep(0.5)
                run(["umount", "--lazy", point])
            actions[host.name].append("unmounted")
        if remove_host_network(host):
            actions[host.name].append("network removed")
        if any([remove_cgroup_tree(cgroup) for cgroup in host_cgroups(host)]):
            actions[host.name].append("cgroups removed")
        for pid_file in (host.supervisor_pid_file, host.nspawn_pid_file, host.stop_flag):
            with contextlib.suppress(FileNotFoundError):
                pid_file.unlink()
    return [f"{name}: {', '.join(done)}" for name, done in actions.items() if done]


def wait_until_ready(host: Host, deadline: float) -> str:
    """Wait for sshd and for systemd to finish booting; return 'running' or 'degraded (units)'."""
    last_error = "no answer"
    while time.monotonic() < deadline:
        if supervisor_pid(host) is None:
            raise FleetError(f"{host.name}: the container exited while booting; see {host.console_log}")
        remaining = max(1.0, deadline - time.monotonic())
        try:
            completed = ssh_run(host, "systemctl is-system-running --wait", timeout=remaining, connect_timeout=2)
        except subprocess.TimeoutExpired:
            break
        state = completed.stdout.strip()
        if state == "running":
            return "running"
        if state == "degraded":
            failed = ssh_run(host, "systemctl list-units --failed --plain --no-legend --no-pager").stdout
            units = ", ".join(line.split()[0] for line in failed.splitlines() if line.strip())
            return f"degraded (failed: {units or 'unknown'})"
        last_error = (completed.stderr or state or f"rc={completed.returncode}").strip().splitlines()[-1]
        time.sleep(0.2)
    raise FleetError(
        f"{host.name} ({host.address}) not ready in time (last: {last_error}); "
        f"see {host.console_log}, then `python3 tests/sandbox/fleet.py down`"
    )


def mounted_hosts() -> list[str]:
    """Names of the hosts whose overlay is mounted (they use the rootfs)."""
    return [Host(index).name for index in sorted(known_host_indexes()) if is_mounted(Host(index).merged)]


def rootfs_is_current() -> bool:
    """Whether the rootfs exists and matches packages.txt and this script."""
    return read_stamp(ROOTFS_DIR / ".sparkfleet-rootfs-stamp") == rootfs_stamp(read_package_sections())


def aptrepo_is_current() -> bool:
    """Whether the apt repo exists and matches packages.txt, the rootfs and this script."""
    return read_stamp(APT_REPO_DIR / ".sparkfleet-aptrepo-stamp") == aptrepo_stamp(read_package_sections())


def refuse_while_hosts_run(action: str) -> None:
    """The rootfs is the hosts' lower layer: it must not change under running hosts."""
    live = mounted_hosts()
    if live:
        raise FleetError(f"cannot {action} while hosts use it ({', '.join(live)}): run `fleet.py down` first")


def fleet_up(host_count: int, timeout: float = 90.0) -> list[Host]:
    """Bring spark-01..spark-NN up (building what is missing), stop any extra; return the fleet."""
    if not 1 <= host_count <= MAX_HOSTS:
        raise FleetError(f"--hosts {host_count} is out of range: use 1 to {MAX_HOSTS}")
    require_root_and_tools("systemd-nspawn", "ip", "ssh", "ssh-keygen", "mount")
    started = time.monotonic()
    if mounted_hosts() and not (rootfs_is_current() and aptrepo_is_current()):
        # the lower layer must not change under running hosts: keep using it until the next down/up
        log("up: note: the rootfs or apt repo is out of date; it is rebuilt at the next `down` + `up`")
    else:
        build_rootfs()
        build_aptrepo()
    fleet = [Host(index) for index in range(1, host_count + 1)]
    extra = [Host(index) for index in sorted(known_host_indexes()) if index > host_count]
    extra_running = [host for host in extra if host_is_running(host) or is_mounted(host.merged)]
    for line in stop_hosts(extra_running):
        log(f"up: stopped extra host {line} (its state is kept)")
    ensure_client_key()
    ensure_bridge()
    to_start = []
    for host in fleet:
        if host_is_running(host):
            log(f"up: {host.name} ({host.address}) already running")
            continue
        for line in stop_hosts([host]):
            log(f"up: cleaned up half-started {line}")
        to_start.append(host)
    for host in fleet:
        if host in to_start:
            start_host(host, fleet)
            log(f"up: {host.name} ({host.address}) booting")
        else:
            provision_host_files(host, fleet)  # keeps /etc/hosts, keys, nvidia-smi current
    write_known_hosts(fleet)
    inventory_changed = write_if_changed(INVENTORY_FILE, inventory_text(fleet), 0o644)
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    errors: list[str] = []

    def wait(host: Host) -> None:
        try:
            states[host.name] = wait_until_ready(host, deadline)
        except FleetError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=wait, args=(host,)) for host in fleet]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise FleetError("; ".join(errors))
    for host in fleet:
        if states[host.name] != "running" or host in to_start:
            log(f"up: {host.name} ({host.address}) ready: systemd {states[host.name]}")
    elapsed = time.monotonic() - started
    if not to_start and not extra_running:
        inventory_note = ", inventory rewritten" if inventory_changed else ""
        log(f"up: nothing to do, {len(fleet)} hosts already running{inventory_note} ({elapsed:.1f} s)")
    else:
        log(
            f"up: {len(fleet)} hosts running ({len(to_start)} started, {len(fleet) - len(to_start)} already "
            f"running) in {elapsed:.1f} s; inventory {INVENTORY_FILE.relative_to(REPO_ROOT)}"
        )
    return fleet


NSPAWN_RUNTIME_DIR = Path("/run/systemd/nspawn")


def remove_nspawn_runtime_leftovers() -> bool:
    """Remove what nspawn leaves in /run/systemd/nspawn when /run is not a tmpfs (as here).

    Our hosts' propagation directories go; the image lock files go only when no systemd-nspawn
    runs at all on this machine (then none can be held); empty directories go last. True when
    something was removed.
    """
    removed = False
    for propagate in NSPAWN_RUNTIME_DIR.glob("propagate/spark-[0-9][0-9]"):
        with contextlib.suppress(OSError):
            propagate.rmdir()
            removed = True
    if not any_nspawn_running():
        # nspawn started from the root cgroup (as the first fleet.py did) leaves these behind
        for hierarchy in systemd_cgroup_hierarchies():
            for cgroup_name in ("payload", "supervisor"):
                removed |= remove_cgroup_tree(hierarchy / cgroup_name)
        for lock_path in NSPAWN_RUNTIME_DIR.glob("locks/inode-*"):
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
                removed = True
    for directory in (NSPAWN_RUNTIME_DIR / "propagate", NSPAWN_RUNTIME_DIR / "locks", NSPAWN_RUNTIME_DIR):
        with contextlib.suppress(OSError):
            directory.rmdir()
            removed = True
    return removed


def any_nspawn_running() -> bool:
    """Whether any systemd-nspawn process runs on this machine (ours or anyone's)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmdline = process_cmdline(int(entry.name))
            if cmdline and Path(cmdline[0]).name == "systemd-nspawn" and not is_zombie(int(entry.name)):
                return True
    return False


def fleet_down(purge: bool = False, timeout: float = 30.0) -> None:
    """Stop every host and remove every mount, namespace, veth, the bridge and the supervisors."""
    require_root_and_tools("ip", "mount")
    started = time.monotonic()
    hosts = [Host(index) for index in sorted(known_host_indexes())]
    done = stop_hosts(hosts, timeout)
    for line in done:
        log(f"down: {line}")
    stray = fleet_processes()
    for pid in stray:
        send_signal(pid, signal.SIGKILL)
    if stray:
        wait_for_exit(stray, 5)
        done.append(f"killed {len(stray)} stray fleet processes")
        log(f"down: killed {len(stray)} stray fleet processes")
    for point in mounts_under(SANDBOX_DIR):
        run(["umount", "--lazy", point], check=False)
        done.append(f"unmounted {point}")
        log(f"down: unmounted stray mount {point}")
    for link in list_links():
        if link.startswith(VETH_PREFIX):
            run(["ip", "link", "del", link], check=False)
            done.append(f"deleted {link}")
    for netns in list_netns():
        if netns.startswith(NETNS_PREFIX):
            run(["ip", "netns", "del", netns], check=False)
            done.append(f"deleted netns {netns}")
    if remove_nspawn_runtime_leftovers():
        done.append("nspawn runtime files removed")
    for hierarchy in systemd_cgroup_hierarchies():
        with contextlib.suppress(OSError):
            (hierarchy / CGROUP_GROUP).rmdir()
            done.append(f"{hierarchy / CGROUP_GROUP} removed")
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir() and not any(netns_dir.iterdir()):
        # `ip netns add` made /run/netns a mount point of its own; with no namespace left, undo it
        if run(["umount", netns_dir], check=False).returncode == 0:
            done.append("/run/netns unmounted")
        with contextlib.suppress(OSError):
            netns_dir.rmdir()
    if BRIDGE in list_links():
        run(["ip", "link", "del", BRIDGE])
        done.append(f"bridge {BRIDGE} removed")
        log(f"down: bridge {BRIDGE} removed")
    if purge:
        if HOSTS_DIR.exists():
            shutil.rmtree(HOSTS_DIR)
            done.append("host state purged")
        for generated in (KNOWN_HOSTS, INVENTORY_FILE):
            with contextlib.suppress(FileNotFoundError):
                generated.unlink()
        log("down: purged host state (upper layers, host keys); the rootfs and apt repo are kept")
    elapsed = time.monotonic() - started
    if done:
        log(f"down: fleet stopped, nothing left running ({elapsed:.1f} s)")
    else:
        log("down: nothing to stop")


def inventory_host_names() -> list[str]:
    """Host names of the generated inventory (the fleet the last `up` made), [] without one."""
    try:
        text = INVENTORY_FILE.read_text()
    except FileNotFoundError:
        return []
    return re.findall(r"^ {8}(spark-\d{2}):$", text, flags=re.MULTILINE)


def fleet_status() -> int:
    """Print one line per known host; 0 when the inventory's hosts all run and answer ssh."""
    hosts = [Host(index) for index in sorted(known_host_indexes())]
    if not hosts:
        log("status: no sandbox hosts (run `python3 tests/sandbox/fleet.py up`)")
        return 1
    expected = inventory_host_names()
    healthy = True
    for host in hosts:
        running = host_is_running(host)
        ssh_state = "-"
        rss = pss = 0
        if running:
            answered = ssh_run(host, "true", timeout=10, connect_timeout=2).returncode == 0
            ssh_state = "ok" if answered else "FAILED"
            healthy &= answered
            pids = processes_in_netns(host.netns) + [
                pid for pid in (supervisor_pid(host), nspawn_pid(host)) if pid is not None
            ]
            rss = sum(process_rss_bytes(pid) for pid in pids)
            pss = sum(process_pss_bytes(pid) for pid in pids)
        elif host.name in expected:
            healthy = False
        state = "running" if running else "stopped" if host.name in expected else "stopped (not in inventory)"
        upper = disk_usage(host.upper)
        log(
            f"{host.name}  {state}  {host.address}  ssh {ssh_state}  "
            f"rss {rss / 2**20:.0f} MiB (pss {pss / 2**20:.0f} MiB)  upper {upper / 2**20:.1f} MiB"
        )
    return 0 if healthy else 1


def fleet_exec(name: str, command: Sequence[str]) -> int:
    """Run command on host ``name`` over ssh, passing its output through; return its exit status."""
    host = host_from_name(name)
    if not host_is_running(host):
        raise FleetError(f"{name} is not running: start it with `python3 tests/sandbox/fleet.py up`")
    if not command:
        raise FleetError("exec needs a command: fleet.py exec spark-01 -- systemctl is-system-running")
    if not CLIENT_KEY.exists():
        raise FleetError("no fleet key yet: run `python3 tests/sandbox/fleet.py up` first")
    # one argument is a shell command line (like ssh's); several are quoted one by one
    remote = command[0] if len(command) == 1 else shlex.join(command)
    return subprocess.run([*ssh_base_argv(host), "--", remote], check=False).returncode


# --------------------------------------------------------------------------- command line


@dataclass
class Arguments:
    """Parsed command line (typed view of argparse's namespace)."""

    command: str
    hosts: int = 3
    timeout: float = 90.0
    purge: bool = False
    force: bool = False
    name: str = ""
    remote: list[str] = field(default_factory=list)


def parse_arguments(argv: Sequence[str]) -> Arguments:
    """Parse fleet.py's command line."""
    parser = argparse.ArgumentParser(prog="fleet.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rootfs = commands.add_parser("rootfs", help="debootstrap the shared host rootfs (cached)")
    rootfs.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    aptrepo = commands.add_parser("aptrepo", help="build the local apt repo the offline hosts use (cached)")
    aptrepo.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    up = commands.add_parser("up", help="boot spark-01..spark-NN (stops hosts beyond NN, keeping their state)")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts (default 3)")
    up.add_argument(
        "--timeout",
        type=float,
        default=240.0,
        help="seconds to wait for the hosts (default 240: a host that serves at boot starts vLLM too)",
    )
    down = commands.add_parser("down", help="stop every host, remove mounts, namespaces, links, processes")
    down.add_argument("--purge", action="store_true", help="also delete host state (fresh hosts next time)")
    down.add_argument(
        "--timeout", type=float, default=30.0, help="seconds for a clean poweroff before killing (default 30)"
    )
    commands.add_parser("status", help="one line per host: running?, address, ssh, memory, disk")
    exec_parser = commands.add_parser("exec", help="run a command in a host over ssh: exec NAME -- CMD...")
    exec_parser.add_argument("name", help="host name, e.g. spark-01")
    exec_parser.add_argument("remote", nargs=argparse.REMAINDER, help="-- CMD...")
    namespace = parser.parse_args(argv)
    remote = list(getattr(namespace, "remote", []) or [])
    if remote[:1] == ["--"]:
        remote = remote[1:]
    return Arguments(
        command=namespace.command,
        hosts=getattr(namespace, "hosts", 3),
        timeout=getattr(namespace, "timeout", 90.0),
        purge=getattr(namespace, "purge", False),
        force=getattr(namespace, "force", False),
        name=getattr(namespace, "name", ""),
        remote=remote,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run one subcommand, print a one-line error on failure."""
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        if arguments.command == "status":
            return fleet_status()
        if arguments.command == "exec":
            return fleet_exec(arguments.name, arguments.remote)
        with fleet_lock():
            if arguments.command == "rootfs":
                build_rootfs(force=arguments.force)
            elif arguments.command == "aptrepo":
                build_aptrepo(force=arguments.force)
            elif arguments.command == "up":
                fleet_up(arguments.hosts, timeout=arguments.timeout)
            elif arguments.command == "down":
                fleet_down(purge=arguments.purge, timeout=arguments.timeout)
    except FleetError as error:
        print(f"fleet.py {arguments.command}: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
