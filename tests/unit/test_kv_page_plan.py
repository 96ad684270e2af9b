"""Unit tests for sparkfleet.serving.kv_page_plan (no vLLM): reference figures, the CLI, bad inputs.

The planner's figures are checked against the real vLLM code in tests/vllm/test_kv_unify_real.py;
these tests pin what the reference recorded on real hardware and the planner's contract.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkfleet import cli
from sparkfleet.serving import kv_page_plan
from sparkfleet.serving.kv_page_plan import KVPlanInputError, plan

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "kv_configs"
TARGET_DIR = FIXTURES / "qwen3_5_122b_a10b"
OLD_DRAFTER_DIR = FIXTURES / "dflash_6c7242c"
NEW_DRAFTER_DIR = FIXTURES / "dflash_bce6f76"


# A dense (non-hybrid) target shaped like the sandbox's tiny Qwen3.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 512,
    "torch_dtype": "bfloat16",
}


@pytest.fixture()
def target() -> dict[str, Any]:
    return kv_page_plan.load_config(TARGET_DIR)


@pytest.fixture()
def old_drafter() -> dict[str, Any]:
    return kv_page_plan.load_config(OLD_DRAFTER_DIR)


@pytest.fixture()
def new_drafter() -> dict[str, Any]:
    return kv_page_plan.load_config(NEW_DRAFTER_DIR)


def test_fixtures_hold_the_architecture_facts(target: dict[str, Any], old_drafter: dict, new_drafter: dict) -> None:
    text = target["text_config"]
    assert text["layer_types"].count("linear_attention") == 36
    assert text["layer_types"].count("full_attention") == 12
    assert (text["num_key_value_heads"], text["head_dim"]) == (2, 256)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_conv_kernel_dim"]) == (16, 64, 4)
    assert (text["hidden_size"], text["vocab_size"]) == (3072, 248320)
    for drafter, facts in ((old_drafter, (4, 4, 2048)), (new_drafter, (8, 6, 4096))):
        assert drafter["architectures"] == ["DFlashDraftModel"] and drafter["model_type"] == "qwen3"
        assert (drafter["num_key_value_heads"], drafter["num_hidden_layers"], drafter["sliding_window"]) == facts
        assert drafter["dflash_config"]["target_layer_ids"]


@pytest.mark.parametrize(
    ("n", "block", "padding"),
    # The reference's own log lines (reference/bench-log-dflash-conc8.md, FINDINGS §1).
    [(5, 2144, "0.00"), (8, 2192, "0.55"), (12, 2240, "0.54")],
)
def test_reference_alignment(target: dict, old_drafter: dict, n: int, block: int, padding: str) -> None:
    for patched in (False, True):
        result = plan(target, old_drafter, n, patched, drafter_label="6c7242c")
        assert result.ok, result.reason
        assert result.attention_block_size == block
        assert f"{result.padding_pct:.2f}" == padding
        assert result.page_size_bytes == block * 2 * 2 * 256 * 2


@pytest.mark.parametrize("n", [5, 8, 12, 15])
def test_new_drafter_fails_stock_and_unifies_patched(target: dict, new_drafter: dict, n: int) -> None:
    stock = plan(target, new_drafter, n, patched=False, drafter_label="bce6f76")
    assert not stock.ok and stock.failure_stage == "unify"
    assert "bce6f76" in stock.reason and "\n" not in stock.reason
    patched = plan(target, new_drafter, n, patched=True, drafter_label="bce6f76")
    assert patched.ok, patched.reason
    assert patched.attention_block_size % 16 == 0 and patched.drafter_block_size % 16 == 0
    # the drafter's page (8 KV heads x 128 x bf16 K+V = 4096 B/token) fills the common page exactly
    assert patched.drafter_block_size * 4096 == patched.page_size_bytes
    assert patched.attention_block_size * 2048 == patched.page_size_bytes
    # the stock verdict points at the fix, with the patched figures
    assert stock.reason.endswith(
        f"patch 0001 (sparkfleet's wheel) unifies it: attention block {patched.attention_block_size}, "
        f"drafter block {patched.drafter_block_size}"
    )


def test_target_alone(target: dict) -> None:
    for patched in (False, True):
        result = plan(target, None, 0, patched)
        assert result.ok and result.drafter_block_size is None and result.drafter is None


def test_mamba_page_follows_num_speculative_tokens(target: dict, old_drafter: dict) -> None:
    pages = [plan(target, old_drafter, n, True).mamba_page_size_bytes for n in (1, 2, 3)]
    # each speculative token adds one conv column: (128*16*2 + 128*64) channels x 2 bytes
    assert pages[1] - pages[0] == pages[2] - pages[1] == 12288 * 2


def test_flat_config_and_tensor_parallel(target: dict, old_drafter: dict) -> None:
    flat = copy.deepcopy(target["text_config"])
    flat["architectures"] = target["architectures"]
    assert plan(flat, old_drafter, 5, True) == plan(target, old_drafter, 5, True)
    split = plan(target, old_drafter, 5, True, tensor_parallel_size=2)
    assert split.ok
    assert split.mamba_page_size_bytes * 2 == plan(target, old_drafter, 5, True).mamba_page_size_bytes


def test_padded_attention_page_with_smaller_kernel_block_is_refused() -> None:
    spec = kv_page_plan._Spec("drafter attention", "attention", 1040, bytes_per_token=2048, page_size_padded=2200000)
    kernels: dict[str, int] = {}
    with pytest.raises(kv_page_plan._UnifyError, match="kernel block 16 < block 1040") as info:
        kv_page_plan._check_runner([spec], [16, 32, 64], kernels)
    assert info.value.stage == "view"
    # the same page with a kernel block equal to the block is viewed correctly
    kv_page_plan._check_runner([spec], [("multiple", 16)], kernels)
    assert kernels == {"drafter attention": 1040}


def test_select_kernel_block_size() -> None:
    assert kv_page_plan.select_kernel_block_size(2144, [16, 32, 64]) == 32
    assert kv_page_plan.select_kernel_block_size(2192, [16, 32, 64]) == 16
    assert kv_page_plan.select_kernel_block_size(1096, [16, 32, 64]) is None
    assert kv_page_plan.select_kernel_block_size(1096, [("multiple", 16)]) is None
    assert kv_page_plan.select_kernel_block_size(2144, [("multiple", 16)]) == 2144


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype 'int4'"),
        ({"platform": "rocm"}, "platform 'rocm'"),
        ({"attention_backend": "FLEX"}, "attention backend 'FLEX'"),
        ({"block_size": 24}, "block_size 24"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size 3"),
        ({"max_model_len": 0}, "max_model_len 0"),
        ({"max_model_len": "262144"}, "max_model_len '262144'"),
        ({"max_num_batched_tokens": 8192}, "max_num_batched_tokens and max_num_seqs together"),
        ({"max_num_batched_tokens": -1, "max_num_seqs": 3}, "max_num_batched_tokens -1"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 3}, "max_num_batched_tokens 8 leaves no tokens"),
    ],
)
def test_bad_options_name_the_value(target: dict, old_drafter: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(KVPlanInputError, match=message):
        plan(target, old_drafter, 5, True, **kwargs)


def test_scheduler_blocks_follow_prefix_caching(target: dict, new_drafter: dict) -> None:
    """Without prefix caching the GDN group's block is max_model_len (no figure without it); with it, the
    cache block, and prefix hashes go on the GCD of the groups' blocks (tests/vllm checks the figures)."""
    off = plan(target, new_drafter, 8, True)
    assert off.ok and (off.scheduler_block_size, off.hash_block_size) == (None, None)
    off = plan(target, new_drafter, 8, True, max_model_len=262144)
    blocks = (off.attention_block_size, off.drafter_block_size, 262144)
    assert off.scheduler_block_size == off.hash_block_size == math.lcm(*blocks)
    on = plan(target, new_drafter, 8, True, enable_prefix_caching=True)
    assert on.ok and on.scheduler_block_size == math.lcm(on.attention_block_size, on.drafter_block_size)
    assert on.hash_block_size == math.gcd(on.attention_block_size, on.drafter_block_size)
    assert f"prefix-cache hash block {on.hash_block_size}" in on.reason


