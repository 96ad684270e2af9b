#!/usr/bin/python
"""Ansible module ``spark_gpu_facts``: the GPU and system facts a DGX Spark (GB10) preflight needs.

Read-only. It asks ``nvidia-smi`` for the GPU (one ``--query-gpu`` call in CSV, plus the plain
output, which is the only place the CUDA version the driver supports is printed) and reads the
system from ``/proc/meminfo``, ``/etc/os-release`` and ``statvfs`` on the model cache path.

The parsing functions are pure and importable (the unit tests feed them recorded outputs);
``build_module()`` and ``main()`` only wire them to Ansible.
"""

from __future__ import annotations

import csv
import os
import platform
import re
from collections.abc import Callable, Sequence
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: spark_gpu_facts
short_description: Gather NVIDIA GPU and system facts for a DGX Spark (GB10) preflight
description:
  - Runs C(nvidia-smi --query-gpu=... --format=csv,noheader,nounits) and the plain C(nvidia-smi)
    (for the CUDA version in its header) with C(LC_ALL=C), and reads C(/proc/meminfo),
    C(/etc/os-release) and the free space of the file system that holds O(cache_path).
  - On a GB10 the GPU has no memory of its own; C(nvidia-smi) reports the C(memory.*) fields as
    C([N/A]) (or C(Not Supported)). The module then sets RV(ansible_facts.spark_gpu.unified_memory)
    and takes the usable GPU memory from the system's C(MemTotal).
  - A missing C(nvidia-smi), or one that cannot talk to the driver, is not a failure - it is a
    fact (RV(ansible_facts.spark_gpu.present) is false and RV(ansible_facts.spark_gpu.error) says
    why), so a host without a driver yet can still be checked and provisioned. Output that does
    not parse is a failure that quotes it.
  - C(nvidia-smi) has no query for clocks locked with C(-lgc). The C(nvidia_driver) role records
    the lock it applies in O(clock_lock_state_path), on tmpfs so that it vanishes at reboot together
    with the lock; the module reports it as RV(ansible_facts.spark_gpu.clock_lock).
version_added: "0.1.0"
author:
  - sparkfleet
options:
  nvidia_smi:
    description:
      - The C(nvidia-smi) to run, a name looked up in C(PATH) or an absolute path.
    type: str
    default: nvidia-smi
  gpu_index:
    description:
      - Index (as C(nvidia-smi) numbers them) of the GPU to report. A DGX Spark has one GPU, index 0.
    type: int
    default: 0
  cache_path:
    description:
      - Absolute path of the model cache. Free space is measured on the nearest existing parent
        when the path does not exist yet. Leave out to skip the disk facts.
    type: path
  measure_cache_usage:
    description:
      - Also sum the space already used under O(cache_path) (each inode once), so that a check can
        count models that are already downloaded.
    type: bool
    default: true
  clock_lock_state_path:
    description:
      - File in which the C(nvidia_driver) role records the GPU clock lock it applied, as C(MIN,MAX)
        in MHz.
    type: path
    default: /run/sparkfleet/nvidia-clock-lock
notes:
  - Supports check mode (it changes nothing).
"""

EXAMPLES = r"""
- name: Gather GPU and system facts
  spark_gpu_facts:
    cache_path: /var/lib/sparkfleet/hf

