"""`make doctor`: one row per host of what it needs to serve its profile, each check pass or fail with the fix.

playbooks/doctor.yml gathers the facts read-only on every host (``spark_gpu_facts``, the serving port's
listeners, the unit's ExecStart) and on the controller (whether the hub answers); ``checks`` judges
them against the same settings the preflight refuses on (spark_preflight_*), so the doctor and the
deploy agree, and ``row`` prints them. Pure and standard library only (the Ansible filter calls it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    value: str
    fix: str = ""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in str(text).split("."):
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def checks(
    gpu: Mapping[str, Any],
    system: Mapping[str, Any],
    needs: Mapping[str, Any],
    settings: Mapping[str, Any],
    port_holders: Sequence[Mapping[str, Any]] = (),
    unit: Mapping[str, Any] | None = None,
    hub: Mapping[str, Any] | None = None,
) -> list[Check]:
    """Every check of one host. ``needs``: memory_gib, disk_gib, port, profile, unit. ``settings``: the
    preflight's (allow_non_aarch64, gpu_names, compute_capability, driver_branches, min_cuda_version,
    port_owner_units regex) and the driver role's (clock_cap {min_mhz, max_mhz} or None, persistence_mode)."""
    found: list[Check] = []
    arch = str(system.get("architecture") or "?")
    allowed = bool(settings.get("allow_non_aarch64"))
    found.append(
        Check(
            "arch",
            arch == "aarch64" or allowed,
            arch + (" (allowed: spark_preflight_allow_non_aarch64)" if arch != "aarch64" and allowed else ""),
            "sparkfleet serves from DGX Spark (aarch64) hosts: remove this host from the inventory",
        )
    )
    if not gpu.get("present"):
        found.append(
            Check("gpu", False, "none", f"{gpu.get('error') or 'nvidia-smi did not answer'}: install the NVIDIA driver")
        )
    else:
        names = list(settings.get("gpu_names") or [])
        cap = str(settings.get("compute_capability") or "")
        name, have_cap = str(gpu.get("name")), str(gpu.get("compute_cap"))
        found.append(
            Check(
                "gpu",
                (not names or name in names) and (not cap or have_cap == cap),
                f"{name} cc {have_cap}",
                f"a {' or '.join(names) or 'GB10'} with compute capability {cap} is needed (spark_preflight_gpu_names)",
            )
        )
        branches = settings.get("driver_branches") or {}
        branch = str(gpu.get("driver_branch") or "?")
        entry = branches.get(branch) or {}
        found.append(
            Check(
                "driver",
                bool(entry.get("allowed")),
                f"{gpu.get('driver_version') or '?'} (branch {branch})",
                str(entry.get("reason") or f"branch {branch} is not validated (spark_preflight_driver_branches)")
                + ": install a validated branch (nvidia_driver_manage: true)",
            )
        )
        minimum = str(settings.get("min_cuda_version") or "0")
        cuda = str(gpu.get("cuda_version") or "0")
        found.append(
            Check(
                "cuda",
                _version_tuple(cuda) >= _version_tuple(minimum),
                cuda,
                f"the driver must support CUDA {minimum}: upgrade the driver (nvidia_driver_manage: true)",
            )
        )
        wanted = settings.get("clock_cap")
        lock = gpu.get("clock_lock")
        found.append(
            Check(
                "clock cap",
                not wanted or lock == {"min_mhz": int(wanted["min_mhz"]), "max_mhz": int(wanted["max_mhz"])},
                f"{lock['min_mhz']}-{lock['max_mhz']} MHz" if lock else "none",
                f"wanted {wanted}: run the deploy with nvidia_driver_manage: true (a reboot clears the lock)",
            )
        )
        persistence = str(gpu.get("persistence_mode") or "?")
        found.append(
            Check(
                "persistence",
                persistence == "Enabled" or not settings.get("persistence_mode", True),
                persistence,
                "enable it: nvidia_driver_manage: true (nvidia-smi -pm 1), or nvidia_driver_persistence_mode: false",
            )
        )
    memory = float(gpu.get("usable_memory_gib") or system.get("memory_total_gib") or 0)
    need_memory = float(needs.get("memory_gib") or 0)
    found.append(
        Check(
            "memory",
            memory >= need_memory,
            f"{memory:.1f} of {need_memory:g} GiB",
            f"profile {needs.get('profile')} needs {need_memory:g} GiB usable memory: serve a smaller profile here",
        )
    )
    free = float(system.get("disk_free_gib") or 0) + float(system.get("cache_used_gib") or 0)
    need_disk = float(needs.get("disk_gib") or 0)
    found.append(
        Check(
            "disk",
            free >= need_disk,
            f"{free:.1f} of {need_disk:g} GiB at {system.get('cache_path_measured') or system.get('cache_path')}",
            f"free {need_disk - free:.1f} GiB more there (or move sparkfleet_state_dir to a larger disk)",
        )
    )
    swap = float(system.get("swap_total_gib") or 0)
    found.append(Check("swap", True, f"{swap:.1f} GiB", ""))
    found.append(_guard(unit, needs))
    found.append(_port(port_holders, needs, str(settings.get("port_owner_units") or "")))
    if hub is not None:
        found.append(
            Check(
                "hub",
                bool(hub.get("ok")),
                str(hub.get("value") or ""),
                "the controller fetches the weights (the seed cache): let it reach the hub (HF_ENDPOINT, proxy)",
            )
        )
    return found


