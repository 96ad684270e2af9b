"""The int8 lm head on the real vLLM 0.23 code (patch 0003) and its kernels under the Triton interpreter.

In-process (fast, no Triton run): the quantization and its error bounds, the switch and its errors,
the device decision, and that the file patch 0003 adds is byte-identical to sparkfleet/kernels/int8_lmhead.py.

In one child process (``TRITON_INTERPRET=1`` must be set before triton is imported, so it cannot be
this pytest process): the installed vllm package is overlaid by a shadow tree where only the files
patch 0003 touches are real (``patch -p1`` applied to copies; everything else links to the installed
files), with ``VLLM_SPARKFLEET_INT8_LMHEAD=1``. There a real ``ParallelLMHead`` and ``LogitsProcessor``
run on CPU through the int8 kernels (the interpreter is the "device that supports it"), and then with
the device support switched off (the bf16 fallback). The child prints one JSON document; the tests
below assert on it. Run the child by hand with ``--scenario OUT_JSON`` (environment as in
``_child_env``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = pytest.mark.vllm

PATCH_FILE = REPO_ROOT / "files" / "patches" / "vllm-0.23.0" / "0003-int8-lm-head.patch"
SHARED_FILE = REPO_ROOT / "sparkfleet" / "kernels" / "int8_lmhead.py"
ADDED_FILE = "vllm/model_executor/layers/quantization/utils/int8_lmhead.py"
HOOK_FILE = "vllm/model_executor/layers/vocab_parallel_embedding.py"
CHILD_TIMEOUT_S = 240


# ---------------------------------------------------------------- in-process: no Triton kernel runs


def added_file_from_patch(patch_text: str, path: str) -> str:
    """The content a new-file hunk of a unified diff creates."""
    lines = patch_text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line.startswith("+++ ") and line[4:].split("\t")[0].strip() == f"b/{path}":
            if not lines[index - 1].startswith("--- /dev/null"):
                raise AssertionError(f"{path} is not created by the patch (old side is {lines[index - 1]!r})")
            body = []
            for hunk_line in lines[index + 2 :]:  # skip the @@ line
                if not hunk_line.startswith("+"):
                    break
                body.append(hunk_line[1:])
            return "".join(body)
    raise AssertionError(f"{path} not in the patch")


def patch_with_shared_file(patch_text: str, content: str, path: str = ADDED_FILE) -> str:
    """``patch_text`` with its new-file hunk for ``path`` replaced by ``content``."""
    marker = f"--- /dev/null\n+++ b/{path}\n"
    head, sep, tail = patch_text.partition(marker)
    if not sep:
        raise ValueError(f"no new-file hunk for {path} in the patch: add one (--- /dev/null, +++ b/{path})")
    lines = tail.splitlines(keepends=True)
    end = 1
    while end < len(lines) and lines[end].startswith("+"):
        end += 1
    body = content.splitlines(keepends=True)
    if not content.endswith("\n"):
        raise ValueError(f"{SHARED_FILE} must end with a newline")
    hunk = [f"@@ -0,0 +1,{len(body)} @@\n"] + ["+" + line for line in body]
    return head + marker + "".join(hunk) + "".join(lines[end:])


def test_patch_adds_the_shared_file_byte_for_byte() -> None:
    added = added_file_from_patch(PATCH_FILE.read_text(), ADDED_FILE)
    assert added == SHARED_FILE.read_text(), (
        "sparkfleet/kernels/int8_lmhead.py and the file patch 0003 adds differ: regenerate the hunk with "
        "build/venv-vllm/bin/python tests/vllm/test_int8_lmhead.py --write-patch"
    )


def test_quantization_bounds_hold() -> None:
    import torch

    from sparkfleet.kernels import int8_lmhead

    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(300, 70, generator=gen) * 0.03).to(torch.bfloat16)
    weight[5] = 0  # an all-zero row must not divide by zero
    packed = int8_lmhead.quantize_lm_head_weight(weight, chunk_rows=64)
    q = packed.rows().double()
    assert packed.qweight.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert int(q.abs().amax(dim=1)[torch.arange(300) != 5].min()) == 127  # each row uses its full range
    err = weight.double() - q * packed.scale.double()[:, None]
    assert bool((err.abs().amax(dim=1) <= packed.err_max.double()).all())
    assert bool((err.norm(dim=1) <= packed.err_l2.double()).all())
    assert bool((packed.err_max.double() <= packed.scale.double() * 0.5 * (1 + 1e-6)).all())
    assert float(packed.err_l2[5]) == 0.0 and int(packed.rows()[5].abs().sum()) == 0
    x = torch.randn(4, 70, generator=gen).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    dequant = x.double() @ (q * packed.scale.double()[:, None]).T
    assert bool(((dequant - exact).abs() <= int8_lmhead.int8_logit_error_bound(x, packed)).all())


def test_tiled_layout_holds_the_same_codes() -> None:
    import torch

    from sparkfleet.kernels import int8_lmhead

    weight = (torch.randn(300, 70, generator=torch.Generator().manual_seed(4)) * 0.03).to(torch.bfloat16)
    plain = int8_lmhead.quantize_lm_head_weight(weight, chunk_rows=100)
    tiled = int8_lmhead.quantize_lm_head_weight(weight, chunk_rows=100, tile=(64, 32))
    assert tuple(tiled.qweight.shape) == (5, 3, 64, 32)  # 300 rows -> 5 blocks, 70 columns -> 3 tiles
    assert torch.equal(tiled.rows(), plain.qweight)
    assert torch.equal(tiled.scale, plain.scale) and torch.equal(tiled.err_l2, plain.err_l2)
    assert int(tiled.qweight[4, :, 300 - 256 :].abs().sum()) == 0  # padding rows are zero
    assert int(tiled.qweight[:, 2, :, 70 - 64 :].abs().sum()) == 0  # padding columns are zero


def test_bad_inputs_are_named() -> None:
    import torch

    from sparkfleet.kernels import int8_lmhead

    with pytest.raises(ValueError, match=r"VLLM_SPARKFLEET_INT8_LMHEAD='yes'.*set it to 1"):
        int8_lmhead.int8_lmhead_enabled({"VLLM_SPARKFLEET_INT8_LMHEAD": "yes"})
    assert int8_lmhead.int8_lmhead_enabled({"VLLM_SPARKFLEET_INT8_LMHEAD": "1"})
    assert not int8_lmhead.int8_lmhead_enabled({})
    with pytest.raises(ValueError, match=r"must be 2-D.*\(3,\)"):
        int8_lmhead.quantize_lm_head_weight(torch.zeros(3))
    with pytest.raises(ValueError, match=r"tile=\(0, 32\) must be two positive sizes"):
        int8_lmhead.quantize_lm_head_weight(torch.zeros(4, 4), tile=(0, 32))
    with pytest.raises(ValueError, match="exceeds the largest bucket 64"):
        int8_lmhead.select_kernel_config(65)
    assert int8_lmhead.select_kernel_config(1).block_b == 16
    assert int8_lmhead.select_kernel_config(17).block_b == 32


def test_device_decision() -> None:
    """CUDA takes the int8 path whenever triton imports; CPU only under the interpreter."""
    import torch

    from sparkfleet.kernels import int8_lmhead

    assert int8_lmhead.triton is not None  # build/venv-vllm carries triton
    assert int8_lmhead.int8_lmhead_device_supported(torch.device("cuda"))
    assert int8_lmhead.int8_lmhead_device_supported(torch.device("cpu")) == int8_lmhead.kernels_interpreted()


# ---------------------------------------------------------------- the child process


def build_patched_overlay(dest: Path) -> Path:
    """Shadow tree of the installed vllm with patch 0003 applied to copies of the files it touches."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed in this interpreter: run with build/venv-vllm/bin/python")
    stock = Path(next(iter(spec.submodule_search_locations)))
    touched = [
        line[4:].split("\t")[0].strip()[2:]  # "+++ b/vllm/..." -> "vllm/..."
        for line in PATCH_FILE.read_text().splitlines()
        if line.startswith("+++ b/")
    ]
    assert HOOK_FILE in touched and ADDED_FILE in touched, touched
    real_dirs = {Path(*Path(p).parts[1:i]) for p in touched for i in range(1, len(Path(p).parts))}
    real_files = {Path(*Path(p).parts[1:]) for p in touched}

    def fill(src: Path, dst: Path, rel: Path) -> None:
        dst.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            entry_rel = rel / entry.name
            if entry.is_dir() and entry_rel in real_dirs:
                fill(entry, dst / entry.name, entry_rel)
            elif entry_rel in real_files:
                shutil.copyfile(entry, dst / entry.name)
            else:
                (dst / entry.name).symlink_to(entry)

    fill(stock, dest / "vllm", Path("."))
    result = subprocess.run(
        ["patch", "-p1", "-s", "--no-backup-if-mismatch", "-i", str(PATCH_FILE)],
        cwd=dest,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"patch 0003 does not apply to the installed vllm: {result.stdout}{result.stderr}")
    return dest


