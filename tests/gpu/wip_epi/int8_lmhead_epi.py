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
order so each program reads one contiguous run). On the exact path (what vLLM runs) two small probe
kernels run first and the same kernel makes the greedy choice exact in its epilogue. The kernel
configs were chosen by sweeps on an H200 (benchmarks/results/gpu); the Spark's GB10 (sm_121, 273 GB/s) has
not been measured: re-run the sweep there.

The exactness guarantee
-----------------------
Let ``z[b, v] = sum_k W[v, k] * x[b, k]`` be the exact logits of the bf16 weight and ``R(.)`` rounding
to the output dtype (the dtype of ``x``, as vLLM's bf16 path returns). The stock greedy token is the
first index of the maximum of ``R(z[b, :])``. The int8 logits ``zq`` differ from ``z`` by at most
``delta[b, v] = min(emax[v] * |x_b|_1, e2[v] * |x_b|_2) + (fp32 accumulation bound)``, where ``emax``
and ``e2`` are the max-abs and L2 norm of the row's quantization error ``w - s * q`` (stored per row,
rounded up).

Every program of the int8 kernel (one 128-row block of the vocab, all tokens) knows, per token, a
proven lower bound ``LB <= max(z)``: first the probe's ``LB0`` (below), then whatever larger one an
earlier program published. It stores ``R(zq)`` for its rows, and for every row whose upper bound
``zq + delta`` (plus 2 output ulps of margin) reaches ``T = LB - 2 ulp(LB)`` for some token, it
recomputes the row's logits exactly (bf16 weight, fp32 accumulation) for every token of the tile and
stores those instead. An exact logit minus its fp32 summation bound ``gamma_(K+2) * sum |w_k x_k|`` is
a proven lower bound of the maximum; the program publishes the largest (an atomic max), so the
programs that start later test against a higher threshold. Then:

* every row whose rounded exact logit can equal the rounded maximum has ``z >= T`` for the threshold
  its program used, so it passes the test: all tied maxima are present with exact values;
* every other row keeps its int8 logit, and ``R(zq) < R(LB) <= R(max z)``: it cannot win.