def test_prefix_caching_needs_a_step_budget_of_one_cache_block(target: dict, new_drafter: dict) -> None:
    """DFlash holds n - 1 slots per sequence back from the budget; prefix caching on the hybrid needs
    what is left to hold one cache block (tests/vllm shows the real scheduler stall)."""
    on = plan(target, new_drafter, 8, True, enable_prefix_caching=True)
    block = on.attention_block_size
    fits = plan(
        target, new_drafter, 8, True, enable_prefix_caching=True, max_num_batched_tokens=block + 21, max_num_seqs=3
    )
    assert fits.ok and fits.step_token_budget == block
    short = plan(
        target, new_drafter, 8, True, enable_prefix_caching=True, max_num_batched_tokens=block + 20, max_num_seqs=3
    )
    assert not short.ok and short.failure_stage == "scheduler" and short.step_token_budget == block - 1
    assert "raise max-num-batched-tokens by at least 1 or turn prefix caching off" in short.reason
    assert plan(target, new_drafter, 8, True, max_num_batched_tokens=block + 20, max_num_seqs=3).ok


def test_serving_options_read_a_profiles_serve_args() -> None:
    args = {"enable-prefix-caching": True, "max-model-len": 262144, "max-num-batched-tokens": 8192, "max-num-seqs": 3}
    assert kv_page_plan.serving_options(args) == {
        "enable_prefix_caching": True,
        "max_model_len": 262144,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 3,
    }
    # one half of the step budget left to vLLM's default: no budget judged
    assert kv_page_plan.serving_options({"max-num-batched-tokens": 8192}) == {"enable_prefix_caching": False}
    assert kv_page_plan.serving_options(None) == {"enable_prefix_caching": False}
    with pytest.raises(KVPlanInputError, match="serve arg max-num-seqs is '3'"):
        kv_page_plan.serving_options({"max-num-seqs": "3"})