def _child_env(overlay: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(overlay), str(REPO_ROOT)]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TRITON_INTERPRET": "1",
            "VLLM_SPARKFLEET_INT8_LMHEAD": "1",
            "VLLM_CACHE_ROOT": str(overlay / "vllm-cache"),
            "VLLM_LOGGING_LEVEL": "ERROR",
        }
    )
    return env


@pytest.fixture(scope="module")
def scenario() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="int8-lmhead-") as tmp:
        overlay = build_patched_overlay(Path(tmp))
        out_json = Path(tmp) / "scenario.json"
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--scenario", str(out_json)],
            env=_child_env(overlay),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0 or not out_json.exists():
            raise AssertionError(f"scenario child failed (rc={result.returncode}):\n{result.stderr[-4000:]}")
        data = json.loads(out_json.read_text())
        return data


def test_child_ran_the_patched_tree(scenario: dict[str, Any]) -> None:
    assert scenario["vllm_file"].endswith("vllm/__init__.py") and "int8-lmhead-" in scenario["vllm_file"]
    assert scenario["kernels_interpreted"] is True


def test_int8_method_chosen_when_enabled_and_weight_kept(scenario: dict[str, Any]) -> None:
    s = scenario["enabled"]
    assert s["quant_method"] == "Int8LMHeadMethod"
    assert s["int8_copy_attached"] is True
    assert s["weight_unchanged"] is True and s["weight_same_storage"] is True and s["weight_is_parameter"]
    assert s["drafter_share_check_equal"] is True