Any lower bound keeps the argument (each row's decision rests on the bound its own program read), so
the order in which programs run changes which rows are re-scored, never the argmax. The margin of 2
output ulps is one ulp more than the rounding argument needs; the spare ulp covers the fp32 rounding
of the bound arithmetic itself (a few fp32 ulps). Vocab-padding rows (``num_valid_rows``) never set a
bound and are never re-scored.

So the returned logits' argmax (first index on ties) equals the argmax of ``R(z)``. The one residue:
the candidates' exact logits are summed in fp32 in a different order than cuBLAS; if cuBLAS's own
fp32 rounding error pushes a value across a bf16 rounding boundary *and* that creates or breaks a tie
at the top, the two paths can disagree (the reference itself is then order-dependent).

The probe and flat logits: a bounded cost
-----------------------------------------
A row with many near-ties (an all-zero hidden state ties every logit) makes most rows candidates;
re-scoring them one by one would cost more than the bf16 GEMM. Before the int8 kernel:

* ``_probe_kernel`` computes ``sum w x`` and ``sum |w x|`` of every ``PROBE_STRIDE``-th row from the bf16
  weight (1,940 rows of the 122B's vocab, 12 MB; the hidden dimension split over ``PROBE_KSPLIT``
  programs per row group, so the read is spread over the whole GPU);
* ``_probe_decide_kernel`` (one program per token) takes ``LB0``, the largest exact logit of the sample
  minus its summation bound, and counts the sampled rows the int8 kernel's test would make
  candidates against it. The last program to finish (a ticket) decides for the batch: it is flat when
  some token, or the union over the tokens, reaches ``FLAT_SAMPLE_SHARE`` of the sample.

In a flat batch every program of the int8 kernel computes its whole tile from the bf16 weight instead
(exact, no int8 pass: the bf16 GEMM's bytes). In the others, a program whose block holds more than
``GATHER_MAX_ROWS`` candidate rows recomputes the whole block from the bf16 weight (for all tokens at
once) instead of gathering rows; so no block costs more than its int8 and bf16 reads together, and
the probe keeps the blocks that pay that to well under ``FLAT_SAMPLE_SHARE`` of the vocab. A weight
built so that its near-ties avoid every sampled row is still exact, at up to the int8 pass plus a bf16
pass.

The decision runs on the device at every call (a CUDA graph replays the decision, not its outcome).
On sm_90+ the three kernels are chained with programmatic dependent launch: the decision's and the
int8 kernel's programs start during the kernel before and load what does not depend on it (norms,
per-row bounds); only their waits sit on the critical path. The probe kernel zeroes the decision's
workspace, so a call needs no memset; two calls in flight on different streams must not share a
device (vLLM runs the lm head on one stream).

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
# Chain the exact path's kernels with programmatic dependent launch where the device has it (sm_90+).
USE_PDL = True
# The flatness probe: sums of every PROBE_STRIDE-th row (one per 128-row block on the 122B's vocab:
# 1,940 rows, 12 MB of the bf16 weight) before the int8 kernel, PROBE_ROWS rows x PROBE_BLOCK_B tokens x
# one of PROBE_KSPLIT parts of the hidden dimension per program.
PROBE_STRIDE = 128
PROBE_ROWS = 16  # tl.dot needs >= 16
PROBE_BLOCK_B = 16
PROBE_KSPLIT = 2
PROBE_BLOCK_K = 256
PROBE_STAGES = 3
# A batch is flat when some token, or the union over its tokens, has at least FLAT_SAMPLE_SHARE of the
# sampled rows (and FLAT_MIN_SAMPLES) as candidates against the sample's lower bound: re-scoring that
# many rows would cost more than recomputing every logit from the bf16 weight.
FLAT_SAMPLE_SHARE = 1 / 8
FLAT_MIN_SAMPLES = 8
# The int8 kernel's epilogue re-scores a block's candidate rows in one gather of GATHER_SLOTS rows (a tl.dot
# over all tokens, GATHER_BLOCK_K hidden elements per step); a block with more than GATHER_MAX_ROWS (at most
# GATHER_SLOTS) candidate rows is left to the bf16 kernel, which recomputes it whole (for all tokens at once).
# One gather, not a loop of them: a loop around the pipelined gather loop faulted on the H200 (explore13).
GATHER_SLOTS = 32
GATHER_BLOCK_K = 128
GATHER_MAX_ROWS = 32
GATHER_STAGES = 2
# The bf16 kernel (a flat batch, or the blocks the int8 kernel marked): the int8 kernel's tile walk on the
# bf16 weight, row-major, BF16_BLOCK_K per step, a persistent grid of BF16_PROGRAMS_PER_SM per SM.
BF16_BLOCK_K = 64
BF16_STAGES = 3
BF16_PROGRAMS_PER_SM = 2
# Register cap of the int8 kernel on the exact path (0: the compiler's choice). Uncapped, the epilogue's
# code takes ptxas to 255 registers per thread (2 programs per SM); the plain kernel holds 150 (3 per SM).
INT8_EXACT_MAXNREG = 168
# Variant switches of this scratch module (tests/gpu/wip_epi/bench_epi.py): flat batches and blocks with too many
# candidates computed by the int8 kernel itself from the bf16 weight (no bf16 kernel launched); the probe reads a
# contiguous copy of the sampled rows made once per weight.
INLINE_BF16 = False
PROBE_COMPACT = False
# Batches of at most PROBE_FUSED_MAX_TOKENS tokens: no decision kernel, the probe's last program decides.
PROBE_FUSED_MAX_TOKENS = 0
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
    try:  # programmatic dependent launch (sm_90+): each kernel of the exact path starts during the one before
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

    @triton.jit
    def _to_output_dtype(values, out_ptr, BF16_RN_BY_BITS: tl.constexpr):
        """fp32 -> the output dtype, round to nearest even (the interpreter truncates to bf16)."""
        if BF16_RN_BY_BITS:
            bits = values.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            values = bits.to(tl.float32, bitcast=True)
        return values.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _tile_sums(
        pid_v,
        pid_b,
        x_ptr,
        w_ptr,
        num_tokens,
        num_rows,
        hidden,
        stride_x,
        stride_w,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        W_IS_A: tl.constexpr,
        EVEN_K: tl.constexpr,
        TILED: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
    ):
        """fp32 [BLOCK_V, BLOCK_B]: sum over k of w[row, k] * x[token, k] for one tile, w being the int8 codes
        (row-major, or TILED: stride_w is then the number of K tiles) or the bf16 weight (row-major)."""
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        offs_k = tl.arange(0, BLOCK_K)
        mask_b = offs_b < num_tokens
        # Clamp instead of masking the weight loads: the last block re-reads a valid row, the loads
        # stay unpredicated and 16 bytes wide.
        rows = tl.minimum(pid_v * BLOCK_V + tl.arange(0, BLOCK_V), num_rows - 1)
        toks = tl.minimum(offs_b, num_tokens - 1)
        if TILED:
            # Padding rows/columns of the tiles hold zeros.
            tile_start = pid_v.to(tl.int64) * stride_w * BLOCK_V * BLOCK_K
            w_ptrs = w_ptr + tile_start + tl.arange(0, BLOCK_V)[:, None] * BLOCK_K + offs_k[None, :]
            w_step = BLOCK_V * BLOCK_K
        else:
            w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + offs_k[None, :]
            w_step = BLOCK_K
        x_ptrs = x_ptr + toks[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        # Token rows past the batch are masked, not clamped: clamped rows all read the last token's
        # lines, and every program hitting the same few L2 lines slowed batch 1 (H200 explore logs).
        x_mask = mask_b[:, None]
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
        return acc

    @triton.jit
    def _rows_exact(
        slot_row,
        slot_ok,
        offs_b,
        mask_b,
        num_tokens,
        x_ptr,
        w_ptr,
        hidden,
        stride_x,
        stride_w,
        SLOTS: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
        STAGES: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """Exact fp32 logits [SLOTS, BLOCK_B] of the bf16 weight's rows ``slot_row`` for the tile's tokens, and
        the sums of |w x| that bound their fp32 summation error."""
        offs_k = tl.arange(0, BLOCK_K)
        # No masked load: every row and token index is clamped to a valid one (slot_row is 0 for unused slots,
        # tokens past the batch read the last token), the hidden offset to hidden - 1, and what a clamped
        # lane read is zeroed or never used (the caller masks by slot_ok and mask_b). The masked pipelined
        # gather faulted on the H200: its masked lanes read from a null base (compute-sanitizer,
        # benchmarks/results/gpu/int8_lmhead_h200_epilogue_try2.log).
        toks = tl.minimum(offs_b, num_tokens - 1)
        w_rows = w_ptr + slot_row[:, None].to(tl.int64) * stride_w
        x_rows = x_ptr + toks[:, None].to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_B, SLOTS], dtype=tl.float32)
        acc_abs = tl.zeros([BLOCK_B, SLOTS], dtype=tl.float32)
        for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                kk = k0 + offs_k
                w = tl.load(w_rows + kk[None, :])
                xt = tl.load(x_rows + kk[None, :])
            else:
                in_k = (k0 + offs_k) < hidden
                kk = tl.minimum(k0 + offs_k, hidden - 1)
                w = tl.where(in_k[None, :], tl.load(w_rows + kk[None, :]), 0.0)
                xt = tl.where(in_k[None, :], tl.load(x_rows + kk[None, :]), 0.0)
            if FP32_DOT:  # the interpreter's bf16 dot is wrong; the products are exact either way
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
            else:
                w = w.to(xt.dtype)
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
            acc_abs = tl.dot(tl.abs(xt), tl.trans(tl.abs(w)), acc_abs, input_precision="ieee")
        return tl.trans(acc), tl.trans(acc_abs)

    @triton.jit
    def _bf16_tile_store(
        pid_v,
        pid_b,
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptrs,
        out_mask,
        rows,
        num_tokens,
        num_rows,
        hidden,
        stride_x,
        stride_w,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
        BF16_RN_BY_BITS: tl.constexpr,
    ):
        """INLINE_BF16: the tile's exact logits from the bf16 weight (row-major), stored over the int8 ones."""
        if CONVERT == 2:
            z = _tile_sums(pid_v, pid_b, x_ptr, w_ptr, num_tokens, num_rows, hidden, stride_x, stride_w, BLOCK_V,
                           BLOCK_B, BLOCK_K, 2, 0, EVEN_K, False, EVICT_FIRST)  # fmt: skip
        else:
            z = _tile_sums(pid_v, pid_b, x_ptr, w_ptr, num_tokens, num_rows, hidden, stride_x, stride_w, BLOCK_V,
                           BLOCK_B, BLOCK_K, 0, 0, EVEN_K, False, EVICT_FIRST)  # fmt: skip
        if HAS_BIAS:
            z += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
        tl.store(out_ptrs, _to_output_dtype(z, out_ptrs, BF16_RN_BY_BITS), mask=out_mask)

    @triton.jit
    def _logits_block(
        pid_v,
        pid_b,
        x_ptr,
        q_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        w_ptr,
        err_max_ptr,
        err_l2_ptr,
        block_stats_ptr,
        probe_ptr,
        flat_ptr,
        stats_ptr,
        spill_ptr,
        num_tokens,
        num_rows,
        num_valid_rows,
        num_blocks,
        hidden,
        stride_x,
        stride_q,
        stride_out,
        stride_w,
        stride_probe,
        gather_max_rows,
        acc_err_coef,
        exact_err_coef,
        slack,
        rel_margin,
        abs_margin,
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
        EXACT: tl.constexpr,
        WAIT_PRIMARY: tl.constexpr,
        SLOTS: tl.constexpr,
        GATHER_BLOCK_K: tl.constexpr,
        STATS: tl.constexpr,
        FP32_DOT: tl.constexpr,
        GATHER_STAGES: tl.constexpr,
        GATHER_EVEN_K: tl.constexpr,
        INLINE_BF16: tl.constexpr,
        BF16_TILE_K: tl.constexpr,
        BF16_EVEN_K: tl.constexpr,
    ):
        """One (vocab block, token block) tile: int8 logits; on the exact path (unless the batch is flat) also the
        candidate test against each token's lower bound and the exact logits of the candidate rows."""
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_v = offs_v < num_rows
        mask_b = offs_b < num_tokens
        rows = tl.minimum(offs_v, num_rows - 1)
        out_ptrs = out_ptr + offs_b[None, :].to(tl.int64) * stride_out + offs_v[:, None]
        out_mask = mask_v[:, None] & mask_b[None, :]
        # The per-row inputs are loaded before the K loop, which hides their latency.
        scale = tl.load(scale_ptr + rows)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows).to(tl.float32)
        if not EXACT:
            z = _tile_sums(pid_v, pid_b, x_ptr, q_ptr, num_tokens, num_rows, hidden, stride_x, stride_q, BLOCK_V,
                           BLOCK_B, BLOCK_K, CONVERT, W_IS_A, EVEN_K, TILED, EVICT_FIRST) * scale[:, None]  # fmt: skip
            if HAS_BIAS:
                z += bias[:, None]
            tl.store(out_ptrs, _to_output_dtype(z, out_ptr, BF16_RN_BY_BITS), mask=out_mask)
        else:
            # Per block: the largest err_max, err_l2 and scale of its rows (made at load time).
            block_err_max = tl.load(block_stats_ptr + pid_v)
            block_err_l2 = tl.load(block_stats_ptr + num_blocks + pid_v)
            block_scale = tl.load(block_stats_ptr + 2 * num_blocks + pid_v)
            if WAIT_PRIMARY:  # the probe's results (programmatic dependent launch: this grid started early)
                _gdc_wait()
            # L2 reads (.cg): the words are written by other kernels and by other programs of this grid.
            flat = tl.load(flat_ptr, cache_modifier=".cg")
            if flat == 0:  # (a flat batch: every logit is the bf16 kernel's, nothing to do here)
                toks = tl.minimum(offs_b, num_tokens - 1)  # every address in bounds, masked or not
                lower = tl.load(probe_ptr + toks, mask=mask_b, other=0.0, cache_modifier=".cg")
                x_l1 = tl.load(probe_ptr + stride_probe + toks, mask=mask_b, other=0.0, cache_modifier=".cg")
                x_l2 = tl.load(probe_ptr + 2 * stride_probe + toks, mask=mask_b, other=0.0, cache_modifier=".cg")
                z = _tile_sums(pid_v, pid_b, x_ptr, q_ptr, num_tokens, num_rows, hidden, stride_x, stride_q,
                               BLOCK_V, BLOCK_B, BLOCK_K, CONVERT, W_IS_A, EVEN_K, TILED, EVICT_FIRST)  # fmt: skip
                z = z * scale[:, None]
                if HAS_BIAS:
                    z += bias[:, None]
                tl.store(out_ptrs, _to_output_dtype(z, out_ptr, BF16_RN_BY_BITS), mask=out_mask)
                # Candidate test (module docstring): the int8 logit's upper bound against the token's
                # threshold T = LB - 2 output ulps; rows that fail it provably round below the maximum.
                # First for the whole block, with its largest bound: z + |z| * c is increasing in z, so the
                # block's largest valid int8 logit bounds every row's test value.
                threshold = lower - (tl.abs(lower) * rel_margin + abs_margin)
                valid_v = offs_v < num_valid_rows  # vocab padding is never a candidate
                z_top = tl.max(tl.where(valid_v[:, None], z, -float("inf")), axis=0)
                block_delta = tl.minimum(block_err_max * x_l1, block_err_l2 * x_l2) + acc_err_coef * block_scale * x_l1
                top_upper = z_top + tl.abs(z_top) * (rel_margin + 4.0e-7 * slack) + abs_margin + block_delta * slack
                block_hit = (top_upper >= threshold) & (z_top > -float("inf")) & mask_b
                spill = tl.full([], 0, tl.int32)
                if tl.max(block_hit.to(tl.int32), axis=0) > 0:
                    err_max = tl.load(err_max_ptr + rows)
                    err_l2 = tl.load(err_l2_ptr + rows)
                    delta = tl.minimum(err_max[:, None] * x_l1[None, :], err_l2[:, None] * x_l2[None, :])
                    delta = (delta + acc_err_coef * scale[:, None] * x_l1[None, :] + tl.abs(z) * 4.0e-7) * slack
                    upper = z + tl.abs(z) * rel_margin + abs_margin + delta
                    is_cand = (upper >= threshold[None, :]) & valid_v[:, None] & mask_b[None, :]
                    cand_row = tl.max(is_cand.to(tl.int32), axis=1)
                    count = tl.sum(cand_row, axis=0)
                    if count > 0:
                        tl.debug_barrier()  # the int8 logits above are stored before any thread overwrites them
                        if count > tl.minimum(gather_max_rows, SLOTS):
                            # Too many candidates for row gathers: the bf16 kernel recomputes the whole block (or,
                            # with INLINE_BF16, this program does, below).
                            if not INLINE_BF16:
                                spill = tl.full([], 1, tl.int32)
                            tl.atomic_add(flat_ptr + 1, 1)  # (with INLINE_BF16 a count only: nothing reads it)
                            # Still publish a lower bound: the exact logits of the block's top int8 rows (of the
                            # first SLOTS tokens), so that the programs to come test against a higher one.
                            top = tl.argmax(tl.where(valid_v[:, None], z, -float("inf")), axis=0)
                            offs_s = tl.arange(0, SLOTS)
                            own = tl.arange(0, BLOCK_B)[None, :] == offs_s[:, None]
                            slot_row = pid_v * BLOCK_V + tl.max(tl.where(own, top[None, :], 0), axis=1)
                            slot_ok = (tl.max(tl.where(own, block_hit.to(tl.int32), 0), axis=1) > 0) & (
                                slot_row < num_valid_rows
                            )
                            slot_row = tl.where(slot_ok, slot_row, 0)
                            tl.debug_barrier()
                            exact, exact_abs = _rows_exact(slot_row, slot_ok, offs_b, mask_b, num_tokens, x_ptr, w_ptr,
                                                           hidden, stride_x, stride_w, SLOTS, BLOCK_B,
                                                           GATHER_BLOCK_K, FP32_DOT, GATHER_STAGES,
                                                           GATHER_EVEN_K)  # fmt: skip
                            if HAS_BIAS:
                                slot_bias = tl.load(bias_ptr + slot_row, mask=slot_ok, other=0.0).to(tl.float32)
                                exact += slot_bias[:, None]
                                exact_abs += tl.abs(slot_bias)[:, None]
                            proven = tl.where(slot_ok[:, None], exact - exact_abs * exact_err_coef, -float("inf"))
                            best = tl.max(proven, axis=0)
                            tl.atomic_max(probe_ptr + toks, best, mask=mask_b & (best > lower))
                            if INLINE_BF16:
                                tl.debug_barrier()
                                _bf16_tile_store(pid_v, pid_b, x_ptr, w_ptr, bias_ptr, out_ptrs, out_mask, rows,
                                                 num_tokens, num_rows, hidden, stride_x, stride_w, HAS_BIAS, BLOCK_V,
                                                 BLOCK_B, BF16_TILE_K, CONVERT, BF16_EVEN_K, EVICT_FIRST,
                                                 BF16_RN_BY_BITS)  # fmt: skip
                        else:
                            # The candidate rows: exact logits for every token of the tile (exact values are always
                            # allowed), and a better lower bound for the programs still to come. The rows are taken
                            # in index order by repeated minima into one group of SLOTS (one gather: no loop around
                            # the pipelined one).
                            remaining = cand_row > 0
                            offs_s = tl.arange(0, SLOTS)
                            slot_row = tl.full([SLOTS], num_rows, dtype=tl.int32)
                            for s in tl.static_range(SLOTS):
                                row = tl.min(tl.where(remaining, offs_v, num_rows), axis=0)
                                slot_row = tl.where(offs_s == s, row, slot_row)
                                remaining = remaining & (offs_v != row)
                            slot_ok = slot_row < num_valid_rows
                            slot_row = tl.where(slot_ok, slot_row, 0)
                            tl.debug_barrier()
                            exact, exact_abs = _rows_exact(slot_row, slot_ok, offs_b, mask_b, num_tokens, x_ptr, w_ptr,
                                                           hidden, stride_x, stride_w, SLOTS, BLOCK_B,
                                                           GATHER_BLOCK_K, FP32_DOT, GATHER_STAGES,
                                                           GATHER_EVEN_K)  # fmt: skip
                            if HAS_BIAS:
                                slot_bias = tl.load(bias_ptr + slot_row, mask=slot_ok, other=0.0).to(tl.float32)
                                exact += slot_bias[:, None]
                                exact_abs += tl.abs(slot_bias)[:, None]
                            slot_ptrs = out_ptr + offs_b[None, :].to(tl.int64) * stride_out + slot_row[:, None]
                            slot_mask = slot_ok[:, None] & mask_b[None, :]
                            tl.store(slot_ptrs, _to_output_dtype(exact, out_ptr, BF16_RN_BY_BITS), mask=slot_mask)
                            # fp32 sum of exact products: error <= gamma * sum |products|.
                            proven = tl.where(slot_mask, exact - exact_abs * exact_err_coef, -float("inf"))
                            best = tl.max(proven, axis=0)
                            tl.atomic_max(probe_ptr + toks, best, mask=mask_b & (best > lower))
                            if STATS:
                                tl.atomic_add(stats_ptr, count)
                tl.store(spill_ptr + pid_b * num_blocks + pid_v, spill.to(tl.int8))
            elif INLINE_BF16:  # a flat batch: this program computes its tile from the bf16 weight
                _bf16_tile_store(pid_v, pid_b, x_ptr, w_ptr, bias_ptr, out_ptrs, out_mask, rows, num_tokens, num_rows,
                                 hidden, stride_x, stride_w, HAS_BIAS, BLOCK_V, BLOCK_B, BF16_TILE_K, CONVERT,
                                 BF16_EVEN_K, EVICT_FIRST, BF16_RN_BY_BITS)  # fmt: skip

    @triton.jit(do_not_specialize=["num_tokens"])  # one compiled kernel for all batches of a bucket
    def _int8_logits_kernel(
        x_ptr,  # [B, K] activations (bf16/fp16/fp32)
        q_ptr,  # int8 codes: [V, K], or tiled (TILED)
        scale_ptr,  # [V] fp32
        bias_ptr,  # [V] or dummy
        out_ptr,  # [B, V] output logits
        num_tokens,
        num_rows,
        num_valid_rows,  # rows >= this (vocab padding) are never candidates
        num_blocks,
        hidden,
        stride_x,
        stride_q,
        stride_out,
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
        EXACT: tl.constexpr = False,  # the argmax-exact path (module docstring); the rest is for it
        w_ptr=None,  # [V, K] the bf16 weight
        err_max_ptr=None,  # [V] fp32
        err_l2_ptr=None,  # [V] fp32
        block_stats_ptr=None,  # [3, NB] fp32: per block the largest err_max, err_l2, scale (block_bound_stats)
        probe_ptr=None,  # [3, B] fp32 from the probe: lower bound of each token's maximum logit, |x|_1, |x|_2
        flat_ptr=None,  # int32 [2]: 1 when the batch is flat (the probe's verdict), blocks left to the bf16 kernel
        stats_ptr=None,  # int32 with STATS: rows re-scored
        spill_ptr=None,  # [token blocks, NB] int8 out: 1 for a block the bf16 kernel recomputes whole
        stride_w=0,
        stride_probe=0,
        gather_max_rows=0,  # a block with more candidate rows is recomputed whole
        acc_err_coef=0.0,
        exact_err_coef=0.0,
        slack=1.0,
        rel_margin=0.0,
        abs_margin=0.0,
        WAIT_PRIMARY: tl.constexpr = False,
        SLOTS: tl.constexpr = 16,
        GATHER_BLOCK_K: tl.constexpr = 128,
        STATS: tl.constexpr = False,
        LAUNCH_DEPENDENTS: tl.constexpr = False,
        FP32_DOT: tl.constexpr = False,  # the interpreter: fp32 dots for the bf16 weight too
        GATHER_STAGES: tl.constexpr = 2,  # pipeline stages of the candidate rows' loop
        GATHER_EVEN_K: tl.constexpr = False,  # hidden is a multiple of GATHER_BLOCK_K
        INLINE_BF16: tl.constexpr = False,  # flat batches and spilled blocks computed here from the bf16 weight
        BF16_TILE_K: tl.constexpr = 64,
        BF16_EVEN_K: tl.constexpr = False,
    ):
        pid_b = tl.program_id(1)
        if EXACT & LAUNCH_DEPENDENTS:  # the bf16 kernel may start now; it waits for this grid's results
            _gdc_launch_dependents()
        if PERSISTENT:
            # A fixed grid of programs walks the vocab blocks (no partial last wave of blocks).
            for pid_v in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
                _logits_block(pid_v, pid_b, x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, w_ptr, err_max_ptr, err_l2_ptr,
                              block_stats_ptr, probe_ptr, flat_ptr, stats_ptr, spill_ptr, num_tokens, num_rows,
                              num_valid_rows, num_blocks, hidden, stride_x,
                              stride_q, stride_out, stride_w, stride_probe, gather_max_rows, acc_err_coef,
                              exact_err_coef, slack, rel_margin, abs_margin, HAS_BIAS, BLOCK_V, BLOCK_B, BLOCK_K,
                              CONVERT, W_IS_A, EVEN_K, BF16_RN_BY_BITS, TILED, EVICT_FIRST, EXACT, WAIT_PRIMARY,
                              SLOTS, GATHER_BLOCK_K, STATS, FP32_DOT, GATHER_STAGES, GATHER_EVEN_K, INLINE_BF16,
                          BF16_TILE_K, BF16_EVEN_K)  # fmt: skip
        else:
            _logits_block(tl.program_id(0), pid_b, x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, w_ptr, err_max_ptr,
                          err_l2_ptr, block_stats_ptr, probe_ptr, flat_ptr, stats_ptr, spill_ptr, num_tokens,
                          num_rows, num_valid_rows, num_blocks, hidden,
                          stride_x, stride_q, stride_out, stride_w, stride_probe, gather_max_rows, acc_err_coef,
                          exact_err_coef, slack, rel_margin, abs_margin, HAS_BIAS, BLOCK_V, BLOCK_B, BLOCK_K, CONVERT,
                          W_IS_A, EVEN_K, BF16_RN_BY_BITS, TILED, EVICT_FIRST, EXACT, WAIT_PRIMARY, SLOTS,
                          GATHER_BLOCK_K, STATS, FP32_DOT, GATHER_STAGES, GATHER_EVEN_K, INLINE_BF16,
                          BF16_TILE_K, BF16_EVEN_K)  # fmt: skip

    @triton.jit
    def _bf16_blocks_kernel(
        x_ptr,
        w_ptr,  # [V, K] the bf16 weight
        bias_ptr,
        out_ptr,
        flat_ptr,  # int32 [2]: the batch is flat; blocks the int8 kernel left to this kernel
        spill_ptr,  # [token blocks, NB] int8 from the int8 kernel
        num_tokens,
        num_rows,
        num_blocks,
        hidden,
        stride_x,
        stride_w,
        stride_out,
        HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CONVERT: tl.constexpr,
        EVEN_K: tl.constexpr,
        BF16_RN_BY_BITS: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
        WAIT_PRIMARY: tl.constexpr,
    ):
        """Exact logits (bf16 weight, fp32 accumulation) of the blocks that need them: all of them in a flat
        batch, else those the int8 kernel marked. A persistent grid: with nothing to do, every program returns
        after one load."""
        if WAIT_PRIMARY:
            _gdc_wait()
        flat = tl.load(flat_ptr, cache_modifier=".cg")
        marked = tl.load(flat_ptr + 1, cache_modifier=".cg")
        pid_b = tl.program_id(1)
        if (flat != 0) | (marked != 0):
            offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
            mask_b = offs_b < num_tokens
            for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
                need = flat
                if flat == 0:
                    need = tl.load(spill_ptr + pid_b * num_blocks + blk, cache_modifier=".cg").to(tl.int32)
                if need != 0:
                    offs_v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
                    z = _tile_sums(blk, pid_b, x_ptr, w_ptr, num_tokens, num_rows, hidden, stride_x, stride_w, BLOCK_V,
                                   BLOCK_B, BLOCK_K, CONVERT, 0, EVEN_K, False, EVICT_FIRST)  # fmt: skip
                    if HAS_BIAS:
                        z += tl.load(bias_ptr + tl.minimum(offs_v, num_rows - 1)).to(tl.float32)[:, None]
                    out_ptrs = out_ptr + offs_b[None, :].to(tl.int64) * stride_out + offs_v[:, None]
                    out_mask = (offs_v < num_rows)[:, None] & mask_b[None, :]
                    tl.store(out_ptrs, _to_output_dtype(z, out_ptr, BF16_RN_BY_BITS), mask=out_mask)

    @triton.jit
    def _decide_all(
        x_ptr,
        bias_ptr,
        part_ptr,
        scale_ptr,
        err_max_ptr,
        err_l2_ptr,
        probe_ptr,
        token_ptr,
        ws_ptr,
        flat_ptr,
        num_tokens,
        num_valid_rows,
        num_samples,
        hidden,
        stride_x,
        stride_probe,
        acc_err_coef,
        exact_err_coef,
        slack,
        rel_margin,
        abs_margin,
        flat_count,
        HAS_BIAS: tl.constexpr,
        STRIDE: tl.constexpr,
        KSPLIT: tl.constexpr,
        S_POW2: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_KC: tl.constexpr,
    ):
        """PROBE_FUSED: ``_probe_decide_kernel``'s work for every token in one program (the probe's last), the
        union of reached samples in registers."""
        offs = tl.arange(0, S_POW2)
        in_range = offs < num_samples
        rows = offs * STRIDE
        valid = in_range & (rows < num_valid_rows)
        safe_rows = tl.where(valid, rows, 0)
        scale = tl.load(scale_ptr + safe_rows, mask=valid, other=0.0)
        err_max = tl.load(err_max_ptr + safe_rows, mask=valid, other=0.0)
        err_l2 = tl.load(err_l2_ptr + safe_rows, mask=valid, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + safe_rows, mask=valid, other=0.0).to(tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        union = tl.zeros([S_POW2], dtype=tl.int32)
        any_flat = tl.full([], 0, tl.int32)
        for tok in range(0, num_tokens):
            x_row = x_ptr + (tok + tl.zeros([], dtype=tl.int64)) * stride_x
            l1 = tl.zeros([BLOCK_K], dtype=tl.float32)
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for c in tl.static_range(NUM_KC):
                kk = c * BLOCK_K + offs_k
                xv = tl.load(x_row + kk, mask=kk < hidden, other=0.0).to(tl.float32)
                l1 += tl.abs(xv)
                sq += xv * xv
            x_l1 = tl.sum(l1, axis=0) * slack
            x_l2 = tl.sqrt(tl.sum(sq, axis=0)) * slack
            z = tl.zeros([S_POW2], dtype=tl.float32)
            z_abs = tl.zeros([S_POW2], dtype=tl.float32)
            for p in tl.static_range(KSPLIT):
                at = (p * 2 * num_tokens + tok).to(tl.int64) * num_samples + tl.minimum(offs, num_samples - 1)
                z += tl.load(part_ptr + at, mask=in_range, other=0.0, cache_modifier=".cg")
                z_abs += tl.load(
                    part_ptr + at + num_tokens * num_samples, mask=in_range, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                z += bias
                z_abs += tl.abs(bias)
            lb0 = tl.max(tl.where(valid, z - z_abs * exact_err_coef, -float("inf")), axis=0)
            quant = tl.minimum(err_max * x_l1, err_l2 * x_l2)
            delta = (quant + acc_err_coef * scale * x_l1 + tl.abs(z) * 4.0e-7) * slack
            threshold = lb0 - (tl.abs(lb0) * rel_margin + abs_margin)
            reach = valid & (z + tl.abs(z) * rel_margin + abs_margin + delta >= threshold)
            count = tl.sum(reach.to(tl.int32), axis=0)
            own_flat = (count >= flat_count).to(tl.int32)
            tl.store(probe_ptr + tok, lb0)
            tl.store(probe_ptr + stride_probe + tok, x_l1)
            tl.store(probe_ptr + 2 * stride_probe + tok, x_l2)
            tl.store(token_ptr + tok, count)
            tl.store(token_ptr + num_tokens + tok, own_flat)
            union = union | reach.to(tl.int32)
            any_flat = any_flat | own_flat
        union_count = tl.sum(union, axis=0)
        tl.store(ws_ptr + S_POW2 + 2, union_count)
        tl.store(flat_ptr, ((union_count >= flat_count) | (any_flat != 0)).to(tl.int32))

    @triton.jit
    def _probe_kernel(
        x_ptr,  # [B, K]
        w_ptr,  # [V, K] the bf16 weight
        part_ptr,  # [KSPLIT, 2, B, S] fp32 out: per K part, sum w x and sum |w x| of each sampled row
        ws_ptr,  # int32 workspace of the decision and the bf16 kernel: [S_POW2 + 8], reset here
        num_tokens,
        num_valid_rows,
        num_samples,
        hidden,
        k_part,  # hidden elements per K part (a multiple of BLOCK_K)
        stride_x,
        stride_w,
        STRIDE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        S_POW2: tl.constexpr,
        FP32_DOT: tl.constexpr,
        LAUNCH_DEPENDENTS: tl.constexpr,
        COMPACT: tl.constexpr = False,  # w_ptr holds only the sampled rows, contiguous
        FUSED: tl.constexpr = False,  # the last program to finish (a ticket) also makes the decision
        ticket_ptr=None,  # int32, 0 between calls (the last program resets it)
        bias_ptr=None,
        scale_ptr=None,
        err_max_ptr=None,
        err_l2_ptr=None,
        probe_ptr=None,
        token_ptr=None,
        flat_ptr=None,
        stride_probe=0,
        acc_err_coef=0.0,
        exact_err_coef=0.0,
        slack=1.0,
        rel_margin=0.0,
        abs_margin=0.0,
        flat_count=0,
        HAS_BIAS: tl.constexpr = False,
        KSPLIT: tl.constexpr = 1,
        DECIDE_BLOCK_K: tl.constexpr = 1024,
        NUM_KC: tl.constexpr = 1,
    ):
        """The flatness probe, part 1: sums for every STRIDE-th row (ROWS sampled rows x BLOCK_B tokens x one
        K part per program)."""
        if LAUNCH_DEPENDENTS:  # the decision kernel may start now; it waits for this grid's results
            _gdc_launch_dependents()
        part = tl.program_id(2)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (part == 0):
            # The decision's union of sampled rows, ticket, any-flat word and verdict, and the count of blocks
            # marked for the bf16 kernel start at 0.
            offs_ws = tl.arange(0, S_POW2)
            tl.store(ws_ptr + offs_ws, tl.zeros([S_POW2], dtype=tl.int32))
            tl.store(ws_ptr + S_POW2 + tl.arange(0, 8), tl.zeros([8], dtype=tl.int32))
        offs_s = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows = offs_s * STRIDE
        valid = (offs_s < num_samples) & (rows < num_valid_rows)
        if COMPACT:  # noqa: SIM108 - constexpr branches, kept as statements for Triton
            safe_rows = tl.where(valid, offs_s, 0)
        else:
            safe_rows = tl.where(valid, rows, 0)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_b = offs_b < num_tokens
        toks = tl.minimum(offs_b, num_tokens - 1)  # every address in bounds, masked or not
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_B, ROWS], dtype=tl.float32)
        acc_abs = tl.zeros([BLOCK_B, ROWS], dtype=tl.float32)
        k_start = part * k_part
        for k0 in range(k_start, tl.minimum(k_start + k_part, hidden), BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < hidden
            w = tl.load(
                w_ptr + safe_rows[:, None].to(tl.int64) * stride_w + kk[None, :],
                mask=valid[:, None] & mask_k[None, :],
                other=0.0,
            )
            xt = tl.load(
                x_ptr + toks[:, None].to(tl.int64) * stride_x + kk[None, :],
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
        at = (part * 2 * num_tokens + offs_b[:, None]).to(tl.int64) * num_samples + offs_s[None, :]
        store = mask_b[:, None] & (offs_s < num_samples)[None, :]
        tl.store(part_ptr + at, acc, mask=store)
        tl.store(part_ptr + at + num_tokens * num_samples, acc_abs, mask=store)
        if FUSED:
            tl.debug_barrier()
            total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
            ticket = tl.atomic_add(ticket_ptr, 1)  # acq_rel: every other program's sums are in
            if ticket == total - 1:
                tl.store(ticket_ptr, 0)
                _decide_all(x_ptr, bias_ptr, part_ptr, scale_ptr, err_max_ptr, err_l2_ptr, probe_ptr, token_ptr,
                            ws_ptr, flat_ptr, num_tokens, num_valid_rows, num_samples, hidden, stride_x,
                            stride_probe, acc_err_coef, exact_err_coef, slack, rel_margin, abs_margin, flat_count,
                            HAS_BIAS, STRIDE, KSPLIT, S_POW2, DECIDE_BLOCK_K, NUM_KC)  # fmt: skip

    @triton.jit
    def _probe_decide_kernel(
        x_ptr,
        bias_ptr,
        part_ptr,  # [KSPLIT, 2, B, S] from the probe
        scale_ptr,
        err_max_ptr,
        err_l2_ptr,
        probe_ptr,  # [3, B] fp32 out: LB0 (the sample's lower bound of the token's maximum), |x|_1, |x|_2
        token_ptr,  # [2, B] int32 out: sampled rows within reach of LB0, the token's own flat verdict
        ws_ptr,  # int32 workspace: union of reached sampled rows [S_POW2], then ticket, any-flat, union count
        flat_ptr,  # int32 out: 1 when the batch is flat
        num_tokens,
        num_valid_rows,
        num_samples,
        hidden,
        stride_x,
        stride_probe,
        acc_err_coef,
        exact_err_coef,
        slack,
        rel_margin,
        abs_margin,
        flat_count,
        HAS_BIAS: tl.constexpr,
        STRIDE: tl.constexpr,
        KSPLIT: tl.constexpr,
        S_POW2: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_KC: tl.constexpr,
        WAIT_PRIMARY: tl.constexpr,
        LAUNCH_DEPENDENTS: tl.constexpr,
    ):
        """The flatness probe, part 2, one program per token: LB0, and the sampled rows that would be re-scoring
        candidates against it (the int8 kernel's test with the exact logit in place of the int8 one). The
        last program to finish decides for the batch: flat when some token, or the union over the tokens,
        reaches ``flat_count`` sampled rows (each stands for STRIDE rows)."""
        if LAUNCH_DEPENDENTS:  # the int8 kernel may start now; it waits for this grid's results
            _gdc_launch_dependents()
        tok = tl.program_id(0)
        # Prologue on inputs the probe does not write (it overlaps the probe's run).
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
        scale = tl.load(scale_ptr + safe_rows, mask=valid, other=0.0)
        quant = tl.minimum(
            tl.load(err_max_ptr + safe_rows, mask=valid, other=0.0) * x_l1,
            tl.load(err_l2_ptr + safe_rows, mask=valid, other=0.0) * x_l2,
        )
        if HAS_BIAS:
            bias = tl.load(bias_ptr + safe_rows, mask=valid, other=0.0).to(tl.float32)
        if WAIT_PRIMARY:
            _gdc_wait()
        z = tl.zeros([S_POW2], dtype=tl.float32)
        z_abs = tl.zeros([S_POW2], dtype=tl.float32)
        for p in tl.static_range(KSPLIT):
            at = (p * 2 * num_tokens + tok).to(tl.int64) * num_samples + tl.minimum(offs, num_samples - 1)
            z += tl.load(part_ptr + at, mask=in_range, other=0.0, cache_modifier=".cg")
            z_abs += tl.load(part_ptr + at + num_tokens * num_samples, mask=in_range, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            z += bias
            z_abs += tl.abs(bias)
        # fp32 sums of exact products (in any order): error <= gamma * sum |products|.
        lb0 = tl.max(tl.where(valid, z - z_abs * exact_err_coef, -float("inf")), axis=0)
        delta = (quant + acc_err_coef * scale * x_l1 + tl.abs(z) * 4.0e-7) * slack
        threshold = lb0 - (tl.abs(lb0) * rel_margin + abs_margin)
        reach = valid & (z + tl.abs(z) * rel_margin + abs_margin + delta >= threshold)
        count = tl.sum(reach.to(tl.int32), axis=0)
        own_flat = (count >= flat_count).to(tl.int32)
        tl.store(probe_ptr + tok, lb0)
        tl.store(probe_ptr + stride_probe + tok, x_l1)
        tl.store(probe_ptr + 2 * stride_probe + tok, x_l2)
        tl.store(token_ptr + tok, count)
        tl.store(token_ptr + num_tokens + tok, own_flat)
        tl.atomic_or(ws_ptr + offs, 1, mask=reach)
        tl.atomic_or(ws_ptr + S_POW2 + 1, own_flat)
        tl.debug_barrier()
        # Last program done (a ticket): every other program's union bits and verdict are in (acq_rel).
        ticket = tl.atomic_add(ws_ptr + S_POW2, 1)
        if ticket == num_tokens - 1:
            union = tl.sum(tl.where(in_range, tl.atomic_add(ws_ptr + offs, 0, mask=in_range), 0), axis=0)
            any_flat = tl.atomic_add(ws_ptr + S_POW2 + 1, 0)
            tl.store(ws_ptr + S_POW2 + 2, union)
            tl.store(flat_ptr, ((union >= flat_count) | (any_flat != 0)).to(tl.int32))


def kernels_interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 before import)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_int8_logits_kernel, InterpretedFunction)


def pdl_supported(device: torch.device) -> bool:
    """Whether the exact path's kernels are chained with programmatic dependent launch on ``device``."""
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
    probe_stride: int = PROBE_STRIDE,
    flat_sample_share: float = FLAT_SAMPLE_SHARE,
    gather_max_rows: int = GATHER_MAX_ROWS,
    stats: dict | None = None,
) -> torch.Tensor:
    """Logits ``x @ weight.T (+ bias)`` of ``x`` [B, K] through the int8 copy, shape [B, V], dtype of x.

    With ``exact_argmax`` (the default) the greedy argmax of the result equals that of the bf16
    logits (module docstring); without it the result is the plain int8 approximation.
    ``num_valid_rows``: rows past it (vocab padding) are left out of the bound.
    ``probe_stride``, ``flat_sample_share`` and ``gather_max_rows``: the flatness probe's sampling and
    threshold, and the candidate rows above which a block is recomputed whole (module constants by
    default; for tests). ``stats`` (tests, benchmark): a dict that receives the probe's per-token
    counts and verdicts, the batch's, and what the int8 kernel re-scored, as tensors (reading them
    synchronizes; the counters cost atomics, so the timed path runs without them).
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
    has_bias = bias is not None
    bias_arg = bias if has_bias else packed.scale
    persistent = cfg.programs_per_sm > 0 and not on_cpu
    grid_v = min(num_blocks, _persistent_programs(x.device, cfg.programs_per_sm)) if persistent else num_blocks
    common = {
        "HAS_BIAS": has_bias,
        "BLOCK_V": cfg.block_v,
        "BLOCK_B": cfg.block_b,
        "BLOCK_K": cfg.block_k,
        "CONVERT": convert,
        "W_IS_A": cfg.w_is_a,
        "EVEN_K": hidden % cfg.block_k == 0,
        "BF16_RN_BY_BITS": round_by_bits,
        "PERSISTENT": persistent,
        "TILED": tiled,
        "EVICT_FIRST": bool(cfg.evict_first) and not on_cpu,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    args = (
        x,
        packed.qweight,
        packed.scale,
        bias_arg,
        out,
        num_tokens,
        num_rows,
        valid_rows,
        num_blocks,
        hidden,
        x.stride(0),
        packed.qweight.shape[1] if tiled else packed.qweight.stride(0),
        out.stride(0),
    )
    grid = (grid_v, triton.cdiv(num_tokens, cfg.block_b))
    if not exact_argmax:
        _int8_logits_kernel[grid](*args, **common)
        return out
    use_pdl = pdl_supported(x.device)
    probe = _run_probe(x, packed, weight, bias, valid_rows, hidden, probe_stride, flat_sample_share, on_cpu, use_pdl)
    rel_margin, abs_margin = OUTPUT_MARGIN[x.dtype]
    slack = norm_slack(hidden)
    counters = torch.zeros(1, dtype=torch.int32, device=x.device) if stats is not None else probe["flat"]
    grid_b = triton.cdiv(num_tokens, cfg.block_b)
    spill = torch.empty((grid_b, num_blocks), dtype=torch.int8, device=x.device)
    pdl = {"launch_pdl": True} if use_pdl else {}
    _int8_logits_kernel[grid](
        *args,
        **common,
        EXACT=True,
        w_ptr=weight,
        err_max_ptr=packed.err_max,
        err_l2_ptr=packed.err_l2,
        block_stats_ptr=block_bound_stats(packed, cfg.block_v),
        probe_ptr=probe["bounds"],
        flat_ptr=probe["flat"],
        stats_ptr=counters,
        spill_ptr=spill,
        stride_w=weight.stride(0),
        stride_probe=probe["bounds"].stride(0),
        gather_max_rows=gather_max_rows,
        acc_err_coef=accumulation_error_coefficient(hidden),
        exact_err_coef=exact_sum_error_coefficient(hidden) * slack,
        slack=slack,
        rel_margin=rel_margin,
        abs_margin=abs_margin,
        WAIT_PRIMARY=use_pdl,
        SLOTS=GATHER_SLOTS,
        GATHER_STAGES=1 if on_cpu else GATHER_STAGES,
        GATHER_BLOCK_K=min(GATHER_BLOCK_K, triton.next_power_of_2(hidden)),
        GATHER_EVEN_K=hidden % min(GATHER_BLOCK_K, triton.next_power_of_2(hidden)) == 0,
        INLINE_BF16=INLINE_BF16,
        BF16_TILE_K=BF16_BLOCK_K,
        BF16_EVEN_K=hidden % BF16_BLOCK_K == 0,
        STATS=stats is not None,
        LAUNCH_DEPENDENTS=use_pdl,
        FP32_DOT=on_cpu,
        **pdl,
        **({"maxnreg": INT8_EXACT_MAXNREG} if INT8_EXACT_MAXNREG and not on_cpu else {}),
    )
    # The flat batch's logits, or the blocks the int8 kernel marked: a persistent grid that returns at once
    # when there is nothing to do.
    programs = 4 if on_cpu else _persistent_programs(x.device, BF16_PROGRAMS_PER_SM)
    if not INLINE_BF16:
        _bf16_blocks_kernel[(min(num_blocks, programs), grid_b)](
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
            HAS_BIAS=has_bias,
            BLOCK_V=cfg.block_v,
            BLOCK_B=cfg.block_b,
            BLOCK_K=BF16_BLOCK_K,
            CONVERT=2 if on_cpu else 0,
            EVEN_K=hidden % BF16_BLOCK_K == 0,
            BF16_RN_BY_BITS=round_by_bits,
            EVICT_FIRST=not on_cpu,
            WAIT_PRIMARY=use_pdl,
            num_warps=4,
            num_stages=BF16_STAGES,
            **pdl,
        )
    if stats is not None:
        stats.update(
            flat=probe["tokens"][1].clone(),
            near=probe["tokens"][0].clone(),
            batch_flat=probe["flat"][0].clone(),
            union=probe["union"].clone(),
            lower_bound=probe["bounds"][0].clone(),
            rows_rescored=counters[0].clone(),
            blocks_recomputed=probe["flat"][1].clone(),
            samples=probe["samples"],
        )
    return out


_COMPACT_CACHE: dict = {}
_TICKETS: dict = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """PROBE_FUSED: the probe's ticket word on ``device``, zero between calls (its last program resets it)."""
    found = _TICKETS.get(str(device))
    if found is None:
        found = _TICKETS[str(device)] = torch.zeros(1, dtype=torch.int32, device=device)
    return found