- name: Show the GPU
  ansible.builtin.debug:
    msg: "{{ spark_gpu.name }} sm{{ spark_gpu.compute_cap }} driver {{ spark_gpu.driver_version }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    spark_gpu:
      description: The GPU selected by O(gpu_index), as C(nvidia-smi) reports it.
      returned: always
      type: dict
      contains:
        present:
          description: Whether C(nvidia-smi) ran and reported the GPU.
          type: bool
        error:
          description: Why the GPU could not be read, when RV(ansible_facts.spark_gpu.present) is false.
          type: str
        count:
          description: Number of GPUs C(nvidia-smi) lists.
          type: int
        name:
          description: Product name, for example C(NVIDIA GB10).
          type: str
        compute_cap:
          description: Compute capability, for example C(12.1).
          type: str
        driver_version:
          description: Driver version, for example C(580.95.05).
          type: str
        driver_branch:
          description: First component of the driver version (the branch), for example C(580).
          type: str
        cuda_version:
          description: Highest CUDA version the driver supports, from the C(nvidia-smi) header.
          type: str
        memory_total_mib:
          description: Dedicated GPU memory; null when the GPU has none (unified memory).
          type: int
        unified_memory:
          description: True when C(nvidia-smi) reports no dedicated memory (GB10, Grace parts).
          type: bool
        usable_memory_gib:
          description: Dedicated memory, or the system's C(MemTotal) on a unified-memory GPU.
          type: float
        persistence_mode:
          description: C(Enabled) or C(Disabled).
          type: str
        clocks:
          description: Current and maximum graphics, SM and memory clocks in MHz (null where unreported).
          type: dict
        clock_lock:
          description: The clock lock recorded by the C(nvidia_driver) role, C({min_mhz, max_mhz}), or null.
          type: dict
        unavailable_fields:
          description: Query fields C(nvidia-smi) reported as not available, with what it printed.
          type: dict
        pci_bus_id:
          description: PCI bus id, for example C(0000000F:01:00.0).
          type: str
        nvidia_smi:
          description: The C(nvidia-smi) that was run (as given when it was not found).
          type: str
      sample:
        present: true
        count: 1
        name: NVIDIA GB10
        compute_cap: "12.1"
        driver_version: 580.95.05
        driver_branch: "580"
        cuda_version: "13.0"
        memory_total_mib: null
        unified_memory: true
        usable_memory_gib: 119.7
        persistence_mode: Enabled
    spark_system:
      description: The host around the GPU.
      returned: always
      type: dict
      contains:
        architecture:
          description: Machine architecture (C(uname -m)), for example C(aarch64).
          type: str
        os:
          description: C(id), C(version_id), C(codename) and C(pretty_name) from C(/etc/os-release).
          type: dict
        memory_total_gib:
          description: C(MemTotal) in GiB.
          type: float
        memory_available_gib:
          description: C(MemAvailable) in GiB.
          type: float
        swap_total_gib:
          description: C(SwapTotal) in GiB.
          type: float
        cache_path:
          description: O(cache_path) as given (absent when not given).
          type: str
        cache_path_measured:
          description: The existing directory whose file system was measured.
          type: str
        cache_path_exists:
          description: Whether O(cache_path) itself exists.
          type: bool
        disk_free_gib:
          description: Space available to unprivileged users on that file system, in GiB.
          type: float
        disk_total_gib:
          description: Size of that file system, in GiB.
          type: float
        cache_used_gib:
          description: Space already used under O(cache_path), in GiB (0 when it does not exist).
          type: float