def test_logits_processor_goes_through_int8_and_argmax_is_exact(scenario: dict[str, Any]) -> None:
    s = scenario["enabled"]
    assert s["int8_calls_forward"] == 1 and s["int8_calls_top_tokens"] == 1
    assert s["logits_shape"] == [s["batch"], s["org_vocab"]]
    assert s["forward_argmax"] == s["reference_argmax"]
    assert s["top_tokens"] == s["reference_argmax"]
    assert s["stock_argmax"] == s["reference_argmax"]
    # The int8 logits are approximations away from the top (so the int8 path really ran), within
    # the bound of the bf16 ones.
    assert s["logits_differing_from_stock"] > 0
    assert s["max_abs_diff_vs_stock"] <= s["max_bound_plus_rounding"]


def test_large_batch_and_replaced_weight(scenario: dict[str, Any]) -> None:
    s = scenario["enabled"]
    assert s["large_batch_calls"] == 0 and s["large_batch_equals_stock"] is True
    assert s["reloaded_requantized"] is True and s["reloaded_argmax_exact"] is True


def test_fallback_when_device_unsupported(scenario: dict[str, Any]) -> None:
    s = scenario["unsupported_device"]
    assert s["quant_method"] == "Int8LMHeadMethod" and s["int8_copy_attached"] is False
    assert s["int8_calls"] == 0 and s["equals_stock_exactly"] is True