def _guard(unit: Mapping[str, Any] | None, needs: Mapping[str, Any]) -> Check:
    unit = unit or {}
    if unit.get("LoadState") == "error":
        return Check("memory guard", False, "unknown: systemctl show failed", "check systemd on the host")
    if unit.get("LoadState") != "loaded":
        return Check("memory guard", True, f"{needs.get('unit')} not deployed yet (the deploy installs it)")
    guarded = "sparkfleet-memory-guard" in str(unit.get("ExecStart") or "")
    return Check(
        "memory guard",
        guarded,
        "on" if guarded else "off: the unit runs vLLM without sparkfleet-memory-guard",
        "deploy again: the unit's ExecStart must run under sparkfleet-memory-guard",
    )


def _port(holders: Sequence[Mapping[str, Any]], needs: Mapping[str, Any], owners: str) -> Check:
    import re

    port = needs.get("port")
    others = [h for h in holders if not (h.get("unit") and owners and re.match(owners, str(h.get("unit"))))]
    if not others:
        ours = [str(h.get("unit")) for h in holders]
        return Check("port", True, f"{port} " + (f"held by {ours[0]}" if ours else "free"))
    first = others[0]
    who = f"{first.get('comm') or '?'} (pid {first.get('pid')}{', ' + str(first['unit']) if first.get('unit') else ''})"
    return Check("port", False, f"{port} held by {who}", f"stop {who} or serve on another sparkfleet_api_port")


def row(host: str, found: Sequence[Check | Mapping[str, Any]]) -> str:
    """``spark-01  FAIL  arch aarch64 ✓ | gpu NVIDIA GB10 cc 12.1 ✓ | ... | disk 40.0 of 75 GiB ✗``."""
    items = [c if isinstance(c, Check) else Check(**c) for c in found]
    verdict = "PASS" if all(c.ok for c in items) else "FAIL"
    cells = " | ".join(f"{c.name} {c.value} {'ok' if c.ok else 'FAIL'}" for c in items)
    return f"{host}  {verdict}  {cells}"


def fixes(host: str, found: Sequence[Check | Mapping[str, Any]]) -> list[str]:
    items = [c if isinstance(c, Check) else Check(**c) for c in found]
    return [f"{host}: {c.name}: {c.value}: {c.fix}" for c in items if not c.ok]


def as_dicts(found: Sequence[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in found]