"""

# The --query-gpu fields, in order. `nounits` strips " MiB" / " MHz"; what is not available comes
# back as "[N/A]", "[Not Supported]" and the like.
QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "compute_cap",
    "driver_version",
    "memory.total",
    "memory.used",
    "memory.free",
    "persistence_mode",
    "clocks.current.graphics",
    "clocks.current.sm",
    "clocks.current.memory",
    "clocks.max.graphics",
    "clocks.max.sm",
    "clocks.max.memory",
)
# Whole numbers: the index, and every memory (MiB) and clock (MHz) reading.
INTEGER_FIELDS = frozenset(
    field for field in QUERY_FIELDS if field == "index" or field.startswith(("memory.", "clocks."))
)
# What nvidia-smi prints instead of a value (with or without brackets, case as printed varies).
UNAVAILABLE_MARKERS = frozenset(
    {
        "n/a",
        "not supported",
        "not available",
        "unknown error",
        "insufficient permissions",
        "requested functionality has been deprecated",
        "gpu requires reset",
    }
)
CUDA_VERSION_RE = re.compile(r"CUDA Version:\s*(\d+\.\d+)")
DRIVER_VERSION_RE = re.compile(r"^\d+(\.\d+)+$")
COMPUTE_CAP_RE = re.compile(r"^\d+\.\d+$")
GIB = 1024**3
ENV_C_LOCALE = {"LC_ALL": "C", "LANG": "C"}


# Every key of the spark_gpu fact, so that a host without a GPU has the same shape.
GPU_FACT_KEYS: tuple[str, ...] = (
    "present",
    "error",
    "count",
    "index",
    "name",
    "uuid",
    "pci_bus_id",
    "compute_cap",
    "driver_version",
    "driver_branch",
    "cuda_version",
    "memory_total_mib",
    "memory_used_mib",
    "memory_free_mib",
    "unified_memory",
    "persistence_mode",
    "clocks",
    "unavailable_fields",
)


class GpuOutputError(ValueError):
    """nvidia-smi printed something this module cannot read; the message quotes it."""


def _excerpt(text: str, limit: int = 160) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _unavailable(value: str) -> bool:
    return value.strip().strip("[]").strip().lower() in UNAVAILABLE_MARKERS


def parse_gpu_query(text: str, fields: Sequence[str] = QUERY_FIELDS) -> list[dict[str, Any]]:
    """Rows of ``--query-gpu=<fields> --format=csv,noheader,nounits`` as dicts keyed by field.

    Values nvidia-smi cannot give are None and listed under ``"_unavailable"`` (field -> what was
    printed). Raises GpuOutputError when a row has the wrong number of columns or a number field
    holds something else.
    """
    rows: list[dict[str, Any]] = []
    lines = [line for line in text.splitlines() if line.strip()]
    for line_number, fields_read in enumerate(csv.reader(lines, skipinitialspace=True), start=1):
        if len(fields_read) != len(fields):
            raise GpuOutputError(
                f"nvidia-smi --query-gpu row {line_number} has {len(fields_read)} fields, expected "
                f"{len(fields)} ({','.join(fields)}): {_excerpt(lines[line_number - 1])}"
            )
        row: dict[str, Any] = {"_unavailable": {}}
        for field, raw in zip(fields, fields_read, strict=True):
            value = raw.strip()
            if _unavailable(value):
                row[field] = None
                row["_unavailable"][field] = value
            elif field in INTEGER_FIELDS:
                try:
                    row[field] = int(float(value))
                except ValueError:
                    raise GpuOutputError(
                        f"nvidia-smi --query-gpu field {field} is not a number: {value!r} "
                        f"(row {line_number}: {_excerpt(lines[line_number - 1])})"
                    ) from None
            else:
                row[field] = value
        _check_row(row, line_number)
        rows.append(row)
    return rows


def _check_row(row: dict[str, Any], line_number: int) -> None:
    if not row.get("name"):
        raise GpuOutputError(f"nvidia-smi --query-gpu row {line_number} has no GPU name")
    if row.get("index") is None:
        raise GpuOutputError(f"nvidia-smi --query-gpu row {line_number} has no GPU index")
    driver = row.get("driver_version")
    if driver is not None and not DRIVER_VERSION_RE.match(driver):
        raise GpuOutputError(f"nvidia-smi reports driver_version {driver!r}, expected digits like 580.95.05")
    compute_cap = row.get("compute_cap")
    if compute_cap is not None and not COMPUTE_CAP_RE.match(compute_cap):
        raise GpuOutputError(f"nvidia-smi reports compute_cap {compute_cap!r}, expected digits like 12.1")


def parse_cuda_version(plain_output: str) -> str | None:
    """The ``CUDA Version: X.Y`` of the plain nvidia-smi header, or None when it prints none."""
    match = CUDA_VERSION_RE.search(plain_output)
    return match.group(1) if match else None


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per key. Raises ValueError when MemTotal is missing."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        multiplier = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
        values[key.strip()] = int(parts[0]) * multiplier
    if "MemTotal" not in values:
        raise ValueError(f"/proc/meminfo has no MemTotal line: {_excerpt(text)}")
    return values


def parse_os_release(text: str) -> dict[str, str]:
    """``/etc/os-release`` KEY=value lines (quotes removed), lower-cased keys."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.startswith("#"):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.lower()] = value
    return values


