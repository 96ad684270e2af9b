"""Int8 (w8a16) lm-head logits with an exact greedy argmax, for vLLM's ``ParallelLMHead``.

This file is shipped twice, byte for byte: as ``sparkfleet/int8_lmhead.py`` (tests, benchmark) and,
through ``files/patches/vllm-0.23.0/0003-int8-lm-head.patch``, as
``vllm/model_executor/layers/quantization/utils/int8_lmhead.py`` inside the patched wheel. It imports
only torch and (optionally) triton, never vllm, so both copies behave the same.

What it does
------------
The vocab projection of Qwen3.5-122B-A10B (248,320 x 3,072, 1.5 GB in bf16) is the largest dense read
of every decode step. ``quantize_lm_head_weight`` keeps a per-row symmetric int8 copy of it
(``q = round(w / s)``, ``s = max|w| / 127``) next to the bf16 weight, which stays in place because the
DFlash drafter shares the target's ``lm_head`` module and compares its ``.weight``.
``int8_lm_head_logits`` then computes the logits of a batch of 1..64 hidden states with one Triton
kernel that streams the int8 weight once (half the bytes of the bf16 GEMM; stored in the kernel's tile
order so each program reads one contiguous run) and a second, small kernel that makes the greedy
choice exact. The kernel configs were chosen by sweeps on an H200 (tests/gpu/results); the Spark's
GB10 (sm_121, 273 GB/s) has not been measured: re-run the sweep there.

The exactness guarantee
-----------------------
Let ``z[b, v] = sum_k W[v, k] * x[b, k]`` be the exact logits of the bf16 weight and ``R(.)`` rounding
to the output dtype (the dtype of ``x``, as vLLM's bf16 path returns). The stock greedy token is the
first index of the maximum of ``R(z[b, :])``. The int8 logits ``zq`` differ from ``z`` by at most
``delta[b, v] = min(emax[v] * |x_b|_1, e2[v] * |x_b|_2) + (fp32 accumulation bound)``, where ``emax``
and ``e2`` are the max-abs and L2 norm of the row's quantization error ``w - s * q`` (stored per row,
rounded up). The first kernel also writes, per (token, 128-row block), one int32 key from a single
integer max: the block's valid rows' unrounded fp32 int8 logits in an order-preserving integer form,
their low 7 bits replaced by the row's position. The key's top bits give an upper bound ``zb`` of the
block's largest int8 logit (low bits set) and its low bits a row ``r*`` whose int8 logit is within 128
fp32 ulps of that largest. The per-block maxima of ``emax``, ``e2`` and ``s`` are made at load time
(``block_bound_stats``). The second kernel (launched with programmatic dependent launch on sm_90+, so
its prologue overlaps the first kernel's last wave), per token, in programs that each own every P-th
block:

* takes the row ``r*`` of the largest key and computes its exact logit in fp32 from the bf16
  weight; minus the fp32 summation bound ``gamma_(K+2) * sum |w_k x_k|`` that is a proven lower bound
  ``LB <= z[r*] <= max(z)`` (any row's exact logit is), and ``T = LB - 2 ulp(LB)`` in the output
  dtype. (The previous design used
  ``LB = max(zq - delta)``, about one bound lower: a window of twice the bound instead of once, which
  on crowded random logits held 3 to 600 tokens per row; tests/gpu/results.)
* skips every block whose bound (``zb`` plus one output ulp, plus ``delta`` evaluated with the block's
  largest ``emax``, ``e2`` and ``s``) stays below ``T``; in the other blocks it recomputes exactly (bf16
  weight, fp32 accumulation) every valid row whose own ``R(zq) + delta`` (with margins) reaches ``T``.

Then:

* every token whose rounded exact logit can equal the rounded maximum has ``z >= T``, so its block and
  row pass the tests: all tied maxima are present with exact values;
* every other token keeps its int8 logit, and ``R(zq) < R(LB) <= R(max z)``: it cannot win.

The margin of 2 output ulps is one ulp more than the rounding argument needs; the spare ulp covers the
fp32 rounding of the bound arithmetic itself (a few fp32 ulps). Vocab-padding rows (``num_valid_rows``)
never set ``LB`` and are never re-scored.

So the returned logits' argmax (first index on ties) equals the argmax of ``R(z)``. The one residue:
the candidates' exact logits are summed in fp32 in a different order than cuBLAS; if cuBLAS's own
fp32 rounding error pushes a value across a bf16 rounding boundary *and* that creates or breaks a tie
at the top, the two paths can disagree (the reference itself is then order-dependent).

Flat logits: a bounded cost
---------------------------
A row with many near-ties (an all-zero hidden state ties every logit) would make the re-scoring
recompute thousands of rows, each once per token: up to 17x the bf16 GEMM. Two kernels around the
others bound that:

* before the int8 kernel, a probe (``_probe_kernel``, ``_probe_decide_kernel``) computes the exact
  logit of every ``PROBE_STRIDE``-th row; its maximum minus its fp32 summation bound is a second lower
  bound ``LB0`` of the row's maximum (the re-scoring kernel takes the larger), and a token for which
  ``FLAT_SAMPLE_SHARE`` of the sampled rows could be candidates (exact logit plus twice its int8 bound
  reaches ``LB0``), or ``DENSE_SAMPLE_SHARE`` within half a bound of it (a tied top), is flat. A
  batch with a flat token skips the int8 and re-scoring kernels (each reads the flags and returns)
  and ``_bf16_blocks_kernel`` computes every logit from the bf16 weight in fp32 (R(z) up to fp32
  summation order, as the GEMM);
* a re-scoring program re-scores at most ``RESCORE_ROW_BUDGET`` candidate rows; the candidate blocks
  it cannot afford are marked, and ``_bf16_blocks_kernel`` recomputes them whole for every token of
  the batch (every one of their rows exact, which keeps the argument above: exact values are
  always allowed).

The probe decides on the device at every call (a CUDA graph replays the decision, not its outcome).
Its cost on non-flat logits is one small read (the sampled rows) and two kernel launches; an input
whose near-ties avoid every sampled row (a weight built for it) is still exact, at the cost of the
int8 pass plus the bf16 recomputation of its candidate blocks.

Non-greedy sampling
-------------------
Tokens that were not recomputed carry int8 logits, off by at most ``delta`` (typically a few
hundredths of a logit, bounded per token as above), so sampled distributions and logprobs are close
to, not equal to, the bf16 ones; the recomputed tokens (the top, within one bound) are exact.

Enabling
--------
The patched vLLM replaces the lm head's ``UnquantizedEmbeddingMethod`` by an int8 one only when
``VLLM_SPARKFLEET_INT8_LMHEAD=1`` (the ``dense`` profile sets it; other profiles are untouched; the
patch also registers the name in ``vllm/envs.py``, which warns about ``VLLM_*`` variables it does
not know). The int8 path runs on CUDA, and on CPU tensors only under the
Triton interpreter (``TRITON_INTERPRET=1``, for tests); elsewhere, and for batches above
``INT8_LMHEAD_MAX_BATCH`` tokens, the bf16 matmul runs as before.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

try:  # the non-kernel parts (quantization, bounds, config) work without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

INT8_LMHEAD_ENV = "VLLM_SPARKFLEET_INT8_LMHEAD"
# Largest number of tokens whose logits go through the int8 kernel in one call. Decode and
# speculative verify (n=12 drafts + 1, times --max-num-seqs 3) stay below it; larger batches (prefill
# with prompt logprobs) are compute-bound and keep the bf16 GEMM.
INT8_LMHEAD_MAX_BATCH = 64
# Rows quantized at a time, to bound the temporary float64 memory of quantization (~400 MB).
QUANTIZE_CHUNK_ROWS = 16384
# Programs per batch row in the exact re-scoring kernel (RESCORE_PROGRAMS // batch, within limits).
RESCORE_PROGRAMS = 1024
RESCORE_MIN_PROGRAMS_PER_ROW = 32
RESCORE_MAX_PROGRAMS_PER_ROW = 128
# Candidate blocks a re-scoring program tests at once, candidate rows it re-scores at once, its warps.
RESCORE_GROUP = 4
RESCORE_SLOTS = 2
RESCORE_NUM_WARPS = 4
# Hidden elements per chunk of the re-scoring kernel's dot products (the chunks are unrolled), and an
# optional register cap for it (0: the compiler's choice).
RESCORE_CHUNK_K = 1024
RESCORE_MAXNREG = 0
# Per-program record of the re-scoring kernel's trace (int8_lm_head_logits(trace=...)): SM id;
# globaltimer ns at start, after the wait for the logits kernel, at the end; SM clock at start, after
# the wait, once the threshold is known, at the end; candidate blocks; rows re-scored.
TRACE_FIELDS = 10
# Launch the re-scoring kernel with programmatic dependent launch where the device has it (sm_90+).
USE_PDL = True
# The flatness probe: the exact logit of every PROBE_STRIDE-th row (one per 128-row block on the
# 122B's vocab: 1,940 rows, 12 MB of the bf16 weight) before the int8 kernel. A batch in which some
# token has at least FLAT_SAMPLE_SHARE of the sampled rows (and FLAT_MIN_SAMPLES) within reach of the
# sample's maximum has so many near-ties that re-scoring them would cost more than the bf16 GEMM: the
# int8 and re-scoring kernels then do nothing and the bf16 kernel computes every logit exactly.
PROBE_STRIDE = 128
PROBE_ROWS = 16  # sampled rows per probe program (tl.dot needs >= 16)
FLAT_SAMPLE_SHARE = 1 / 8
# ... or at least DENSE_SAMPLE_SHARE of them within half a bound of it (a tied top; random logits on the
# H200 bench reach 1/64 within two bounds, far fewer within half a bound).
DENSE_SAMPLE_SHARE = 1 / 160
FLAT_MIN_SAMPLES = 8
# Candidate rows one re-scoring program re-scores at most; candidate blocks beyond that budget are
# recomputed whole, from the bf16 weight, by the bf16 kernel (one streaming read for every token of the
# batch, where re-scoring reads a row once per token). Bounds the re-scoring kernel's time.
RESCORE_ROW_BUDGET = 128
# Programs per SM of the bf16 kernel (persistent: with nothing to recompute, every program returns at once).
BF16_PROGRAMS_PER_SM = 2
# Batch entries the flat flags are read as (every kernel reads the flags of all tokens: one masked load).
FLAG_SLOTS = 64
# fp32 accumulation unit roundoff used in the error bound: 2**-23 instead of 2**-24, so the bound
# also holds for accumulators that truncate (tensor cores). The bound charges it to every one of the
# K additions; tensor cores that align a group of 8..16 products to the largest exponent lose at most
# ~16 * 2**-23 per group, i.e. about 2**-23 per product, so the charge stays an upper bound.
ACCUMULATION_UNIT_ROUNDOFF = 2.0**-23
# Twice the relative spacing of the output dtype (2 ulp at |LB|) and an absolute floor near zero.
OUTPUT_MARGIN = {
    torch.bfloat16: (2.0**-6, 2.0**-120),
    torch.float16: (2.0**-9, 2.0**-22),
    torch.float32: (2.0**-22, 2.0**-120),
}


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the int8 logits kernel for one batch-size bucket."""

    block_v: int  # vocab rows per program (also the re-scoring granularity)
    block_b: int  # batch rows per program (tl.dot needs >= 16)
    block_k: int  # hidden elements per loop step
    num_warps: int
    num_stages: int
    convert: int  # int8 -> bf16: 0 plain cast; 1 byte-permute + fp32 magic number (CUDA, bf16 only)
    w_is_a: int  # 1: weight tile is the dot's A operand; 0: the activations are
    programs_per_sm: int = 0  # > 0: persistent grid of this many programs per SM; 0: one per block
    tiled: int = 0  # 1: the int8 weight is stored in this config's tile order
    evict_first: int = 0  # 1: weight loads marked evict-first (streamed once, keep L2 for the rest)


