"""Which CUDA code a wheel's binaries carry, read with NVIDIA's cuobjdump, and whether it runs on a GPU.

A CUDA binary holds SASS (cubins, machine code for one architecture) and PTX (a virtual ISA the
driver JIT-compiles). NVIDIA's compatibility rules, as this module applies them for a GPU of compute
capability X.Y:

- SASS ``sm_XZ`` runs when its major is X and Z <= Y (a 12.0 cubin runs on the GB10's 12.1);
  ``sm_XZa`` (architecture-specific) only when Z == Y; ``sm_XZf`` (family) like plain ``sm_XZ``.
- PTX ``compute_VW`` is JIT-compiled for any GPU at V.W or newer; ``compute_VWa`` only for exactly
  V.W, ``compute_VWf`` for V.W and newer GPUs of major V. JIT code works, but the first start pays
  for the compile, and every start unless the driver's cache (``CUDA_CACHE_PATH``) persists.

The listing comes from NVIDIA's own ``cuobjdump --list-elf --list-ptx`` (the ``nvidia-cuda-cuobjdump``
wheel in the controller venv), never from a hand-written fat-binary parser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The binaries every serve of the GB10 profiles loads: vLLM's own ops, its MoE ops, and the FA2
# kernels FLASH_ATTN (target and DFlash drafter) uses on Blackwell. The FA3 library is Hopper-only
# (vLLM picks FA2 on 12.x), and the rest load on demand, so their code is listed, not required.
REQUIRED_BINARIES = (
    "vllm/_C.abi3.so",
    "vllm/_moe_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
)

_CODE = re.compile(r"^(?:sm|compute)_(\d+)(\d)([af]?)$")
_LISTED = re.compile(r"^(ELF|PTX) file\s+\d+:\s+\S*?\.((?:sm|compute)_\d+[af]?)\.(?:cubin|ptx)\s*$")


class CudaArchError(RuntimeError):
    """cuobjdump is missing or could not read a binary; the message names it and the fix."""


def cuobjdump() -> str:
    """The cuobjdump to run: $SPARKFLEET_CUOBJDUMP, the controller venv's NVIDIA wheel, or PATH's."""
    explicit = os.environ.get("SPARKFLEET_CUOBJDUMP")
    if explicit:
        return explicit
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/cuobjdump")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("cuobjdump")
    if found:
        return found
    raise CudaArchError(
        "cuobjdump not found: install the controller venv (make venv installs NVIDIA's nvidia-cuda-cuobjdump "
        "wheel), or set SPARKFLEET_CUOBJDUMP to one"
    )


def tool_version(tool: str) -> str:
    result = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release [\d.]+, V([\d.]+)", result.stdout)
    return f"cuobjdump {match.group(1)}" if match else "cuobjdump"


def list_code(path: Path, tool: str) -> dict[str, list[str]]:
    """``{"sass": [...], "ptx": [...]}`` of one binary (empty lists when it holds no device code)."""
    try:
        result = subprocess.run(
            [tool, "--list-elf", "--list-ptx", str(path)], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise CudaArchError(f"cannot run cuobjdump {tool} ({exc.strerror}): set SPARKFLEET_CUOBJDUMP to one") from exc
    if "does not contain device code" in result.stderr:
        return {"sass": [], "ptx": []}
    if result.returncode != 0 and not result.stdout.strip():
        why = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise CudaArchError(f"cuobjdump could not list {path.name}: {why}")
    sass: set[str] = set()
    ptx: set[str] = set()
    for line in result.stdout.splitlines():
        match = _LISTED.match(line.strip())
        if match:
            kind, code = match.groups()
            if kind == "ELF":
                sass.add(code.replace("compute_", "sm_"))
            else:
                ptx.add(code.replace("sm_", "compute_"))
    return {"sass": sorted(sass, key=_order), "ptx": sorted(ptx, key=_order)}


def _order(code: str) -> tuple[int, int, str]:
    match = _CODE.match(code)
    return (int(match.group(1)), int(match.group(2)), match.group(3)) if match else (0, 0, code)


def scan_wheel(wheel: Path, tool: str | None = None) -> dict[str, object]:
    """The manifest's ``cuda`` section: the device code of every shared library in the wheel that has any."""
    binaries: dict[str, dict[str, list[str]]] = {}
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory(prefix="sparkfleet-cuda-") as tmp:
        for info in archive.infolist():
            name = info.filename
            if not (name.endswith(".so") or ".so." in name.rsplit("/", 1)[-1]):
                continue
            tool = tool or cuobjdump()
            target = Path(tmp) / "binary.so"
            with archive.open(info) as source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            code = list_code(target, tool)
            if code["sass"] or code["ptx"]:
                binaries[name] = code
            target.unlink()
    return {"tool": tool_version(tool) if tool else "", "binaries": binaries, "required": list(REQUIRED_BINARIES)}


