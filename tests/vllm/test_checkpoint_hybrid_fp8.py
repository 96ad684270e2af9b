"""`sparkfleet checkpoint hybrid-fp8` output: loaded by the patched vLLM, and greedy-equal to its BF16 source.

The tiny Qwen3.5-MoE base (tests/fixtures/hybrid_fp8_checkpoint.py with `fp8_scales="none"`: INT4 attention
and routed experts, BF16 shared experts, the real tensor names) goes through the builder with 128x128 block
scales and with per-tensor scales; a copy whose shared-expert blocks are scaled by 1, 2, 4 or 8 (the fixture
draws every weight from one range, so all its blocks share one scale) goes through with block scales, to
check that each block's scale is its own and sits where vLLM reads it. Then:

1. vLLM loads it. A subprocess whose PYTHONPATH starts with a vllm tree patched with 0002 (built as
   tests/vllm/test_inc_hybrid_fp8.py builds it) runs `EngineArgs.create_engine_config` (INCConfig reads the
   output's headers and its rewritten quantization_config), `initialize_model`, and the model's own
   `load_weights` for the shared-expert tensors. Per-tensor output: the real `Fp8LinearMethod` layers are
   built and loaded; the driver dumps the matrix the loaded FP8 parameters stand for (each logical shard
   times its scale). Block output (and the varied copy): the dispatch decision is checked (every
   shared-expert layer -> Fp8LinearMethod, block [128, 128]); where the CPU has AMX tiles the real
   `Fp8LinearMethod` layers are built with vLLM's CPU block kernel (`CPUFp8BlockScaledMMKernel`), loaded (FP8
   bytes and `weight_scale_inv` equal to the file's) and processed by vLLM's `process_weights_after_loading`
   (the kernel prepacks the weights for AMX), then run (3). Without AMX the block layers cannot be built
   (no CPU kernel), the driver records only the decisions and the kernel tests skip, naming what is missing.

2. Greedy tokens. vLLM's FP8 GEMM cannot run on this CPU build (its scaled_fp8_quant ops are empty), so the
   forward is a reference one: transformers' Qwen3_5MoeForCausalLM in float32, INT4 layers dequantized, once
   with the BF16 shared experts (the source) and once with the FP8 ones (per-tensor: the matrices vLLM
   loaded; block: dequantized from the output's tensors; block W8A8: the same plus activations fake-quantized
   to E4M3 per token and 128-wide group, as vLLM's block path quantizes them on a GPU).

3. vLLM's real block-FP8 GEMM, where the CPU has AMX tiles (the driver asks Linux for AMX tile data first).
   `CPUFp8BlockScaledMMKernel` is W8A16: activations stay BF16, each FP8 weight block is expanded with its
   scale, products accumulate in float32, the output is BF16. Each loaded shared-expert layer (block build
   and varied build, 4 layers each) runs through its own forward on fixed BF16 inputs (128 seeded Gaussian
   rows), and its output y is compared with (a) the dequantized reference x . W_deq^T and (b) the BF16
   source layer x . W^T, both in float64. Tolerances, derived like the ones above: (a) elementwise and
   rigorous for the kernel's arithmetic: one BF16 rounding of each scaled weight (u = 2^-8 relative), float32
   accumulation of K products (gamma_K = K * 2^-24 / (1 - K * 2^-24) of sum |x||w|), one BF16 rounding of
   the output (u of |y| <= sum |x||w|), so |y - x . W_deq^T| <= (u + (1 + u)(u + gamma_K)) . |x| . |W_deq|^T
   on every element; (b) first order, as tau: for isotropic inputs FP8 weights move the output by the
   manifest's relative Frobenius error eps (largest over a fused layer's shards), the kernel adds at most
   2u + gamma_K, so the relative Frobenius error must stay within eps + 2u + gamma_K. Negative controls run
   the same kernel with each shard's scale grid transposed (varied build: blocks scaled 2x apart swap) and
   with the scales left out (all 1); both must fail (a) and (b). Greedy tokens through the kernel: the
   reference model (2) with each shared-expert projection's output replaced by the loaded vLLM layer's (its
   input rounded to BF16), teacher-forced on the source's greedy sequences; per matrix the kernel path adds
   3 BF16 roundings (input, scaled weight, output) and gamma_K, so tau = 3 * (eps + 3u + gamma_K) * S against
   the source, 3 * (3u + gamma_K) * S against the dequantized-reference model, plus (2)'s token checks.
   With SPARKFLEET_FP8_UPDATE_DOC=docs/dense-checkpoint.md the run writes these figures into that document.

Tolerance, derived from the model and the weights, not fitted to the logits: S = the largest logit change
the shared experts make at all (source against the same model with them zeroed); eps = the largest
per-tensor relative FP8 error of the weights, as the builder's manifest reports it. A shared expert chains 3
matrices, so to first order FP8 weights move the logits by about tau = 3 * eps * S. The weight-only variants
must keep every logit within tau of the source's, on every position of every reference sequence. For W8A8
(6 roundings, tau = 6 * eps * S) that estimate does not hold: activation rounding moved the logits ~3x past
it on this CPU emulation, and ~4x with real per-tensor FP8 GEMMs on an H200
(benchmarks/results/checkpoint-gpu-fp8-gemm.json), so there only the token checks apply. Token checks, for
every variant: the argmax must equal the source's greedy token wherever the source's top-1/top-2 margin
exceeds 2 * tau (no change of at most tau can flip it there); closer margins are near-ties, which this
random, untrained model is full of, so a token may flip there, and at least 90 % of all positions must
agree. Comparing argmaxes on the source's greedy sequences (teacher forcing) is exact for free-running
greedy decoding: a prompt whose positions all agree generates the same tokens (reported as
prompts_generating_identical_tokens). A negative control (FP8 bytes read without their scales, what stock
vLLM does) must exceed 5 * tau, so the check can fail.

The GPU mode (`python tests/vllm/test_checkpoint_hybrid_fp8.py --gpu OUT_DIR`, PYTHONPATH at the repo root,
torch with CUDA, no vLLM) runs the shared experts through torch._scaled_mm as vLLM's per-tensor FP8 path
computes them (per-tensor dynamic activations, gate/up requantized to one max scale) and tries the 128x128
blockwise form, and writes the same report as JSON.

What this proves: the builder's FP8 tensors and scales are what the patched vLLM loader puts into its FP8
layers, and a model computing with exactly those weights decodes greedily like the BF16 source; on a CPU
with AMX, also that vLLM's own block-FP8 path (loader, process_weights_after_loading, CPU kernel) reads the
128x128 `weight_scale_inv` grid the way the builder writes it and computes what the dequantized weights
define, to within its BF16 arithmetic, and that greedy tokens through it agree with the source as the
emulation's do. What it does not: the GPU kernels vLLM serves the block layout with on the GB10
(CUTLASS/Triton/DeepGEMM, with activations quantized to FP8 per token and 128-wide group, which the W8A16
CPU kernel never does), vLLM's per-tensor FP8 kernels and the per-tensor requantization of fused shards to
one max scale in process_weights_after_loading (the CPU build's scaled_fp8_quant ops are empty), and the
real 122B weights. Without AMX the block kernel is not run at all.

The module doubles as the subprocess driver:
`python test_checkpoint_hybrid_fp8.py OUT_DIR TENSOR_CKPT BLOCK_CKPT VARIED_BLOCK_CKPT BASE SEQUENCES_PT`.
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

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH = REPO_ROOT / "files/patches/vllm-0.23.0/0002-inc-hybrid-fp8.patch"
NUM_PROMPTS = 6
PROMPT_TOKENS = 8
NEW_TOKENS = 10
VLLM_LAYERS = ("language_model.model.layers.0", "language_model.model.layers.1")
SHARED_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LANGUAGE_PREFIX = "model.language_model."
LAYER_TOKENS = 128  # rows of the fixed inputs each block-FP8 layer is run on
BF16_U = 2.0**-8  # unit roundoff of BF16 (8-bit significand): round-to-nearest moves a value by <= u relative
F32_U = 2.0**-24
DOC_BLOCK = ("<!-- amx_block_fp8:begin -->", "<!-- amx_block_fp8:end -->")


# --------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from sparkfleet.build.checkpoint import BuildOptions, build_hybrid
    from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint

    root = tmp_path_factory.mktemp("ckpt_hybrid")
    base = write_hybrid_fp8_checkpoint(root / "base", fp8_scales="none").path
    varied = _with_varied_blocks(base, root / "varied-base")
    builds = {"block": (base, "block"), "tensor": (base, "tensor"), "varied-block": (varied, "block")}
    manifests = {
        name: build_hybrid(BuildOptions(base=source, out=root / name, scales=scales), log=lambda _line: None)
        for name, (source, scales) in builds.items()
    }
    return {"root": root, "base": base, "varied-base": varied, "manifests": manifests, **{n: root / n for n in builds}}


def _block_factors(rows: int, cols: int) -> Any:
    """A different power-of-two magnitude per 128x128 block (1, 2, 4, 8 by block position)."""
    import torch

    factors = torch.tensor([[2.0 ** ((i + 2 * j) % 4) for j in range(-(-cols // 128))] for i in range(-(-rows // 128))])
    return factors.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def _with_varied_blocks(source: Path, dest: Path) -> Path:
    """The fixture's base with each shared-expert block scaled differently.

    The fixture draws every BF16 weight from one uniform range, so all 128x128 blocks share one amax and
    block scales would equal the per-tensor one: a scale grid written transposed or misplaced would go
    unnoticed. Scaling blocks by 1, 2, 4 or 8 (exact in BF16) makes each block's scale its own.
    """
    from sparkfleet.build import fp8_quant
    from sparkfleet.build.checkpoint import read_layout
    from sparkfleet.build.safetensors_stream import ByteRange, ShardEntry, read_tensor_bytes, write_shard

    layout = read_layout(source)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    for shard in layout.shard_names:
        header = layout.headers[shard]
        entries = []
        for name, info in header.tensors.items():
            if ".mlp.shared_expert." in name and name.endswith(".weight"):
                weight = fp8_quant.tensor_from_bytes(read_tensor_bytes(header.path, info), info.dtype, info.shape)
                varied = (weight.float() * _block_factors(*info.shape)).to(weight.dtype)
                entries.append(ShardEntry(name, info.dtype, info.shape, lambda v=varied: fp8_quant.tensor_to_bytes(v)))
            else:
                entries.append(ShardEntry(name, info.dtype, info.shape, ByteRange(header.path, info.start, info.end)))
        write_shard(dest / shard, entries, header.metadata)
    return dest


@pytest.fixture(scope="module")
def vllm_loaded(built: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch

    from tests.vllm.vllm_trees import build_vllm_tree

    root = built["root"]
    site = build_vllm_tree(root / "patched", PATCH)
    stock_site = build_vllm_tree(root / "stock", None)
    out = root / "vllm-out"
    out.mkdir()

    def environment(tree: Path, cache: str) -> dict[str, str]:
        # The caller's PYTHONPATH follows the vllm tree and the repo (a sitecustomize there reaches the driver).
        path = [str(tree), str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1")
        env["VLLM_CACHE_ROOT"] = str(root / cache)
        return env

    torch.save(reference["sequences"], root / "sequences.pt")
    ckpts = [built[name] for name in ("tensor", "block", "varied-block", "base")]
    command = [sys.executable, __file__, str(out), *map(str, ckpts), str(root / "sequences.pt")]
    started = time.monotonic()
    patched = subprocess.Popen(
        command, env=environment(site, "vllm-cache"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    # Stock vLLM on the same output, through test_inc_hybrid_fp8.py's driver: it must refuse, not load FP8
    # bytes as BF16 values (the rewritten extra_config says 8 bits).
    inc_driver = Path(__file__).with_name("test_inc_hybrid_fp8.py")
    stock_command = [sys.executable, str(inc_driver), str(root / "stock.json"), f"{built['tensor']}:full"]
    stock = subprocess.Popen(
        stock_command, env=environment(stock_site, "vllm-cache-stock"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output, _ = patched.communicate(timeout=600)
    driver_s = time.monotonic() - started
    assert patched.returncode == 0, (
        f"driver failed (rc {patched.returncode}):\n{output.decode(errors='replace')[-8000:]}"
    )
    stock_output, _ = stock.communicate(timeout=300)
    kernel = out / "kernel.pt"
    return {
        **json.loads((out / "report.json").read_text()),
        "driver_s": driver_s,
        "matrices": torch.load(out / "shared.pt"),
        "kernel": torch.load(kernel) if kernel.exists() else None,
        "stock": {"returncode": stock.returncode, "output_tail": stock_output.decode(errors="replace")[-3000:]},
    }


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
    logits = _logits(model, sequences)
    # S: how far the shared experts move the logits at all (the model with them zeroed, against the source).
    try:
        _set_shared(model, {n: torch.zeros_like(w) for n, w in source_shared.items()}, fake_quant_activations=False)
        without = _logits(model, sequences)
    finally:
        _set_shared(model, source_shared, fake_quant_activations=False)
    contribution = max(float((a - b).abs().max()) for a, b in zip(logits, without, strict=True))
    return {
        "model": model,
        "sequences": sequences,
        "source_shared": source_shared,
        "logits": logits,
        "shared_contribution": contribution,
    }


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


def test_manifest_reports_fp8_error_per_tensor(built: dict[str, Any]) -> None:
    import torch

    from sparkfleet.build import fp8_quant
    from sparkfleet.build.checkpoint import read_layout
    from sparkfleet.build.safetensors_stream import read_tensor_bytes

    for name in ("block", "tensor", "varied-block"):
        manifest = built["manifests"][name]
        modules = manifest["fp8_modules"]
        assert len(modules) == 6
        base = read_layout(built["varied-base" if name.startswith("varied") else "base"])
        out = read_layout(built[name])
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


def test_block_scales_follow_their_blocks(built: dict[str, Any]) -> None:
    """Each weight_scale_inv[i, j] is amax(block i, j of the BF16 weight) / 448: orientation and placement."""
    source, out = _tensors(built["varied-base"]), _tensors(built["varied-block"])
    for module in built["manifests"]["varied-block"]["fp8_modules"]:
        weight = source[f"{module}.weight"].float()
        scale = out[f"{module}.weight_scale_inv"]
        rows, cols = weight.shape
        assert tuple(scale.shape) == (-(-rows // 128), -(-cols // 128)), module
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                amax = float(weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max())
                assert float(scale[i, j]) == pytest.approx(amax / 448.0, rel=1e-6), (module, i, j)
        assert len({float(v) for v in scale.flatten()}) > 1, f"{module}: all blocks share one scale"


def test_quantize_block_scales_layout_and_error_bound() -> None:
    import torch

    from sparkfleet.build import fp8_quant

    generator = torch.Generator().manual_seed(7)
    weight = (torch.rand(200, 300, generator=generator) * 2 - 1) * _block_factors(200, 300)
    weight[5, 7] = 0.0
    fp8, scale = fp8_quant.quantize(weight, "block")
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (200, 300)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert float(scale[i, j]) == pytest.approx(float(block.abs().max()) / 448.0, rel=1e-6)
            # Each block's largest magnitude maps to 448 exactly (no saturation, full range used).
            assert float(fp8[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max()) == 448.0
    restored = fp8_quant.dequantize(fp8, scale)
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # Round to nearest in E4M3: error at most half a step, 2^-4 of the value (normal range) or of 2^-9 x scale.
    bound = torch.maximum(weight.abs() * 2**-4, expanded * 2**-10)
    assert bool(((restored - weight).abs() <= bound * 1.0001).all())
    assert float(restored[5, 7]) == 0.0
    tensor_fp8, tensor_scale = fp8_quant.quantize(weight, "tensor")
    assert tensor_scale.shape == () and float(tensor_scale) == pytest.approx(float(weight.abs().max()) / 448.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8_quant.quantize(torch.full((4, 4), float("nan")), "block")


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


def test_stock_vllm_refuses_the_output_instead_of_misloading_it(vllm_loaded: dict[str, Any]) -> None:
    # On CPU stock INC builds the 8-bit extra_config entries with its w4a16 path, which refuses them.
    stock = vllm_loaded["stock"]
    assert stock["returncode"] != 0, stock["output_tail"]
    assert "only supports 4-bit quantization, got weight_bits=8" in stock["output_tail"], stock["output_tail"]


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
    manifest = built["manifests"]["tensor" if variant.startswith("tensor") else "block"]
    tau = _tolerance(variant, reference["shared_contribution"], manifest["error_summary"]["rel_fro_max"])
    report = _compare(reference["sequences"], reference["logits"], logits, tau)
    print(f"{variant}: {json.dumps(report)}")
    if not variant.endswith("w8a8"):
        # Activation rounding is not bounded by the weights' eps: the first-order estimate held for weights
        # only (W8A8 measured ~3x over it here, ~4x with real per-tensor FP8 GEMMs on an H200).
        assert report["max_abs_logit_diff"] <= tau, report
    assert report["decided_positions_disagreeing"] == 0, report
    # Near-ties (margin <= 2 * tau) may flip; on this random model they are common, a real one has few.
    assert report["positions_agreeing"] >= 0.9 * report["positions"], report
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
    weight_error = built["manifests"]["block"]["error_summary"]["rel_fro_max"]
    tau = _tolerance("block", reference["shared_contribution"], weight_error)
    report = _compare(reference["sequences"], reference["logits"], logits, tau)
    assert report["max_abs_logit_diff"] > 5 * tau, report


# --------------------------------------------------------------------------------------------------------
# vLLM's real block-FP8 kernel (CPUFp8BlockScaledMMKernel), where the CPU has AMX tiles
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def amx_figures(vllm_loaded: dict[str, Any]) -> Any:
    """Figures of the kernel tests; with SPARKFLEET_FP8_UPDATE_DOC=docs/dense-checkpoint.md they replace its block."""
    figures: dict[str, Any] = {}
    yield figures
    doc = os.environ.get("SPARKFLEET_FP8_UPDATE_DOC")
    if doc and figures:
        figures["driver_s"] = vllm_loaded["driver_s"]
        figures["vllm"] = vllm_loaded["vllm_version"]
        path = REPO_ROOT / doc
        text = path.read_text()
        head, rest = text.split(DOC_BLOCK[0], 1)
        _old, tail = rest.split(DOC_BLOCK[1], 1)
        path.write_text(f"{head}{DOC_BLOCK[0]}\n{_render_figures(figures)}{DOC_BLOCK[1]}{tail}")


def _require_block_kernel(vllm_loaded: dict[str, Any]) -> dict[str, Any]:
    missing = vllm_loaded["block_kernel_missing"]
    if missing:
        pytest.skip(f"vLLM's CPU block-FP8 kernel cannot run: {missing}")
    return vllm_loaded["kernel"]


def _fused_shards(prefix: str) -> tuple[int, tuple[str, ...]]:
    layer, fused = prefix.split(".mlp.shared_expert.")
    return VLLM_LAYERS.index(layer), SHARED_FUSED[fused]


def _layer_matrices(built: dict[str, Any], label: str) -> dict[str, tuple[Any, Any, float]]:
    """Per vLLM layer: the dequantized FP8 matrix, the BF16 source matrix, the manifest's largest shard error."""
    import torch

    dequantized = _shared_from_checkpoint(built[label], with_scales=True)
    source = _tensors(built["varied-base" if label.startswith("varied") else "base"])
    modules = built["manifests"][label]["fp8_modules"]
    out = {}
    for layer in VLLM_LAYERS:
        for fused in SHARED_FUSED:
            prefix = f"{layer}.mlp.shared_expert.{fused}"
            index, shards = _fused_shards(prefix)
            names = [f"layers.{index}.mlp.shared_expert.{shard}" for shard in shards]
            out[prefix] = (
                torch.cat([dequantized[f"model.{name}"] for name in names]),
                torch.cat([source[f"{LANGUAGE_PREFIX}{name}.weight"].float() for name in names]),
                max(modules[f"{LANGUAGE_PREFIX}{name}"]["rel_error"]["rel_fro"] for name in names),
            )
    return out