def test_switch_is_a_known_vllm_variable(scenario: dict[str, Any]) -> None:
    """Patch 0003 registers the switch in vllm/envs.py, so vLLM's unknown-variable check passes."""
    assert scenario["env_registered"] is True and scenario["env_value_seen_by_vllm"] is True


def test_switch_off_and_bad_value(scenario: dict[str, Any]) -> None:
    assert scenario["disabled"]["quant_method"] == "UnquantizedEmbeddingMethod"
    assert "VLLM_SPARKFLEET_INT8_LMHEAD='on'" in scenario["bad_value_error"]


def test_kernels_under_interpreter(scenario: dict[str, Any]) -> None:
    cases = scenario["kernel_cases"]
    assert len(cases) >= 5
    for case in cases:
        assert case["exact_argmax"] == case["reference_argmax"], case["name"]
        assert case["all_written"], case["name"]
        assert case["max_err_over_bound"] <= 1.0, case["name"]
        assert case.get("flat", True) and case.get("spilled", True), case  # the path the case is about ran
    assert {"flat_logits_probe_flags_them", "flat_logits_rescored", "flat_logits_spilled"} <= {c["name"] for c in cases}
    assert {"zero_hidden_states", "identical_rows"} <= {c["name"] for c in cases}
    # The near-tie problems have teeth: the plain int8 argmax is wrong somewhere.
    assert any(c["plain_argmax"] != c["reference_argmax"] for c in cases)


def test_kernels_stay_inside_their_tensors(scenario: dict[str, Any]) -> None:
    """Every load, store and atomic of the kernel cases (every path: re-scoring, spill, flat, padding, bias, odd
    hidden sizes, tiled and row-major weights) addresses memory inside one of its launch's tensors. The GPU
    faults on such an access; the interpreter reads beside the tensor and goes on (tests/triton_memcheck.py)."""
    memcheck = scenario["memcheck"]
    # the check has teeth: it passes a masked read and catches one past the end of its tensor
    assert memcheck["self_test"]["masked"] == 0 and memcheck["self_test"]["unmasked"] > 0, memcheck["self_test"]
    assert memcheck["accesses_checked"] > 1000, memcheck
    assert memcheck["out_of_bounds"] == 0, memcheck["violations"][:3]


# ---------------------------------------------------------------- child body


def _kernel_cases(int8_lmhead: Any) -> list[dict[str, Any]]:
    """The kernel cases, with every float buffer the module allocates starting as NaN.

    ``int8_lm_head_logits`` allocates its output with ``torch.empty``; filled with NaN first, a
    logit the kernels never write stays NaN, so ``all_written`` (every logit finite) can fail.
    """
    import torch

    real_empty = torch.empty

    def nan_empty(*args: Any, **kwargs: Any) -> Any:
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    torch.empty = nan_empty
    try:
        return _kernel_cases_body(int8_lmhead)
    finally:
        torch.empty = real_empty