def _compact_sample(weight: torch.Tensor, stride: int, valid_rows: int) -> torch.Tensor:
    """PROBE_COMPACT: the sampled rows of ``weight`` (every ``stride``-th valid row) as one contiguous tensor, made
    once per weight (keyed by its storage, shape and version; a scratch-module stand-in for a copy made at load
    time)."""
    key = (weight.data_ptr(), tuple(weight.shape), weight._version, stride, valid_rows)
    found = _COMPACT_CACHE.get(key)
    if found is None:
        if len(_COMPACT_CACHE) > 8:
            _COMPACT_CACHE.clear()
        found = _COMPACT_CACHE[key] = weight[:valid_rows:stride].contiguous()
    return found


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
    use_pdl: bool,
) -> dict:
    """The flatness probe (two small kernels, module docstring): per token LB0 and |x|_1, |x|_2, the sampled
    rows within reach, and the batch's flat verdict, all on the device."""
    num_tokens = x.shape[0]
    num_samples = triton.cdiv(valid_rows, stride)
    s_pow2 = triton.next_power_of_2(num_samples)
    block_k = min(PROBE_BLOCK_K, triton.next_power_of_2(hidden))
    k_part = triton.cdiv(triton.cdiv(hidden, PROBE_KSPLIT), block_k) * block_k
    ksplit = triton.cdiv(hidden, k_part)
    parts = torch.empty((ksplit, 2, num_tokens, num_samples), dtype=torch.float32, device=x.device)
    workspace = torch.empty(s_pow2 + 8, dtype=torch.int32, device=x.device)
    bounds = torch.empty((3, num_tokens), dtype=torch.float32, device=x.device)
    tokens = torch.empty((2, num_tokens), dtype=torch.int32, device=x.device)
    flat = workspace[s_pow2 + 3 : s_pow2 + 5]
    pdl = {"launch_pdl": True} if use_pdl else {}
    probe_w = _compact_sample(weight, stride, valid_rows) if PROBE_COMPACT else weight
    rel_margin, abs_margin = OUTPUT_MARGIN[x.dtype]
    slack = norm_slack(hidden)
    decide_block_k = min(triton.next_power_of_2(hidden), 1024)
    flat_count = max(FLAT_MIN_SAMPLES, math.ceil(num_samples * flat_sample_share))
    fused = num_tokens <= PROBE_FUSED_MAX_TOKENS
    extra = {}
    if fused:
        extra = {
            "FUSED": True,
            "ticket_ptr": _ticket(x.device),
            "bias_ptr": bias if bias is not None else packed.scale,
            "scale_ptr": packed.scale,
            "err_max_ptr": packed.err_max,
            "err_l2_ptr": packed.err_l2,
            "probe_ptr": bounds,
            "token_ptr": tokens,
            "flat_ptr": flat,
            "stride_probe": bounds.stride(0),
            "acc_err_coef": accumulation_error_coefficient(hidden),
            "exact_err_coef": exact_sum_error_coefficient(hidden) * slack,
            "slack": slack,
            "rel_margin": rel_margin,
            "abs_margin": abs_margin,
            "flat_count": flat_count,
            "HAS_BIAS": bias is not None,
            "KSPLIT": ksplit,
            "DECIDE_BLOCK_K": decide_block_k,
            "NUM_KC": triton.cdiv(hidden, decide_block_k),
        }
    _probe_kernel[(triton.cdiv(num_samples, PROBE_ROWS), triton.cdiv(num_tokens, PROBE_BLOCK_B), ksplit)](
        x,
        probe_w,
        parts,
        workspace,
        num_tokens,
        valid_rows,
        num_samples,
        hidden,
        k_part,
        x.stride(0),
        probe_w.stride(0),
        STRIDE=stride,
        ROWS=PROBE_ROWS,
        BLOCK_B=PROBE_BLOCK_B,
        BLOCK_K=block_k,
        S_POW2=s_pow2,
        FP32_DOT=on_cpu,
        LAUNCH_DEPENDENTS=use_pdl,
        COMPACT=PROBE_COMPACT,
        num_warps=4,
        num_stages=PROBE_STAGES,
        **extra,
    )
    if fused:
        return {
            "bounds": bounds,
            "tokens": tokens,
            "flat": flat,
            "union": workspace[s_pow2 + 2],
            "samples": num_samples,
        }
    _probe_decide_kernel[(num_tokens,)](
        x,
        bias if bias is not None else packed.scale,
        parts,
        packed.scale,
        packed.err_max,
        packed.err_l2,
        bounds,
        tokens,
        workspace,
        flat,
        num_tokens,
        valid_rows,
        num_samples,
        hidden,
        x.stride(0),
        bounds.stride(0),
        accumulation_error_coefficient(hidden),
        exact_sum_error_coefficient(hidden) * slack,
        slack,
        rel_margin,
        abs_margin,
        max(FLAT_MIN_SAMPLES, math.ceil(num_samples * flat_sample_share)),
        HAS_BIAS=bias is not None,
        STRIDE=stride,
        KSPLIT=ksplit,
        S_POW2=s_pow2,
        BLOCK_K=decide_block_k,
        NUM_KC=triton.cdiv(hidden, decide_block_k),
        WAIT_PRIMARY=use_pdl,
        LAUNCH_DEPENDENTS=use_pdl,
        num_warps=4,
        **pdl,
    )
    return {
        "bounds": bounds,
        "tokens": tokens,
        "flat": flat,
        "union": workspace[s_pow2 + 2],
        "samples": num_samples,
    }


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
