"""Patch 0002 (INC hybrid INT4 + FP8) on the real vLLM 0.23 code, stock against patched.

A synthetic Qwen3.5-MoE checkpoint in the hybrid layout (tests/fixtures/hybrid_fp8_checkpoint.py: INT4
AutoRound/GPTQ attention and routed experts, FP8 shared experts, AutoRound `quantization_config` whose
`extra_config` marks the shared experts 16-bit) goes through vLLM's own code in a subprocess whose
`PYTHONPATH` puts first a vllm tree built under tmp_path: symlinks to the installed stock files, with the
files the patch touches copied and patched with `patch -p1`.

What runs for real: `EngineArgs.create_engine_config` (the `auto-round` -> `INCConfig` override, and
`maybe_update_config` called from `config/vllm.py`, reading the safetensors headers), `initialize_model` of
`Qwen3_5MoeForConditionalGeneration` (`configure_quant_config` applying the model's `hf_to_vllm_mapper` and
`packed_modules_mapping`, every layer asking `INCConfig.get_quant_method`, each method's `create_weights`),
and `load_weights` of the shared-expert tensors through the model's own loader (name mapping, fused-shard
stacking, scale parameters).

What does not run here, and why:
- `Fp8LinearMethod.create_weights` for 128x128 *block* scales selects a kernel, which a CPU without AMX
  lacks (`CPUFp8BlockScaledMMKernel` wants AMX; the CUDA kernels want a GPU). So that this file passes the
  same way on every CPU, for the block-scale checkpoint the driver records every real `get_quant_method`
  decision during construction and, for the layers sent to `Fp8LinearMethod`, lets construction go on with
  `UnquantizedLinearMethod` (mode `decide`): the decision is exercised, the block layer is not built. The
  per-tensor-scale checkpoint builds for real (`PerTensorTorchFP8ScaledMMLinearKernel`) and its weights
  load. Where the CPU has AMX, the block layers are built, loaded and run for real by
  tests/vllm/test_checkpoint_hybrid_fp8.py.
- FP8 weight processing and the FP8 GEMM: the CPU build's `_C.static_scaled_fp8_quant` /
  `dynamic_scaled_fp8_quant` are empty stubs. The loaded FP8 parameters are checked instead: bytes equal to
  the checkpoint's, scales equal, and the matrix they stand for equal to the checkpoint's dequantized one.
- On this platform INCConfig's GPTQ path is `apply_cpu_w4a16_quant_layer` -> `AutoGPTQLinearMethod`
  (CPUWNA16 kernel) for INT4 linear layers; for the fused MoE it returns no method, which falls back to
  `UnquantizedFusedMoEMethod`. That is stock behaviour on CPU; the tests check the patch leaves every
  non-FP8 decision as stock makes it.

The module doubles as the subprocess driver: `python test_inc_hybrid_fp8.py OUT.json CKPT:MODE ...`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.vllm_trees import build_vllm_tree, init_one_process_world

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH = REPO_ROOT / "files/patches/vllm-0.23.0/0002-inc-hybrid-fp8.patch"
LAYERS = ("language_model.model.layers.0", "language_model.model.layers.1")
FP8_PREFIXES = {f"{layer}.mlp.shared_expert.{proj}" for layer in LAYERS for proj in ("gate_up_proj", "down_proj")}
HUB_REPO = "sparkfleet-test/tiny-hybrid-fp8"
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"
INT4_PREFIXES = {
    "language_model.model.layers.0.linear_attn.in_proj_qkvz",
    "language_model.model.layers.0.linear_attn.out_proj",
    "language_model.model.layers.1.self_attn.qkv_proj",
    "language_model.model.layers.1.self_attn.o_proj",
}


# --------------------------------------------------------------------------------------------------------
# The stock and patched trees (tests/vllm/vllm_trees.py), each run by this file as a driver
# --------------------------------------------------------------------------------------------------------


def run_drivers(*runs: tuple[Path, Path, list[str]]) -> list[dict[str, Any]]:
    """Run the driver once per (site, out, jobs), all at the same time (importing vllm dominates)."""
    processes = []
    for site, out, jobs in runs:
        env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}")
        env["VLLM_CACHE_ROOT"] = str(out.parent / "vllm-cache")
        env["HF_HOME"] = str(out.parent / "hf")
        env["HF_HUB_OFFLINE"] = "1"
        command = [sys.executable, __file__, str(out), *jobs]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for (_site, out, _jobs), process in zip(runs, processes, strict=True):
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"driver failed:\n{output.decode(errors='replace')[-8000:]}"
        results.append(json.loads(out.read_text()))
    return results


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint

    root = tmp_path_factory.mktemp("inc_hybrid")
    block = write_hybrid_fp8_checkpoint(root / "ckpt-block", fp8_scales="block").path
    tensor = write_hybrid_fp8_checkpoint(root / "ckpt-tensor", fp8_scales="tensor").path
    # The same checkpoint as a Hub repo in an offline Hugging Face cache, downloaded at a pinned commit
    # (a snapshot folder, no refs/main), as the model_cache role leaves it on a Spark.
    snapshot = root / "hf" / "hub" / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / HUB_REVISION
    shutil.copytree(block, snapshot)
    hub = f"{HUB_REPO}@{HUB_REVISION}"
    stock_site = build_vllm_tree(root / "stock", None)
    patched_site = build_vllm_tree(root / "patched", PATCH)
    stock, patched = run_drivers(
        (stock_site, root / "stock.json", [f"{block}:full", f"{tensor}:full", f"{hub}:decide"]),
        (
            patched_site,
            root / "patched.json",
            [f"{block}:decide", f"{tensor}:full", f"{block}:headers", f"{hub}:decide"],
        ),
    )
    return {
        "stock-hub": stock[f"{hub}:decide"],
        "patched-hub": patched[f"{hub}:decide"],
        "stock-block": stock[f"{block}:full"],
        "stock-tensor": stock[f"{tensor}:full"],
        "patched-block": patched[f"{block}:decide"],
        "patched-tensor": patched[f"{tensor}:full"],
        "patched-headers": patched[f"{block}:headers"],
    }


def _linear_decisions(run: dict[str, Any]) -> dict[str, str]:
    return {prefix: d["method"] for prefix, d in run["decisions"].items() if d["layer_is_linear"]}


@pytest.mark.parametrize("scales", ["block", "tensor"])
def test_patched_dispatches_fp8_for_exactly_the_fp8_layers(results: dict[str, dict[str, Any]], scales: str) -> None:
    run = results[f"patched-{scales}"]
    decisions = _linear_decisions(run)
    fp8 = {prefix for prefix, method in decisions.items() if method == "Fp8LinearMethod"}
    assert fp8 == FP8_PREFIXES, f"FP8 dispatch went to {sorted(fp8)}"
    # The recorded names are the checkpoint's, renamed by the model's mapper.
    assert sorted(run["fp8_layers"]) == sorted(
        f"{layer}.mlp.shared_expert.{proj}" for layer in LAYERS for proj in ("gate_proj", "up_proj", "down_proj")
    )
    expected_block = [128, 128] if scales == "block" else None
    for prefix in FP8_PREFIXES:
        assert run["decisions"][prefix]["weight_block_size"] == expected_block, prefix
        assert run["decisions"][prefix]["activation_scheme"] == "dynamic", prefix
    for prefix in INT4_PREFIXES:
        assert decisions[prefix] == "AutoGPTQLinearMethod", prefix


@pytest.mark.parametrize("scales", ["block", "tensor"])
def test_patch_changes_nothing_but_the_fp8_layers(results: dict[str, dict[str, Any]], scales: str) -> None:
    stock = results[f"stock-{scales}"]["decisions"]
    patched = results[f"patched-{scales}"]["decisions"]
    assert stock.keys() == patched.keys()
    changed = {prefix for prefix in stock if stock[prefix]["method"] != patched[prefix]["method"]}
    assert changed == FP8_PREFIXES
    # Stock obeys the AutoRound extra_config (16-bit) for the layers the hybrid made FP8.
    assert {stock[prefix]["method"] for prefix in FP8_PREFIXES} == {"UnquantizedLinearMethod"}


def test_stock_loads_fp8_bytes_as_bf16_values_and_drops_the_scales(
    results: dict[str, dict[str, Any]],
) -> None:
    loaded = results["stock-block"]["loaded"]
    for prefix in FP8_PREFIXES:
        entry = loaded[prefix]
        assert entry["weight_dtype"] == "torch.bfloat16"
        assert entry["weight_equals_unscaled_fp8_cast"] is True
        assert entry["scale_param"] is None
        # So the layer computes with weights ~1/scale (here ~1000x) too large.
        assert entry["represented_rel_error"] > 10


def test_patched_loads_fp8_weights_and_scales_into_fp8_parameters(results: dict[str, dict[str, Any]]) -> None:
    # Per-tensor scales only: block-scale layers need AMX (see the module docstring).
    loaded = results["patched-tensor"]["loaded"]
    for prefix in FP8_PREFIXES:
        entry = loaded[prefix]
        assert entry["weight_dtype"] == "torch.float8_e4m3fn"
        assert entry["weight_bytes_equal_checkpoint"] is True
        assert entry["scale_param"] == "weight_scale"
        assert entry["scales_equal_checkpoint"] is True


def test_patched_fp8_parameters_stand_for_the_checkpoint_matrix(results: dict[str, dict[str, Any]]) -> None:
    loaded = results["patched-tensor"]["loaded"]
    for prefix in FP8_PREFIXES:
        assert loaded[prefix]["represented_rel_error"] == 0.0, (
            prefix,
            loaded[prefix]["represented_rel_error"],
        )


def test_hub_repo_at_a_pinned_revision(results: dict[str, dict[str, Any]]) -> None:
    patched = results["patched-hub"]
    fp8 = {prefix for prefix, method in _linear_decisions(patched).items() if method == "Fp8LinearMethod"}
    assert fp8 == FP8_PREFIXES
    assert results["stock-hub"]["fp8_layers"] == []
    # The revision passthrough matters: without it the cache lookup misses and nothing is detected.
    assert patched["tensors_without_revision"] == 0
    assert patched["tensors_with_revision"] > 0


def test_bad_fp8_checkpoints_fail_with_the_layer_named(results: dict[str, dict[str, Any]]) -> None:
    out = results["patched-headers"]
    assert out["as_written"] == 6  # the good checkpoint: 6 FP8 modules found from headers alone
    assert "down_proj has an F8_E4M3 weight but neither weight_scale_inv" in out["no_scale"]
    assert "weight_scale_inv has shape [1, 1]" in out["wrong_block"]
    assert "stores its weight as F8_E5M2" in out["e5m2"]
    assert "only ['model.language_model.layers.0.mlp.shared_expert.gate_proj'] are FP8" in out["half_fused"]
    assert "has FP8 weights in the checkpoint" in out["fp8_expert"]


# --------------------------------------------------------------------------------------------------------
# The driver (runs in the subprocess, against whichever vllm tree is first on PYTHONPATH)
# --------------------------------------------------------------------------------------------------------


def _engine_config(ckpt: str) -> Any:
    """`ckpt` is a local directory, or `REPO@REVISION` for a Hub repo (here: the offline HF cache)."""
    from vllm.engine.arg_utils import EngineArgs

    model, _, revision = ckpt.partition("@")
    args = EngineArgs(
        model=model,
        revision=revision or None,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        language_model_only=True,
    )
    return args.create_engine_config()


def _build_model(vllm_config: Any, mode: str) -> tuple[Any, dict[str, dict[str, Any]]]:
    """initialize_model, recording each get_quant_method decision (see the module docstring for `decide`)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    quant_config = vllm_config.quant_config
    decisions: dict[str, dict[str, Any]] = {}
    real_get_quant_method = quant_config.get_quant_method

    def recording_get_quant_method(layer: torch.nn.Module, prefix: str) -> Any:
        method = real_get_quant_method(layer, prefix)
        inner = getattr(method, "quant_config", None)
        decisions[prefix] = {
            "layer": type(layer).__name__,
            "layer_is_linear": isinstance(layer, LinearBase),
            "method": type(method).__name__ if method is not None else None,
            "weight_block_size": getattr(inner, "weight_block_size", None),
            "activation_scheme": getattr(inner, "activation_scheme", None),
        }
        if mode == "decide" and type(method).__name__ == "Fp8LinearMethod":
            return UnquantizedLinearMethod()
        return method

    quant_config.get_quant_method = recording_get_quant_method
    # As DefaultModelLoader.load_model does it: parameters in the model dtype (bfloat16).
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("cpu"),
    ):
        model = initialize_model(vllm_config=vllm_config)
    return model, decisions