def _kernel_cases_body(int8_lmhead: Any) -> list[dict[str, Any]]:
    import torch

    from tests.gpu.near_ties import bf16_reference_argmax, near_tie_problem

    cases = []
    configs = {
        "x_as_a": int8_lmhead.KernelConfig(256, 16, 64, 4, 1, 0, 0),  # hidden > block_k: a K loop
        "w_as_a": int8_lmhead.KernelConfig(128, 16, 128, 4, 1, 0, 1),
        "tiled": int8_lmhead.KernelConfig(128, 16, 64, 4, 1, 0, 0, tiled=1),
    }
    for name, rows, hidden, batch, cfg_name, with_bias in (
        ("near_ties_b5", 800, 96, 5, "x_as_a", False),
        ("near_ties_b5_w_as_a", 800, 96, 5, "w_as_a", False),
        ("near_ties_b17_odd_hidden", 2100, 100, 17, "x_as_a", False),
        ("near_ties_b3_bias", 500, 64, 3, "w_as_a", True),
        ("near_ties_b1", 300, 64, 1, "x_as_a", False),
        ("near_ties_b4_tiled_odd_hidden", 700, 100, 4, "tiled", False),
    ):
        weight, x = near_tie_problem(rows, hidden, batch, seed=rows + batch)
        bias = None
        if with_bias:
            bias = (torch.randn(rows, generator=torch.Generator().manual_seed(1)) * 0.01).to(torch.bfloat16)
        cfg = configs[cfg_name]
        packed = int8_lmhead.quantize_lm_head_weight(weight, tile=(cfg.block_v, cfg.block_k) if cfg.tiled else None)
        exact = int8_lmhead.int8_lm_head_logits(x, packed, weight, bias, config=cfg)
        plain = int8_lmhead.int8_lm_head_logits(x, packed, weight, bias, exact_argmax=False, config=cfg)
        # fp32 activations: the kernel's own int8 logits, unrounded, against the bound.
        raw = int8_lmhead.int8_lm_head_logits(x.float(), packed, weight, bias, exact_argmax=False, config=cfg)
        exact64 = x.double() @ weight.double().T
        if bias is not None:
            exact64 = exact64 + bias.double()
        bound = int8_lmhead.int8_logit_error_bound(x.float(), packed)
        reference = exact64.to(torch.bfloat16).argmax(-1) if bias is not None else bf16_reference_argmax(x, weight)
        cases.append(
            {
                "name": name,
                "exact_argmax": exact.argmax(-1).tolist(),
                "plain_argmax": plain.argmax(-1).tolist(),
                "reference_argmax": reference.tolist(),
                "all_written": bool(torch.isfinite(exact).all() and torch.isfinite(raw).all()),
                "max_err_over_bound": float(((raw.double() - exact64).abs() / bound).max()),
            }
        )
    # Zero vocab-padding rows (logit 0) above all-negative real logits: the padding must never set the
    # lower bound, or the real maximum would fall below the threshold.
    org, pad, hidden = 650, 50, 96
    weight, x = near_tie_problem(org, hidden, 3, seed=5)
    padded = torch.cat([weight, torch.zeros(pad, hidden, dtype=weight.dtype)])
    bias = torch.cat([torch.full((org,), -40.0), torch.zeros(pad)]).to(torch.bfloat16)
    cfg = configs["tiled"]
    packed = int8_lmhead.quantize_lm_head_weight(padded, tile=(cfg.block_v, cfg.block_k))
    exact = int8_lmhead.int8_lm_head_logits(x, packed, padded, bias, num_valid_rows=org, config=cfg)
    plain = int8_lmhead.int8_lm_head_logits(x, packed, padded, bias, num_valid_rows=org, exact_argmax=False, config=cfg)
    exact64 = x.double() @ weight.double().T + bias[:org].double()
    raw = int8_lmhead.int8_lm_head_logits(x.float(), packed, padded, bias, exact_argmax=False, config=cfg)[:, :org]
    bound = int8_lmhead.int8_logit_error_bound(x.float(), packed)[:, :org]
    cases.append(
        {
            "name": "padding_rows_negative_logits",
            "exact_argmax": exact[:, :org].argmax(-1).tolist(),
            "plain_argmax": plain[:, :org].argmax(-1).tolist(),
            "reference_argmax": exact64.to(torch.bfloat16).argmax(-1).tolist(),
            "all_written": bool(torch.isfinite(exact).all() and torch.isfinite(raw).all()),
            "max_err_over_bound": float(((raw.double() - exact64).abs() / bound).max()),
        }
    )
    # Near-identical rows, 16-row blocks: every block and nearly every row is a candidate, so the
    # re-scoring kernel loops over many groups of blocks and slots of rows; every logit it returns
    # must then be the exact one rounded to bf16.
    gen = torch.Generator().manual_seed(3)
    rows, hidden = 1_503, 96
    weight = (torch.randn(hidden, generator=gen) * 0.02).to(torch.bfloat16).repeat(rows, 1)
    cols = torch.randint(0, hidden, (rows,), generator=gen)
    picked = weight[torch.arange(rows), cols].float()
    sign = torch.randint(0, 2, (rows,), generator=gen).float() * 2 - 1
    weight[torch.arange(rows), cols] = (picked * (1 + sign * 2.0**-7)).to(torch.bfloat16)
    x = torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
    cfg = int8_lmhead.KernelConfig(16, 16, 32, 4, 1, 0, 0, tiled=1)
    packed = int8_lmhead.quantize_lm_head_weight(weight, tile=(cfg.block_v, cfg.block_k))
    plain = int8_lmhead.int8_lm_head_logits(x, packed, weight, exact_argmax=False, config=cfg)
    exact64 = x.double() @ weight.double().T
    # Three paths to the same exact logits: the probe (every 4th row sampled) finds them flat and the bf16
    # kernel computes them all; with the probe blind (a share above 1) the re-scoring kernel takes them,
    # three programs per token, each owning every third block, with a budget that holds every row; with
    # a budget of 8 rows it spills the rest to the bf16 kernel.
    for name, options, expect in (
        ("flat_logits_probe_flags_them", {"probe_stride": 4}, {"flat": 1, "spilled": False}),
        (
            "flat_logits_rescored",
            {
                "probe_stride": 4,
                "flat_sample_share": 2.0,
                "dense_sample_share": 2.0,
                "rescore_programs_per_row": 3,
                "rescore_row_budget": 1 << 20,
            },
            {"flat": 0, "spilled": False},
        ),
        (
            "flat_logits_spilled",
            {
                "probe_stride": 4,
                "flat_sample_share": 2.0,
                "dense_sample_share": 2.0,
                "rescore_programs_per_row": 3,
                "rescore_row_budget": 8,
            },
            {"flat": 0, "spilled": True},
        ),
    ):
        stats: dict[str, Any] = {}
        exact = int8_lmhead.int8_lm_head_logits(x, packed, weight, config=cfg, stats=stats, **options)
        cases.append(
            {
                "name": name,
                "exact_argmax": exact.argmax(-1).tolist(),
                "plain_argmax": plain.argmax(-1).tolist(),
                "reference_argmax": bf16_reference_argmax(x, weight).tolist(),
                "all_written": bool(torch.equal(exact, exact64.to(torch.bfloat16))),
                "max_err_over_bound": 0.0,
                "flat": stats["flat"].tolist() == [expect["flat"]] * 3,
                "spilled": bool(stats["spilled"].any()) == expect["spilled"],
            }
        )
    # All-zero hidden states: every logit is 0 and ties with every other; the first row is the answer.
    # Identical rows: every logit ties too. Both are flat: no candidate cap could re-score them cheaply.
    zero = torch.zeros_like(x)
    same = weight[:1].repeat(weight.shape[0], 1)
    for name, w_case, x_case in (("zero_hidden_states", weight, zero), ("identical_rows", same, x)):
        packed_case = int8_lmhead.quantize_lm_head_weight(w_case, tile=(cfg.block_v, cfg.block_k))
        stats = {}
        exact = int8_lmhead.int8_lm_head_logits(x_case, packed_case, w_case, config=cfg, stats=stats, probe_stride=4)
        exact64 = x_case.double() @ w_case.double().T
        cases.append(
            {
                "name": name,
                "exact_argmax": exact.argmax(-1).tolist(),
                "plain_argmax": int8_lmhead.int8_lm_head_logits(
                    x_case, packed_case, w_case, exact_argmax=False, config=cfg
                )
                .argmax(-1)
                .tolist(),
                "reference_argmax": exact64.to(torch.bfloat16).argmax(-1).tolist(),
                "all_written": bool(torch.equal(exact, exact64.to(torch.bfloat16))),
                "max_err_over_bound": 0.0,
                "flat": stats["flat"].tolist() == [1, 1, 1],
                "spilled": True,
            }
        )
    return cases