def test_serving_options_read_every_flag_that_changes_the_layout(target: dict, new_drafter: dict) -> None:
    # what the unit serves is what is planned: the rank's share under tensor parallelism, the cache
    # block, the cache and state dtypes and the attention backend (vLLM takes its name in any case)
    args = {
        "tensor-parallel-size": 2,
        "block-size": 32,
        "kv-cache-dtype": "fp8",
        "mamba-cache-dtype": "float32",
        "mamba-ssm-cache-dtype": "float32",
        "dtype": "bfloat16",
        "attention-backend": "flash_attn",
        "pipeline-parallel-size": 2,  # each stage holds whole layers: pages are the single node's
    }
    assert kv_page_plan.serving_options(args) == {
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
        "block_size": 32,
        "kv_cache_dtype": "fp8",
        "mamba_cache_dtype": "float32",
        "mamba_ssm_cache_dtype": "float32",
        "dtype": "bfloat16",
        "attention_backend": "FLASH_ATTN",
    }
    # null drops a flag a lower layer set: vLLM's default is planned
    assert kv_page_plan.serving_options({"attention-backend": None, "tensor-parallel-size": None}) == {
        "enable_prefix_caching": False
    }
    with pytest.raises(KVPlanInputError, match="serve arg tensor-parallel-size is '2'"):
        kv_page_plan.serving_options({"tensor-parallel-size": "2"})
    with pytest.raises(KVPlanInputError, match="serve arg kv-cache-dtype is 8"):
        kv_page_plan.serving_options({"kv-cache-dtype": 8})
    with pytest.raises(KVPlanInputError, match="tensor_parallel_size 0 must be a positive integer"):
        plan(target, None, 0, True, tensor_parallel_size=0)

    # a two-node tensor-parallel profile is planned for one rank: half the KV heads, so half the
    # attention bytes per token, against that rank's share of the GDN state
    for n in (4, 12):
        one = kv_page_plan.plan_for_profile(target, new_drafter, n, True, serve_args={"max-model-len": 4096})
        two = kv_page_plan.plan_for_profile(
            target, new_drafter, n, True, serve_args={"max-model-len": 4096, "tensor-parallel-size": 2}
        )
        assert two == plan(target, new_drafter, n, True, max_model_len=4096, tensor_parallel_size=2)
        assert two != one
        assert two.ok and one.ok
        assert two.mamba_page_size_bytes is not None and one.mamba_page_size_bytes is not None
        assert two.mamba_page_size_bytes < one.mamba_page_size_bytes
    # and the state dtypes the profile sets size the GDN page (the conv state here: the config already
    # asks for a float32 SSM state)
    auto = kv_page_plan.plan_for_profile(target, None, 0, True, serve_args={})
    f32 = kv_page_plan.plan_for_profile(target, None, 0, True, serve_args={"mamba-cache-dtype": "float32"})
    assert f32 == plan(target, None, 0, True, mamba_cache_dtype="float32")
    assert auto.mamba_page_size_bytes is not None and f32.mamba_page_size_bytes is not None
    assert f32.mamba_page_size_bytes > auto.mamba_page_size_bytes