def _layer_check(x: Any, y: Any, dequantized: Any, source: Any, eps: float) -> dict[str, Any]:
    """The kernel's output y = layer(x) against the dequantized-reference and the BF16-source products.

    Reference (elementwise, rigorous): the kernel is W8A16, x stays BF16. Per output element it may round
    each scaled weight to BF16 (<= u relative), accumulates K products in float32 (<= gamma_K = K*u32/(1 -
    K*u32) of sum |x||w|) and rounds the result to BF16 (<= u of |y|); |y| <= sum |x||w|, so
    |y - x.W_deq^T| <= c * (|x|.|W_deq|^T) with c = u + (1 + u)(u + gamma_K). Source (first order, as the
    greedy tolerance): for isotropic inputs E||x dW^T||^2 = ||x||^2 ||dW||_F^2 / K, so FP8 weights move the
    output by eps (the manifest's relative Frobenius error, largest over the fused shards) relative; the
    kernel's arithmetic adds at most 2u + gamma_K: tolerance eps + 2u + gamma_K on the relative Frobenius error.
    """
    import torch

    k = x.shape[-1]
    gamma = k * F32_U / (1 - k * F32_U)
    c = BF16_U + (1 + BF16_U) * (BF16_U + gamma)
    x64, y64 = x.double(), y.double()
    reference = x64 @ dequantized.double().t()
    source_out = x64 @ source.double().t()
    bound = c * (x64.abs() @ dequantized.double().abs().t())
    error = (y64 - reference).abs()
    ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, torch.inf, 0.0))
    rel_source = float((y64 - source_out).norm() / source_out.norm())
    tau_source = eps + 2 * BF16_U + gamma
    return {
        "rel_fro_vs_reference": float((y64 - reference).norm() / reference.norm()),
        "max_error_over_bound_vs_reference": float(ratio.max()),
        "within_bound_vs_reference": bool((error <= bound).all()),
        "rel_fro_vs_bf16_source": rel_source,
        "rel_fro_dequantized_vs_bf16_source": float((reference - source_out).norm() / source_out.norm()),
        "weight_eps": eps,
        "tau_vs_bf16_source": tau_source,
        "within_tau_vs_bf16_source": rel_source <= tau_source,
    }