def _checkpoint_tensors(ckpt: str, wanted: str) -> dict[str, Any]:
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if wanted in name:
                    tensors[name] = handle.get_tensor(name)
    return tensors


def _load_and_run_shared_experts(model: Any, ckpt: str) -> dict[str, dict[str, Any]]:
    """Load the shared-expert tensors through the model's loader; report what the parameters hold."""
    import torch

    tensors = _checkpoint_tensors(ckpt, ".mlp.shared_expert.")
    model.load_weights(iter(tensors.items()))
    modules = dict(model.named_modules())
    report: dict[str, dict[str, Any]] = {}
    for index in range(len(LAYERS)):
        hf = f"model.language_model.layers.{index}.mlp.shared_expert"
        for fused, shards in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            prefix = f"{LAYERS[index]}.mlp.shared_expert.{fused}"
            module = modules[prefix]
            weights = [tensors[f"{hf}.{shard}.weight"] for shard in shards]
            checkpoint_fp8 = torch.cat(weights)
            scale_param = next((n for n in ("weight_scale_inv", "weight_scale") if hasattr(module, n)), None)
            entry: dict[str, Any] = {
                "weight_dtype": str(module.weight.dtype),
                "scale_param": scale_param,
                "weight_bytes_equal_checkpoint": bool(
                    module.weight.dtype == torch.float8_e4m3fn
                    and torch.equal(module.weight.data.view(torch.uint8), checkpoint_fp8.view(torch.uint8))
                ),
                "weight_equals_unscaled_fp8_cast": bool(
                    module.weight.dtype == torch.bfloat16
                    and torch.equal(module.weight.data, checkpoint_fp8.to(torch.bfloat16))
                ),
            }
            # Exact reference: every shard dequantized with its own scales, in float32.
            dequantized = []
            scales = []
            for shard, weight in zip(shards, weights, strict=True):
                inv = tensors.get(f"{hf}.{shard}.weight_scale_inv")
                if inv is not None:
                    scales.append(inv)
                    expanded = inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
                    scale = expanded[: weight.shape[0], : weight.shape[1]]
                else:
                    scale = tensors[f"{hf}.{shard}.weight_scale"]
                    scales.append(scale.reshape(1))
                dequantized.append(weight.to(torch.float32) * scale)
            if scale_param is not None:
                entry["scales_equal_checkpoint"] = bool(
                    torch.equal(
                        getattr(module, scale_param).data.reshape(-1),
                        torch.cat([s.reshape(-1) for s in scales]),
                    )
                )
            reference_weight = torch.cat(dequantized)
            # The matrix the loaded parameters stand for, read the way each method reads them: an FP8
            # layer scales each logical shard (logical_widths) by its own per-tensor scale; a 16-bit layer
            # is its weight. (Running the FP8 kernels is not possible on the CPU build: weight processing
            # and activation quantization call _C.static/dynamic_scaled_fp8_quant, which it lacks.)
            if module.weight.dtype == torch.float8_e4m3fn and scale_param == "weight_scale":
                rows = torch.split(module.weight.data.to(torch.float32), list(module.logical_widths))
                represented = torch.cat([shard * module.weight_scale.data[i] for i, shard in enumerate(rows)])
            else:
                represented = module.weight.data.to(torch.float32)
            entry["represented_rel_error"] = float((represented - reference_weight).norm() / reference_weight.norm())
            report[prefix] = entry
    return report