def test_bad_configs_name_the_key(target: dict, old_drafter: dict) -> None:
    with pytest.raises(KVPlanInputError, match="num_speculative_tokens is 0 but a drafter"):
        plan(target, old_drafter, 0, True)
    with pytest.raises(KVPlanInputError, match="num_speculative_tokens is -1"):
        plan(target, None, -1, True)
    broken = copy.deepcopy(target)
    del broken["text_config"]["linear_num_value_heads"]
    broken["text_config"]["layer_types"][0] = "linear_attention"
    with pytest.raises(KVPlanInputError, match="`linear_num_value_heads` is None"):
        plan(broken, old_drafter, 5, True)
    no_arch = dict(old_drafter, architectures=[])
    with pytest.raises(KVPlanInputError, match="`architectures` is \\[\\]"):
        plan(target, no_arch, 5, True)


def _kv_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkfleet", "kv-plan", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_refuses_a_drafter_that_cannot_unify_in_one_line() -> None:
    args = ["--target-config", str(TARGET_DIR), "--drafter-config", str(NEW_DRAFTER_DIR), "--num-speculative-tokens"]
    stock = _kv_plan(*args, "12", "--stock")
    assert stock.returncode == 1
    lines = stock.stdout.strip().splitlines()
    assert len(lines) == 1 and "dflash_bce6f76" in lines[0] and "cannot unify" in lines[0]
    patched = _kv_plan(*args, "12")
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "attention block 2240, drafter block 1120" in patched.stdout