# Chosen from the autotune sweep in tests/gpu/bench_int8_lmhead.py (tests/gpu/results/*.json) on an
# H200; keyed by the largest batch of the bucket.
KERNEL_CONFIGS: dict[int, KernelConfig] = {
    16: KernelConfig(128, 16, 128, num_warps=4, num_stages=3, convert=0, w_is_a=0, tiled=1, evict_first=1),
    32: KernelConfig(128, 32, 128, num_warps=4, num_stages=3, convert=0, w_is_a=0, tiled=1, evict_first=1),
    64: KernelConfig(128, 64, 128, num_warps=4, num_stages=3, convert=0, w_is_a=0, tiled=1, evict_first=1),
}


# The bf16 kernel (exact logits of a flat batch or of spilled blocks): the int8 kernel's tile walk on the
# bf16 weight, row-major (block_v is the int8 config's, so a spilled block is the same rows).
BF16_KERNEL_CONFIG = KernelConfig(128, 16, 64, num_warps=4, num_stages=3, convert=0, w_is_a=0, evict_first=1)


def int8_lmhead_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``VLLM_SPARKFLEET_INT8_LMHEAD`` asks for the int8 lm head; a bad value raises."""
    value = (os.environ if environ is None else environ).get(INT8_LMHEAD_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{INT8_LMHEAD_ENV}={value!r} is not understood: set it to 1 (int8 lm head) or 0")
    return value == "1"


def int8_lmhead_device_supported(device: torch.device) -> bool:
    """Whether the int8 kernels can run on ``device``: CUDA, or CPU under the Triton interpreter."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and kernels_interpreted()


@dataclass
class Int8LMHeadWeight:
    """The int8 copy of one lm-head weight and the per-row numbers the error bound needs."""

    # q = round(w / scale), |q| <= 127: [V, K] row-major, or with ``tile`` = (BLOCK_V, BLOCK_K) the
    # tiles [V / BLOCK_V, K / BLOCK_K, BLOCK_V, BLOCK_K] (zero-padded), so that each program of the
    # kernel streams one contiguous run of memory.
    qweight: torch.Tensor
    scale: torch.Tensor  # [V] float32
    err_max: torch.Tensor  # [V] float32, >= max_k |w - scale * q| (rounded up)
    err_l2: torch.Tensor  # [V] float32, >= ||w - scale * q||_2 (rounded up)
    source_data_ptr: int  # the bf16 weight this was made from (re-quantize if it is replaced)
    source_shape: tuple[int, ...]
    tile: tuple[int, int] | None = None
    # BLOCK_V -> [3, num_blocks] float32: per block of BLOCK_V rows, the largest err_max, err_l2 and
    # scale (over all rows, padding included: an upper bound for every subset). x-independent, so
    # made here, at load time, not by the kernel (block_bound_stats).
    block_stats: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def rows(self) -> torch.Tensor:
        """The int8 codes as a row-major [V, K] tensor (a copy when tiled)."""
        if self.tile is None:
            return self.qweight
        num_rows, hidden = self.source_shape
        blocks, k_tiles, block_v, block_k = self.qweight.shape
        flat = self.qweight.permute(0, 2, 1, 3).reshape(blocks * block_v, k_tiles * block_k)
        return flat[:num_rows, :hidden]


