"""GPU checks of the int8 lm head (sparkfleet/int8_lmhead.py): exact greedy argmax, bound, configs.

Run on a CUDA machine: ``python -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparkfleet import int8_lmhead as lmhead  # noqa: E402
from tests.gpu.near_ties import bf16_reference_argmax, near_tie_problem  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

FULL_ROWS, FULL_HIDDEN = 248_320, 3_072


@pytest.mark.parametrize("batch", [1, 2, 13, 16, 32, 40])
def test_near_ties_full_shape_exact(batch: int) -> None:
    weight, x = near_tie_problem(FULL_ROWS, FULL_HIDDEN, batch, seed=batch, device="cuda")
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    exact = lmhead.int8_lm_head_logits(x, packed, weight)
    plain = lmhead.int8_lm_head_logits(x, packed, weight, exact_argmax=False)
    want = bf16_reference_argmax(x, weight)
    assert exact.argmax(-1).tolist() == want.tolist()
    # cuBLAS agrees on this data (its rounding differs from float64 only far below the top).
    assert exact.argmax(-1).tolist() == torch.nn.functional.linear(x, weight).argmax(-1).tolist()
    if batch >= 13:  # the problem has teeth: plain int8 logits pick another token somewhere
        assert plain.argmax(-1).tolist() != want.tolist()


@pytest.mark.parametrize(
    "convert,w_is_a,tiled,evict",
    [(0, 1, 0, 0), (1, 1, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 1), (0, 0, 0, 1)],
)
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_every_kernel_variant_matches_float64(convert: int, w_is_a: int, tiled: int, evict: int, batch: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(batch)
    rows, hidden = 50_000 + 37, 3_072
    weight = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(batch, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    base = lmhead.select_kernel_config(batch)
    cfg = dataclasses.replace(base, convert=convert, w_is_a=w_is_a, tiled=tiled, evict_first=evict)
    packed = lmhead.quantize_lm_head_weight(weight, tile=(cfg.block_v, cfg.block_k) if tiled else None)
    # The output buffer the function allocates starts as NaN, so a logit never written stays NaN.
    real_empty = torch.empty
    lmhead_torch = lmhead.torch

    def nan_empty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    lmhead_torch.empty = nan_empty
    try:
        out = lmhead.int8_lm_head_logits(x, packed, weight, exact_argmax=False, config=cfg)
    finally:
        lmhead_torch.empty = real_empty
    assert not torch.isnan(out).any()
    dequant = packed.rows().double() * packed.scale.double()[:, None]
    want = x.double() @ dequant.T
    rel = (out.double() - want).norm() / want.norm()
    assert rel < 4e-3  # bf16 output rounding
    exact = x.double() @ weight.double().T
    bound = lmhead.int8_logit_error_bound(x, packed) + out.double().abs() * 2.0**-8
    assert bool(((out.double() - exact).abs() <= bound).all())
    assert lmhead.int8_lm_head_logits(x, packed, weight, config=cfg).argmax(-1).tolist() == (
        bf16_reference_argmax(x, weight).tolist()
    )


def test_bias_and_odd_hidden() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, hidden = 4_099, 1_000  # hidden not a multiple of any BLOCK_K
    weight = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(rows, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(5, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    out = lmhead.int8_lm_head_logits(x, packed, weight, bias)
    want = (x.double() @ weight.double().T + bias.double()).to(torch.bfloat16).argmax(-1)
    assert out.argmax(-1).tolist() == want.tolist()


@pytest.mark.parametrize("batch", [1, 5])
def test_flat_logits_rescore_everything_and_stay_exact(batch: int) -> None:
    """Near-identical rows: every token is a candidate (no fixed cap), the argmax still exact."""
    gen = torch.Generator(device="cuda").manual_seed(11 + batch)
    rows, hidden = 20_000 + 3, 3_072
    base = (torch.randn(hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    weight = base.repeat(rows, 1)
    # One element per row moved by about one bf16 ulp up or down: exact logits differ by a hair.
    cols = torch.randint(0, hidden, (rows,), device="cuda", generator=gen)
    picked = weight[torch.arange(rows, device="cuda"), cols].float()
    sign = torch.randint(0, 2, (rows,), device="cuda", generator=gen).float() * 2 - 1
    weight[torch.arange(rows, device="cuda"), cols] = (picked * (1 + sign * 2.0**-7)).to(torch.bfloat16)
    x = torch.randn(batch, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    exact = lmhead.int8_lm_head_logits(x, packed, weight)
    assert exact.argmax(-1).tolist() == bf16_reference_argmax(x, weight).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_full_shape_exact(seed: int) -> None:
    """Random data (a crowded top, hundreds of rows within twice the bound): exact argmax at batch 16."""
    gen = torch.Generator(device="cuda").manual_seed(100 + seed)
    weight = (torch.randn(FULL_ROWS, FULL_HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(16, FULL_HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    exact = lmhead.int8_lm_head_logits(x, packed, weight)
    assert exact.argmax(-1).tolist() == bf16_reference_argmax(x, weight).tolist()


def test_padding_rows_never_set_the_lower_bound() -> None:
    """Zero padding rows (logit 0) above all-negative real logits: the argmax over real rows stays exact."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, org, hidden = 70_000, 69_900, 3_072
    weight = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight[:org] = (torch.randn(org, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.zeros(rows, device="cuda", dtype=torch.bfloat16)
    bias[:org] = -60.0
    x = torch.randn(9, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    out = lmhead.int8_lm_head_logits(x, packed, weight, bias, num_valid_rows=org)
    want = (x.double() @ weight[:org].double().T + bias[:org].double()).to(torch.bfloat16).argmax(-1)
    assert out[:, :org].argmax(-1).tolist() == want.tolist()