def _header_errors(ckpt: str) -> dict[str, Any]:
    """The patched INCConfig on doctored headers: what each kind of bad checkpoint raises."""
    import copy

    import torch
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization import inc
    from vllm.transformers_utils.config import get_safetensors_params_metadata

    good = get_safetensors_params_metadata(ckpt)
    gate = "model.language_model.layers.0.mlp.shared_expert.gate_proj"
    down = "model.language_model.layers.0.mlp.shared_expert.down_proj"
    result: dict[str, Any] = {"as_written": len(inc._find_fp8_dense_layers(good))}

    def error_of(metadata: dict[str, Any]) -> str:
        try:
            inc._find_fp8_dense_layers(metadata)
        except ValueError as error:
            return str(error)
        return "no error"

    no_scale = copy.deepcopy(good)
    del no_scale[f"{down}.weight_scale_inv"]
    result["no_scale"] = error_of(no_scale)
    wrong_block = copy.deepcopy(good)
    wrong_block[f"{down}.weight_scale_inv"]["shape"] = [1, 1]
    result["wrong_block"] = error_of(wrong_block)
    e5m2 = copy.deepcopy(good)
    e5m2[f"{down}.weight"]["dtype"] = "F8_E5M2"
    result["e5m2"] = error_of(e5m2)

    config = inc.INCConfig(weight_bits=4, group_size=128)
    config.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    config.fp8_layers = {k: v for k, v in inc._find_fp8_dense_layers(good).items() if k == gate}
    layer = torch.nn.Module.__new__(MergedColumnParallelLinear)
    try:
        config.get_fp8_config(layer, gate.replace("gate_proj", "gate_up_proj"))
        result["half_fused"] = "no error"
    except ValueError as error:
        result["half_fused"] = str(error)
    config.fp8_layers = {"model.language_model.layers.0.mlp.experts.0.gate_proj": config.fp8_layers[gate]}
    experts = torch.nn.Module.__new__(RoutedExperts)
    try:
        config.get_fp8_config(experts, "model.language_model.layers.0.mlp.experts")
        result["fp8_expert"] = "no error"
    except NotImplementedError as error:
        result["fp8_expert"] = str(error)
    return result


