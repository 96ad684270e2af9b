"""KV-cache page-size planner: will vLLM 0.23 unify a hybrid target's KV cache with its drafter's?

From the target's and the drafter's ``config.json`` and the speculative config, this predicts what
vLLM 0.23 does with the KV cache of a hybrid Gated-DeltaNet target (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) plus a speculative drafter (DFlash, EAGLE, draft model), stock or with patch
``files/patches/vllm-0.23.0/0001-kv-page-size-unify.patch``. It loads no weights and imports neither
vllm nor torch (stdlib only), so it runs on the Ansible controller and inside a custom module.

It follows vLLM 0.23's own steps, figure for figure:

1. Hybrid block alignment (``Platform._align_hybrid_block_size``, vllm/platforms/interface.py): the
   attention block is the smallest multiple of the kernel alignment whose page (block x attention bytes
   per token) holds one GDN state (conv state with ``conv_kernel - 1 + num_speculative_tokens``
   columns plus the SSM state); the GDN page is padded up to that attention page. Patched, the block
   step also makes the page a whole number of kernel-aligned drafter blocks.
2. Page-size unification (``unify_kv_cache_spec_page_size``, vllm/v1/core/kv_cache_utils.py). Stock
   rescales every layer whose page is not the largest by an integer block-size ratio; a GDN page does
   not depend on block size, so the largest page must not be an attention page. Patched, the GDN page
   is the common page and attention blocks are fitted to it exactly (never padded).
3. The model runner's kernel block (``select_common_block_size``, vllm/v1/worker/utils.py) and its KV
   view (``_reshape_kv_cache_tensors``, gpu_model_runner.py): a padded attention page is viewed with
   one page stride per kernel block, which overruns the buffer when the kernel block is smaller than
   the spec's block.

``plan()`` is the entry point for Python and Ansible callers; ``sparkfleet kv-plan`` is the CLI.
tests/vllm/test_kv_unify_real.py checks every figure against the real vLLM 0.23 functions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sparkfleet.build import jsonfile

# Bytes per element of the dtype names vLLM accepts for the model, the KV cache and the mamba state.
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAMBA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")

# Hybrid GDN architectures whose mamba state this planner models. The Qwen3.5 ones take their SSM
# state dtype from the config's `mamba_ssm_dtype` when --mamba-ssm-cache-dtype is "auto"
# (Qwen3_5ForConditionalGenerationConfig in vllm/model_executor/models/config.py).
GDN_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": True,
    "Qwen3_5MoeForConditionalGeneration": True,
    "Qwen3NextForCausalLM": False,
}

# Kernel block sizes an attention backend accepts: ints are exact sizes, ("multiple", b) means any
# multiple of b. FLASH_ATTN drops to [16, 32, 64] for hybrid models with a float32 mamba state (NaN
# propagation, see flash_attn.py get_supported_kernel_block_sizes).
KernelSize = int | tuple[str, int]
BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "CPU_ATTN")
PLATFORMS = ("cuda", "cpu")
DEFAULT_BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE, what FLASH_ATTN prefers on CUDA
CPU_DEFAULT_BLOCK_SIZE = 128  # CpuPlatform.check_and_update_config


class KVPlanInputError(ValueError):
    """A config or option the planner cannot read; the message names the value and the fix."""


@dataclass(frozen=True)
class AttentionGeometry:
    """KV geometry of one attention layer (after tensor-parallel split)."""

    num_kv_heads: int
    head_size: int
    num_layers: int

    def bytes_per_token(self, kv_bytes: int) -> int:
        """FullAttentionSpec(block_size=1).page_size_bytes: K and V, every head."""
        return 2 * self.num_kv_heads * self.head_size * kv_bytes


@dataclass(frozen=True)
class GDNGeometry:
    """Gated-DeltaNet (linear attention) state geometry, as MambaStateShapeCalculator sees it."""

    num_layers: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def page_bytes(self, num_speculative_tokens: int, conv_bytes: int, ssm_bytes: int, tp: int) -> int:
        """MambaSpec(shapes, dtypes).page_size_bytes for gated_delta_net_state_shape."""
        conv_dim = self.key_head_dim * self.num_key_heads * 2 + self.value_head_dim * self.num_value_heads
        conv_columns = self.conv_kernel - 1 + num_speculative_tokens
        conv_state = _divide(conv_dim, tp, "GDN conv dim") * conv_columns * conv_bytes
        ssm_state = (
            _divide(self.num_value_heads, tp, "linear_num_value_heads")
            * self.value_head_dim
            * self.key_head_dim
            * ssm_bytes
        )
        return conv_state + ssm_state


@dataclass(frozen=True)
class TargetModel:
    """What the planner reads from the target's config.json."""

    architecture: str
    dtype: str
    attention: AttentionGeometry
    gdn: GDNGeometry | None
    mamba_ssm_dtype: str | None  # the config's own `mamba_ssm_dtype`, if any


@dataclass(frozen=True)
class DrafterModel:
    """What the planner reads from the drafter's config.json."""

    label: str
    architecture: str
    attention: AttentionGeometry
    sliding_window: int | None