def _round_up_to_float32(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded towards +inf (bounds must not shrink)."""
    as_float32 = values.to(torch.float32)
    too_small = as_float32.to(torch.float64) < values
    bumped = torch.nextafter(as_float32, torch.full_like(as_float32, math.inf))
    return torch.where(too_small, bumped, as_float32)


def quantize_lm_head_weight(
    weight: torch.Tensor, chunk_rows: int = QUANTIZE_CHUNK_ROWS, tile: tuple[int, int] | None = None
) -> Int8LMHeadWeight:
    """Per-row symmetric int8 quantization of ``weight`` [V, K], with its error bounds, on its device.

    ``tile`` = (BLOCK_V, BLOCK_K) stores the codes in the kernel's tile order (see Int8LMHeadWeight).
    """
    if weight.dim() != 2:
        raise ValueError(f"lm head weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"lm head weight must be floating point, got {weight.dtype}")
    num_rows, hidden = weight.shape
    device = weight.device
    if tile is None:
        qweight = torch.empty((num_rows, hidden), dtype=torch.int8, device=device)
    else:
        block_v, block_k = tile
        if block_v <= 0 or block_k <= 0:
            raise ValueError(f"tile={tile} must be two positive sizes (BLOCK_V, BLOCK_K)")
        chunk_rows = max(block_v, chunk_rows // block_v * block_v)
        k_tiles = -(-hidden // block_k)
        qweight = torch.zeros((-(-num_rows // block_v), k_tiles, block_v, block_k), dtype=torch.int8, device=device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=device)
    err_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    err_l2 = torch.empty(num_rows, dtype=torch.float32, device=device)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_rows))
        w = weight[rows].to(torch.float64)
        amax = w.abs().amax(dim=1)
        row_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.float32)
        s = row_scale.to(torch.float64)[:, None]
        q = torch.clamp(torch.round(w / s), -127, 127)
        err = w - s * q  # exact in float64: w and s*q have < 53 significant bits between them
        if tile is None:
            qweight[rows] = q.to(torch.int8)
        else:
            padded = torch.zeros(
                (-(-q.shape[0] // block_v) * block_v, k_tiles * block_k), dtype=torch.int8, device=device
            )
            padded[: q.shape[0], :hidden] = q.to(torch.int8)
            first = start // block_v
            tiles = padded.view(-1, block_v, k_tiles, block_k).permute(0, 2, 1, 3)
            qweight[first : first + tiles.shape[0]] = tiles
        scale[rows] = row_scale
        err_max[rows] = _round_up_to_float32(err.abs().amax(dim=1))
        # float64 sum of K squares: relative error < K * 2**-53, covered by the 1e-9 inflation.
        err_l2[rows] = _round_up_to_float32(err.square().sum(dim=1).sqrt() * (1.0 + 1e-9))
    packed = Int8LMHeadWeight(
        qweight=qweight,
        scale=scale,
        err_max=err_max,
        err_l2=err_l2,
        source_data_ptr=weight.data_ptr(),
        source_shape=tuple(weight.shape),
        tile=tile,
    )
    for block_v in {c.block_v for c in KERNEL_CONFIGS.values()} | ({tile[0]} if tile else set()):
        block_bound_stats(packed, block_v)
    return packed


def block_bound_stats(packed: Int8LMHeadWeight, block_v: int) -> torch.Tensor:
    """[3, num_blocks] float32: per block of ``block_v`` rows, max err_max, max err_l2, max scale (cached)."""
    stats = packed.block_stats.get(block_v)
    if stats is None:
        num_rows = packed.scale.shape[0]
        num_blocks = -(-num_rows // block_v)
        padded = torch.zeros((3, num_blocks * block_v), dtype=torch.float32, device=packed.scale.device)
        padded[0, :num_rows] = packed.err_max
        padded[1, :num_rows] = packed.err_l2
        padded[2, :num_rows] = packed.scale
        stats = padded.view(3, num_blocks, block_v).amax(dim=2).contiguous()
        packed.block_stats[block_v] = stats
    return stats


def accumulation_error_coefficient(hidden: int) -> float:
    """c such that the fp32 kernel's rounding error on a logit is <= c * scale * |x|_1.

    The products q*x are exact in fp32 (8-bit x 8-bit mantissas); a K-term sum has error at most
    gamma_K = K u / (1 - K u) times sum |q x| <= 127 |x|_1; one more rounding for the scale multiply.
    """
    unit = ACCUMULATION_UNIT_ROUNDOFF
    terms = hidden + 2
    gamma = terms * unit / (1.0 - terms * unit)
    return 127.0 * gamma


def exact_sum_error_coefficient(hidden: int) -> float:
    """gamma such that an fp32 sum of the K exact products w_k * x_k (+ bias) is within gamma * sum |.|.

    bf16 x bf16 products are exact in fp32; any summation order of K + 1 terms errs by at most
    gamma_{K+1} times the sum of their magnitudes (same unit roundoff as the kernel's bound).
    """
    unit = ACCUMULATION_UNIT_ROUNDOFF
    terms = hidden + 2
    return terms * unit / (1.0 - terms * unit)


def norm_slack(hidden: int) -> float:
    """Factor that covers the fp32 rounding of |x|_1, |x|_2 and of the bound arithmetic itself."""
    return 1.0 + 4.0 * (hidden + 8) * ACCUMULATION_UNIT_ROUNDOFF


def int8_logit_error_bound(x: torch.Tensor, packed: Int8LMHeadWeight) -> torch.Tensor:
    """The bound on |int8 logit - exact logit| that the kernel uses, [B, V] in float64 (for tests).

    Same formula as the kernel's epilogue, evaluated in float64 without the final safety factor on
    the sum; the kernel's own fp32 evaluation is at least this large up to ``norm_slack``.
    """
    hidden = x.shape[1]
    xf = x.to(torch.float64)
    x_l1 = xf.abs().sum(dim=1)[:, None]
    x_l2 = xf.square().sum(dim=1).sqrt()[:, None]
    scale = packed.scale.to(torch.float64)[None, :]
    quant = torch.minimum(
        packed.err_max.to(torch.float64)[None, :] * x_l1, packed.err_l2.to(torch.float64)[None, :] * x_l2
    )
    return quant + accumulation_error_coefficient(hidden) * scale * x_l1


def weight_tile() -> tuple[int, int] | None:
    """The tile order the tuned configs want the int8 weight in (one for all buckets), or None."""
    tiles = {(c.block_v, c.block_k) if c.tiled else None for c in KERNEL_CONFIGS.values()}
    if len(tiles) != 1:
        raise ValueError(f"KERNEL_CONFIGS mix weight layouts {sorted(map(str, tiles))}: give every bucket one")
    return tiles.pop()


def select_kernel_config(num_tokens: int) -> KernelConfig:
    """The tuned config of the smallest batch bucket that holds ``num_tokens``."""
    for bucket in sorted(KERNEL_CONFIGS):
        if num_tokens <= bucket:
            return KERNEL_CONFIGS[bucket]
    raise ValueError(
        f"int8 lm head batch of {num_tokens} tokens exceeds the largest bucket {max(KERNEL_CONFIGS)}: "
        "use the bf16 path for it"
    )


if triton is not None:
    try:  # programmatic dependent launch (sm_90+): the re-scoring kernel overlaps the logits kernel's tail
        from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
        from triton.language.extra.cuda import gdc_wait as _gdc_wait

        PDL_IN_TRITON = True
    except ImportError:  # pragma: no cover - older triton: plain stream order
        PDL_IN_TRITON = False

        @triton.jit
        def _gdc_launch_dependents():
            pass

        @triton.jit
        def _gdc_wait():
            pass

    _TRACE_FIELDS = tl.constexpr(TRACE_FIELDS)

    @triton.jit
    def _trace_clock():
        """The SM's cycle counter (tracing only)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _trace_globaltimer():
        """The device-wide nanosecond timer (tracing only)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _trace_smid():
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _to_output_dtype(values, out_ptr, BF16_RN_BY_BITS: tl.constexpr):
        """fp32 -> the output dtype, round to nearest even (the interpreter truncates to bf16)."""
        if BF16_RN_BY_BITS:
            bits = values.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            values = bits.to(tl.float32, bitcast=True)
        return values.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _int8_logits_tile(
        pid_v,
        pid_b,
        x_ptr,
        q_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        block_key_ptr,
        num_tokens,
        num_rows,
        num_valid_rows,
        hidden,
        stride_x,
        stride_q,
        stride_out,
        stride_block,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        W_IS_A: tl.constexpr,
        EVEN_K: tl.constexpr,
        BF16_RN_BY_BITS: tl.constexpr,
        TILED: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
        WITH_BOUNDS: tl.constexpr,
        UNSCALED: tl.constexpr = False,  # q_ptr is the bf16 weight itself: no per-row scale (the bf16 kernel)
    ):
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        offs_k = tl.arange(0, BLOCK_K)
        mask_v = offs_v < num_rows
        mask_b = offs_b < num_tokens
        # Clamp instead of masking the weight loads: the last block re-reads a valid row, the loads
        # stay unpredicated and 16 bytes wide.
        rows = tl.minimum(offs_v, num_rows - 1)
        toks = tl.minimum(offs_b, num_tokens - 1)
        if TILED:
            # stride_q is the number of K tiles here; padding rows/columns hold zeros.
            tile_start = pid_v.to(tl.int64) * stride_q * BLOCK_V * BLOCK_K
            w_ptrs = q_ptr + tile_start + tl.arange(0, BLOCK_V)[:, None] * BLOCK_K + offs_k[None, :]
            w_step = BLOCK_V * BLOCK_K
        else:
            w_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_q + offs_k[None, :]
            w_step = BLOCK_K
        x_ptrs = x_ptr + toks[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        # Token rows past the batch are masked, not clamped: clamped rows all read the last token's
        # lines, and every program hitting the same few L2 lines slowed batch 1 (H200 explore logs).
        x_mask = mask_b[:, None]
        # The epilogue's per-row inputs are loaded before the K loop, which hides their latency.
        if not UNSCALED:
            scale = tl.load(scale_ptr + rows)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows).to(tl.float32)
        if W_IS_A:
            acc = tl.zeros([BLOCK_V, BLOCK_B], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K or TILED:
                if EVICT_FIRST:  # noqa: SIM108 - constexpr branches, kept as statements for Triton
                    w = tl.load(w_ptrs, eviction_policy="evict_first")
                else:
                    w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=((k0 + offs_k) < hidden)[None, :], other=0)
            if EVEN_K:  # noqa: SIM108 - constexpr branches, kept as statements for Triton
                xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
            else:
                xt = tl.load(x_ptrs, mask=x_mask & ((k0 + offs_k) < hidden)[None, :], other=0.0)
            if CONVERT == 1:
                # int8 -> bf16, exact: flip the sign bit (q + 128 as a byte), place the byte in the
                # mantissa of 2**23 (prmt), subtract 2**23 + 128 in fp32, keep the high halves
                # (q has <= 8 significant bits, so the low halves are zero).
                wd = tl.inline_asm_elementwise(
                    asm="""
                    {
                    .reg .b32 u, t0, t1, t2, t3;
                    xor.b32 u, $2, 0x80808080;
                    prmt.b32 t0, u, 0x4B000000, 0x7540;
                    prmt.b32 t1, u, 0x4B000000, 0x7541;
                    prmt.b32 t2, u, 0x4B000000, 0x7542;
                    prmt.b32 t3, u, 0x4B000000, 0x7543;
                    sub.f32 t0, t0, 0f4B000080;
                    sub.f32 t1, t1, 0f4B000080;
                    sub.f32 t2, t2, 0f4B000080;
                    sub.f32 t3, t3, 0f4B000080;
                    prmt.b32 $0, t0, t1, 0x7632;
                    prmt.b32 $1, t2, t3, 0x7632;
                    }
                    """,
                    constraints="=r,=r,r",
                    args=[w],
                    dtype=tl.bfloat16,
                    is_pure=True,
                    pack=4,
                )
            elif CONVERT == 2:
                # Triton interpreter (CPU tests): its bf16 dot is wrong, so both operands go to
                # fp32; the products are exact either way.
                wd = w.to(tl.float32)
                xt = xt.to(tl.float32)
            else:
                wd = w.to(xt.dtype)
            if W_IS_A:
                acc = tl.dot(wd, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wd), acc, input_precision="ieee")
            w_ptrs += w_step
            x_ptrs += BLOCK_K
        if not W_IS_A:
            acc = tl.trans(acc)
        if UNSCALED:  # noqa: SIM108 - constexpr branches, kept as statements for Triton
            z = acc
        else:
            z = acc * scale[:, None]
        if HAS_BIAS:
            z += bias[:, None]
        out_ptrs = out_ptr + offs_b[None, :].to(tl.int64) * stride_out + offs_v[:, None]
        tl.store(out_ptrs, _to_output_dtype(z, out_ptr, BF16_RN_BY_BITS), mask=mask_v[:, None] & mask_b[None, :])
        if WITH_BOUNDS:
            # Per (token, block), one int32 key from one integer max: the fp32 int8 logit of each valid
            # row in an order-preserving integer form (f >= 0: its bits; f < 0: its bits with the
            # magnitude bits flipped), the low log2(BLOCK_V) bits replaced by BLOCK_V - 1 - (row in
            # block). The largest key holds the top bits of the block's largest int8 logit (so setting
            # its low bits gives an upper bound of it) and a row whose logit shares those bits (within
            # BLOCK_V fp32 ulps of the maximum). Blocks of padding rows only hold the key of -inf.
            valid_v = offs_v < num_valid_rows
            zv = tl.where(valid_v[:, None], z, -float("inf"))
            bits = zv.to(tl.int32, bitcast=True)
            ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            local = BLOCK_V - 1 - tl.arange(0, BLOCK_V)
            key = (ordered & (-BLOCK_V)) | local[:, None]
            block_ptrs = offs_b.to(tl.int64) * stride_block + pid_v
            tl.store(block_key_ptr + block_ptrs, tl.max(key, axis=0), mask=mask_b)

    @triton.jit(do_not_specialize=["num_tokens"])  # one compiled kernel for all batches of a bucket
    def _int8_logits_kernel(
        x_ptr,  # [B, K] activations (bf16/fp16/fp32)
        q_ptr,  # [V, K] int8
        scale_ptr,  # [V] fp32
        bias_ptr,  # [V] or dummy
        out_ptr,  # [B, V] output logits
        block_key_ptr,  # [B, NB] int32: per block, its largest int8 logit and a row (see the tile)
        num_tokens,
        num_rows,
        num_valid_rows,  # rows >= this (vocab padding) take no part in the bound
        num_blocks,
        hidden,
        stride_x,
        stride_q,
        stride_out,
        stride_block,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        W_IS_A: tl.constexpr,
        EVEN_K: tl.constexpr,
        BF16_RN_BY_BITS: tl.constexpr,
        PERSISTENT: tl.constexpr,
        TILED: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
        WITH_BOUNDS: tl.constexpr,
        LAUNCH_DEPENDENTS: tl.constexpr,
        flat_ptr=None,  # [B] int32 from the probe: a batch with a flat token leaves every logit to the bf16 kernel
        FLAG_SLOTS: tl.constexpr = 64,
    ):
        if LAUNCH_DEPENDENTS:
            # Programmatic dependent launch: the re-scoring kernel may be scheduled once every program
            # of this grid has started; its programs take the slots the last wave frees, run their
            # prologue and wait (griddepcontrol.wait) for this grid's results.
            _gdc_launch_dependents()
        run = True
        if flat_ptr is not None:
            slots = tl.arange(0, FLAG_SLOTS)
            run = tl.max(tl.load(flat_ptr + slots, mask=slots < num_tokens, other=0), axis=0) == 0
        if run:
            pid_b = tl.program_id(1)
            if PERSISTENT:
                # A fixed grid of programs walks the vocab blocks (no partial last wave of blocks).
                for pid_v in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
                    _int8_logits_tile(pid_v, pid_b, x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, block_key_ptr,
                                      num_tokens, num_rows, num_valid_rows, hidden, stride_x, stride_q, stride_out,
                                      stride_block, HAS_BIAS, BLOCK_V, BLOCK_B, BLOCK_K, CONVERT, W_IS_A, EVEN_K,
                                      BF16_RN_BY_BITS, TILED, EVICT_FIRST, WITH_BOUNDS)  # fmt: skip
            else:
                _int8_logits_tile(tl.program_id(0), pid_b, x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr,
                                  block_key_ptr, num_tokens, num_rows, num_valid_rows, hidden, stride_x, stride_q,
                                  stride_out, stride_block, HAS_BIAS, BLOCK_V, BLOCK_B, BLOCK_K, CONVERT, W_IS_A,
                                  EVEN_K, BF16_RN_BY_BITS, TILED, EVICT_FIRST, WITH_BOUNDS)  # fmt: skip

    @triton.jit
    def _probe_kernel(
        x_ptr,  # [B, K]
        w_ptr,  # [V, K] the bf16 weight
        bias_ptr,
        z_ptr,  # [B, S] fp32 out: the exact logit of each sampled row (-inf for padding rows)
        lb_ptr,  # [B, S] fp32 out: a proven lower bound of it (its fp32 summation error taken off)
        num_tokens,
        num_valid_rows,
        num_samples,
        hidden,
        stride_x,
        stride_w,
        stride_probe,
        exact_err_coef,
        HAS_BIAS: tl.constexpr,
        STRIDE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        """The flatness probe, part 1: exact logits of every STRIDE-th row (ROWS sampled rows x BLOCK_B tokens)."""
        offs_s = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows = offs_s * STRIDE
        valid = (offs_s < num_samples) & (rows < num_valid_rows)
        safe_rows = tl.where(valid, rows, 0)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_b = offs_b < num_tokens
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_B, ROWS], dtype=tl.float32)
        acc_abs = tl.zeros([BLOCK_B, ROWS], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < hidden
            w = tl.load(
                w_ptr + safe_rows[:, None].to(tl.int64) * stride_w + kk[None, :],
                mask=valid[:, None] & mask_k[None, :],
                other=0.0,
            )
            xt = tl.load(
                x_ptr + offs_b[:, None].to(tl.int64) * stride_x + kk[None, :],
                mask=mask_b[:, None] & mask_k[None, :],
                other=0.0,
            )
            if FP32_DOT:  # the interpreter's bf16 dot is wrong; the products are exact either way
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
            else:
                w = w.to(xt.dtype)
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
            acc_abs = tl.dot(tl.abs(xt), tl.trans(tl.abs(w)), acc_abs, input_precision="ieee")
        z = acc
        if HAS_BIAS:
            bias = tl.load(bias_ptr + safe_rows, mask=valid, other=0.0).to(tl.float32)
            z += bias[None, :]
            acc_abs += tl.abs(bias)[None, :]
        lower = z - acc_abs * exact_err_coef
        ok = valid[None, :] & mask_b[:, None]
        at = offs_b[:, None].to(tl.int64) * stride_probe + offs_s[None, :]
        store = mask_b[:, None] & (offs_s < num_samples)[None, :]
        tl.store(z_ptr + at, tl.where(ok, z, -float("inf")), mask=store)
        tl.store(lb_ptr + at, tl.where(ok, lower, -float("inf")), mask=store)

    @triton.jit
    def _probe_decide_kernel(
        x_ptr,
        z_ptr,
        lb_ptr,
        scale_ptr,
        err_max_ptr,
        err_l2_ptr,
        lb0_ptr,  # [B] fp32 out: the sample's lower bound of the token's maximum logit
        flat_ptr,  # [B] int32 out: 1 when the token's logits are flat (see FLAT_SAMPLE_SHARE)
        near_ptr,  # [B] int32 out: the sampled rows within reach of the maximum (the count judged)
        num_valid_rows,
        num_samples,
        hidden,
        stride_x,
        stride_probe,
        acc_err_coef,
        slack,
        rel_margin,
        abs_margin,
        flat_count,
        dense_count,
        STRIDE: tl.constexpr,
        S_POW2: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_KC: tl.constexpr,
    ):
        """The flatness probe, part 2, one program per token: the sample's lower bound LB0 of the maximum,
        and how many sampled rows could be re-scoring candidates (their exact logit plus twice their
        int8 bound reaches LB0). That count stands for STRIDE rows each."""
        tok = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        x_row = x_ptr + tok.to(tl.int64) * stride_x
        l1 = tl.zeros([BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for c in tl.static_range(NUM_KC):
            kk = c * BLOCK_K + offs_k
            xv = tl.load(x_row + kk, mask=kk < hidden, other=0.0).to(tl.float32)
            l1 += tl.abs(xv)
            sq += xv * xv
        x_l1 = tl.sum(l1, axis=0) * slack
        x_l2 = tl.sqrt(tl.sum(sq, axis=0)) * slack
        offs = tl.arange(0, S_POW2)
        in_range = offs < num_samples
        rows = offs * STRIDE
        valid = in_range & (rows < num_valid_rows)
        safe_rows = tl.where(valid, rows, 0)
        row_at = tok.to(tl.int64) * stride_probe + offs
        lb0 = tl.max(tl.load(lb_ptr + row_at, mask=in_range, other=-float("inf")), axis=0)
        z = tl.load(z_ptr + row_at, mask=valid, other=0.0)
        scale = tl.load(scale_ptr + safe_rows, mask=valid, other=0.0)
        delta = tl.minimum(
            tl.load(err_max_ptr + safe_rows, mask=valid, other=0.0) * x_l1,
            tl.load(err_l2_ptr + safe_rows, mask=valid, other=0.0) * x_l2,
        )
        delta = (delta + acc_err_coef * scale * x_l1 + tl.abs(z) * 4.0e-7) * slack
        threshold = lb0 - (tl.abs(lb0) * rel_margin + abs_margin)
        reach = z + tl.abs(z) * rel_margin + abs_margin
        near = valid & (reach + 2.0 * delta >= threshold)
        count = tl.sum(near.to(tl.int32), axis=0)
        # A tied top: many sampled rows within half a bound of the maximum. Random logits keep the top of
        # a sample sparse (its rows a fraction of the spread apart); a tie shows every tied row the sample
        # holds, and such a top is what makes re-scoring expensive at every batch size.
        dense = tl.sum((valid & (reach + 0.5 * delta >= threshold)).to(tl.int32), axis=0)
        tl.store(lb0_ptr + tok, lb0)
        tl.store(flat_ptr + tok, ((count >= flat_count) | (dense >= dense_count)).to(tl.int32))
        tl.store(near_ptr + tok, count)

    @triton.jit
    def _bf16_blocks_kernel(
        x_ptr,
        w_ptr,  # [V, K] the bf16 weight
        bias_ptr,
        out_ptr,
        flat_ptr,  # [B] int32: any token flat -> every block
        spill_ptr,  # [B, NB] int8: blocks the re-scoring kernel left to this kernel (beyond its row budget)
        num_tokens,
        num_rows,
        num_blocks,
        hidden,
        stride_x,
        stride_w,
        stride_out,
        stride_spill,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        EVEN_K: tl.constexpr,
        BF16_RN_BY_BITS: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
        FLAG_SLOTS: tl.constexpr,
    ):
        """Exact logits (bf16 weight, fp32 accumulation) of the blocks that need them: all of them for a flat
        batch, else the blocks the re-scoring kernel spilled. A persistent grid: with nothing to do, every
        program returns after one load of the flags."""
        slots = tl.arange(0, FLAG_SLOTS)
        flat = tl.max(tl.load(flat_ptr + slots, mask=slots < num_tokens, other=0), axis=0)
        pid_b = tl.program_id(1)
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_b = offs_b < num_tokens
        for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            need = flat
            if flat == 0:
                spilled = tl.load(spill_ptr + offs_b.to(tl.int64) * stride_spill + blk, mask=mask_b, other=0)
                need = tl.max(spilled.to(tl.int32), axis=0)
            if need != 0:
                _int8_logits_tile(blk, pid_b, x_ptr, w_ptr, bias_ptr, bias_ptr, out_ptr, flat_ptr, num_tokens,
                                  num_rows, num_rows, hidden, stride_x, stride_w, stride_out, 0, HAS_BIAS, BLOCK_V,
                                  BLOCK_B, BLOCK_K, CONVERT, 0, EVEN_K, BF16_RN_BY_BITS, False, EVICT_FIRST, False,
                                  True)  # fmt: skip

    @triton.jit
    def _exact_rescore_kernel(
        x_ptr,  # [B, K]
        w_ptr,  # [V, K] the original (bf16) weight
        bias_ptr,
        scale_ptr,
        err_max_ptr,
        err_l2_ptr,
        out_ptr,  # [B, V] logits from _int8_logits_kernel; candidate tokens overwritten
        block_key_ptr,  # [B, NB] int32 from _int8_logits_kernel
        block_stats_ptr,  # [3, NB] fp32: per block max of err_max, err_l2, scale (block_bound_stats)
        trace_ptr,  # [B, PROGRAMS_PER_ROW, TRACE_FIELDS] int64 with TRACE, else unused
        num_rows,
        num_valid_rows,
        num_blocks,
        hidden,
        stride_x,
        stride_w,
        stride_out,
        stride_block,
        acc_err_coef,
        exact_err_coef,
        slack,
        rel_margin,
        abs_margin,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NB_POW2: tl.constexpr,
        PROGRAMS_PER_ROW: tl.constexpr,
        OWN_POW2: tl.constexpr,  # >= the blocks a program owns, cdiv(num_blocks, PROGRAMS_PER_ROW)
        GROUP: tl.constexpr,  # candidate blocks a program tests at once
        SLOTS: tl.constexpr,  # candidate rows a program re-scores at once
        BF16_RN_BY_BITS: tl.constexpr,
        NUM_KC: tl.constexpr,  # cdiv(hidden, BLOCK_K): hidden-dimension chunks, unrolled
        WAIT_PRIMARY: tl.constexpr,
        TRACE: tl.constexpr,  # record per-program timestamps (exploration only; see TRACE_FIELDS)
        flat_ptr=None,  # [B] int32 from the probe: a flat batch is the bf16 kernel's, nothing to do here
        lb0_ptr=None,  # [B] fp32 from the probe: the sample's lower bound of each token's maximum
        spill_ptr=None,  # [B, NB] int8 out: 1 for the owned candidate blocks beyond the row budget
        num_tokens=1,
        stride_spill=0,
        ROW_BUDGET: tl.constexpr = 1 << 30,  # candidate rows a program re-scores at most
        FLAG_SLOTS: tl.constexpr = 64,
    ):
        tok = tl.program_id(0)
        part = tl.program_id(1)
        run = 1  # 0: a flat batch, every logit is the bf16 kernel's
        if flat_ptr is not None:
            slots = tl.arange(0, FLAG_SLOTS)
            run = (tl.max(tl.load(flat_ptr + slots, mask=slots < num_tokens, other=0), axis=0) == 0).to(tl.int32)
        if TRACE:
            trace_gt_start = _trace_globaltimer()
            trace_c_start = _trace_clock()
        offs_nb = tl.arange(0, NB_POW2)
        mask_nb = offs_nb < num_blocks
        offs_k = tl.arange(0, BLOCK_K)
        x_row = x_ptr + tok.to(tl.int64) * stride_x
        # Program ``part`` owns the blocks part, part + PROGRAMS_PER_ROW, ...: it tests them and
        # re-scores their candidate rows (every block has one owner, so no two programs write a row).
        own = part + tl.arange(0, OWN_POW2) * PROGRAMS_PER_ROW
        mask_own = own < num_blocks
        # Prologue, on inputs the logits kernel does not write (with programmatic dependent launch it
        # overlaps that kernel's last wave): |x|_1, |x|_2 and the bound of each owned block (as in the
        # row test below, with the block's largest err_max, err_l2 and scale).
        block_err_max = tl.load(block_stats_ptr + own, mask=mask_own, other=0.0)
        block_err_l2 = tl.load(block_stats_ptr + num_blocks + own, mask=mask_own, other=0.0)
        block_scale = tl.load(block_stats_ptr + 2 * num_blocks + own, mask=mask_own, other=0.0)
        # The hidden dimension is walked in NUM_KC unrolled chunks (all loads of a walk can be in
        # flight at once; x is re-read from L1 at each walk instead of held in registers).
        l1 = tl.zeros([BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for c in tl.static_range(NUM_KC):
            kk = c * BLOCK_K + offs_k
            xv = tl.load(x_row + kk, mask=kk < hidden, other=0.0).to(tl.float32)
            l1 += tl.abs(xv)
            sq += xv * xv
        x_l1 = tl.sum(l1, axis=0) * slack
        x_l2 = tl.sqrt(tl.sum(sq, axis=0)) * slack
        block_delta = tl.minimum(block_err_max * x_l1, block_err_l2 * x_l2) + acc_err_coef * block_scale * x_l1
        block_delta = block_delta * slack
        if WAIT_PRIMARY:
            _gdc_wait()
        if TRACE:
            trace_gt_wait = _trace_globaltimer()
            trace_c_wait = _trace_clock()
        # Masked blocks read the key of -inf (ordered form of 0xFF800000).
        key_row = block_key_ptr + tok.to(tl.int64) * stride_block
        keys = tl.load(key_row + offs_nb, mask=mask_nb, other=-2139095041)
        own_keys = tl.load(key_row + own, mask=mask_own, other=-2139095041)
        # Upper bound of each owned block's largest int8 logit: its key with the low bits set, decoded.
        upper_key = own_keys | (BLOCK_V - 1)
        block_z = (upper_key ^ ((upper_key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        # The lower bound: the exact logit of a row of the largest key (any row's exact logit is <= the
        # maximum; this one's int8 logit is within BLOCK_V fp32 ulps of the largest), in fp32.
        best_key, best = tl.max(keys, axis=0, return_indices=True)
        best_row = best * BLOCK_V + (BLOCK_V - 1 - (best_key & (BLOCK_V - 1)))
        best_row = tl.minimum(tl.maximum(best_row, 0), num_rows - 1)
        w_best = w_ptr + best_row.to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        acc_abs = tl.zeros([BLOCK_K], dtype=tl.float32)
        for c in tl.static_range(NUM_KC):
            kk = c * BLOCK_K + offs_k
            mask_k = kk < hidden
            xv = tl.load(x_row + kk, mask=mask_k, other=0.0).to(tl.float32)
            prod = tl.load(w_best + kk, mask=mask_k, other=0.0).to(tl.float32) * xv
            acc += prod
            acc_abs += tl.abs(prod)
        best_exact = tl.sum(acc, axis=0)
        best_abs = tl.sum(acc_abs, axis=0)
        if HAS_BIAS:
            best_bias = tl.load(bias_ptr + best_row).to(tl.float32)
            best_exact += best_bias
            best_abs += tl.abs(best_bias)
        # fp32 sum of exact products: error <= gamma * sum |products| (exact_err_coef = gamma * slack).
        lower_bound = best_exact - best_abs * exact_err_coef
        if lb0_ptr is not None:  # the probe's sampled rows bound the maximum from below too: take the higher
            lower_bound = tl.maximum(lower_bound, tl.load(lb0_ptr + tok))
        threshold = lower_bound - (tl.abs(lower_bound) * rel_margin + abs_margin)
        if TRACE:
            trace_c_threshold = _trace_clock()
        # Block test: every row v of the block has R(zq_v) <= capped (rounding moves at most one output
        # ulp, half of rel_margin) and its bound <= the block's, so its row test value <= block_upper.
        has_rows = mask_own & (block_z > -float("inf"))  # blocks of padding rows only are never candidates
        finite_z = tl.where(has_rows, block_z, 0.0)
        capped = finite_z + tl.abs(finite_z) * (rel_margin * 0.5) + abs_margin
        block_upper = capped + tl.abs(capped) * (rel_margin + 4.0e-7 * slack) + abs_margin + block_delta
        is_candidate = (block_upper >= threshold) & has_rows
        count = tl.sum(is_candidate.to(tl.int32), axis=0)
        rank = tl.cumsum(is_candidate.to(tl.int32), axis=0) - 1
        offs_g = tl.arange(0, GROUP)
        offs_r = tl.arange(0, BLOCK_V)
        offs_s = tl.arange(0, SLOTS)
        out_row = out_ptr + tok.to(tl.int64) * stride_out
        rows_rescored = 0
        budget = ROW_BUDGET
        spilled = tl.zeros([OWN_POW2], dtype=tl.int32)
        # The owned candidate blocks, GROUP at a time (one round of loads for their rows' bounds), then
        # their candidate rows SLOTS at a time while the row budget lasts; a group that does not fit is
        # left whole to the bf16 kernel (spilled), and so is every group after it.
        for r0 in range(0, count * run, GROUP):
            my_rank = r0 + offs_g
            blocks = tl.sum(
                tl.where(is_candidate[None, :] & (rank[None, :] == my_rank[:, None]), own[None, :], 0), axis=1
            )
            rows = tl.reshape(blocks[:, None] * BLOCK_V + offs_r[None, :], [GROUP * BLOCK_V])
            in_group = tl.reshape((my_rank < count)[:, None] & (offs_r < BLOCK_V)[None, :], [GROUP * BLOCK_V])
            mask_r = in_group & (rows < num_valid_rows)
            safe_rows = tl.minimum(rows, num_rows - 1)
            # Per-token upper bound from the stored (rounded) int8 logit: rounding adds at most
            # half an ulp, covered by rel_margin.
            approx = tl.load(out_row + safe_rows, mask=mask_r, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + safe_rows, mask=mask_r, other=0.0)
            quant = tl.minimum(
                tl.load(err_max_ptr + safe_rows, mask=mask_r, other=0.0) * x_l1,
                tl.load(err_l2_ptr + safe_rows, mask=mask_r, other=0.0) * x_l2,
            )
            delta = (quant + acc_err_coef * scale * x_l1 + tl.abs(approx) * 4.0e-7) * slack
            upper = approx + tl.abs(approx) * rel_margin + abs_margin + delta
            is_token = (upper >= threshold) & mask_r
            num_here = tl.sum(is_token.to(tl.int32), axis=0)
            fits = num_here <= budget
            in_group = is_candidate & (rank >= r0) & (rank < r0 + GROUP)
            spilled = tl.where(in_group & (num_here > budget), 1, spilled)
            budget = tl.where(fits, budget - num_here, 0)
            num_here = tl.where(fits, num_here, 0)
            rows_rescored += num_here
            token_rank = tl.cumsum(is_token.to(tl.int32), axis=0) - 1
            for t0 in range(0, num_here, SLOTS):
                slot_rank = t0 + offs_s
                slot_ok = slot_rank < num_here
                slot_row = tl.sum(
                    tl.where(is_token[None, :] & (token_rank[None, :] == slot_rank[:, None]), rows[None, :], 0), axis=1
                )
                w_rows = w_ptr + slot_row.to(tl.int64)[:, None] * stride_w
                acc2 = tl.zeros([SLOTS, BLOCK_K], dtype=tl.float32)
                for c in tl.static_range(NUM_KC):
                    kk = c * BLOCK_K + offs_k
                    mask_k = kk < hidden
                    w = tl.load(w_rows + kk[None, :], mask=slot_ok[:, None] & mask_k[None, :], other=0.0)
                    xv = tl.load(x_row + kk, mask=mask_k, other=0.0).to(tl.float32)
                    acc2 += w.to(tl.float32) * xv[None, :]
                exact = tl.sum(acc2, axis=1)
                if HAS_BIAS:
                    exact += tl.load(bias_ptr + slot_row, mask=slot_ok, other=0.0).to(tl.float32)
                tl.store(out_row + slot_row, _to_output_dtype(exact, out_ptr, BF16_RN_BY_BITS), mask=slot_ok)
        if spill_ptr is not None:  # every owned block, every call: no stale mark survives into the next
            tl.store(spill_ptr + tok.to(tl.int64) * stride_spill + own, spilled.to(tl.int8), mask=mask_own)
        if TRACE:
            trace_c_end = _trace_clock()
            trace_gt_end = _trace_globaltimer()
            at = trace_ptr + (tok.to(tl.int64) * PROGRAMS_PER_ROW + part) * _TRACE_FIELDS
            tl.store(at + 0, _trace_smid().to(tl.int64))
            tl.store(at + 1, trace_gt_start)
            tl.store(at + 2, trace_gt_wait)
            tl.store(at + 3, trace_gt_end)
            tl.store(at + 4, trace_c_start)
            tl.store(at + 5, trace_c_wait)
            tl.store(at + 6, trace_c_threshold)
            tl.store(at + 7, trace_c_end)
            tl.store(at + 8, count.to(tl.int64))
            tl.store(at + 9, rows_rescored.to(tl.int64))


def kernels_interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 before import)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_int8_logits_kernel, InterpretedFunction)


def pdl_supported(device: torch.device) -> bool:
    """Whether the re-scoring kernel is launched with programmatic dependent launch on ``device``."""
    if not USE_PDL or triton is None or device.type != "cuda" or not PDL_IN_TRITON:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _persistent_programs(device: torch.device, programs_per_sm: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm


def int8_lm_head_logits(
    x: torch.Tensor,
    packed: Int8LMHeadWeight,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_valid_rows: int | None = None,
    exact_argmax: bool = True,
    config: KernelConfig | None = None,
    rescore_programs_per_row: int | None = None,
    trace: list | None = None,
    probe_stride: int = PROBE_STRIDE,
    flat_sample_share: float = FLAT_SAMPLE_SHARE,
    dense_sample_share: float = DENSE_SAMPLE_SHARE,
    rescore_row_budget: int = RESCORE_ROW_BUDGET,
    stats: dict | None = None,
) -> torch.Tensor:
    """Logits ``x @ weight.T (+ bias)`` of ``x`` [B, K] through the int8 copy, shape [B, V], dtype of x.

    With ``exact_argmax`` (the default) the greedy argmax of the result equals that of the bf16
    logits (module docstring); without it the result is the plain int8 approximation.
    ``num_valid_rows``: rows past it (vocab padding) are left out of the bound.
    ``rescore_programs_per_row``: programs per token of the re-scoring kernel (default: from
    ``RESCORE_PROGRAMS``; for tuning). ``trace`` (exploration, CUDA only): a list that receives the
    re-scoring kernel's per-program record, [B, programs per token, TRACE_FIELDS] int64.
    ``probe_stride``, ``flat_sample_share`` and ``rescore_row_budget``: the flatness probe's sampling and
    threshold and the re-scoring kernel's row budget (module constants by default; for tests).
    ``stats`` (tests, benchmark): a dict that receives the probe's per-token flat flags and the spilled
    blocks, as tensors (reading them synchronizes).
    """
    if triton is None:
        raise RuntimeError("int8 lm head needs triton, which is not installed")
    if x.dim() != 2:
        raise ValueError(f"hidden states must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    num_rows = packed.source_shape[0]
    if packed.source_shape[1] != hidden or tuple(weight.shape) != packed.source_shape:
        raise ValueError(
            f"hidden size {hidden} does not match the lm head weight {tuple(weight.shape)} / int8 copy "
            f"of {packed.source_shape}"
        )
    if num_tokens == 0:
        return torch.empty((0, num_rows), dtype=x.dtype, device=x.device)
    if x.dtype not in OUTPUT_MARGIN:
        raise ValueError(f"hidden states dtype {x.dtype} unsupported: use bfloat16, float16 or float32")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("lm head weight must be contiguous along the hidden dimension")
    on_cpu = x.device.type == "cpu"
    if on_cpu and not kernels_interpreted():
        raise RuntimeError(
            "int8 lm head on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported"
        )
    cfg = config or select_kernel_config(num_tokens)
    tiled = packed.tile is not None
    if tiled and packed.tile != (cfg.block_v, cfg.block_k):
        raise ValueError(
            f"int8 weight tiled as {packed.tile} but the kernel config uses (block_v, block_k) = "
            f"{(cfg.block_v, cfg.block_k)}: quantize with the config's tile"
        )
    if cfg.tiled and not tiled:
        cfg = dataclasses.replace(cfg, tiled=0)
    if on_cpu:
        convert = 2  # the interpreter's fp32 path
    elif cfg.convert == 1 and x.dtype != torch.bfloat16:
        convert = 0
    else:
        convert = cfg.convert
    round_by_bits = on_cpu and x.dtype == torch.bfloat16
    valid_rows = num_rows if num_valid_rows is None else min(num_valid_rows, num_rows)
    num_blocks = triton.cdiv(num_rows, cfg.block_v)
    out = torch.empty((num_tokens, num_rows), dtype=x.dtype, device=x.device)
    if exact_argmax:
        block_key = torch.empty((num_tokens, num_blocks), dtype=torch.int32, device=x.device)
        block_stats = block_bound_stats(packed, cfg.block_v)
    else:  # the plain int8 logits need no block maxima: the kernel leaves this untouched
        block_key = packed.scale
    has_bias = bias is not None
    bias_arg = bias if has_bias else packed.scale
    acc_err_coef = accumulation_error_coefficient(hidden)
    slack = norm_slack(hidden)
    persistent = cfg.programs_per_sm > 0 and not on_cpu
    grid_v = min(num_blocks, _persistent_programs(x.device, cfg.programs_per_sm)) if persistent else num_blocks
    use_pdl = exact_argmax and pdl_supported(x.device)
    probe = None
    if exact_argmax:
        probe = _run_probe(
            x, packed, weight, bias, valid_rows, hidden, probe_stride, flat_sample_share, on_cpu, dense_sample_share
        )
    _int8_logits_kernel[(grid_v, triton.cdiv(num_tokens, cfg.block_b))](
        x,
        packed.qweight,
        packed.scale,
        bias_arg,
        out,
        block_key,
        num_tokens,
        num_rows,
        valid_rows,
        num_blocks,
        hidden,
        x.stride(0),
        packed.qweight.shape[1] if tiled else packed.qweight.stride(0),
        out.stride(0),
        block_key.stride(0),
        HAS_BIAS=has_bias,
        BLOCK_V=cfg.block_v,
        BLOCK_B=cfg.block_b,
        BLOCK_K=cfg.block_k,
        CONVERT=convert,
        W_IS_A=cfg.w_is_a,
        EVEN_K=hidden % cfg.block_k == 0,
        BF16_RN_BY_BITS=round_by_bits,
        PERSISTENT=persistent,
        TILED=tiled,
        EVICT_FIRST=bool(cfg.evict_first) and not on_cpu,
        WITH_BOUNDS=exact_argmax,
        LAUNCH_DEPENDENTS=use_pdl,
        flat_ptr=probe["flat"] if probe else None,
        FLAG_SLOTS=FLAG_SLOTS,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if exact_argmax:
        rel_margin, abs_margin = OUTPUT_MARGIN[x.dtype]
        # A few programs per token, each re-scoring its share of the candidate blocks (latency-bound
        # work); the interpreter runs programs one by one: one per token there.
        if rescore_programs_per_row is not None:
            programs_per_row = rescore_programs_per_row
        elif on_cpu:
            programs_per_row = 1
        else:
            programs_per_row = max(
                RESCORE_MIN_PROGRAMS_PER_ROW, min(RESCORE_MAX_PROGRAMS_PER_ROW, RESCORE_PROGRAMS // num_tokens)
            )
        rescore_block_k = min(triton.next_power_of_2(hidden), 256 if on_cpu else RESCORE_CHUNK_K)
        launch_options = {"launch_pdl": True} if use_pdl else {}
        trace_buffer = None
        if trace is not None:
            trace_buffer = torch.zeros((num_tokens, programs_per_row, TRACE_FIELDS), dtype=torch.int64, device=x.device)
            trace.append(trace_buffer)
        spill = torch.empty((num_tokens, num_blocks), dtype=torch.int8, device=x.device)
        _exact_rescore_kernel[(num_tokens, programs_per_row)](
            x,
            weight,
            bias_arg,
            packed.scale,
            packed.err_max,
            packed.err_l2,
            out,
            block_key,
            block_stats,
            block_key if trace_buffer is None else trace_buffer,
            num_rows,
            valid_rows,
            num_blocks,
            hidden,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            block_key.stride(0),
            acc_err_coef,
            exact_sum_error_coefficient(hidden) * slack,
            slack,
            rel_margin,
            abs_margin,
            HAS_BIAS=has_bias,
            BLOCK_V=cfg.block_v,
            BLOCK_K=rescore_block_k,
            NB_POW2=triton.next_power_of_2(num_blocks),
            PROGRAMS_PER_ROW=programs_per_row,
            OWN_POW2=triton.next_power_of_2(triton.cdiv(num_blocks, programs_per_row)),
            GROUP=4 if on_cpu else RESCORE_GROUP,
            SLOTS=16 if on_cpu else RESCORE_SLOTS,
            BF16_RN_BY_BITS=round_by_bits,
            NUM_KC=triton.cdiv(hidden, rescore_block_k),
            WAIT_PRIMARY=use_pdl,
            TRACE=trace_buffer is not None,
            flat_ptr=probe["flat"],
            lb0_ptr=probe["lb0"],
            spill_ptr=spill,
            num_tokens=num_tokens,
            stride_spill=spill.stride(0),
            ROW_BUDGET=rescore_row_budget,
            FLAG_SLOTS=FLAG_SLOTS,
            num_warps=4 if on_cpu else RESCORE_NUM_WARPS,
            **launch_options,
            **({"maxnreg": RESCORE_MAXNREG} if RESCORE_MAXNREG and not on_cpu else {}),
        )
        # The exact logits of a flat batch, or of the blocks the re-scoring kernel spilled: one streaming
        # read of the bf16 weight's rows for every token of the batch (a persistent grid that returns at
        # once when there is nothing to do).
        bf16 = BF16_KERNEL_CONFIG
        programs = 4 if on_cpu else _persistent_programs(x.device, BF16_PROGRAMS_PER_SM)
        _bf16_blocks_kernel[(min(num_blocks, programs), triton.cdiv(num_tokens, bf16.block_b))](
            x,
            weight,
            bias_arg,
            out,
            probe["flat"],
            spill,
            num_tokens,
            num_rows,
            num_blocks,
            hidden,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            spill.stride(0),
            HAS_BIAS=has_bias,
            BLOCK_V=cfg.block_v,
            BLOCK_B=bf16.block_b,
            BLOCK_K=bf16.block_k,
            CONVERT=2 if on_cpu else 0,
            EVEN_K=hidden % bf16.block_k == 0,
            BF16_RN_BY_BITS=round_by_bits,
            EVICT_FIRST=bool(bf16.evict_first) and not on_cpu,
            FLAG_SLOTS=FLAG_SLOTS,
            num_warps=bf16.num_warps,
            num_stages=bf16.num_stages,
        )
        if stats is not None:
            stats.update(flat=probe["flat"].clone(), near=probe["near"].clone(), spilled=spill.clone())
    return out


def _run_probe(
    x: torch.Tensor,
    packed: Int8LMHeadWeight,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    valid_rows: int,
    hidden: int,
    stride: int,
    flat_sample_share: float,
    on_cpu: bool,
    dense_sample_share: float = DENSE_SAMPLE_SHARE,
) -> dict[str, torch.Tensor]:
    """The flatness probe (two small kernels): per token, LB0 (a lower bound of the maximum logit from
    the exact logits of every ``stride``-th row) and whether the logits are flat (module docstring)."""
    num_tokens = x.shape[0]
    num_samples = triton.cdiv(valid_rows, stride)
    if num_tokens > FLAG_SLOTS:
        raise ValueError(f"int8 lm head batch of {num_tokens} tokens exceeds the probe's {FLAG_SLOTS} flag slots")
    z = torch.empty((num_tokens, num_samples), dtype=torch.float32, device=x.device)
    lower = torch.empty_like(z)
    lb0 = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    flat = torch.empty(num_tokens, dtype=torch.int32, device=x.device)
    near = torch.empty_like(flat)
    block_k = min(512, triton.next_power_of_2(hidden))
    _probe_kernel[(triton.cdiv(num_samples, PROBE_ROWS), triton.cdiv(num_tokens, 16))](
        x,
        weight,
        bias if bias is not None else packed.scale,
        z,
        lower,
        num_tokens,
        valid_rows,
        num_samples,
        hidden,
        x.stride(0),
        weight.stride(0),
        z.stride(0),
        exact_sum_error_coefficient(hidden) * norm_slack(hidden),
        HAS_BIAS=bias is not None,
        STRIDE=stride,
        ROWS=PROBE_ROWS,
        BLOCK_B=16,
        BLOCK_K=block_k,
        FP32_DOT=on_cpu,
        num_warps=4,
        num_stages=3,
    )
    rel_margin, abs_margin = OUTPUT_MARGIN[x.dtype]
    decide_block_k = min(triton.next_power_of_2(hidden), 1024)
    flat_count = max(FLAT_MIN_SAMPLES, math.ceil(num_samples * flat_sample_share))
    _probe_decide_kernel[(num_tokens,)](
        x,
        z,
        lower,
        packed.scale,
        packed.err_max,
        packed.err_l2,
        lb0,
        flat,
        near,
        valid_rows,
        num_samples,
        hidden,
        x.stride(0),
        z.stride(0),
        accumulation_error_coefficient(hidden),
        norm_slack(hidden),
        rel_margin,
        abs_margin,
        flat_count,
        max(FLAT_MIN_SAMPLES, math.ceil(num_samples * dense_sample_share)),
        STRIDE=stride,
        S_POW2=triton.next_power_of_2(num_samples),
        BLOCK_K=decide_block_k,
        NUM_KC=triton.cdiv(hidden, decide_block_k),
        num_warps=4,
    )
    return {"z": z, "lower": lower, "lb0": lb0, "flat": flat, "near": near, "samples": num_samples}


LAYER_ATTRIBUTE = "sparkfleet_int8_lm_head"


def prepare_int8_lm_head(layer: torch.nn.Module) -> Int8LMHeadWeight | None:
    """Attach (or refresh) the int8 copy of ``layer.weight`` when the device can run the kernels.

    The copy is a plain attribute, not a parameter or buffer: weight loading, ``state_dict`` and the
    drafter's ``_maybe_share_lm_head`` (which compares ``.weight``) see the layer unchanged.
    """
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
        return None
    if not int8_lmhead_device_supported(weight.device):
        setattr(layer, LAYER_ATTRIBUTE, None)
        return None
    with torch.no_grad():
        packed = quantize_lm_head_weight(weight.detach(), tile=weight_tile())
    setattr(layer, LAYER_ATTRIBUTE, packed)
    return packed


def int8_lm_head_apply(
    layer: torch.nn.Module,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    num_valid_rows: int | None = None,
) -> torch.Tensor | None:
    """The int8 logits of ``layer`` for ``x``, or None when the bf16 path must run instead."""
    packed: Int8LMHeadWeight | None = getattr(layer, LAYER_ATTRIBUTE, None)
    if packed is None or x.dim() != 2 or not 0 < x.shape[0] <= INT8_LMHEAD_MAX_BATCH:
        return None
    weight = layer.weight
    if weight.data_ptr() != packed.source_data_ptr or tuple(weight.shape) != packed.source_shape:
        packed = prepare_int8_lm_head(layer)  # the weight was replaced (reload): quantize it again
        if packed is None:
            return None
    if x.device != weight.device or not int8_lmhead_device_supported(x.device):
        return None
    return int8_lm_head_logits(x, packed, weight, bias, num_valid_rows=num_valid_rows)