def test_block_output_loads_into_real_block_fp8_layers(vllm_loaded: dict[str, Any]) -> None:
    _require_block_kernel(vllm_loaded)
    for label in ("block", "varied-block"):
        loaded = vllm_loaded[label]["loaded"]
        assert sorted(loaded) == sorted(vllm_loaded[label]["fp8_decisions"]), label
        for prefix, entry in loaded.items():
            assert entry["method"] == "Fp8LinearMethod", (label, prefix)
            assert entry["weight_dtype"] == "torch.float8_e4m3fn", (label, prefix)
            assert entry["scale_param"] == "weight_scale_inv", (label, prefix)
            assert entry["weight_bytes_equal_checkpoint"], (label, prefix)
            assert entry["scales_equal_checkpoint"], (label, prefix)
        assert set(vllm_loaded[label]["kernels"].values()) == {"CPUFp8BlockScaledMMKernel"}, label
        assert vllm_loaded[label]["int4_methods"] == ["AutoGPTQLinearMethod"]


@pytest.mark.parametrize("label", ["block", "varied-block"])
def test_real_block_fp8_kernel_matches_reference_and_bf16_source(
    label: str, vllm_loaded: dict[str, Any], built: dict[str, Any], amx_figures: dict[str, Any]
) -> None:
    kernel = _require_block_kernel(vllm_loaded)
    matrices = _layer_matrices(built, label)
    checks = {}
    for prefix, y in kernel["outputs"][label].items():
        dequantized, source, eps = matrices[prefix]
        checks[prefix] = _layer_check(kernel["inputs"][prefix], y, dequantized, source, eps)
    print(f"{label}: {json.dumps(checks)}")
    amx_figures.setdefault("layers", {})[label] = checks
    assert len(checks) == len(VLLM_LAYERS) * len(SHARED_FUSED)
    for prefix, check in checks.items():
        assert check["within_bound_vs_reference"], (prefix, check)
        assert check["within_tau_vs_bf16_source"], (prefix, check)