@dataclass(frozen=True)
class KVPlan:
    """The predicted outcome for one (target, drafter, num_speculative_tokens, stock|patched)."""

    ok: bool
    reason: str
    patched: bool
    num_speculative_tokens: int
    drafter: str | None
    attention_block_size: int | None  # the target's attention block (cache_config.block_size)
    drafter_block_size: int | None  # the drafter's attention block after unification
    page_size_bytes: int | None  # the common page of every KV cache group
    mamba_page_size_bytes: int | None  # the GDN state page before padding
    padding_pct: float  # how much the GDN page is padded to reach the common page
    kernel_block_sizes: dict[str, int] = field(default_factory=dict)
    failure_stage: str | None = None  # "alignment", "unify", "grouping", "kernel", "view" or "scheduler"
    # resolve_kv_cache_block_sizes: the scheduler's token alignment and the prefix-cache hash block
    # (None when the plan failed before the scheduler, or without prefix caching and max_model_len)
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    # the scheduler's token budget per step (max_num_scheduled_tokens), when max_num_batched_tokens is known
    step_token_budget: int | None = None
    # The KV cache groups vLLM builds (get_kv_cache_groups), for the pool (kv_pool): one entry per spec
    # type with its kind, block size, how many groups it fills and, for GDN state, the pages one request
    # holds per group; ``kv_layout`` is "uniform" (one spec), "uniform_type" (one group of full-attention
    # layers of several geometries) or "hybrid" (groups of ``kv_group_size`` layers, one page size).
    kv_layout: str | None = None
    kv_group_size: int | None = None
    kv_groups: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanOptions:
    """plan()'s keyword options (vLLM's serve flags and the drafter's label), as one value."""

    drafter_label: str | None = None
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    platform: str = "cuda"
    block_size: int | None = None
    enable_prefix_caching: bool = False
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class KVPool:
    """The KV cache pool vLLM 0.23 builds from ``kv_cache_bytes`` for one plan, as it reports it at start.

    ``tokens`` is vLLM's "GPU KV cache size: N tokens" and ``max_concurrency`` its "Maximum concurrency for
    M tokens per request: Cx" (``_report_kv_cache_config``: tokens = int(concurrency x max_model_len)).
    """

    kv_cache_bytes: int
    max_model_len: int
    num_blocks: int  # get_kv_cache_config_from_groups: blocks of every group's page
    bytes_per_block: int  # what one block takes from the pool (every layer slot of a group)
    blocks_per_request: int  # blocks one request of max_model_len tokens holds across the groups
    bytes_per_request: int
    max_concurrency: float
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_pool(kv_plan: KVPlan, kv_cache_bytes: int, max_model_len: int) -> KVPool:
    """vLLM 0.23's KV pool for a plan that unifies: blocks, max concurrency and tokens at ``max_model_len``.

    Mirrors get_kv_cache_config_from_groups (num_blocks = bytes // page // layers per group, or // the
    summed page of a one-group model of several geometries) and get_max_concurrency_for_kv_cache_config
    (a request of max_model_len tokens holds cdiv(max_model_len, block) blocks of each attention group
    and 1 + n pages of each GDN group, 2 + n with prefix caching's "align" mode).
    """
    if not kv_plan.ok or kv_plan.kv_layout is None or kv_plan.page_size_bytes is None:
        raise KVPlanInputError(f"no KV pool for a plan that does not unify: {kv_plan.reason}")
    for name, value in (("kv_cache_bytes", kv_cache_bytes), ("max_model_len", max_model_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KVPlanInputError(f"{name} {value!r} must be a positive integer")
    group_size = kv_plan.kv_group_size or 1
    page = kv_plan.page_size_bytes
    if kv_plan.kv_layout == "uniform_type":
        # UniformTypeKVCacheSpecs: one group whose page is every layer's page summed
        bytes_per_block = page
        num_blocks = kv_cache_bytes // page
        blocks_per_request = -(-max_model_len // kv_plan.kv_groups[0]["block_size"])
    else:
        bytes_per_block = page * group_size
        num_blocks = kv_cache_bytes // page // group_size
        blocks_per_request = 0
        for group in kv_plan.kv_groups:
            per_group = group["pages_per_request"] or -(-max_model_len // group["block_size"])
            blocks_per_request += per_group * group["groups"]
    max_concurrency = num_blocks / blocks_per_request
    return KVPool(
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        bytes_per_block=bytes_per_block,
        blocks_per_request=blocks_per_request,
        bytes_per_request=blocks_per_request * bytes_per_block,
        max_concurrency=max_concurrency,
        tokens=int(max_concurrency * max_model_len),
    )


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise KVPlanInputError(
            f"{what} {numerator} is not divisible by tensor_parallel_size {denominator}; "
            "pick a tensor-parallel size that divides it"
        )
    return numerator // denominator


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _require_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVPlanInputError(f"{where}: `{key}` is {value!r}; it must be a positive integer")
    return value


def _architecture(config: dict[str, Any], where: str) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise KVPlanInputError(f"{where}: `architectures` is {archs!r}; expected a list like ['DFlashDraftModel']")
    return archs[0]


def _config_dtype(config: dict[str, Any], text: dict[str, Any]) -> str:
    for source in (text, config):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str) and value in DTYPE_BYTES:
                return "bfloat16" if value == "float32" else value
    return "bfloat16"


def _attention_geometry(text: dict[str, Any], num_layers: int, tp: int, where: str) -> AttentionGeometry:
    num_heads = _require_int(text, "num_attention_heads", where)
    total_kv_heads = text.get("num_key_value_heads", num_heads)
    if not isinstance(total_kv_heads, int) or total_kv_heads <= 0:
        raise KVPlanInputError(f"{where}: `num_key_value_heads` is {total_kv_heads!r}; expected a positive int")
    head_size = text.get("head_dim")
    if head_size is None:
        head_size = _require_int(text, "hidden_size", where) // num_heads
    elif not isinstance(head_size, int) or head_size <= 0:
        raise KVPlanInputError(f"{where}: `head_dim` is {head_size!r}; expected a positive int")
    if total_kv_heads >= tp and total_kv_heads % tp:
        raise KVPlanInputError(
            f"{where}: {total_kv_heads} KV heads do not split over tensor_parallel_size {tp}; "
            "pick a tensor-parallel size that divides them"
        )
    # ModelConfig.get_num_kv_heads: KV heads are replicated when there are fewer than TP ranks.
    return AttentionGeometry(num_kv_heads=max(1, total_kv_heads // tp), head_size=head_size, num_layers=num_layers)


def read_target(config: dict[str, Any], tensor_parallel_size: int = 1, where: str = "target config") -> TargetModel:
    """Read the target model's KV geometry from its config.json (flat or with a `text_config`)."""
    architecture = _architecture(config, where)
    text = _text_config(config)
    num_layers = _require_int(text, "num_hidden_layers", where)
    layer_types = text.get("layer_types")
    if layer_types is None and "linear_num_value_heads" in text:
        interval = text.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        layer_types = ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise KVPlanInputError(
            f"{where}: `layer_types` has {len(layer_types) if isinstance(layer_types, list) else layer_types!r} "
            f"entries for {num_layers} layers; give one per layer"
        )
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
        raise KVPlanInputError(
            f"{where}: layer type(s) {unknown} are not modelled; only full_attention and linear_attention"
        )
    num_full = layer_types.count("full_attention")
    num_linear = layer_types.count("linear_attention")
    attention = _attention_geometry(text, num_full, tensor_parallel_size, where)
    gdn = None
    if num_linear:
        if architecture not in GDN_ARCHITECTURES:
            raise KVPlanInputError(
                f"{where}: architecture {architecture} has linear-attention layers but is not a modelled "
                f"Gated-DeltaNet hybrid ({', '.join(sorted(GDN_ARCHITECTURES))})"
            )
        gdn = GDNGeometry(
            num_layers=num_linear,
            num_key_heads=_require_int(text, "linear_num_key_heads", where),
            num_value_heads=_require_int(text, "linear_num_value_heads", where),
            key_head_dim=_require_int(text, "linear_key_head_dim", where),
            value_head_dim=_require_int(text, "linear_value_head_dim", where),
            conv_kernel=_require_int(text, "linear_conv_kernel_dim", where),
        )
    ssm_dtype = text.get("mamba_ssm_dtype")
    if ssm_dtype is not None and ssm_dtype not in DTYPE_BYTES:
        raise KVPlanInputError(f"{where}: `mamba_ssm_dtype` is {ssm_dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return TargetModel(
        architecture=architecture,
        dtype=_config_dtype(config, text),
        attention=attention,
        gdn=gdn,
        mamba_ssm_dtype=ssm_dtype if GDN_ARCHITECTURES.get(architecture) else None,
    )


def read_drafter(
    config: dict[str, Any], tensor_parallel_size: int = 1, label: str = "drafter", where: str = "drafter config"
) -> DrafterModel:
    """Read a drafter's attention geometry (every drafter layer is one attention layer)."""
    architecture = _architecture(config, where)
    text = _text_config(config)
    num_layers = _require_int(text, "num_hidden_layers", where)
    window = text.get("sliding_window")
    return DrafterModel(
        label=label,
        architecture=architecture,
        attention=_attention_geometry(text, num_layers, tensor_parallel_size, where),
        sliding_window=window if isinstance(window, int) else None,
    )


def supported_kernel_block_sizes(backend: str, hybrid: bool, mamba_float32: bool) -> list[KernelSize]:
    """get_supported_kernel_block_sizes() of the attention backend, as vLLM 0.23 answers it."""
    if backend == "FLASH_ATTN":
        return [16, 32, 64] if hybrid and mamba_float32 else [("multiple", 16)]
    if backend == "FLASHINFER":
        return [16, 32, 64]
    if backend in ("TRITON_ATTN", "CPU_ATTN"):
        return [("multiple", 16)]
    raise KVPlanInputError(f"attention backend {backend!r} is not modelled; use one of {', '.join(BACKENDS)}")


def _kernel_size_supported(sizes: list[KernelSize], block_size: int) -> bool:
    return any(block_size % size[1] == 0 if isinstance(size, tuple) else block_size == size for size in sizes)


def select_kernel_block_size(block_size: int, sizes: list[KernelSize]) -> int | None:
    """select_common_block_size (vllm/v1/worker/utils.py) for one backend; None where vLLM raises."""
    if _kernel_size_supported(sizes, block_size):
        return block_size
    for size in sorted((s for s in sizes if isinstance(s, int)), reverse=True):
        if block_size % size == 0:
            return size
    return None


@dataclass
class _Spec:
    """One KV cache group's spec, enough of vLLM's KVCacheSpec to follow unification."""

    name: str
    kind: str  # "attention" or "mamba"
    block_size: int
    bytes_per_token: int = 0  # attention only
    state_bytes: int = 0  # mamba only: the unpadded page
    page_size_padded: int | None = None
    num_layers: int = 1
    geometry: tuple[int, int] = (0, 0)  # attention only: (KV heads, head size), part of the spec's identity

    def identity(self) -> tuple:
        """What makes two layers' KVCacheSpecs equal (and so one spec type when vLLM groups them)."""
        if self.kind == "mamba":
            return ("mamba", self.state_bytes, self.page_size_padded)
        return ("attention", self.block_size, self.geometry, self.bytes_per_token)

    @property
    def page_size_bytes(self) -> int:
        real = self.state_bytes if self.kind == "mamba" else self.block_size * self.bytes_per_token
        return self.page_size_padded if self.page_size_padded is not None else real


class _UnifyError(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def _unify_stock(specs: list[_Spec]) -> None:
    """unify_kv_cache_spec_page_size as shipped: scale smaller pages up to the largest by an integer ratio."""
    pages = {spec.page_size_bytes for spec in specs}
    if len(pages) <= 1:
        return
    max_page = max(pages)
    for spec in specs:
        page = spec.page_size_bytes
        if page == max_page:
            continue
        if max_page % page:
            raise _UnifyError("unify", f"its {page}-byte {spec.name} page does not divide the {max_page}-byte page")
        spec.block_size *= max_page // page
        if spec.page_size_bytes != max_page:
            raise _UnifyError(
                "unify",
                f"stock scales the {spec.name} block instead, but a GDN page ({page} B) does not grow with "
                f"block size, so the page assert fails ({page} != {max_page} B)",
            )


def _unify_patched(specs: list[_Spec]) -> None:
    """unify_kv_cache_spec_page_size with patch 0001: common page from the GDN specs, exact attention fits."""
    pages = {spec.page_size_bytes for spec in specs}
    if len(pages) <= 1:
        return
    fixed = {spec.page_size_bytes for spec in specs if spec.kind == "mamba"}
    if not fixed:
        _unify_stock(specs)
        return
    common = max(fixed)
    for spec in specs:
        if spec.page_size_bytes == common:
            continue
        if spec.kind == "mamba":
            spec.page_size_padded = common
        elif spec.page_size_padded is None:
            if common % spec.bytes_per_token:
                raise _UnifyError(
                    "unify",
                    f"its {spec.bytes_per_token} B/token {spec.name} layers do not divide the {common}-byte "
                    "common page and an attention page is never padded",
                )
            spec.block_size = common // spec.bytes_per_token
        else:
            raise _UnifyError("unify", f"the padded {spec.name} page cannot be rescaled")


def _spec_types(specs: list[_Spec]) -> dict[tuple, list[str]]:
    """Layers by KV cache spec, as vLLM groups them: equal specs are one type (a drafter layer whose spec
    equals the target's attention spec joins the target's layers, after them)."""
    types: dict[tuple, list[str]] = {}
    for spec in specs:
        layers = types.setdefault(spec.identity(), [])
        layers.extend(f"{spec.name} {i}" for i in range(spec.num_layers))
    return types


def _layout(specs: list[_Spec]) -> str:
    """Which of get_kv_cache_groups' paths the specs take: one spec ("uniform"), full-attention layers of
    one block size but several geometries (UniformTypeKVCacheSpecs: "uniform_type", no unification), or
    the general multi-group path that unifies page sizes ("hybrid")."""
    if len(_spec_types(specs)) == 1:
        return "uniform"
    if all(spec.kind == "attention" for spec in specs) and len({spec.block_size for spec in specs}) == 1:
        return "uniform_type"
    return "hybrid"


def _group_size(types: dict[tuple, list[str]]) -> int:
    """_get_kv_cache_groups_uniform_page_size: the smallest type's layer count, or the largest when no
    type has 1.5 times the smallest."""
    counts = [len(layers) for layers in types.values()]
    return max(counts) if max(counts) < min(counts) * 1.5 else min(counts)


def _check_groups(specs: list[_Spec]) -> None:
    """The KV cache groups (``_get_kv_cache_groups_uniform_page_size``) and the drafter's one-group rule.

    vLLM puts layers with equal specs into one type, takes the group size from the smallest type (the
    largest when no type has 1.5 times the layers of the smallest), and deals each type's layers
    round-robin into ceil(count / group size) groups. The proposer then asserts that every drafting
    layer is in the same group (``validate_same_kv_cache_group``, v1/spec_decode/llm_base_proposer.py):
    a drafter with more layers than the group size fails. A DFlash drafter's own sliding window plays
    no part: its layers take the target's ``cache_config.sliding_window`` (none on Qwen3.5), so they
    are full-attention layers. One-group layouts (``_layout``) put every layer in one group.
    """
    drafter = next((spec for spec in specs if spec.name == "drafter attention"), None)
    if drafter is None or _layout(specs) != "hybrid":
        return
    types = _spec_types(specs)
    group_size = _group_size(types)
    layers = types[drafter.identity()]
    num_groups = -(-len(layers) // group_size)
    groups = {index % num_groups for index, name in enumerate(layers) if name.startswith("drafter attention")}
    if len(groups) > 1:
        raise _UnifyError(
            "grouping",
            f"vLLM groups KV layers {group_size} at a time here, so the drafter's {drafter.num_layers} layers "
            f'land in {len(groups)} KV cache groups and the proposer asserts "All drafting layers should '
            f'belong to the same kv cache group"',
        )


def _kv_groups(specs: list[_Spec], num_speculative_blocks: int, mamba_align: bool) -> tuple[str, int, list[dict]]:
    """(layout, layers per group, one entry per spec type) for kv_pool: the groups vLLM builds."""
    layout = _layout(specs)
    types = _spec_types(specs)
    first = {spec.identity(): spec for spec in reversed(specs)}
    total = sum(len(layers) for layers in types.values())
    group_size = total if layout != "hybrid" else _group_size(types)
    groups = []
    for identity, layers in types.items():
        spec = first[identity]
        mamba = spec.kind == "mamba"
        groups.append(
            {
                "kind": spec.kind,
                "names": sorted({name.rsplit(" ", 1)[0] for name in layers}),
                "layers": len(layers),
                "block_size": spec.block_size,
                "layer_page_bytes": spec.page_size_bytes,
                "groups": 1 if layout != "hybrid" else -(-len(layers) // group_size),
                # MambaSpec.max_memory_usage_bytes: 1 + n pages ("none"), 2 + n ("align")
                "pages_per_request": (2 if mamba_align else 1) + num_speculative_blocks if mamba else None,
            }
        )
    return layout, group_size, groups


def _check_runner(specs: list[_Spec], kernel_sizes: list[KernelSize], kernel_blocks: dict[str, int]) -> None:
    """The model runner: kernel block per attention group, FLASH_ATTN shape check, padded-page view."""
    for spec in specs:
        if spec.kind != "attention":
            continue
        kernel = select_kernel_block_size(spec.block_size, kernel_sizes)
        if kernel is None:
            raise _UnifyError(
                "kernel", f"no kernel block size divides the {spec.name} block of {spec.block_size} tokens"
            )
        kernel_blocks[spec.name] = kernel
        if spec.page_size_padded is not None and kernel < spec.block_size:
            raise _UnifyError(
                "view",
                f"the padded {spec.name} page is viewed with kernel block {kernel} < block {spec.block_size}: "
                "the strided view runs past the buffer (setStorage out of bounds)",
            )


def _check_scheduler(
    specs: list[_Spec], cache_block_size: int, enable_prefix_caching: bool, max_model_len: int | None
) -> tuple[int, int] | None:
    """resolve_kv_cache_block_sizes and the KV cache coordinator's asserts: (scheduler, hash) block sizes.

    vLLM builds one KV cache group or several (the GDN layers' groups and one or more of attention
    layers); a group's block is its spec's. None when the answer needs ``max_model_len`` (the GDN
    group's block without prefix caching) and none was given.
    """
    blocks = []
    for spec in specs:
        if spec.kind == "mamba" and not enable_prefix_caching:
            if max_model_len is None:
                return None
            blocks.append(max_model_len)  # mamba cache mode "none": one block holds the whole sequence
        else:
            blocks.append(spec.block_size)
    if _layout(specs) != "hybrid":  # one KV cache group
        return cache_block_size, cache_block_size
    scheduler = math.lcm(*blocks)
    if not enable_prefix_caching:
        return scheduler, scheduler
    if any(spec.kind == "mamba" and spec.block_size != cache_block_size for spec in specs):
        bad = sorted({b for b in blocks if b % scheduler})
        if bad:
            raise _UnifyError(
                "scheduler",
                f"a GDN block differs from cache_config.block_size {cache_block_size}, so prefix caching hashes "
                f"on the {scheduler}-token LCM of the group blocks and HybridKVCacheCoordinator asserts "
                f'"block_size must be divisible by hash_block_size" (group blocks {sorted(set(blocks))})',
            )
        return scheduler, scheduler
    return scheduler, math.gcd(*blocks)


# Drafters that draft in parallel (vLLM's SpeculativeConfig.parallel_drafting): one new slot per
# masked token, n - 1 per sequence, held back from the scheduler's token budget.
PARALLEL_DRAFTERS = ("DFlashDraftModel",)


def step_token_budget(
    max_num_batched_tokens: int, max_num_seqs: int, num_speculative_tokens: int, drafter_architecture: str | None
) -> int:
    """VllmConfig's max_num_scheduled_tokens: the batch less the drafting slots of every sequence."""
    slots = num_speculative_tokens - 1 if drafter_architecture in PARALLEL_DRAFTERS and num_speculative_tokens else 0
    return max_num_batched_tokens - slots * max_num_seqs


def _check_prefill_budget(hybrid: bool, enable_prefix_caching: bool, cache_block_size: int, budget: int | None) -> None:
    """Prefix caching on a hybrid schedules prefill in whole cache blocks: the budget must hold one."""
    if not (hybrid and enable_prefix_caching) or budget is None or budget >= cache_block_size:
        return
    raise _UnifyError(
        "scheduler",
        f"with prefix caching the GDN state is cached per {cache_block_size}-token block, so prefill is "
        f"scheduled in whole blocks, but a step may schedule only {budget} tokens (max-num-batched-tokens less "
        f"the drafting slots): a prompt of {cache_block_size} tokens or more is never scheduled; raise "
        f"max-num-batched-tokens by at least {cache_block_size - budget} or turn prefix caching off",
    )


def _align(
    block_size: int,
    kernel_alignment: int,
    attn_bytes_per_token: int,
    mamba_page: int,
    drafter_bytes_per_token: int | None,
    patched: bool,
) -> int:
    """Platform._align_hybrid_block_size (mamba_cache_mode none/align): the target's attention block."""
    quantum = kernel_alignment * attn_bytes_per_token
    if patched and drafter_bytes_per_token:
        quantum = math.lcm(quantum, kernel_alignment * drafter_bytes_per_token)
    step = quantum // attn_bytes_per_token
    attn_block = step * -(-mamba_page // quantum)
    return max(block_size, attn_block)


# vLLM serve flags the planner judges, as a profile's serve_args name them -> plan() keywords.
SERVING_FLAGS = {
    "enable-prefix-caching": "enable_prefix_caching",
    "max-model-len": "max_model_len",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "max-num-seqs": "max_num_seqs",
}
# Serve flags that change the KV layout itself: the rank's share of the KV heads, the cache block,
# the cache and state dtypes and the attention backend whose kernel block sizes the runner needs.
LAYOUT_INT_FLAGS = {"tensor-parallel-size": "tensor_parallel_size", "block-size": "block_size"}
LAYOUT_TEXT_FLAGS = {
    "kv-cache-dtype": "kv_cache_dtype",
    "mamba-cache-dtype": "mamba_cache_dtype",
    "mamba-ssm-cache-dtype": "mamba_ssm_cache_dtype",
    "dtype": "dtype",
    "attention-backend": "attention_backend",
}


def _int_arg(flag: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVPlanInputError(f"serve arg {flag} is {value!r}; it must be an integer")
    return value


def serving_options(serve_args: dict[str, Any] | None) -> dict[str, Any]:
    """plan() keywords from a resolved profile's serve_args: every flag that changes what vLLM lays out
    (the step budget only when both halves are set, since vLLM's defaults for them depend on its usage
    context); a flag a profile leaves unset (or null) keeps plan()'s default, which is vLLM's."""
    args = serve_args or {}
    options: dict[str, Any] = {"enable_prefix_caching": bool(args.get("enable-prefix-caching"))}
    for flag in ("max-model-len", "max-num-batched-tokens", "max-num-seqs"):
        if args.get(flag) is not None:
            options[SERVING_FLAGS[flag]] = _int_arg(flag, args[flag])
    if ("max_num_batched_tokens" in options) != ("max_num_seqs" in options):
        options.pop("max_num_batched_tokens", None)
        options.pop("max_num_seqs", None)
    for flag, keyword in LAYOUT_INT_FLAGS.items():
        if args.get(flag) is not None:
            options[keyword] = _int_arg(flag, args[flag])
    for flag, keyword in LAYOUT_TEXT_FLAGS.items():
        if args.get(flag) is not None:
            if not isinstance(args[flag], str):
                raise KVPlanInputError(f"serve arg {flag} is {args[flag]!r}; it must be a string")
            # vLLM takes the backend's enum name in any case (flash_attn is FLASH_ATTN)
            options[keyword] = args[flag].upper() if flag == "attention-backend" else args[flag]
    return options


def plan(
    target_config: dict[str, Any],
    drafter_config: dict[str, Any] | None,
    num_speculative_tokens: int,
    patched: bool,
    *,
    drafter_label: str | None = None,
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    attention_backend: str | None = None,
    platform: str = "cuda",
    block_size: int | None = None,
    enable_prefix_caching: bool = False,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
) -> KVPlan:
    """Predict vLLM 0.23's KV page unification for a target + drafter, stock or patched.

    ``num_speculative_tokens`` 0 (or no drafter config) plans the target alone; with no drafter config
    and n > 0 it plans drafter-less speculation (ngram). ``drafter_label`` names the drafter in
    ``reason`` (e.g. its revision). The other options are vLLM's serve flags; ``attention_backend``
    defaults to FLASH_ATTN on CUDA and CPU_ATTN on CPU, ``block_size`` None to the platform's default.
    ``max_model_len`` only sets the scheduler's block sizes without prefix caching (the GDN group's block);
    ``max_num_batched_tokens`` and ``max_num_seqs`` (vLLM's defaults are its usage context's, so give
    them) set the step's token budget, which prefix caching on a hybrid needs to hold one cache block.
    A stock plan that fails says in its reason whether the patched build unifies the case.
    Raises KVPlanInputError for configs or options it cannot read.
    """
    options = PlanOptions(
        drafter_label,
        kv_cache_dtype,
        mamba_cache_dtype,
        mamba_ssm_cache_dtype,
        dtype,
        tensor_parallel_size,
        attention_backend,
        platform,
        block_size,
        enable_prefix_caching,
        max_model_len,
        max_num_batched_tokens,
        max_num_seqs,
    )
    result = _plan(target_config, drafter_config, num_speculative_tokens, patched, options)
    if not result.ok and not patched:
        fixed = _plan(target_config, drafter_config, num_speculative_tokens, True, options)
        if fixed.ok:
            hint = f"patch 0001 (sparkfleet's wheel) unifies it: attention block {fixed.attention_block_size}"
            if fixed.drafter_block_size is not None:
                hint += f", drafter block {fixed.drafter_block_size}"
            result = replace(result, reason=f"{result.reason}; {hint}")
    return result


def plan_for_profile(
    target_config: dict[str, Any],
    drafter_config: dict[str, Any] | None,
    num_speculative_tokens: int,
    patched: bool,
    *,
    drafter_path: str | None = None,
    platform: str = "cuda",
    serve_args: dict[str, Any] | None = None,
) -> KVPlan:
    """``plan`` as a deploy judges a profile: the drafter named by its config's directory (a revision's
    snapshot), the profile's resolved serve_args read by ``serving_options``. The preflight's lookup and
    ``make tune``'s vetting both plan through this."""
    return plan(
        target_config,
        drafter_config,
        num_speculative_tokens,
        patched,
        drafter_label=Path(drafter_path).parent.name if drafter_path else None,
        platform=platform,
        **serving_options(serve_args),
    )


def _plan(
    target_config: dict[str, Any],
    drafter_config: dict[str, Any] | None,
    num_speculative_tokens: int,
    patched: bool,
    options: PlanOptions,
) -> KVPlan:
    """plan() for one build. With prefix caching the modelled architectures run mamba cache mode
    "align" (none of them supports "all"), whose alignment is the one without prefix caching; what
    prefix caching changes is the GDN group's block, and so the scheduler's block sizes."""
    for name, value in (
        ("max_model_len", options.max_model_len),
        ("max_num_batched_tokens", options.max_num_batched_tokens),
        ("max_num_seqs", options.max_num_seqs),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise KVPlanInputError(f"{name} {value!r} must be a positive integer")
    if (options.max_num_batched_tokens is None) != (options.max_num_seqs is None):
        raise KVPlanInputError("give max_num_batched_tokens and max_num_seqs together (the step budget needs both)")
    if options.platform not in PLATFORMS:
        raise KVPlanInputError(f"platform {options.platform!r} is not modelled; use one of {', '.join(PLATFORMS)}")
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
        raise KVPlanInputError(
            f"num_speculative_tokens is {num_speculative_tokens!r}; it must be an integer >= 0 (0: no drafter)"
        )
    if drafter_config is not None and num_speculative_tokens == 0:
        raise KVPlanInputError("num_speculative_tokens is 0 but a drafter config was given; pass 1 or more")
    for name, value, allowed in (
        ("kv_cache_dtype", options.kv_cache_dtype, KV_CACHE_DTYPES),
        ("mamba_cache_dtype", options.mamba_cache_dtype, MAMBA_CACHE_DTYPES),
        ("mamba_ssm_cache_dtype", options.mamba_ssm_cache_dtype, MAMBA_CACHE_DTYPES),
        ("dtype", options.dtype, ("auto", "bfloat16", "float16")),
    ):
        if value not in allowed:
            raise KVPlanInputError(f"{name} {value!r} is not modelled; use one of {', '.join(allowed)}")
    if (
        not isinstance(options.tensor_parallel_size, int)
        or isinstance(options.tensor_parallel_size, bool)
        or options.tensor_parallel_size < 1
    ):
        raise KVPlanInputError(f"tensor_parallel_size {options.tensor_parallel_size!r} must be a positive integer")
    if options.block_size is not None and (options.block_size <= 0 or options.block_size % 16):
        raise KVPlanInputError(f"block_size {options.block_size} must be a positive multiple of 16")
    backend = options.attention_backend or ("FLASH_ATTN" if options.platform == "cuda" else "CPU_ATTN")

    target = read_target(target_config, options.tensor_parallel_size)
    label = options.drafter_label or "drafter"
    drafter = (
        read_drafter(drafter_config, options.tensor_parallel_size, label=label) if drafter_config is not None else None
    )
    model_dtype = target.dtype if options.dtype == "auto" else options.dtype
    kv_bytes = DTYPE_BYTES[model_dtype if options.kv_cache_dtype == "auto" else options.kv_cache_dtype]
    conv_dtype = model_dtype if options.mamba_cache_dtype == "auto" else options.mamba_cache_dtype
    # The SSM state dtype as cache_config holds it once the Qwen3.5 config hook has run ("auto" kept
    # for other models); FLASH_ATTN compares these strings, the state itself falls back to the conv dtype.
    ssm_dtype_setting = (
        options.mamba_ssm_cache_dtype if options.mamba_ssm_cache_dtype != "auto" else target.mamba_ssm_dtype
    )
    ssm_dtype = ssm_dtype_setting or conv_dtype
    mamba_float32 = "float32" in (ssm_dtype_setting, options.mamba_cache_dtype)
    kernel_sizes = supported_kernel_block_sizes(backend, target.gdn is not None, mamba_float32)

    initial_block = options.block_size or (DEFAULT_BLOCK_SIZE if options.platform == "cuda" else CPU_DEFAULT_BLOCK_SIZE)
    attn_bpt = target.attention.bytes_per_token(kv_bytes)
    drafter_bpt = drafter.attention.bytes_per_token(kv_bytes) if drafter else None
    n = num_speculative_tokens

    mamba_page = None
    page_padded = None
    attention_block = initial_block
    if target.gdn is not None:
        mamba_page = target.gdn.page_bytes(
            n, DTYPE_BYTES[conv_dtype], DTYPE_BYTES[ssm_dtype], options.tensor_parallel_size
        )
        kernel_alignment = max(min(s[1] if isinstance(s, tuple) else s for s in kernel_sizes), initial_block)
        attention_block = _align(initial_block, kernel_alignment, attn_bpt, mamba_page, drafter_bpt, patched)
        if attention_block * attn_bpt > mamba_page:
            page_padded = attention_block * attn_bpt

    target_geometry = (target.attention.num_kv_heads, target.attention.head_size)
    specs = [
        _Spec(
            "target attention",
            "attention",
            attention_block,
            bytes_per_token=attn_bpt,
            num_layers=target.attention.num_layers,
            geometry=target_geometry,
        )
    ]
    if target.gdn is not None and mamba_page is not None:
        specs.append(
            _Spec(
                "GDN state",
                "mamba",
                attention_block,
                state_bytes=mamba_page,
                page_size_padded=page_padded,
                num_layers=target.gdn.num_layers,
            )
        )
    if drafter is not None and drafter_bpt is not None:
        specs.append(
            _Spec(
                "drafter attention",
                "attention",
                attention_block,
                bytes_per_token=drafter_bpt,
                num_layers=drafter.attention.num_layers,
                geometry=(drafter.attention.num_kv_heads, drafter.attention.head_size),
            )
        )

    budget = None
    if options.max_num_batched_tokens is not None and options.max_num_seqs is not None:
        budget = step_token_budget(
            options.max_num_batched_tokens, options.max_num_seqs, n, drafter.architecture if drafter else None
        )
        if budget <= 0:
            raise KVPlanInputError(
                f"max_num_batched_tokens {options.max_num_batched_tokens} leaves no tokens per step after the drafting "
                f"slots of {options.max_num_seqs} sequences at n={n} (vLLM refuses it); raise it"
            )
    kernel_blocks: dict[str, int] = {}
    failure: _UnifyError | None = None
    scheduler_blocks: tuple[int, int] | None = None
    try:
        if _layout(specs) == "hybrid":  # one-group layouts are never unified
            (_unify_patched if patched else _unify_stock)(specs)
        _check_groups(specs)
        _check_runner(specs, kernel_sizes, kernel_blocks)
        scheduler_blocks = _check_scheduler(
            specs, attention_block, options.enable_prefix_caching, options.max_model_len
        )
        _check_prefill_budget(target.gdn is not None, options.enable_prefix_caching, attention_block, budget)
    except _UnifyError as exc:
        failure = exc

    padding_pct = 0.0
    if mamba_page:
        mamba_spec = next(spec for spec in specs if spec.kind == "mamba")
        padding_pct = 100 * (mamba_spec.page_size_bytes - mamba_page) / mamba_page
    drafter_desc = _describe_drafter(drafter, drafter_bpt, attn_bpt) if drafter else "no drafter"
    version = "patched" if patched else "stock"
    if failure is not None:
        return KVPlan(
            ok=False,
            reason=f"{drafter_desc}, n={n}: {version} vLLM 0.23 cannot unify the KV cache: {failure}",
            patched=patched,
            num_speculative_tokens=n,
            drafter=drafter.label if drafter else None,
            attention_block_size=attention_block,
            drafter_block_size=None,
            page_size_bytes=None,
            mamba_page_size_bytes=mamba_page,
            padding_pct=round(padding_pct, 4),
            kernel_block_sizes=kernel_blocks,
            failure_stage=failure.stage,
            step_token_budget=budget,
        )
    layout, group_size, groups = _kv_groups(
        specs, n if n else 0, mamba_align=options.enable_prefix_caching and target.gdn is not None
    )
    # the page of every KV cache group; a one-group model of several geometries has every layer's summed
    common_page = (
        sum(g["layers"] * g["layer_page_bytes"] for g in groups)
        if layout == "uniform_type"
        else (specs[0].page_size_bytes)
    )
    drafter_spec = next((spec for spec in specs if spec.name == "drafter attention"), None)
    drafter_block = drafter_spec.block_size if drafter_spec is not None else None
    detail = f"attention block {specs[0].block_size}"
    if drafter_block is not None:
        detail += f", drafter block {drafter_block}"
    detail += f", page {common_page} B"
    if mamba_page:
        detail += f", GDN page padded {padding_pct:.2f}%"
    if scheduler_blocks is not None:
        detail += f", scheduler block {scheduler_blocks[0]}"
        if options.enable_prefix_caching:
            detail += f", prefix-cache hash block {scheduler_blocks[1]}"
            if target.gdn is not None and scheduler_blocks[0] > attention_block:
                # a group block above the GDN block: hits need a GDN state on a scheduler-block boundary,
                # but prefill is chunked in GDN blocks, so a chunk may end past it and the hit is lost
                detail += (
                    f"; prefix-cache hits can be lost: they need a GDN state at a multiple of "
                    f"{scheduler_blocks[0]} tokens, and prefill chunks end on multiples of {attention_block}"
                )
    return KVPlan(
        ok=True,
        reason=f"{drafter_desc}, n={n}: {version} vLLM 0.23 unifies the KV cache ({detail})",
        patched=patched,
        num_speculative_tokens=n,
        drafter=drafter.label if drafter else None,
        attention_block_size=specs[0].block_size,
        drafter_block_size=drafter_block,
        page_size_bytes=common_page,
        mamba_page_size_bytes=mamba_page,
        padding_pct=round(padding_pct, 4),
        kernel_block_sizes=kernel_blocks,
        scheduler_block_size=scheduler_blocks[0] if scheduler_blocks else None,
        hash_block_size=scheduler_blocks[1] if scheduler_blocks else None,
        step_token_budget=budget,
        kv_layout=layout,
        kv_group_size=group_size,
        kv_groups=groups,
    )


def _describe_drafter(drafter: DrafterModel, drafter_bpt: int | None, target_bpt: int) -> str:
    geometry = drafter.attention
    text = (
        f"drafter {drafter.label} ({geometry.num_kv_heads} KV heads x {geometry.head_size}, "
        f"{geometry.num_layers} layers, {drafter_bpt} B/token vs the target's {target_bpt})"
    )
    return text


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json, given the file or the model directory that holds it."""
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    try:
        return jsonfile.read_object(config_path)
    except jsonfile.NotAJsonObject as exc:
        raise KVPlanInputError(f"{config_path}: {exc}; pass a config.json or the directory holding it") from None


def _label_from_path(path: str) -> str:
    config_path = Path(path)
    return config_path.name if config_path.is_dir() else config_path.parent.name or config_path.stem


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-plan",
        help="predict whether vLLM 0.23 (stock and patched) unifies a target's and a drafter's KV cache",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--target-config", required=True, help="target config.json (or its directory)")
    parser.add_argument("--drafter-config", help="drafter config.json (or its directory); omit for none")
    parser.add_argument("--drafter-label", help="name for the drafter in messages (default: its directory)")
    parser.add_argument("--num-speculative-tokens", type=int, required=True, help="0 plans the target alone")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--mamba-cache-dtype", default="auto", choices=MAMBA_CACHE_DTYPES)
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_CACHE_DTYPES)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--attention-backend", choices=BACKENDS, help="default: FLASH_ATTN (cuda), CPU_ATTN (cpu)")
    parser.add_argument("--platform", default="cuda", choices=PLATFORMS)
    parser.add_argument("--block-size", type=int, help="a user --block-size (default: the platform's)")
    parser.add_argument(
        "--enable-prefix-caching", action="store_true", help="as vLLM's flag (the GDN group's block, the hash block)"
    )
    parser.add_argument(
        "--max-model-len", type=int, help="as vLLM's flag: the GDN group's block without prefix caching"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, help="as vLLM's flag (with --max-num-seqs)")
    parser.add_argument("--max-num-seqs", type=int, help="as vLLM's flag: the step budget's drafting slots")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        help="also print the KV pool vLLM builds from this much KV cache memory (GiB; needs --max-model-len): "
        "tokens and the max concurrency at max-model-len, as vLLM logs them at start",
    )
    parser.add_argument(
        "--stock", action="store_true", help="judge stock vLLM 0.23 (default: with patch 0001, as sparkfleet ships)"
    )
    parser.add_argument("--json", action="store_true", help="print both plans as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the stock and patched plans; exit 1 (one line) when the judged version cannot unify."""
    try:
        target = load_config(args.target_config)
        drafter = load_config(args.drafter_config) if args.drafter_config else None
        label = args.drafter_label or (_label_from_path(args.drafter_config) if args.drafter_config else None)
        options = {
            "drafter_label": label,
            "kv_cache_dtype": args.kv_cache_dtype,
            "mamba_cache_dtype": args.mamba_cache_dtype,
            "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
            "dtype": args.dtype,
            "tensor_parallel_size": args.tensor_parallel_size,
            "attention_backend": args.attention_backend,
            "platform": args.platform,
            "block_size": args.block_size,
            "enable_prefix_caching": args.enable_prefix_caching,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
        }
        plans = {
            version: plan(target, drafter, args.num_speculative_tokens, version == "patched", **options)
            for version in ("stock", "patched")
        }
        pools: dict[str, KVPool] = {}
        if args.kv_cache_gib is not None:
            if args.max_model_len is None or args.kv_cache_gib <= 0:
                raise KVPlanInputError(
                    f"--kv-cache-gib {args.kv_cache_gib} needs a positive size and --max-model-len (the context "
                    "the concurrency is counted at)"
                )
            kv_bytes = int(args.kv_cache_gib * (1 << 30))
            pools = {v: kv_pool(p, kv_bytes, args.max_model_len) for v, p in plans.items() if p.ok}
    except KVPlanInputError as exc:
        print(f"kv-plan: {exc}", file=sys.stderr)
        return 2
    version = "stock" if args.stock else "patched"
    judged = plans[version]
    if args.json:
        print(
            json.dumps(
                {v: {**p.to_dict(), "pool": pools[v].to_dict() if v in pools else None} for v, p in plans.items()},
                indent=2,
            )
        )
    else:
        print(judged.reason)
        if version in pools:
            pool = pools[version]
            print(
                f"KV pool at {args.kv_cache_gib:g} GiB: {pool.tokens:,} tokens, max concurrency "
                f"{pool.max_concurrency:.2f}x at {pool.max_model_len:,} tokens per request "
                f"({pool.num_blocks} blocks, {pool.blocks_per_request} per request)"
            )
    return 0 if judged.ok else 1