def test_cli_json_carries_both_plans() -> None:
    result = _kv_plan(
        "--target-config",
        str(TARGET_DIR / "config.json"),
        "--drafter-config",
        str(OLD_DRAFTER_DIR),
        "--drafter-label",
        "6c7242c",
        "--num-speculative-tokens",
        "5",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["stock"]["attention_block_size"] == data["patched"]["attention_block_size"] == 2144
    assert data["patched"]["drafter"] == "6c7242c"


def test_cli_bad_path_is_one_line(tmp_path: Path) -> None:
    result = _kv_plan("--target-config", str(tmp_path / "missing"), "--num-speculative-tokens", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"kv-plan: {tmp_path / 'missing'}: no such file; pass a config.json or the directory holding it"
    ]


def test_registered_in_the_cli() -> None:
    assert cli.COMMANDS["kv-plan"] == "sparkfleet.serving.kv_page_plan"
    args = cli.build_parser().parse_args(
        ["kv-plan", "--target-config", str(TARGET_DIR), "--num-speculative-tokens", "0"]
    )
    assert args.func is kv_page_plan.run


def test_planner_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, sparkfleet.serving.kv_page_plan; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_attention_target_with_a_drafter(old_drafter: dict) -> None:
    """A non-hybrid target (no GDN layers, like the sandbox's tiny Qwen3) has no mamba page:
    target and drafter attention share one page when their bytes per token agree."""
    plain = dict(TINY_QWEN3)
    drafter = copy.deepcopy(old_drafter)
    drafter.update({"num_key_value_heads": 1, "head_dim": 64, "hidden_size": 128, "num_attention_heads": 2})
    result = plan(plain, drafter, 12, patched=True, platform="cpu")
    assert result.ok, result.reason
    assert result.mamba_page_size_bytes is None and result.padding_pct == 0
    assert result.drafter_block_size == result.attention_block_size


def test_the_pool_reproduces_the_gb10_log_of_the_conc8_recipe(target: dict, old_drafter: dict) -> None:
    """reference/bench-log-dflash-conc8.md: the pinned drafter at n=5, prefix caching on, a 262K context:
    "KV cache 27.72 GiB (GPU KV = 800,129 tokens -> max concurrency 3.05x at 262K ctx)"."""
    conc8 = plan(target, old_drafter, 5, True, enable_prefix_caching=True, max_model_len=262144)
    assert (conc8.kv_layout, conc8.kv_group_size) == ("hybrid", 4)  # 12 target, 36 GDN, 4 drafter layers
    pool = kv_page_plan.kv_pool(conc8, int(27.72 * (1 << 30)), 262144)
    assert pool.tokens == 800_129
    assert round(pool.max_concurrency, 2) == 3.05
    # 3 target-attention groups of ceil(262144 / 2144) blocks, 9 GDN groups of 2 + 5 pages, 1 drafter group
    assert pool.blocks_per_request == 3 * 123 + 9 * 7 + 123
    # the log's 27.72 is rounded: every size it stands for gives the same pool
    for gib in (27.715, 27.7249):
        assert kv_page_plan.kv_pool(conc8, int(gib * (1 << 30)), 262144).tokens == 800_129


def test_the_pool_follows_n_prefix_caching_and_the_drafter(target: dict, old_drafter: dict, new_drafter: dict) -> None:
    kv_bytes, context = 24 << 30, 262144
    pools = {}
    for drafter, name in ((old_drafter, "6c7242c"), (new_drafter, "bce6f76")):
        for n in (5, 12):
            for caching in (False, True):
                p = plan(target, drafter, n, True, enable_prefix_caching=caching, max_model_len=context)
                pools[name, n, caching] = kv_page_plan.kv_pool(p, kv_bytes, context)
    # each GDN group holds 1 + n pages per request (2 + n with prefix caching): more n, fewer requests
    assert pools["6c7242c", 12, False].blocks_per_request - pools["6c7242c", 12, True].blocks_per_request == -9
    assert pools["6c7242c", 12, True].max_concurrency < pools["6c7242c", 5, True].max_concurrency
    # the newer drafter's 6 layers make groups of 6 and its half-size block doubles its group's blocks
    newer = plan(target, new_drafter, 12, True, max_model_len=context)
    assert newer.kv_group_size == 6 and newer.drafter_block_size == 1120
    assert pools["bce6f76", 12, False].blocks_per_request == 2 * 118 + 6 * 13 + 235
    for pool in pools.values():
        assert pool.tokens == int(pool.num_blocks / pool.blocks_per_request * context)
        assert pool.num_blocks * pool.bytes_per_block <= kv_bytes < (pool.num_blocks + 1) * pool.bytes_per_block


def test_the_pool_of_a_dense_target(old_drafter: dict) -> None:
    """One KV cache group: all layers share a spec (the drafter has the target's geometry), or the group
    sums the pages of several geometries (UniformTypeKVCacheSpecs); either way no unification."""
    dense = dict(TINY_QWEN3)
    same = dict(old_drafter, num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
    wide = dict(same, num_key_value_heads=2, num_hidden_layers=2)
    one = plan(dense, same, 12, True, platform="cpu")
    assert (one.kv_layout, one.kv_group_size, one.page_size_bytes) == ("uniform", 5, 128 * 256)
    pool = kv_page_plan.kv_pool(one, 1 << 30, 1024)
    assert pool.num_blocks == (1 << 30) // (128 * 256) // 5 and pool.blocks_per_request == 8
    two = plan(dense, wide, 12, True, platform="cpu")
    assert two.kv_layout == "uniform_type" and two.drafter_block_size == two.attention_block_size == 128
    assert two.page_size_bytes == 4 * 128 * 256 + 2 * 128 * 512  # every layer's page, summed
    assert kv_page_plan.kv_pool(two, 1 << 30, 1024).num_blocks == (1 << 30) // two.page_size_bytes


def test_no_pool_for_a_plan_that_does_not_unify(target: dict, new_drafter: dict) -> None:
    stock = plan(target, new_drafter, 12, False)
    with pytest.raises(KVPlanInputError, match="no KV pool for a plan that does not unify"):
        kv_page_plan.kv_pool(stock, 1 << 30, 4096)
    ok = plan(target, None, 0, True)
    with pytest.raises(KVPlanInputError, match="kv_cache_bytes 0 must be a positive integer"):
        kv_page_plan.kv_pool(ok, 0, 4096)


def test_cli_prints_the_pool_vllm_will_log() -> None:
    args = ["--target-config", str(TARGET_DIR), "--drafter-config", str(OLD_DRAFTER_DIR)]
    args += ["--num-speculative-tokens", "5", "--enable-prefix-caching", "--max-model-len", "262144"]
    result = _kv_plan(*args, "--kv-cache-gib", "27.72")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1] == (
        "KV pool at 27.72 GiB: 800,129 tokens, max concurrency 3.05x at 262,144 tokens per request "
        "(1694 blocks, 555 per request)"
    )
    as_json = json.loads(_kv_plan(*args, "--kv-cache-gib", "27.72", "--json").stdout)
    assert as_json["patched"]["pool"]["tokens"] == 800_129
    refused = _kv_plan("--target-config", str(TARGET_DIR), "--num-speculative-tokens", "0", "--kv-cache-gib", "3")
    assert refused.returncode == 2 and "--kv-cache-gib 3.0 needs" in refused.stderr
