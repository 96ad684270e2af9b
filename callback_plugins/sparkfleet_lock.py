"""Ansible callback: one run at a time per inventory.

Two ``make deploy`` runs (or a deploy and a switch) on the same inventory would restart the same
units and rewrite the same files at once. When a playbook starts, this callback takes an exclusive
lock (``lockf``) on a lock file of the inventory (on the controller, under ``~/.cache/sparkfleet/locks``);
the lock is the process's, so it goes away with the run however the run ends. A second run refuses
at once, naming who holds the lock (pid, user, host, playbook, limit, since when), or waits for it
with ``SPARKFLEET_LOCK_WAIT=<seconds>``. Check-mode runs (``--check``, ``make drift``) change
nothing and take no lock.
"""

from __future__ import annotations

import errno
import fcntl
import getpass
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from ansible import context
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: sparkfleet_lock
type: aggregate
short_description: one non-check run at a time per inventory (a controller-side lock file)
description:
  - Takes an exclusive POSIX lock per inventory when a playbook starts; a second run refuses naming the holder,
    or waits up to O(wait) seconds.
options:
  wait:
    description: Seconds a second run waits for the lock before it refuses (0 refuses at once).
    type: float
    default: 0
    env:
      - name: SPARKFLEET_LOCK_WAIT
  lock_dir:
    description: Where the lock files live (one per inventory).
    type: str
    default: ~/.cache/sparkfleet/locks
    env:
      - name: SPARKFLEET_LOCK_DIR
"""

EXIT_LOCKED = 3


def lock_path(lock_dir: str, inventories: list[str]) -> Path:
    """The lock file of a set of inventory sources (their real paths, order-independent)."""
    key = "\n".join(sorted(os.path.realpath(os.path.expanduser(source)) for source in inventories))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(os.path.expanduser(lock_dir)) / f"inventory-{digest}.lock"


def describe(holder: dict) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(holder.get("since", 0)))
    limit = f" --limit {holder['limit']}" if holder.get("limit") else ""
    return (
        f"pid {holder.get('pid', '?')} ({holder.get('user', '?')}@{holder.get('host', '?')}, "
        f"{holder.get('playbook', '?')}{limit}, since {since})"
    )


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkfleet_lock"
    CALLBACK_NEEDS_ENABLED = True
    _fd: int | None = None  # the lock's descriptor once taken (an instance attribute from then on)

    def v2_playbook_on_start(self, playbook) -> None:
        args = context.CLIARGS
        if args.get("check") or self._fd is not None:
            return
        inventories = list(args.get("inventory") or [])
        if not inventories:
            return
        path = lock_path(self.get_option("lock_dir"), inventories)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        wait = float(self.get_option("wait") or 0)
        deadline = time.monotonic() + wait
        where = ", ".join(inventories)
        announced = False
        while True:
            try:
                # a POSIX record lock is this process's own: Ansible's forked workers do not inherit it
                # (a flock would be shared with them and outlive a killed run), and it goes when we exit
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                holder = self._read(fd)
                if time.monotonic() >= deadline:
                    os.close(fd)
                    self._display.error(
                        f"sparkfleet: another run holds inventory {where}: {describe(holder)}; wait for it to end, "
                        "or run with SPARKFLEET_LOCK_WAIT=<seconds> to wait for it",
                        wrap_text=False,
                    )
                    sys.exit(EXIT_LOCKED)
                if not announced:
                    self._display.display(f"sparkfleet: waiting up to {wait:g} s for {describe(holder)} to end")
                    announced = True
                time.sleep(0.5)
        holder = {
            "pid": os.getpid(),
            "user": getpass.getuser(),
            "host": socket.gethostname(),
            "playbook": os.path.basename(getattr(playbook, "_file_name", "") or "?"),
            "limit": args.get("subset") or "",
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd  # held until this process exits

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