def nearest_existing_path(path: str) -> str:
    """``path`` itself if it exists, else its nearest existing parent (``/`` at the latest)."""
    if not os.path.isabs(path):
        raise ValueError(f"cache_path must be absolute, got {path!r}; give the full path of the model cache")
    current = os.path.normpath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def directory_usage_bytes(path: str) -> int:
    """Bytes allocated to the files under ``path``, each inode counted once (symlinks not followed;
    the Hugging Face cache links snapshots to blobs)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in files + dirs:
            try:
                stat = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # removed while walking
            key = (stat.st_dev, stat.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += stat.st_blocks * 512
    return total


def parse_clock_lock(text: str) -> dict[str, int] | None:
    """``MIN,MAX`` (MHz) as recorded by the nvidia_driver role; None for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match:
        return None
    return {"min_mhz": int(match.group(1)), "max_mhz": int(match.group(2))}


def gpu_facts(rows: list[dict[str, Any]], gpu_index: int, cuda_version: str | None) -> dict[str, Any]:
    """The ``spark_gpu`` fact for the GPU numbered ``gpu_index`` among parsed query rows."""
    selected = [row for row in rows if row["index"] == gpu_index]
    if not selected:
        indexes = ", ".join(str(row["index"]) for row in rows)
        raise GpuOutputError(f"gpu_index {gpu_index} is not among the GPUs nvidia-smi lists ({indexes})")
    row = selected[0]
    memory_total = row["memory.total"]
    driver = row["driver_version"]
    return {
        "present": True,
        "error": None,
        "count": len(rows),
        "index": row["index"],
        "name": row["name"],
        "uuid": row["uuid"],
        "pci_bus_id": row["pci.bus_id"],
        "compute_cap": row["compute_cap"],
        "driver_version": driver,
        "driver_branch": driver.split(".")[0] if driver else None,
        "cuda_version": cuda_version,
        "memory_total_mib": memory_total,
        "memory_used_mib": row["memory.used"],
        "memory_free_mib": row["memory.free"],
        "unified_memory": memory_total is None,
        "persistence_mode": row["persistence_mode"],
        "clocks": {
            "graphics_mhz": row["clocks.current.graphics"],
            "sm_mhz": row["clocks.current.sm"],
            "memory_mhz": row["clocks.current.memory"],
            "max_graphics_mhz": row["clocks.max.graphics"],
            "max_sm_mhz": row["clocks.max.sm"],
            "max_memory_mhz": row["clocks.max.memory"],
        },
        "unavailable_fields": row["_unavailable"],
    }


def absent_gpu(error: str) -> dict[str, Any]:
    """The ``spark_gpu`` fact when no GPU could be read; ``error`` says why and what to do."""
    clocks = ("graphics_mhz", "sm_mhz", "memory_mhz", "max_graphics_mhz", "max_sm_mhz", "max_memory_mhz")
    facts: dict[str, Any] = {key: None for key in GPU_FACT_KEYS}
    facts.update({"present": False, "error": error, "count": 0, "unified_memory": False})
    facts.update({"clocks": dict.fromkeys(clocks), "unavailable_fields": {}})
    return facts


# run(argv) -> (rc, stdout, stderr), as AnsibleModule.run_command returns it.
Runner = Callable[[list[str]], tuple[int, str, str]]


def read_gpu(nvidia_smi: str | None, requested: str, run: Runner, gpu_index: int) -> dict[str, Any]:
    """Run nvidia-smi through ``run`` and build the ``spark_gpu`` fact.

    ``nvidia_smi`` is the resolved executable (None when not found). A missing tool, a non-zero
    exit or "no devices" give ``present: false``; unreadable output raises GpuOutputError.
    """
    if nvidia_smi is None:
        return absent_gpu(
            f"nvidia-smi not found ({requested!r} is not in PATH): the NVIDIA driver is not installed; "
            "install the R580 driver (role nvidia_driver with nvidia_driver_manage: true)"
        )
    query = [nvidia_smi, "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits"]
    rc, out, err = run(query)
    if rc != 0:
        message = (err.strip() or out.strip() or "no output").splitlines()[0]
        return absent_gpu(
            f"{nvidia_smi} --query-gpu exited {rc}: {message}; check that the NVIDIA kernel module is "
            "loaded (a reboot is needed after a driver install)"
        )
    rows = parse_gpu_query(out)
    if not rows:
        return absent_gpu(f"{nvidia_smi} lists no GPU; check that the NVIDIA kernel module sees the device")
    plain_rc, plain_out, _plain_err = run([nvidia_smi])
    cuda_version = parse_cuda_version(plain_out) if plain_rc == 0 else None
    return gpu_facts(rows, gpu_index, cuda_version)