@pytest.mark.parametrize(
    "control,label", [("varied-block scales transposed", "varied-block"), ("block scales left out", "block")]
)
def test_real_block_fp8_kernel_negative_controls_fail_the_checks(
    control: str, label: str, vllm_loaded: dict[str, Any], built: dict[str, Any], amx_figures: dict[str, Any]
) -> None:
    """The same kernel with each shard's scale grid transposed, or with no scales: both checks must fail."""
    kernel = _require_block_kernel(vllm_loaded)
    matrices = _layer_matrices(built, label)
    checks = {
        prefix: _layer_check(kernel["inputs"][prefix], y, *matrices[prefix])
        for prefix, y in kernel["controls"][control].items()
    }
    print(f"{control}: {json.dumps(checks)}")
    amx_figures.setdefault("controls", {})[control] = checks
    for prefix, check in checks.items():
        assert not check["within_bound_vs_reference"], (prefix, check)
        assert not check["within_tau_vs_bf16_source"], (prefix, check)


def test_greedy_tokens_through_the_real_block_fp8_kernel(
    vllm_loaded: dict[str, Any], reference: dict[str, Any], built: dict[str, Any], amx_figures: dict[str, Any]
) -> None:
    """The reference model with its shared-expert projections computed by the loaded vLLM block-FP8 layers.

    Tolerance as for the weight-only variants, with the kernel's arithmetic added per matrix: the hidden
    state rounded to BF16 on the way in, the scaled weight and the output rounded to BF16 (3u), gamma_K for
    float32 accumulation: tau = 3 * (eps + 3u + gamma_K) * S. Against the dequantized-reference model (same
    weights, float32) only the arithmetic remains: 3 * (3u + gamma_K) * S.
    """
    import torch

    kernel = _require_block_kernel(vllm_loaded)
    sequences, source = reference["sequences"], reference["logits"]
    driver_source = kernel["logits"]["source"]
    # The driver rebuilt the same reference model: its plain logits are the pytest process's.
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(driver_source, source, strict=True))
    through_kernel = kernel["logits"]["kernel"]
    model = reference["model"]
    try:
        _set_shared(model, _shared_from_checkpoint(built["block"], with_scales=True), fake_quant_activations=False)
        dequantized = _logits(model, sequences)
    finally:
        _set_shared(model, reference["source_shared"], fake_quant_activations=False)
    k = max(int(w.shape[1]) for w in reference["source_shared"].values())
    gamma = k * F32_U / (1 - k * F32_U)
    contribution = reference["shared_contribution"]
    eps = built["manifests"]["block"]["error_summary"]["rel_fro_max"]
    tau = 3 * (eps + 3 * BF16_U + gamma) * contribution
    report = _compare(sequences, source, through_kernel, tau)
    tau_reference = 3 * (3 * BF16_U + gamma) * contribution
    report["max_abs_logit_diff_vs_dequantized_reference"] = max(
        float((a - b).abs().max()) for a, b in zip(through_kernel, dequantized, strict=True)
    )
    report["tau_vs_dequantized_reference"] = tau_reference
    report["positions_argmax_equal_to_dequantized_reference"] = sum(
        int((a.argmax(-1) == b.argmax(-1))[PROMPT_TOKENS - 1 : -1].sum())
        for a, b in zip(through_kernel, dequantized, strict=True)
    )
    report["positions_agreeing_dequantized_reference"] = _compare(sequences, source, dequantized, tau)[
        "positions_agreeing"
    ]
    report["shared_contribution"] = contribution
    report["weight_eps"] = eps
    print(f"greedy through the kernel: {json.dumps(report)}")
    amx_figures["greedy"] = report
    assert report["max_abs_logit_diff"] <= tau, report
    assert report["max_abs_logit_diff_vs_dequantized_reference"] <= tau_reference, report
    assert report["decided_positions_disagreeing"] == 0, report
    assert report["positions_agreeing"] >= 0.9 * report["positions"], report