def _driver(out: str, jobs: list[str]) -> None:
    import tempfile

    from vllm.config import set_current_vllm_config

    results: dict[str, Any] = {}
    distributed_ready = False
    for job in jobs:
        ckpt, _, mode = job.rpartition(":")
        if mode not in ("full", "decide", "headers"):
            raise SystemExit(f"job {job!r}: mode {mode!r} is not full, decide or headers")
        if mode == "headers":
            results[job] = _header_errors(ckpt)
            continue
        vllm_config = _engine_config(ckpt)
        if not distributed_ready:
            # One process, world size 1, gloo over a file rendezvous (no TCP port).
            with set_current_vllm_config(vllm_config):
                init_one_process_world(tempfile.mkdtemp())
            distributed_ready = True
        model, decisions = _build_model(vllm_config, mode)
        results[job] = {
            "quant_config": type(vllm_config.quant_config).__name__,
            "fp8_layers": sorted(getattr(vllm_config.quant_config, "fp8_layers", {})),
            "decisions": decisions,
        }
        repo, _, revision = ckpt.partition("@")
        if revision:
            # What the headers give without the revision (as stock config/vllm.py asks): the cache was
            # filled at a pinned commit and has no refs/main.
            from vllm.transformers_utils.config import get_safetensors_params_metadata

            results[job]["tensors_without_revision"] = len(get_safetensors_params_metadata(repo))
            results[job]["tensors_with_revision"] = len(get_safetensors_params_metadata(repo, revision=revision))
        elif mode == "full":
            with set_current_vllm_config(vllm_config):
                results[job]["loaded"] = _load_and_run_shared_experts(model, ckpt)
    Path(out).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2:])
