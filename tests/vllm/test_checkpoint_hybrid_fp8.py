"""`sparkfleet checkpoint hybrid-fp8` output: loaded by the patched vLLM, and greedy-equal to its BF16 source.

The tiny Qwen3.5-MoE base (tests/fixtures/hybrid_fp8_checkpoint.py with `fp8_scales="none"`: INT4 attention
and routed experts, BF16 shared experts, the real tensor names) goes through the builder twice (128x128 block
scales, per-tensor scales). Then:

1. vLLM loads it. A subprocess whose PYTHONPATH starts with a vllm tree patched with 0002 (built as
   tests/vllm/test_inc_hybrid_fp8.py builds it) runs `EngineArgs.create_engine_config` (INCConfig reads the
   output's headers and its rewritten quantization_config), `initialize_model`, and the model's own
   `load_weights` for the shared-expert tensors. Per-tensor output: the real `Fp8LinearMethod` layers are
   built and loaded; the driver dumps the matrix the loaded FP8 parameters stand for (each logical shard
   times its scale). Block output: this CPU has no block-FP8 kernel (`CPUFp8BlockScaledMMKernel` needs AMX),
   so only the dispatch decision is checked (every shared-expert layer -> Fp8LinearMethod, block [128, 128]).

2. Greedy tokens. vLLM's FP8 GEMM cannot run on this CPU build (its scaled_fp8_quant ops are empty), so the
   forward is a reference one: transformers' Qwen3_5MoeForCausalLM in float32, INT4 layers dequantized, once
   with the BF16 shared experts (the source) and once with the FP8 ones (per-tensor: the matrices vLLM
   loaded; block: dequantized from the output's tensors; block W8A8: the same plus activations fake-quantized
   to E4M3 per token and 128-wide group, as vLLM's block path quantizes them on a GPU).

Tolerance: TAU = 0.02 logits, about 10 % of the logit standard deviation of this random model (~0.19) and a
round figure ~2.5x above the weight-only FP8 error first measured (0.0077). The FP8 model's logits must stay
within TAU of the source's at every position of every reference sequence, and its argmax must equal the
source's greedy token wherever the source's top-1/top-2 margin exceeds 2 * TAU (there no perturbation of at
most TAU can flip it). Below that margin a position is a near-tie of a random, untrained model (about 60 % of
positions here): a token there may differ, and the sequences are compared up to the first one. Teacher
forcing on the source's greedy sequences is exact for free-running greedy decoding: while every step's
argmax agrees, the FP8 model generates the same sequence. The W8A8 emulation moves logits ~10x more (0.083):
it gets its own regression bound TAU_W8A8 and the same 2 * TAU token check, which there is a measurement,
not a consequence. A negative control (FP8 bytes read without their scales, what stock vLLM does) must
break the tolerance, so the check can fail.

What this proves: the builder's FP8 tensors and scales are what the patched vLLM loader puts into its FP8
layers, and a model computing with exactly those weights decodes greedily like the BF16 source. What it
does not: vLLM's FP8 GEMM numerics (CUTLASS/Triton block kernels, the per-tensor requantization of fused
shards to one max scale in process_weights_after_loading), which need a GPU.

The module doubles as the subprocess driver: `python test_checkpoint_hybrid_fp8.py OUT_DIR TENSOR_CKPT BLOCK_CKPT`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH = REPO_ROOT / "files/patches/vllm-0.23.0/0002-inc-hybrid-fp8.patch"
TAU = 0.02
# W8A8 emulation: activations rounded to E4M3 too. Set after the first measurement (0.083 on this toy: the
# activation rounding dominates the weight rounding here); a regression bound, not a derived one.
TAU_W8A8 = 0.1
NUM_PROMPTS = 6
PROMPT_TOKENS = 8
NEW_TOKENS = 10
VLLM_LAYERS = ("language_model.model.layers.0", "language_model.model.layers.1")
SHARED_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LANGUAGE_PREFIX = "model.language_model."


# --------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from sparkfleet.checkpoint import BuildOptions, build_hybrid
    from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint

    root = tmp_path_factory.mktemp("ckpt_hybrid")
    base = write_hybrid_fp8_checkpoint(root / "base", fp8_scales="none").path
    manifests = {
        scales: build_hybrid(BuildOptions(base=base, out=root / scales, scales=scales), log=lambda _line: None)
        for scales in ("block", "tensor")
    }
    return {"root": root, "base": base, "block": root / "block", "tensor": root / "tensor", "manifests": manifests}


@pytest.fixture(scope="module")
def vllm_loaded(built: dict[str, Any]) -> dict[str, Any]:
    from tests.vllm.test_inc_hybrid_fp8 import build_vllm_tree

    root = built["root"]
    site = build_vllm_tree(root / "patched", PATCH)
    out = root / "vllm-out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}", HF_HUB_OFFLINE="1")
    env["VLLM_CACHE_ROOT"] = str(root / "vllm-cache")
    command = [sys.executable, __file__, str(out), str(built["tensor"]), str(built["block"])]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"driver failed:\n{(result.stdout + result.stderr)[-8000:]}"
    import torch

    return {**json.loads((out / "report.json").read_text()), "matrices": torch.load(out / "shared.pt")}


@pytest.fixture(scope="module")
def reference(built: dict[str, Any]) -> dict[str, Any]:
    """The source model, its greedy sequences, and its logits on them."""
    import torch

    model = _reference_model(built["base"])
    generator = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size - 4  # the last ids are the vision markers
    prompts = [torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator) for _ in range(NUM_PROMPTS)]
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, pad_token_id=0
            )
            sequences.append(out[0])
    source_shared = _shared_state(model)
    return {
        "model": model,
        "sequences": sequences,
        "source_shared": source_shared,
        "logits": _logits(model, sequences),
    }


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


def test_manifest_reports_fp8_error_per_tensor(built: dict[str, Any]) -> None:
    import torch

    from sparkfleet import fp8_quant
    from sparkfleet.checkpoint import read_layout
    from sparkfleet.safetensors_stream import read_tensor_bytes

    for scales in ("block", "tensor"):
        manifest = built["manifests"][scales]
        modules = manifest["fp8_modules"]
        assert len(modules) == 6
        base, out = read_layout(built["base"]), read_layout(built[scales])
        for module, entry in modules.items():
            # Recompute the error from the two checkpoints' bytes, independently of the builder's numbers.
            shard, info = base.tensor(f"{module}.weight")
            source = fp8_quant.tensor_from_bytes(read_tensor_bytes(base.path / shard, info), "BF16", info.shape)
            shard, winfo = out.tensor(f"{module}.weight")
            assert winfo.dtype == "F8_E4M3"
            weight = fp8_quant.tensor_from_bytes(read_tensor_bytes(out.path / shard, winfo), "F8_E4M3", winfo.shape)
            sshard, sinfo = out.tensor(f"{module}.{entry['scale']}")
            scale = fp8_quant.tensor_from_bytes(read_tensor_bytes(out.path / sshard, sinfo), "F32", sinfo.shape)
            rel = float((fp8_quant.dequantize(weight, scale) - source.float()).norm() / source.float().norm())
            assert entry["rel_error"]["rel_fro"] == pytest.approx(rel, rel=1e-6), module
            # E4M3 keeps 3 mantissa bits: a relative rounding error of at most 2^-4 per element.
            assert 0.005 < rel < 2**-4, (module, rel)
            assert torch.isfinite(weight.float()).all()


def test_patched_vllm_loads_the_per_tensor_output_as_fp8(vllm_loaded: dict[str, Any], built: dict[str, Any]) -> None:
    loaded = vllm_loaded["tensor"]["loaded"]
    assert sorted(loaded) == sorted(
        f"{layer}.mlp.shared_expert.{fused}" for layer in VLLM_LAYERS for fused in SHARED_FUSED
    )
    for prefix, entry in loaded.items():
        assert entry["method"] == "Fp8LinearMethod", prefix
        assert entry["weight_dtype"] == "torch.float8_e4m3fn", prefix
        assert entry["scale_param"] == "weight_scale", prefix
        assert entry["weight_bytes_equal_checkpoint"], prefix
        assert entry["scales_equal_checkpoint"], prefix
    assert vllm_loaded["tensor"]["int4_methods"] == ["AutoGPTQLinearMethod"]


def test_patched_vllm_dispatches_the_block_output_to_block_fp8(vllm_loaded: dict[str, Any]) -> None:
    decisions = vllm_loaded["block"]["fp8_decisions"]
    assert sorted(decisions) == sorted(
        f"{layer}.mlp.shared_expert.{fused}" for layer in VLLM_LAYERS for fused in SHARED_FUSED
    )
    assert all(d == {"method": "Fp8LinearMethod", "weight_block_size": [128, 128]} for d in decisions.values())
    assert vllm_loaded["block"]["int4_methods"] == ["AutoGPTQLinearMethod"]


@pytest.mark.parametrize("variant", ["tensor-vllm-loaded", "block", "block-w8a8"])
def test_greedy_tokens_match_the_bf16_source(
    variant: str, reference: dict[str, Any], built: dict[str, Any], vllm_loaded: dict[str, Any]
) -> None:
    import torch

    model = reference["model"]
    if variant == "tensor-vllm-loaded":
        shared = _shared_from_vllm(vllm_loaded["matrices"])
    else:
        shared = _shared_from_checkpoint(built["block"], with_scales=True)
    try:
        _set_shared(model, shared, fake_quant_activations=variant.endswith("w8a8"))
        logits = _logits(model, reference["sequences"])
    finally:
        _set_shared(model, reference["source_shared"], fake_quant_activations=False)
    report = _compare(reference["sequences"], reference["logits"], logits)
    print(f"{variant}: {json.dumps(report)}")
    assert report["max_abs_logit_diff"] <= (TAU_W8A8 if variant.endswith("w8a8") else TAU), report
    # Decided positions use 2 * TAU for every variant: for W8A8 this is measured agreement, not implied.
    assert report["decided_positions_disagreeing"] == 0, report
    # Not vacuous: most positions are decided, and some prompts decode identically end to end.
    assert report["decided_positions"] >= report["positions"] // 3, report
    assert report["prompts_identical_to_first_near_tie"] == NUM_PROMPTS, report
    assert torch.isfinite(logits[0]).all()


def test_negative_control_fp8_without_scales_breaks_the_tolerance(
    reference: dict[str, Any], built: dict[str, Any]
) -> None:
    model = reference["model"]
    try:
        _set_shared(model, _shared_from_checkpoint(built["block"], with_scales=False), fake_quant_activations=False)
        logits = _logits(model, reference["sequences"])
    finally:
        _set_shared(model, reference["source_shared"], fake_quant_activations=False)
    report = _compare(reference["sequences"], reference["logits"], logits)
    assert report["max_abs_logit_diff"] > 10 * TAU, report


# --------------------------------------------------------------------------------------------------------
# The reference forward (transformers, float32)
# --------------------------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, Any]:
    from sparkfleet import fp8_quant
    from sparkfleet.checkpoint import read_layout
    from sparkfleet.safetensors_stream import read_tensor_bytes

    layout = read_layout(path)
    out = {}
    for name, (shard, info) in layout.all_tensors().items():
        data = read_tensor_bytes(layout.path / shard, info)
        if info.dtype == "I32":
            import torch

            out[name] = torch.frombuffer(bytearray(data), dtype=torch.int32).reshape(info.shape)
        else:
            out[name] = fp8_quant.tensor_from_bytes(data, info.dtype, info.shape)
    return out


def _dequantize_gptq(qweight: Any, scales: Any, group: int = 128) -> Any:
    """Symmetric GPTQ v1 (AutoRound auto_gptq packing): 8 nibbles per int32 along in, zero point 8."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    nibbles = (qweight.unsqueeze(1) >> shifts) & 0xF
    values = nibbles.reshape(-1, qweight.shape[1]).to(torch.float32) - 8
    return (values * scales.to(torch.float32).repeat_interleave(group, 0)).t().contiguous()