def _render_figures(figures: dict[str, Any]) -> str:
    import platform

    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    test = Path(__file__).relative_to(REPO_ROOT)
    lines = [
        f"Written by `SPARKFLEET_FP8_UPDATE_DOC=docs/dense-checkpoint.md pytest {test}` on {cpu}"
        f" ({os.cpu_count()} CPUs), torch {torch.__version__}, vLLM {figures['vllm']}; the vLLM driver"
        f" subprocess took {figures['driver_s']:.0f} s.",
        "",
        "| build / control | layer | (a) rel. error vs dequantized ref. | (a) max error / bound"
        " | (b) rel. error vs BF16 | (b) tau | dequantized ref. vs BF16 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = [*figures.get("layers", {}).items(), *figures.get("controls", {}).items()]
    for name, checks in rows:
        for prefix, check in checks.items():
            lines.append(
                f"| {name} | {prefix.removeprefix('language_model.model.')} | {check['rel_fro_vs_reference']:.2e}"
                f" | {check['max_error_over_bound_vs_reference']:.3g} | {check['rel_fro_vs_bf16_source']:.4f}"
                f" | {check['tau_vs_bf16_source']:.4f} | {check['rel_fro_dequantized_vs_bf16_source']:.4f} |"
            )
    greedy = figures.get("greedy")
    if greedy:
        lines += [
            "",
            f"Greedy, shared experts through the kernel ({greedy['positions']} teacher-forced positions of"
            f" {NUM_PROMPTS} prompts): {greedy['positions_agreeing']} agree with the BF16 source's tokens (the"
            f" float32 dequantized-reference model: {greedy['positions_agreeing_dequantized_reference']});"
            f" {greedy['decided_positions']} positions are decided (margin > 2 tau), of those"
            f" {greedy['decided_positions_disagreeing']} disagree; {greedy['prompts_generating_identical_tokens']}"
            f"/{NUM_PROMPTS} prompts generate identical tokens. Max logit change against the source"
            f" {greedy['max_abs_logit_diff']:.4f} (tau {greedy['tau']:.4f}; S {greedy['shared_contribution']:.4f},"
            f" eps {greedy['weight_eps']:.4f}), against the dequantized-reference model"
            f" {greedy['max_abs_logit_diff_vs_dequantized_reference']:.4f} (tau"
            f" {greedy['tau_vs_dequantized_reference']:.4f}); argmax equal to that model's on"
            f" {greedy['positions_argmax_equal_to_dequantized_reference']}/{greedy['positions']} positions.",
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------
# The reference forward (transformers, float32)
# --------------------------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, Any]:
    from sparkfleet.build import fp8_quant
    from sparkfleet.build.checkpoint import read_layout
    from sparkfleet.build.safetensors_stream import read_tensor_bytes

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

    raw = _tensors(path)
    shared = {}
    for name in _shared_modules_names(raw):
        weight = raw[f"{LANGUAGE_PREFIX}{name}.weight"]
        scale = raw.get(f"{LANGUAGE_PREFIX}{name}.weight_scale_inv", raw.get(f"{LANGUAGE_PREFIX}{name}.weight_scale"))
        matrix = weight.to(torch.float32)
        if with_scales and scale.numel() == 1:
            matrix = matrix * scale.reshape(())
        elif with_scales:  # block by block, written out here rather than through fp8_quant.dequantize
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    matrix[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale[i, j]
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


def _tolerance(variant: str, shared_contribution: float, weight_error: float) -> float:
    """First-order logit change: the weights' relative FP8 error on each of the shared expert's 3 matrices.

    `weight_error` is the largest per-tensor relative error the builder's manifest reports (measured on
    weights, not on logits). For W8A8 the same estimate counts each matrix's rounded input too (6 roundings);
    it is used only to pick the decided positions, since activation rounding exceeds it.
    """
    roundings = 6 if variant.endswith("w8a8") else 3
    return roundings * weight_error * shared_contribution


def _compare(sequences: list[Any], source: list[Any], fp8: list[Any], tau: float) -> dict[str, Any]:
    """Teacher-forced comparison on the source's greedy sequences (exact for free-running greedy decoding)."""
    positions = decided = disagreeing = agreeing = identical = 0
    max_diff = 0.0
    for sequence, src, hyp in zip(sequences, source, fp8, strict=True):
        max_diff = max(max_diff, float((hyp - src).abs().max()))
        all_agree = True
        for step in range(PROMPT_TOKENS - 1, len(sequence) - 1):
            token = int(sequence[step + 1])
            top = src[step].topk(2).values
            agrees = int(hyp[step].argmax()) == token
            positions += 1
            agreeing += agrees
            all_agree &= agrees
            if float(top[0] - top[1]) > 2 * tau:
                decided += 1
                disagreeing += not agrees
        identical += all_agree
    return {
        "positions": positions,
        "positions_agreeing": agreeing,
        "decided_positions": decided,
        "decided_positions_disagreeing": disagreeing,
        "prompts_generating_identical_tokens": identical,
        "max_abs_logit_diff": max_diff,
        "tau": tau,
    }


# --------------------------------------------------------------------------------------------------------
# The driver (a subprocess with the patched vllm tree first on PYTHONPATH)
# --------------------------------------------------------------------------------------------------------


def _block_kernel_missing() -> str | None:
    """None where vLLM's CPU block-FP8 kernel can run in this process, else what is missing (one line)."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return "this CPU has no AMX tiles (amx_tile), which CPUFp8BlockScaledMMKernel needs"
    # Linux keeps AMX tile data off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM); an AMX
    # instruction before that is a SIGILL (rc -4). oneDNN's brgemm, under this kernel, asked by itself when
    # tried here, but whether some other library issues the first AMX instruction is not ours to rely on.
    if not torch.cpu._init_amx():
        return "the OS refused this process AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    from vllm.model_executor.kernels.linear import CPUFp8BlockScaledMMKernel

    supported, reason = CPUFp8BlockScaledMMKernel.is_supported()
    return None if supported else f"CPUFp8BlockScaledMMKernel: {reason}"


def _driver(out: Path, tensor_ckpt: str, block_ckpt: str, varied_ckpt: str, base: str, sequences: str) -> None:
    """Per-tensor: load. Block: load and run vLLM's real block-FP8 kernel where it exists (else: dispatch only)."""
    import tempfile

    import torch
    from vllm.config import set_current_vllm_config

    from tests.vllm.test_inc_hybrid_fp8 import INT4_PREFIXES, _engine_config
    from tests.vllm.vllm_trees import init_one_process_world

    missing = _block_kernel_missing()
    import vllm

    report: dict[str, Any] = {"block_kernel_missing": missing, "vllm_version": vllm.__version__}
    matrices: dict[str, list[Any]] = {}
    kernel: dict[str, Any] = {"outputs": {}, "controls": {}}
    runs = [("tensor", tensor_ckpt, "full"), ("block", block_ckpt, "decide" if missing else "full")]
    if not missing:
        runs.append(("varied-block", varied_ckpt, "full"))
    for label, ckpt, mode in runs:
        vllm_config = _engine_config(ckpt)
        if label == "tensor":
            with set_current_vllm_config(vllm_config):
                init_one_process_world(tempfile.mkdtemp())
        entry, model = _driver_load(vllm_config, ckpt, mode, INT4_PREFIXES)
        if label == "tensor":
            modules = dict(model.named_modules())
            for prefix in entry["loaded"]:
                module = modules[prefix]
                rows = torch.split(module.weight.data.to(torch.float32), list(module.logical_widths))
                # The matrix the loaded FP8 parameters stand for: each logical shard times its own scale.
                matrices[prefix] = [part * module.weight_scale.data[i] for i, part in enumerate(rows)]
        elif mode == "full":
            entry["kernels"] = _driver_run_block_kernel(model, vllm_config, label, kernel)
            if label == "block":
                kernel["logits"] = _driver_kernel_logits(model, vllm_config, base, sequences)
        report[label] = entry
    torch.save(matrices, out / "shared.pt")
    if not missing:
        torch.save(kernel, out / "kernel.pt")
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))


def _driver_load(vllm_config: Any, ckpt: str, mode: str, int4_prefixes: Any) -> tuple[dict[str, Any], Any]:
    """initialize_model, then (mode `full`) the model's load_weights and vLLM's process_weights_after_loading."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from tests.vllm.test_inc_hybrid_fp8 import _build_model, _checkpoint_tensors

    model, decisions = _build_model(vllm_config, mode)
    entry: dict[str, Any] = {
        "fp8_decisions": {
            prefix: {"method": d["method"], "weight_block_size": d["weight_block_size"]}
            for prefix, d in decisions.items()
            if d["method"] == "Fp8LinearMethod"
        },
        "int4_methods": sorted({decisions[prefix]["method"] for prefix in int4_prefixes}),
    }
    if mode != "full":
        return entry, model
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
            scale_name = "weight_scale_inv" if hasattr(module, "weight_scale_inv") else "weight_scale"
            checkpoint_weight = torch.cat([tensors[f"{hf}.{s}.weight"] for s in shards])
            checkpoint_scales = torch.cat([tensors[f"{hf}.{s}.{scale_name}"].reshape(-1) for s in shards])
            loaded[prefix] = {
                "method": type(module.quant_method).__name__,
                "weight_dtype": str(module.weight.dtype),
                "scale_param": scale_name if hasattr(module, scale_name) else None,
                "weight_bytes_equal_checkpoint": bool(
                    module.weight.dtype == torch.float8_e4m3fn
                    and torch.equal(module.weight.data.view(torch.uint8), checkpoint_weight.view(torch.uint8))
                ),
                "scales_equal_checkpoint": bool(
                    torch.equal(getattr(module, scale_name).data.reshape(-1), checkpoint_scales)
                ),
            }
    entry["loaded"] = loaded
    if entry["fp8_decisions"] and all(d["weight_block_size"] for d in entry["fp8_decisions"].values()):
        # vLLM's own post-load step, as DefaultModelLoader runs it: for the block layers the CPU kernel
        # prepacks the FP8 weights (VNNI) for AMX. (The per-tensor path's would call the CPU build's empty
        # scaled_fp8_quant stubs, see test_inc_hybrid_fp8.py.) Layers whose weights were not loaded here
        # process uninitialized memory, which nothing reads.
        with set_current_vllm_config(vllm_config):
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return entry, model


def _driver_run_block_kernel(model: Any, vllm_config: Any, label: str, kernel: dict[str, Any]) -> dict[str, str]:
    """Each loaded block-FP8 shared-expert layer on fixed BF16 inputs, through the layer's own forward."""
    import torch
    from vllm.config import set_current_vllm_config

    modules = dict(model.named_modules())
    generator = torch.Generator().manual_seed(99)
    inputs, outputs, kernels = kernel.setdefault("inputs", {}), {}, {}
    with set_current_vllm_config(vllm_config), torch.no_grad():
        for prefix in sorted(f"{layer}.mlp.shared_expert.{fused}" for layer in VLLM_LAYERS for fused in SHARED_FUSED):
            module = modules[prefix]
            kernels[prefix] = type(module.quant_method.fp8_linear).__name__
            if prefix not in inputs:
                inputs[prefix] = torch.randn(LAYER_TOKENS, module.input_size, generator=generator).to(torch.bfloat16)
            x = inputs[prefix]
            outputs[prefix] = module(x)[0].clone()
            # Negative controls, through the same kernel: each logical shard's scale grid transposed (the
            # varied build, whose blocks differ), or the scales left out (all 1: the FP8 bytes as values).
            scale = module.weight_scale_inv.data
            saved = scale.clone()
            if label == "varied-block":
                rows = [w // 128 for w in module.logical_widths]
                scale.copy_(torch.cat([part.t() for part in torch.split(saved, rows)]))
                kernel["controls"].setdefault("varied-block scales transposed", {})[prefix] = module(x)[0].clone()
            else:
                scale.fill_(1.0)
                kernel["controls"].setdefault("block scales left out", {})[prefix] = module(x)[0].clone()
            scale.copy_(saved)
            assert torch.equal(module(x)[0], outputs[prefix]), f"{prefix}: restoring the scales changed the output"
    kernel["outputs"][label] = outputs
    return kernels


class _KernelLinear:
    """Forward hook: a transformers Linear's output replaced by a loaded vLLM layer's, BF16 in and out."""

    def __init__(self, layer: Any, rows: slice) -> None:
        self.layer, self.rows = layer, rows

    def __call__(self, _module: Any, args: tuple[Any, ...], output: Any) -> Any:
        import torch

        (x,) = args
        with torch.no_grad():
            y = self.layer(x.to(torch.bfloat16).reshape(-1, x.shape[-1]))[0][:, self.rows]
        return y.to(output.dtype).reshape(*x.shape[:-1], -1)


def _driver_kernel_logits(model: Any, vllm_config: Any, base: str, sequences_path: str) -> dict[str, Any]:
    """The reference model's logits on the given sequences, shared experts plain and through the vLLM layers."""
    import torch
    from vllm.config import set_current_vllm_config

    sequences = torch.load(sequences_path)
    reference = _reference_model(Path(base))
    source = _logits(reference, sequences)
    modules = dict(model.named_modules())
    handles = []
    for index, layer in enumerate(VLLM_LAYERS):
        gate_up = modules[f"{layer}.mlp.shared_expert.gate_up_proj"]
        down = modules[f"{layer}.mlp.shared_expert.down_proj"]
        width = gate_up.logical_widths[0]
        shared = reference.model.layers[index].mlp.shared_expert
        for linear, vllm_layer, rows in (
            (shared.gate_proj, gate_up, slice(0, width)),
            (shared.up_proj, gate_up, slice(width, None)),
            (shared.down_proj, down, slice(None)),
        ):
            handles.append(linear.register_forward_hook(_KernelLinear(vllm_layer, rows)))
    try:
        with set_current_vllm_config(vllm_config):
            through_kernel = _logits(reference, sequences)
    finally:
        for handle in handles:
            handle.remove()
    return {"source": source, "kernel": through_kernel}


# --------------------------------------------------------------------------------------------------------
# On a CUDA machine (no vLLM needed): the shared experts through real FP8 GEMMs
# --------------------------------------------------------------------------------------------------------


class _Fp8Linear:
    """Forward hook replacing a Linear's output with an FP8 GEMM (torch._scaled_mm), as vLLM computes it.

    `tensor`: per-tensor weight scale, activations quantized per tensor, dynamically (vLLM's Fp8LinearMethod
    for per-tensor checkpoints with dynamic activations). `block`: 128x128 weight blocks, activations per
    token and 128-wide group (vLLM's block path).
    """

    def __init__(self, weight_fp8: Any, scale: Any, form: str) -> None:
        self.weight_fp8, self.scale, self.form = weight_fp8, scale, form

    def __call__(self, _module: Any, args: tuple[Any, ...], _output: Any) -> Any:
        import torch

        (x,) = args
        flat = x.reshape(-1, x.shape[-1]).float()
        rows = flat.shape[0]
        padded = torch.zeros(-(-rows // 16) * 16, flat.shape[1], device=flat.device)
        padded[:rows] = flat
        if self.form == "tensor":
            x_scale = (padded.abs().max() / 448.0).clamp(min=1e-12)
            x_fp8 = (padded / x_scale).to(torch.float8_e4m3fn)
            out = torch._scaled_mm(
                x_fp8, self.weight_fp8.t(), scale_a=x_scale.reshape(()), scale_b=self.scale.reshape(()),
                out_dtype=torch.bfloat16,
            )  # fmt: skip
        else:
            groups = padded.reshape(padded.shape[0], -1, 128)
            x_scale = (groups.abs().amax(-1) / 448.0).clamp(min=1e-12)
            x_fp8 = (groups / x_scale[..., None]).reshape(padded.shape).to(torch.float8_e4m3fn)
            out = _block_scaled_mm(x_fp8, x_scale, self.weight_fp8, self.scale)
        return out[:rows].float().reshape(*x.shape[:-1], -1)


_BLOCK_LAYOUT: list[Any] = []  # the scale layouts torch._scaled_mm accepted, found by _probe_block_layout


def _block_scaled_mm(x_fp8: Any, x_scale: Any, weight_fp8: Any, weight_scale: Any) -> Any:
    import torch

    layout_a, layout_b = _BLOCK_LAYOUT[0]
    return torch._scaled_mm(
        x_fp8, weight_fp8.t(), scale_a=layout_a(x_scale), scale_b=layout_b(weight_scale), out_dtype=torch.bfloat16
    )


def _probe_block_layout() -> str:
    """Which scale layouts torch._scaled_mm takes for 1x128 x 128x128 blockwise scaling, checked numerically."""
    import torch

    from sparkfleet.build import fp8_quant

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 256, generator=generator) * _block_factors(32, 256)
    w = torch.randn(384, 256, generator=generator) * _block_factors(384, 256)
    w_fp8, w_scale = fp8_quant.quantize(w, "block")
    groups = x.reshape(32, -1, 128)
    x_scale = groups.abs().amax(-1) / 448.0
    x_fp8 = (groups / x_scale[..., None]).reshape(32, 256).to(torch.float8_e4m3fn)
    expected = (x_fp8.float().reshape(32, -1, 128) * x_scale[..., None]).reshape(32, 256) @ fp8_quant.dequantize(
        w_fp8, w_scale
    ).t()
    layouts = {
        "a row-major": lambda s: s.contiguous(),
        "a col-major": lambda s: s.t().contiguous().t(),
    }
    layouts_b = {
        "b [N/128,K/128] row-major": lambda s: s.contiguous(),
        "b [N/128,K/128] col-major": lambda s: s.t().contiguous().t(),
        "b [K/128,N/128] row-major": lambda s: s.t().contiguous(),
    }
    tried = []
    for name_a, layout_a in layouts.items():
        for name_b, layout_b in layouts_b.items():
            try:
                got = torch._scaled_mm(
                    x_fp8.cuda(), w_fp8.cuda().t(), scale_a=layout_a(x_scale.cuda()),
                    scale_b=layout_b(w_scale.cuda()), out_dtype=torch.bfloat16,
                ).float().cpu()  # fmt: skip
            except Exception as error:  # noqa: BLE001 - recorded, next layout
                tried.append(f"{name_a}, {name_b}: {type(error).__name__}: {str(error)[:200]}")
                continue
            rel = float((got - expected).norm() / expected.norm())
            tried.append(f"{name_a}, {name_b}: rel error {rel:.2e}")
            if rel < 2e-2:
                _BLOCK_LAYOUT[:] = [(layout_a, layout_b)]
                return f"{name_a}, {name_b} (rel error {rel:.2e})"
    raise RuntimeError("no blockwise layout worked: " + " | ".join(tried))


def _gpu_fp8_gemm(out: Path) -> None:
    """Greedy tokens with the shared experts computed by real FP8 GEMMs on a GPU; writes gpu_fp8_gemm.json."""
    import tempfile

    import torch

    from sparkfleet.build.checkpoint import BuildOptions, build_hybrid
    from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint

    root = Path(tempfile.mkdtemp())
    base = write_hybrid_fp8_checkpoint(root / "base", fp8_scales="none").path
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = _reference_model(base).cuda()
    generator = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size - 4
    prompts = [torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator) for _ in range(NUM_PROMPTS)]
    with torch.no_grad():
        sequences = [
            model.generate(p[None].cuda(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0]
            for p in prompts
        ]  # fmt: skip
    source_logits = _logits(model, sequences)
    source_shared = _shared_state(model)
    _set_shared(model, {n: torch.zeros_like(w) for n, w in source_shared.items()}, fake_quant_activations=False)
    without = _logits(model, sequences)
    _set_shared(model, source_shared, fake_quant_activations=False)
    contribution = max(float((a - b).abs().max()) for a, b in zip(source_logits, without, strict=True))
    modules = _shared_modules(model)
    try:
        report["block_layout"] = _probe_block_layout()
    except Exception as error:  # noqa: BLE001 - the report says what this torch/GPU cannot do
        report["block_layout"] = f"{type(error).__name__}: {error}"[:3000]
    for form in ("tensor", "block"):
        manifest = build_hybrid(BuildOptions(base=base, out=root / form, scales=form), log=lambda _line: None)
        raw = _tensors(root / form)
        weights = {}
        for name in modules:
            hf = f"{LANGUAGE_PREFIX}{name.removeprefix('model.')}"
            scale_name = "weight_scale_inv" if form == "block" else "weight_scale"
            weights[name] = (raw[f"{hf}.weight"].cuda(), raw[f"{hf}.{scale_name}"].float().cuda())
        if form == "tensor":
            # vLLM's per-tensor path requantizes the fused gate_up_proj to the larger of its two scales.
            for name in [n for n in modules if n.endswith("gate_proj")]:
                up = name.replace("gate_proj", "up_proj")
                shared_scale = torch.maximum(weights[name][1], weights[up][1])
                for shard in (name, up):
                    w, s = weights[shard]
                    requantized = (w.float() * s / shared_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                    weights[shard] = (requantized, shared_scale)
        handles = [module.register_forward_hook(_Fp8Linear(*weights[name], form)) for name, module in modules.items()]
        try:
            logits = _logits(model, sequences)
            weight_error = manifest["error_summary"]["rel_fro_max"]
            tau = _tolerance(f"{form}-w8a8", contribution, weight_error)
            compared = _compare(
                [s.cpu() for s in sequences], [x.cpu() for x in source_logits], [x.cpu() for x in logits], tau
            )
            report[form] = {**compared, "shared_contribution": contribution}
        except Exception as error:  # noqa: BLE001 - the report says what this torch/GPU cannot do
            report[form] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        finally:
            for handle in handles:
                handle.remove()
    (out / "gpu_fp8_gemm.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--gpu":
        _gpu_fp8_gemm(Path(sys.argv[2]))
    else:
        _driver(Path(sys.argv[1]), *sys.argv[2:7])