@dataclass(frozen=True)
class Verdict:
    """How a binary's code runs on one GPU: native (SASS), jit (PTX only) or none."""

    binary: str
    how: str  # native | jit | none
    via: str  # the code that runs there, or what the binary has


def _capability(compute_cap: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d)", str(compute_cap).strip())
    if not match:
        raise ValueError(f"compute capability {compute_cap!r} is not MAJOR.MINOR (nvidia-smi's compute_cap)")
    return int(match.group(1)), int(match.group(2))


def sass_runs(code: str, capability: tuple[int, int]) -> bool:
    match = _CODE.match(code)
    if not match or not code.startswith("sm_"):
        return False
    major, minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    if major != capability[0] or minor > capability[1]:
        return False
    return suffix != "a" or minor == capability[1]


def ptx_runs(code: str, capability: tuple[int, int]) -> bool:
    match = _CODE.match(code)
    if not match or not code.startswith("compute_"):
        return False
    major, minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    if suffix == "a":
        return (major, minor) == capability
    if suffix == "f":
        return major == capability[0] and minor <= capability[1]
    return (major, minor) <= capability


def verdict(binary: str, code: dict[str, list[str]], compute_cap: str) -> Verdict:
    capability = _capability(compute_cap)
    native = [c for c in code.get("sass", []) if sass_runs(c, capability)]
    if native:
        return Verdict(binary, "native", ", ".join(native))
    jit = [c for c in code.get("ptx", []) if ptx_runs(c, capability)]
    if jit:
        return Verdict(binary, "jit", ", ".join(jit))
    has = ", ".join(code.get("sass", []) + code.get("ptx", [])) or "no device code"
    return Verdict(binary, "none", has)


def check(cuda: dict | None, compute_cap: str) -> dict[str, object]:
    """Whether a wheel's code runs on a GPU of ``compute_cap``: ``{ok, checked, native, jit, none, reason}``.

    ``cuda`` is the manifest's section (None for a wheel built without one: a CPU wheel, or a manifest
    from before it was recorded: nothing to check, ``checked`` false). Refused: a required binary with
    no code for the GPU, or a wheel none of whose binaries has any.
    """
    if not cuda or not cuda.get("binaries"):
        return {
            "ok": True,
            "checked": False,
            "native": [],
            "jit": [],
            "none": [],
            "reason": "the manifest records no CUDA code",
        }
    verdicts = [verdict(name, code, compute_cap) for name, code in sorted(cuda["binaries"].items())]
    required = set(cuda.get("required") or REQUIRED_BINARIES)
    blocking = [v for v in verdicts if v.how == "none" and v.binary in required]
    runnable = [v for v in verdicts if v.how != "none"]
    ok = not blocking and bool(runnable)
    if blocking:
        reason = "; ".join(f"{v.binary} has only {v.via}" for v in blocking)
    elif not runnable:
        reason = f"no binary of the wheel has code for compute capability {compute_cap}"
    else:
        reason = ""
    return {
        "ok": ok,
        "checked": True,
        "native": [f"{v.binary} ({v.via})" for v in verdicts if v.how == "native"],
        "jit": [f"{v.binary} ({v.via})" for v in verdicts if v.how == "jit"],
        "none": [f"{v.binary} ({v.via})" for v in verdicts if v.how == "none"],
        "reason": reason,
    }