def _reference_model(base: Path) -> Any:
    import torch
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = json.loads((base / "config.json").read_text())["text_config"]
    text_config = Qwen3_5MoeTextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(text_config).to(torch.float32).eval()
    raw = _tensors(base)
    state: dict[str, Any] = {}
    for name, tensor in raw.items():
        if not (name.startswith(LANGUAGE_PREFIX) or name == "lm_head.weight"):
            continue  # the vision tower
        module, _, suffix = name.rpartition(".")
        target = name.replace(LANGUAGE_PREFIX, "model.")
        if suffix == "qweight":
            state[target.removesuffix("qweight") + "weight"] = _dequantize_gptq(tensor, raw[f"{module}.scales"])
        elif suffix not in ("qzeros", "scales"):
            state[target] = tensor.to(torch.float32)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config["num_experts"])
        gate_up = [torch.cat([state.pop(f"{prefix}.{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in experts]
        state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}.down_proj"] = torch.stack([state.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def _shared_modules(model: Any) -> dict[str, Any]:
    return {
        f"model.layers.{index}.mlp.shared_expert.{proj}": getattr(layer.mlp.shared_expert, proj)
        for index, layer in enumerate(model.model.layers)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def _shared_state(model: Any) -> dict[str, Any]:
    return {name: module.weight.detach().clone() for name, module in _shared_modules(model).items()}


def _shared_from_checkpoint(path: Path, *, with_scales: bool) -> dict[str, Any]:
    import torch

    from sparkfleet import fp8_quant

    raw = _tensors(path)
    shared = {}
    for name in _shared_modules_names(raw):
        weight = raw[f"{LANGUAGE_PREFIX}{name}.weight"]
        scale = raw.get(f"{LANGUAGE_PREFIX}{name}.weight_scale_inv", raw.get(f"{LANGUAGE_PREFIX}{name}.weight_scale"))
        matrix = fp8_quant.dequantize(weight, scale) if with_scales else weight.to(torch.float32)
        shared[f"model.{name}"] = matrix
    return shared


def _shared_modules_names(raw: dict[str, Any]) -> list[str]:
    return sorted(
        name.removeprefix(LANGUAGE_PREFIX).removesuffix(".weight")
        for name in raw
        if ".mlp.shared_expert." in name and name.endswith(".weight")
    )


def _shared_from_vllm(matrices: dict[str, Any]) -> dict[str, Any]:
    """Split vLLM's fused gate_up_proj back into the checkpoint's gate/up matrices."""
    shared = {}
    for index, layer in enumerate(VLLM_LAYERS):
        for fused, shards in SHARED_FUSED.items():
            parts = matrices[f"{layer}.mlp.shared_expert.{fused}"]
            for shard, part in zip(shards, parts, strict=True):
                shared[f"model.layers.{index}.mlp.shared_expert.{shard}"] = part
    return shared


class _FakeQuantActivations:
    """Pre-forward hook: activations rounded to E4M3 with one dynamic scale per token and 128-wide group."""

    def __call__(self, _module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        import torch

        (x,) = args
        groups = x.reshape(*x.shape[:-1], -1, 128)
        scale = (groups.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        rounded = (groups / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
        return (rounded.reshape(x.shape),)


def _set_shared(model: Any, shared: dict[str, Any], *, fake_quant_activations: bool) -> None:
    import torch

    modules = _shared_modules(model)
    assert sorted(shared) == sorted(modules), (sorted(shared), sorted(modules))
    for name, module in modules.items():
        with torch.no_grad():
            module.weight.copy_(shared[name])
        for handle in getattr(module, "_sparkfleet_hooks", []):
            handle.remove()
        module._sparkfleet_hooks = (
            [module.register_forward_pre_hook(_FakeQuantActivations())] if fake_quant_activations else []
        )


def _logits(model: Any, sequences: list[Any]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(sequence[None]).logits[0] for sequence in sequences]


def _compare(sequences: list[Any], source: list[Any], fp8: list[Any]) -> dict[str, Any]:
    positions = decided = disagreeing = without_tie = identical = 0
    max_diff = 0.0
    for sequence, src, hyp in zip(sequences, source, fp8, strict=True):
        max_diff = max(max_diff, float((hyp - src).abs().max()))
        first_tie = None
        agree_to_first_tie = True
        for step in range(PROMPT_TOKENS - 1, len(sequence) - 1):
            token = int(sequence[step + 1])
            top = src[step].topk(2).values
            margin = float(top[0] - top[1])
            positions += 1
            if margin > 2 * TAU:
                decided += 1
                disagreeing += int(int(hyp[step].argmax()) != token)
            elif first_tie is None:
                first_tie = step
            if first_tie is None and int(hyp[step].argmax()) != token:
                agree_to_first_tie = False
        without_tie += first_tie is None
        identical += agree_to_first_tie
    return {
        "positions": positions,
        "decided_positions": decided,
        "decided_positions_disagreeing": disagreeing,
        "max_abs_logit_diff": max_diff,
        "prompts_without_near_tie": without_tie,
        "prompts_identical_to_first_near_tie": identical,
    }


# --------------------------------------------------------------------------------------------------------
# The driver (a subprocess with the patched vllm tree first on PYTHONPATH)
# --------------------------------------------------------------------------------------------------------


def _driver(out: Path, tensor_ckpt: str, block_ckpt: str) -> None:
    import tempfile

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from tests.vllm.test_inc_hybrid_fp8 import INT4_PREFIXES, _build_model, _checkpoint_tensors, _engine_config

    report: dict[str, Any] = {}
    matrices: dict[str, list[Any]] = {}
    for label, ckpt, mode in (("tensor", tensor_ckpt, "full"), ("block", block_ckpt, "decide")):
        vllm_config = _engine_config(ckpt)
        if label == "tensor":
            with set_current_vllm_config(vllm_config):
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
                    backend="gloo",
                )
                initialize_model_parallel(1, 1)
        model, decisions = _build_model(vllm_config, mode)
        entry: dict[str, Any] = {
            "fp8_decisions": {
                prefix: {"method": d["method"], "weight_block_size": d["weight_block_size"]}
                for prefix, d in decisions.items()
                if d["method"] == "Fp8LinearMethod"
            },
            "int4_methods": sorted({decisions[prefix]["method"] for prefix in INT4_PREFIXES}),
        }
        if mode == "full":
            tensors = _checkpoint_tensors(ckpt, ".mlp.shared_expert.")
            with set_current_vllm_config(vllm_config):
                model.load_weights(iter(tensors.items()))
            modules = dict(model.named_modules())
            loaded = {}
            for index, layer in enumerate(VLLM_LAYERS):
                hf = f"{LANGUAGE_PREFIX}layers.{index}.mlp.shared_expert"
                for fused, shards in SHARED_FUSED.items():
                    prefix = f"{layer}.mlp.shared_expert.{fused}"
                    module = modules[prefix]
                    checkpoint_weight = torch.cat([tensors[f"{hf}.{s}.weight"] for s in shards])
                    checkpoint_scales = torch.cat([tensors[f"{hf}.{s}.weight_scale"].reshape(1) for s in shards])
                    widths = list(module.logical_widths)
                    rows = torch.split(module.weight.data.to(torch.float32), widths)
                    # The matrix the loaded FP8 parameters stand for: each logical shard times its own scale.
                    matrices[prefix] = [part * module.weight_scale.data[i] for i, part in enumerate(rows)]
                    loaded[prefix] = {
                        "method": type(module.quant_method).__name__,
                        "weight_dtype": str(module.weight.dtype),
                        "scale_param": "weight_scale" if hasattr(module, "weight_scale") else None,
                        "weight_bytes_equal_checkpoint": bool(
                            module.weight.dtype == torch.float8_e4m3fn
                            and torch.equal(module.weight.data.view(torch.uint8), checkpoint_weight.view(torch.uint8))
                        ),
                        "scales_equal_checkpoint": bool(
                            torch.equal(module.weight_scale.data.reshape(-1), checkpoint_scales)
                        ),
                    }
            entry["loaded"] = loaded
        report[label] = entry
    torch.save(matrices, out / "shared.pt")
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))


if __name__ == "__main__":
    _driver(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