def system_facts(
    meminfo_text: str,
    os_release_text: str,
    architecture: str,
    cache_path: str | None,
    measure_cache_usage: bool,
) -> dict[str, Any]:
    """The ``spark_system`` fact. Disk facts only when ``cache_path`` is given."""
    meminfo = parse_meminfo(meminfo_text)
    os_release = parse_os_release(os_release_text)
    facts: dict[str, Any] = {
        "architecture": architecture,
        "os": {
            "id": os_release.get("id"),
            "version_id": os_release.get("version_id"),
            "codename": os_release.get("version_codename"),
            "pretty_name": os_release.get("pretty_name"),
        },
        "memory_total_gib": round(meminfo["MemTotal"] / GIB, 2),
        "memory_available_gib": round(meminfo.get("MemAvailable", 0) / GIB, 2),
        "swap_total_gib": round(meminfo.get("SwapTotal", 0) / GIB, 2),
    }
    if cache_path:
        measured = nearest_existing_path(cache_path)
        stat = os.statvfs(measured)
        facts.update(
            {
                "cache_path": cache_path,
                "cache_path_exists": measured == os.path.normpath(cache_path),
                "cache_path_measured": measured,
                "disk_free_gib": round(stat.f_bavail * stat.f_frsize / GIB, 2),
                "disk_total_gib": round(stat.f_blocks * stat.f_frsize / GIB, 2),
                "cache_used_gib": 0.0,
            }
        )
        if measure_cache_usage and facts["cache_path_exists"] and os.path.isdir(measured):
            facts["cache_used_gib"] = round(directory_usage_bytes(measured) / GIB, 2)
    return facts


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        return ""


def build_module() -> AnsibleModule:
    """The AnsibleModule with this module's argument spec."""
    return AnsibleModule(
        argument_spec={
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "gpu_index": {"type": "int", "default": 0},
            "cache_path": {"type": "path"},
            "measure_cache_usage": {"type": "bool", "default": True},
            "clock_lock_state_path": {"type": "path", "default": "/run/sparkfleet/nvidia-clock-lock"},
        },
        supports_check_mode=True,
    )


def main() -> None:
    module = build_module()
    params = module.params
    requested = params["nvidia_smi"]
    nvidia_smi = module.get_bin_path(requested, required=False)

    def run(argv: list[str]) -> tuple[int, str, str]:
        return module.run_command(argv, environ_update=ENV_C_LOCALE)

    try:
        gpu = read_gpu(nvidia_smi, requested, run, params["gpu_index"])
        system = system_facts(
            _read_text("/proc/meminfo"),
            _read_text("/etc/os-release"),
            platform.machine(),
            params["cache_path"],
            params["measure_cache_usage"],
        )
    except (GpuOutputError, ValueError, OSError) as exc:
        module.fail_json(msg=f"spark_gpu_facts: {exc}")
    if gpu["present"]:
        gpu["usable_memory_gib"] = (
            system["memory_total_gib"] if gpu["unified_memory"] else round(gpu["memory_total_mib"] / 1024, 2)
        )
        gpu["clock_lock"] = parse_clock_lock(_read_text(params["clock_lock_state_path"]))
    else:
        gpu.update({"usable_memory_gib": None, "clock_lock": None})
    gpu["nvidia_smi"] = nvidia_smi or requested
    module.exit_json(changed=False, ansible_facts={"spark_gpu": gpu, "spark_system": system})


if __name__ == "__main__":
    main()