def run_scenario(out_json: Path) -> None:
    import torch
    import vllm
    import vllm.envs as vllm_envs
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.utils import int8_lmhead

    from tests.gpu.near_ties import bf16_reference_argmax, near_tie_problem
    from tests.vllm.vllm_trees import init_one_process_world

    results: dict[str, Any] = {
        "env_registered": "VLLM_SPARKFLEET_INT8_LMHEAD" in vllm_envs.environment_variables,
        "env_value_seen_by_vllm": vllm_envs.VLLM_SPARKFLEET_INT8_LMHEAD,
        "vllm_file": vllm.__file__,
        "kernels_interpreted": int8_lmhead.kernels_interpreted(),
    }
    calls = {"n": 0}
    real_logits = int8_lmhead.int8_lm_head_logits

    def counting_logits(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        return real_logits(*args, **kwargs)

    int8_lmhead.int8_lm_head_logits = counting_logits
    org_vocab, hidden, batch = 1000, 96, 6
    weight, x = near_tie_problem(org_vocab, hidden, batch, seed=11)
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        init_one_process_world(tmp)
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )

        def make_head(source: torch.Tensor) -> ParallelLMHead:
            head = ParallelLMHead(org_vocab, hidden, params_dtype=torch.bfloat16)
            with torch.no_grad():
                head.weight.zero_()  # vocab padding rows, as the loader leaves them
                head.weight[:org_vocab] = source
            return head

        head = make_head(weight)
        before = head.weight.detach().clone()
        storage = head.weight.data_ptr()
        head.quant_method.process_weights_after_loading(head)  # what the model loader calls
        weight_unchanged = bool(torch.equal(before, head.weight.detach()))
        weight_same_storage = head.weight.data_ptr() == storage
        weight_is_parameter = isinstance(head.weight, torch.nn.Parameter)
        drafter_copy = make_head(weight)  # an EAGLE-style drafter with its own identical lm_head
        head_weight_after = head.weight.detach().clone()
        processor = LogitsProcessor(org_vocab)
        stock = UnquantizedEmbeddingMethod().apply(head, x)[:, :org_vocab]
        calls["n"] = 0
        logits = processor(head, x)
        calls_forward = calls["n"]
        top_tokens = processor.get_top_tokens(head, x)
        calls_top = calls["n"] - calls_forward
        reference = bf16_reference_argmax(x, weight).tolist()
        packed = getattr(head, int8_lmhead.LAYER_ATTRIBUTE)
        bound = int8_lmhead.int8_logit_error_bound(x, packed)[:, :org_vocab]
        diff = (logits.double() - stock.double()).abs()
        rounding = (logits.double().abs() + stock.double().abs()) * 2.0**-8
        big = torch.randn(int8_lmhead.INT8_LMHEAD_MAX_BATCH + 1, hidden).to(torch.bfloat16)
        calls["n"] = 0
        big_logits = processor(head, big)
        large_calls = calls["n"]
        big_stock = UnquantizedEmbeddingMethod().apply(head, big)[:, :org_vocab]
        # A replaced weight (e.g. a reload) is quantized again before use.
        weight2, x2 = near_tie_problem(org_vocab, hidden, batch, seed=12)
        new_param = torch.nn.Parameter(torch.zeros_like(head.weight), requires_grad=False)
        with torch.no_grad():
            new_param[:org_vocab] = weight2
        head.weight = new_param
        reloaded = processor(head, x2)
        results["enabled"] = {
            "quant_method": type(head.quant_method).__name__,
            "int8_copy_attached": packed is not None,
            "weight_unchanged": weight_unchanged,
            "weight_same_storage": weight_same_storage,
            "weight_is_parameter": weight_is_parameter,
            # _maybe_share_lm_head's test for an EAGLE drafter with its own, identical lm_head.
            "drafter_share_check_equal": bool(torch.equal(head_weight_after.cpu(), drafter_copy.weight.cpu())),
            "batch": batch,
            "org_vocab": org_vocab,
            "logits_shape": list(logits.shape),
            "int8_calls_forward": calls_forward,
            "int8_calls_top_tokens": calls_top,
            "forward_argmax": logits.argmax(-1).tolist(),
            "top_tokens": top_tokens.tolist(),
            "stock_argmax": stock.argmax(-1).tolist(),
            "reference_argmax": reference,
            "logits_differing_from_stock": int((logits != stock).sum()),
            "max_abs_diff_vs_stock": float(diff.max()),
            "max_bound_plus_rounding": float((bound + rounding).max()),
            "large_batch_calls": large_calls,
            "large_batch_equals_stock": bool(torch.equal(big_logits, big_stock)),
            "reloaded_requantized": getattr(head, int8_lmhead.LAYER_ATTRIBUTE).source_data_ptr == new_param.data_ptr(),
            "reloaded_argmax_exact": reloaded.argmax(-1).tolist() == bf16_reference_argmax(x2, weight2).tolist(),
        }

        # A device the kernels cannot run on: the method stays, the copy is not made, bf16 runs.
        supported = int8_lmhead.int8_lmhead_device_supported
        int8_lmhead.int8_lmhead_device_supported = lambda device: False
        try:
            fallback_head = make_head(weight)
            fallback_head.quant_method.process_weights_after_loading(fallback_head)
            calls["n"] = 0
            fallback = processor(fallback_head, x)
            results["unsupported_device"] = {
                "quant_method": type(fallback_head.quant_method).__name__,
                "int8_copy_attached": getattr(fallback_head, int8_lmhead.LAYER_ATTRIBUTE, None) is not None,
                "int8_calls": calls["n"],
                "equals_stock_exactly": bool(
                    torch.equal(fallback, UnquantizedEmbeddingMethod().apply(fallback_head, x)[:, :org_vocab])
                ),
            }
        finally:
            int8_lmhead.int8_lmhead_device_supported = supported

        os.environ["VLLM_SPARKFLEET_INT8_LMHEAD"] = "0"
        results["disabled"] = {"quant_method": type(make_head(weight).quant_method).__name__}
        os.environ["VLLM_SPARKFLEET_INT8_LMHEAD"] = "on"
        try:
            make_head(weight)
            results["bad_value_error"] = "no error"
        except ValueError as exc:
            results["bad_value_error"] = str(exc)
        os.environ["VLLM_SPARKFLEET_INT8_LMHEAD"] = "1"
    int8_lmhead.int8_lm_head_logits = real_logits
    from tests.triton_memcheck import AddressCheck, self_test

    with AddressCheck() as check:  # every address the kernels touch, inside their tensors (compute-sanitizer's check)
        results["kernel_cases"] = _kernel_cases(int8_lmhead)
    results["memcheck"] = {
        "accesses_checked": check.checked,
        "out_of_bounds": check.count,
        "violations": check.violations,
        "self_test": self_test(),
    }
    out_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="int8 lm head: scenario child, or patch regeneration")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--scenario", type=Path, help="run the scenario child; write its JSON here")
    group.add_argument(
        "--write-patch",
        action="store_true",
        help="rewrite patch 0003's new-file hunk from sparkfleet/kernels/int8_lmhead.py",
    )
    cli = parser.parse_args()
    if cli.write_patch:
        PATCH_FILE.write_text(patch_with_shared_file(PATCH_FILE.read_text(), SHARED_FILE.read_text()))
        print(f"wrote {PATCH_FILE.relative_to(REPO_ROOT)}")
    else:
        run_scenario(cli.scenario)
