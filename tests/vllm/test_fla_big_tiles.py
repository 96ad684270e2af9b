"""Patch 0004 (FLA big tiles on sm_12x): the tile lists vLLM's FLA ops pick, stock against patched, per GPU.

`chunk_o.py` (`BKV_LIST`) and `cumsum.py` (`BS_LIST`) choose their autotune tile sizes at import time
from the device's shared memory (`check_shared_mem()` in `fla/ops/utils.py`). The real modules are
imported, in a subprocess whose `PYTHONPATH` puts first a vllm tree built under tmp_path (symlinks to the
installed stock files; the patched files copied and patched with `patch -p1`), once per simulated GPU.

Only the GPU is faked, at the level vLLM queries it: Triton's active driver (`get_current_target()`,
`utils.get_device_properties(i)["max_shared_mem"]`; on this CPU host vLLM hands out a Triton placeholder,
which gets the fake driver) and `torch.cuda.{device_count, get_device_name, get_device_capability}`. The
shared-memory figures are the devices' opt-in per-block limits (what Triton reports as max_shared_mem).
NVIDIA devices only: on ROCm/XPU hosts vLLM's platform (not only the GPU) decides how fla/ops/utils.py
probes the device, and the patch's rule starts with `is_nvidia`.

What the big tiles need is checked too, with no GPU: the chunk_o and cumsum kernels, as the patched files
define them, are compiled by Triton for sm_121 in every config the autotuner would try on a GB10, and the
shared memory each needs (what Triton checks against max_shared_mem at launch) is compared with the GB10's
101376 bytes. The kernels are the modules' own functions (vLLM's Triton placeholder leaves them
undecorated on a CPU host), re-bound to the real Triton.

The module doubles as the subprocess driver: `python test_fla_big_tiles.py OUT.json [--compile]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.vllm_trees import build_vllm_tree, run_tree_drivers

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH = REPO_ROOT / "files/patches/vllm-0.23.0/0004-fla-sm121-big-tiles.patch"
BIG = {"BKV_LIST": [64, 128], "BS_LIST": [32, 64]}
SMALL = {"BKV_LIST": [32, 64], "BS_LIST": [16, 32]}

# name, Triton backend, compute capability, max_shared_mem (bytes per block, opt-in)
DEVICES: dict[str, tuple[str, str, tuple[int, int], int]] = {
    "gb10": ("NVIDIA GB10", "cuda", (12, 1), 101376),
    "rtx5090": ("NVIDIA GeForce RTX 5090", "cuda", (12, 0), 101376),
    "rtx4090": ("NVIDIA GeForce RTX 4090", "cuda", (8, 9), 101376),
    "rtx3090": ("NVIDIA GeForce RTX 3090", "cuda", (8, 6), 101376),
    "a100": ("NVIDIA A100-SXM4-80GB", "cuda", (8, 0), 166912),
    "h100": ("NVIDIA H100 80GB HBM3", "cuda", (9, 0), 232448),
    # An sm_12x part reporting less shared memory than the 99 KiB the rule is about.
    "sm121-64k": ("NVIDIA GB10 (64 KiB)", "cuda", (12, 1), 65536),
}
# What each tree picks: stock follows FLA's 100 KiB (102400) threshold; the patch adds sm_12x at 99 KiB.
EXPECTED_BIG = {
    "stock": {"a100", "h100"},
    "patched": {"a100", "h100", "gb10", "rtx5090"},
}


# --------------------------------------------------------------------------------------------------------
# The stock and patched trees (tests/vllm/vllm_trees.py), each run by this file as a driver
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def picks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fla_tiles")
    trees = {
        "stock": build_vllm_tree(root / "stock", None),
        "patched": build_vllm_tree(root / "patched", PATCH),
    }
    # compile afresh, write nothing outside
    env = {tree: {"TRITON_CACHE_DIR": str(root / f"triton-cache-{tree}")} for tree in trees}
    return run_tree_drivers(__file__, trees, root, args={"patched": ["--compile"]}, env=env)


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", ["stock", "patched"])
@pytest.mark.parametrize("device", sorted(DEVICES))
def test_tile_lists_per_device(picks: dict[str, dict[str, dict[str, Any]]], tree: str, device: str) -> None:
    pick = picks[tree][device]
    expected = BIG if device in EXPECTED_BIG[tree] else SMALL
    assert {"BKV_LIST": pick["BKV_LIST"], "BS_LIST": pick["BS_LIST"]} == expected, pick


def test_the_fake_gpu_is_what_vllm_sees(picks: dict[str, dict[str, dict[str, Any]]]) -> None:
    # The module-level device probing of fla/ops/utils.py took the fakes: vendor, Hopper flag, shared memory.
    for tree in ("stock", "patched"):
        for device, (_name, backend, capability, shared) in DEVICES.items():
            pick = picks[tree][device]
            assert pick["max_shared_mem"] == [shared]
            assert pick["is_nvidia"] is (backend == "cuda")
            assert pick["is_nvidia_hopper"] is (backend == "cuda" and capability[0] >= 9)


def test_every_big_tile_config_fits_a_gb10(picks: dict[str, dict[str, dict[str, Any]]]) -> None:
    compiled = picks["patched"]["compile"]
    gb10_shared = DEVICES["gb10"][3]
    assert compiled["arch"] == 121
    # Every config the patched modules offer on a GB10: 2 x 2 tile sizes x warps (chunk_o), 2 x 3 (cumsum).
    assert len(compiled["chunk_fwd_kernel_o"]) == 4 * len(compiled["num_warps"])
    assert len(compiled["chunk_local_cumsum_vector_kernel"]) == 2 * 3
    for kernel in ("chunk_fwd_kernel_o", "chunk_local_cumsum_vector_kernel"):
        for config, shared in compiled[kernel]:
            assert 0 < shared <= gb10_shared, (kernel, config, shared)
    # The biggest big tile (BK = BV = 128) is among them.
    assert any(config["BK"] == config["BV"] == 128 for config, _ in compiled["chunk_fwd_kernel_o"])


def test_patch_leaves_check_shared_mem_alone(picks: dict[str, dict[str, dict[str, Any]]]) -> None:
    for device in DEVICES:
        assert picks["patched"][device]["check_shared_mem"] == picks["stock"][device]["check_shared_mem"]
    assert picks["stock"]["gb10"]["check_big_tiles"] is None  # the stock tree has no such rule
    assert picks["patched"]["gb10"]["check_big_tiles"] is True


# --------------------------------------------------------------------------------------------------------
# The driver (runs in the subprocess, against whichever vllm tree is first on PYTHONPATH)
# --------------------------------------------------------------------------------------------------------


class _FakeTritonDriver:
    """What `triton.runtime.driver.active` answers on a host with one GPU of the given kind."""

    def __init__(self, backend: str, capability: tuple[int, int], max_shared_mem: int) -> None:
        from types import SimpleNamespace

        self._target = SimpleNamespace(backend=backend, arch=capability[0] * 10 + capability[1], warp_size=32)
        self.utils = SimpleNamespace(
            get_device_properties=lambda index: {"max_shared_mem": max_shared_mem, "multiprocessor_count": 48}
        )

    def get_current_target(self) -> Any:
        return self._target


def _pick_for(device: str) -> dict[str, Any]:
    import importlib
    from types import SimpleNamespace

    import torch
    import vllm.triton_utils as triton_utils

    name, backend, capability, shared = DEVICES[device]
    if triton_utils.HAS_TRITON:
        raise RuntimeError("vLLM found a real Triton driver here; this driver fakes the GPU on CPU hosts only")
    for module in [m for m in sys.modules if m.startswith("vllm.model_executor.layers.fla")]:
        del sys.modules[module]
    triton_utils.triton.runtime = SimpleNamespace(
        driver=SimpleNamespace(active=_FakeTritonDriver(backend, capability, shared))
    )
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.get_device_capability = lambda device=None: capability
    utils = importlib.import_module("vllm.model_executor.layers.fla.ops.utils")
    chunk_o = importlib.import_module("vllm.model_executor.layers.fla.ops.chunk_o")
    cumsum = importlib.import_module("vllm.model_executor.layers.fla.ops.cumsum")
    big_tiles = getattr(utils, "check_big_tiles", None)
    return {
        "BKV_LIST": chunk_o.BKV_LIST,
        "BS_LIST": cumsum.BS_LIST,
        "check_shared_mem": utils.check_shared_mem(),
        "check_big_tiles": big_tiles() if big_tiles is not None else None,
        "max_shared_mem": utils.get_all_max_shared_mem(),
        "is_nvidia": utils.is_nvidia,
        "is_nvidia_hopper": bool(utils.is_nvidia_hopper),
    }


def _compile_for_gb10() -> dict[str, Any]:
    """Shared memory of every chunk_o / cumsum config the modules offer on a GB10, compiled for sm_121."""
    import types

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _pick_for("gb10")  # the modules as imported on a GB10
    chunk_o = sys.modules["vllm.model_executor.layers.fla.ops.chunk_o"]
    cumsum = sys.modules["vllm.model_executor.layers.fla.ops.cumsum"]
    capability = DEVICES["gb10"][2]
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    def real_jit(function: Any) -> Any:
        # The placeholder bound `tl`, `triton` and op.exp (tl.exp without FLA_USE_FAST_OPS) at import and
        # turned the `tl.constexpr` annotations into None: bind the real ones.
        bindings = dict(function.__globals__, tl=tl, triton=triton, exp=tl.exp)
        rebound = types.FunctionType(function.__code__, bindings, function.__name__, function.__defaults__)
        rebound.__annotations__ = {k: tl.constexpr for k, v in function.__annotations__.items() if v is None}
        rebound.__module__, rebound.__qualname__ = function.__module__, function.__qualname__
        return triton.jit(rebound)

    def shared_bytes(kernel: Any, signature: dict[str, str], constants: dict[str, Any], **options: int) -> int:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        return triton.compile(source, target=target, options=options).metadata.shared

    # Qwen3.5-122B's Gated DeltaNet: 16 key heads, 64 value heads, head dims 128; chunk size 64.
    chunk_signature = {name: "*bf16" for name in ("q", "k", "v", "h", "o")}
    chunk_signature |= {
        "g": "*fp32",
        "cu_seqlens": "*i32",
        "chunk_indices": "*i32",
        "scale": "fp32",
        "T": "i32",
    }
    chunk_constants: dict[str, Any] = {"H": 64, "Hg": 16, "K": 128, "V": 128, "BT": chunk_o.FLA_CHUNK_SIZE}
    chunk_constants |= {"USE_G": True, "IS_VARLEN": True}
    chunk_signature |= {name: "constexpr" for name in [*chunk_constants, "BK", "BV"]}
    kernel_o = real_jit(chunk_o.chunk_fwd_kernel_o)
    # The autotuner's configs (chunk_o.py): BK x BV from BKV_LIST, NUM_WARPS, num_stages 2..4; the most
    # stages stage the most buffers, so num_stages=4 bounds each (BK, BV, warps).
    chunk_results = [
        (
            {"BK": bk, "BV": bv, "num_warps": warps},
            shared_bytes(
                kernel_o,
                chunk_signature,
                chunk_constants | {"BK": bk, "BV": bv},
                num_warps=warps,
                num_stages=4,
            ),
        )
        for bk in chunk_o.BKV_LIST
        for bv in chunk_o.BKV_LIST
        for warps in chunk_o.NUM_WARPS
    ]
    cumsum_signature = {"s": "*fp32", "o": "*fp32", "cu_seqlens": "*i32", "chunk_indices": "*i32", "T": "i32"}
    cumsum_constants: dict[str, Any] = {"B": 1, "H": 64, "S": 128, "BT": chunk_o.FLA_CHUNK_SIZE}
    cumsum_constants |= {"REVERSE": False, "IS_VARLEN": True, "HEAD_FIRST": False}
    cumsum_signature |= {name: "constexpr" for name in [*cumsum_constants, "BS"]}
    kernel_cumsum = real_jit(cumsum.chunk_local_cumsum_vector_kernel)
    cumsum_results = [
        (
            {"BS": bs, "num_warps": warps},
            shared_bytes(kernel_cumsum, cumsum_signature, cumsum_constants | {"BS": bs}, num_warps=warps),
        )
        for bs in cumsum.BS_LIST
        for warps in (2, 4, 8)  # the autotuner's warps (cumsum.py)
    ]
    return {
        "arch": target.arch,
        "num_warps": list(chunk_o.NUM_WARPS),
        "chunk_fwd_kernel_o": chunk_results,
        "chunk_local_cumsum_vector_kernel": cumsum_results,
    }


if __name__ == "__main__":
    report: dict[str, Any] = {device: _pick_for(device) for device in DEVICES}
    if "--compile" in sys.argv[2:]:
        report["compile"] = _compile_for_gb10()
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
