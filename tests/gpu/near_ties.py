"""Lm-head test problems whose top logits are near-tied, shared by the CPU and GPU int8 tests.

For every batch row b, ``near_tie_problem`` plants a cluster of rows around the maximum:

* ``t``: a row on the int8 grid (``w = s * q``, ``s = 2**-10``, one element at q = 127 so the row's
  scale is exactly s), aligned with ``x_b`` so that it leads the random rows;
* ``p`` at a higher index than ``t``: ``t`` plus ``0.375 * s * sign(x_b)`` on every other element.
  Its int8 codes equal ``t``'s (the offsets round away), so the int8 logits tie and a plain int8
  argmax picks ``t``, while the exact logit of ``p`` is larger by ``0.375 * s * |x_b|_1``: the
  exact path must return ``p`` (or one of the rows below);
* copies of ``p`` with random perturbations of 0.35 or 4 quantization steps (near ties within the
  int8 error, some tying ``p`` after bf16 rounding of the logits);
* below ``t``'s index: an exact duplicate of ``p`` (even b: a true tie, the lowest index wins) or
  ``p`` with its weight at the largest ``|x_b|`` moved one bf16 ulp up (odd b: a tie after rounding
  or a win by a hair).
"""

from __future__ import annotations

import torch

GRID_SCALE = 2.0**-10
CLUSTER = 6


def bf16_reference_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Greedy token of the exact logits rounded to x's dtype (first index on ties), in float64."""
    logits = x.double() @ weight.double().T
    return logits.to(x.dtype).argmax(dim=-1)


def near_tie_problem(
    rows: int, hidden: int, batch: int, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [rows, hidden] bf16, x [batch, hidden] bf16) with near-tied top tokens per row."""
    per_row = CLUSTER + 3
    if rows < batch * per_row * 4:
        raise ValueError(f"rows={rows} too small for batch={batch}: use at least {batch * per_row * 4}")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, hidden, generator=gen) * 0.005
    x = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16).float()
    slots = torch.randperm(rows, generator=gen)[: batch * per_row].view(batch, per_row)
    for b in range(batch):
        ordered = sorted(int(i) for i in slots[b])
        low, top, partner, copies = ordered[0], ordered[1], ordered[2], ordered[3 : 3 + CLUSTER]
        anchor = int(torch.argmin(x[b].abs()))
        q = torch.clamp(torch.round(x[b] / x[b].abs().max() * 20.0), -20, 20)
        q[anchor] = 127.0
        weight[top] = q * GRID_SCALE
        offsets = 0.375 * torch.sign(x[b])
        offsets[anchor] = 0.0
        weight[partner] = (q + offsets) * GRID_SCALE
        for n, i in enumerate(copies):
            width = 0.7 if n % 2 == 0 else 8.0
            noise = (torch.rand(hidden, generator=gen) - 0.5) * width
            noise[anchor] = 0.0
            weight[i] = ((q + offsets + noise) * GRID_SCALE).to(torch.bfloat16).float()
        if b % 2 == 0:
            weight[low] = weight[partner]
        else:
            bumped = weight[partner].to(torch.bfloat16).clone()
            k = int(torch.argmax(torch.where(torch.arange(hidden) == anchor, 0.0, x[b].abs())))
            ulp = 2.0 ** (float(torch.floor(torch.log2(bumped[k].float().abs()))) - 7)
            bumped[k] = (bumped[k].float() + float(torch.sign(x[b, k])) * ulp).to(torch.bfloat16)
            weight[low] = bumped.float()
    return weight.to(torch.bfloat16).to(device), x.to(torch.bfloat16).to(device)
