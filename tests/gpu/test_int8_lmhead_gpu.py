"""GPU checks of the int8 lm head (sparkfleet/kernels/int8_lmhead.py): exact greedy argmax, bound, configs.

Run on a CUDA machine: ``python -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparkfleet.kernels import int8_lmhead as lmhead  # noqa: E402
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


def _stats_call(x, packed, weight, **options):  # noqa: ANN001, ANN003, ANN202
    stats: dict = {}
    out = lmhead.int8_lm_head_logits(x, packed, weight, stats=stats, **options)
    return out, stats


@pytest.fixture(scope="module")
def full_problem():  # noqa: ANN201
    gen = torch.Generator(device="cuda").manual_seed(77)
    weight = (torch.randn(FULL_ROWS, FULL_HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(16, FULL_HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    return weight, x, lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_random_logits_are_not_flat_and_spill_nothing(full_problem, batch: int) -> None:  # noqa: ANN001
    weight, x, packed = full_problem
    out, stats = _stats_call(x[:batch], packed, weight)
    assert stats["flat"].sum().item() == 0 and stats["spilled"].sum().item() == 0
    assert out.argmax(-1).tolist() == bf16_reference_argmax(x[:batch], weight).tolist()


@pytest.mark.parametrize("batch", [1, 16])
def test_zero_hidden_states_go_to_the_bf16_kernel(full_problem, batch: int) -> None:  # noqa: ANN001
    """All logits 0: every row ties. The probe flags the batch flat; every logit is the bf16 kernel's."""
    weight, x, packed = full_problem
    zero = torch.zeros_like(x[:batch])
    out, stats = _stats_call(zero, packed, weight)
    assert stats["flat"].tolist() == [1] * batch
    assert torch.count_nonzero(out).item() == 0 and out.argmax(-1).tolist() == [0] * batch


def test_one_flat_token_sends_its_whole_batch_to_bf16(full_problem) -> None:  # noqa: ANN001
    weight, x, packed = full_problem
    mixed = x[:8].clone()
    mixed[5] = 0
    out, stats = _stats_call(mixed, packed, weight)
    assert stats["flat"].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    want = torch.nn.functional.linear(mixed, weight)
    assert out.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert torch.equal(out[5], want[5])


def test_identical_rows_tie_everywhere_and_the_first_wins() -> None:
    gen = torch.Generator(device="cuda").manual_seed(8)
    row = (torch.randn(1, FULL_HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    weight = row.repeat(FULL_ROWS, 1)
    x = torch.randn(4, FULL_HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    out, stats = _stats_call(x, packed, weight)
    assert stats["flat"].tolist() == [1] * 4
    assert out.argmax(-1).tolist() == [0] * 4
    assert (out == out[:, :1]).all()


def test_the_spill_path_is_exact_when_the_probe_sees_nothing() -> None:
    """Near-identical rows with the probe blinded: the re-scoring kernel re-scores its row budget and
    leaves the rest of its candidate blocks to the bf16 kernel; the result is exact."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    rows, hidden = 40_000 + 3, FULL_HIDDEN
    base = (torch.randn(hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    weight = base.repeat(rows, 1)
    cols = torch.randint(0, hidden, (rows,), device="cuda", generator=gen)
    picked = weight[torch.arange(rows, device="cuda"), cols].float()
    sign = torch.randint(0, 2, (rows,), device="cuda", generator=gen).float() * 2 - 1
    weight[torch.arange(rows, device="cuda"), cols] = (picked * (1 + sign * 2.0**-7)).to(torch.bfloat16)
    x = torch.randn(3, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    packed = lmhead.quantize_lm_head_weight(weight, tile=lmhead.weight_tile())
    out, stats = _stats_call(x, packed, weight, flat_sample_share=2.0, dense_sample_share=2.0)
    assert stats["flat"].sum().item() == 0 and stats["spilled"].sum().item() > 0
    assert out.argmax(-1).tolist() == bf16_reference_argmax(x, weight).tolist()


def test_a_graph_replay_decides_again_on_new_data(full_problem) -> None:  # noqa: ANN001
    """The flat decision is taken on the device at every call: a CUDA graph captured on random hidden
    states, replayed on all-zero ones, goes to the bf16 kernel, and back."""
    weight, x, packed = full_problem
    static = x[:2].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            lmhead.int8_lm_head_logits(static, packed, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lmhead.int8_lm_head_logits(static, packed, weight)
    for data in (x[:2], torch.zeros_like(x[:2]), x[2:4]):
        static.copy_(data)
        graph.replay()
        torch.cuda.synchronize()
        assert out.argmax(-1).tolist() == bf16_reference_argmax(static, weight).tolist()
        if not data.any():
            assert torch.count_nonzero(out).item() == 0
