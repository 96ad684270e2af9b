"""KV page-size unification on the real vLLM 0.23 code, stock and with patch 0001, vs sparkfleet kv-plan.

For each case a real VllmConfig is built from config.json files (target + DFlash drafter, real
ModelConfig / SpeculativeConfig / CacheConfig), then vLLM's own steps run:

1. ``Platform._align_hybrid_block_size`` with the FLASH_ATTN backend class (CUDA) or CPU_ATTN (CPU);
2. the KV cache specs the model's layers report: real ``Attention`` layers (target full attention and
   drafter layers, built with the arguments DFlashQwen3Attention passes) and the GDN ``MambaSpec`` from
   the model class's ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``;
3. ``get_kv_cache_configs`` (``get_kv_cache_groups``, which calls ``unify_kv_cache_spec_page_size``),
   the scheduler's block sizes (``resolve_kv_cache_block_sizes``) and a ``KVCacheManager`` over the result;
4. the runner's ``select_common_block_size`` and ``GPUModelRunner._reshape_kv_cache_tensors`` on small
   CPU buffers (the runner is the one stand-in: a namespace carrying the attributes that method reads).

The patched code is the stock files of the installed vllm with the patch applied by ``patch -p1`` in a
temporary directory, loaded as separate modules. Every outcome is compared with
``sparkfleet.serving.kv_page_plan.plan``.

Run as a script to print the table or write docs/kv-unify.md:
    build/venv-vllm/bin/python tests/vllm/test_kv_unify_real.py --write docs/kv-unify.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from sparkfleet.serving import kv_page_plan  # noqa: E402

pytestmark = pytest.mark.vllm

PATCH_FILE = REPO_ROOT / "files" / "patches" / "vllm-0.23.0" / "0001-kv-page-size-unify.patch"
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "kv_configs"
TARGET_FIXTURE = FIXTURES / "qwen3_5_122b_a10b" / "config.json"
DRAFTERS = {
    "6c7242c": FIXTURES / "dflash_6c7242c" / "config.json",
    "bce6f76": FIXTURES / "dflash_bce6f76" / "config.json",
}
REFERENCE_NS = (0, 5, 8, 12, 15)
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 4 << 30  # what get_kv_cache_configs may plan with (nothing is allocated)
LONG_CONTEXT_KV_CACHE_BYTES = 28 << 30  # one 262,144-token request of the 122B takes ~10 GiB


@dataclass(frozen=True)
class Case:
    """One configuration: a target, an optional drafter, n and the cache options."""

    name: str
    target: dict[str, Any]
    drafter: dict[str, Any] | None
    drafter_label: str | None
    num_speculative_tokens: int
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    platform: str = "cuda"
    block_size: int | None = None
    enable_prefix_caching: bool = False
    max_model_len: int = MAX_MODEL_LEN
    kv_bytes: int | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """The KV memory this case plans with: ``kv_bytes``, else KV_CACHE_BYTES less a per-case odd
        amount, so block counts are not round numbers."""
        if self.kv_bytes is not None:
            return self.kv_bytes
        salt = zlib.crc32(f"{self.name}/{self.drafter_label}/{self.num_speculative_tokens}".encode())
        base = KV_CACHE_BYTES if self.max_model_len <= MAX_MODEL_LEN else LONG_CONTEXT_KV_CACHE_BYTES
        return base - salt % (1 << 28)

    def plan(self, patched: bool) -> kv_page_plan.KVPlan:
        keywords = (  # the case's fields named as the planner's options
            "drafter_label",
            "kv_cache_dtype",
            "mamba_ssm_cache_dtype",
            "platform",
            "block_size",
            "enable_prefix_caching",
            "max_model_len",
        )
        options = {name: getattr(self, name) for name in keywords}
        return kv_page_plan.plan(self.target, self.drafter, self.num_speculative_tokens, patched, **options)


@dataclass
class Outcome:
    """What the real vLLM code did with one case."""

    ok: bool
    stage: str | None = None  # where it failed: "unify", "grouping", "kernel", "view" or "scheduler"
    error: str = ""
    attention_block_size: int | None = None
    drafter_block_size: int | None = None
    page_size_bytes: int | None = None
    mamba_page_size_bytes: int | None = None
    padding_pct: float = 0.0
    kernel_block_sizes: dict[str, int] = field(default_factory=dict)
    padded_attention: bool = False
    log_lines: list[str] = field(default_factory=list)
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    # the KV pool (get_kv_cache_config_from_groups, get_max_concurrency_for_kv_cache_config)
    num_blocks: int | None = None
    max_concurrency: float | None = None
    kv_tokens: int | None = None  # vLLM's "GPU KV cache size: N tokens"
    # what the scheduler is built from (kept for the prefix-caching runs; never compared)
    vllm_config: Any = field(default=None, repr=False, compare=False)
    kv_cache_config: Any = field(default=None, repr=False, compare=False)


# --------------------------------------------------------------------------------------------------
# vLLM: stock modules, patched modules
# --------------------------------------------------------------------------------------------------


def patched_file_paths(patch_text: str) -> list[str]:
    """The wheel-relative paths a unified diff touches (its `+++ b/...` lines)."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch_text, flags=re.MULTILINE)


def load_patched_vllm(workdir: Path) -> SimpleNamespace:
    """Apply the patch to copies of the installed vllm files and import them as separate modules."""
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    patch_text = PATCH_FILE.read_text()
    for rel in patched_file_paths(patch_text):
        dest = workdir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((site / rel).read_bytes())
    result = subprocess.run(
        ["patch", "-p1", "--forward", "--batch", "-d", str(workdir), "-i", str(PATCH_FILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"patch does not apply to the installed vllm:\n{result.stdout}{result.stderr}"
    loaded = {"vllm/platforms/interface.py": "interface", "vllm/v1/core/kv_cache_utils.py": "kv_cache_utils"}
    assert set(patched_file_paths(patch_text)) == set(loaded), "the patch touches files this test does not load"
    modules = {}
    for rel, key in loaded.items():
        name = "sparkfleet_patched_" + rel.removesuffix(".py").replace("/", "_")
        spec = importlib.util.spec_from_file_location(name, workdir / rel)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[key] = module
    return SimpleNamespace(**modules)


class LogCapture(logging.Handler):
    """Collects the messages of the alignment's `logger.info` lines."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def captured_logs(module: ModuleType) -> Iterator[LogCapture]:
    logger = module.logger
    capture = LogCapture()
    old_level = logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        logger.setLevel(old_level)


class RealVLLM:
    """Runs cases through the real vLLM 0.23 code, stock or patched."""

    def __init__(self, workdir: Path) -> None:
        import vllm.platforms.interface as stock_interface
        import vllm.v1.core.kv_cache_utils as stock_kv_cache_utils

        self.workdir = workdir
        self.stock = SimpleNamespace(interface=stock_interface, kv_cache_utils=stock_kv_cache_utils)
        register_models_in_process(("Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "DFlashDraftModel"))
        self.patched = load_patched_vllm(workdir / "patched")
        self._config_dirs: dict[str, Path] = {}

    def config_dir(self, config: dict[str, Any]) -> Path:
        text = json.dumps(config, sort_keys=True, indent=1)
        key = hashlib.sha256(text.encode()).hexdigest()[:16]
        if key not in self._config_dirs:
            path = self.workdir / "configs" / key
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(text)
            self._config_dirs[key] = path
        return self._config_dirs[key]

    def model_configs(self, case: Case) -> tuple[Any, Any, Any]:
        """Fresh real ModelConfig, ParallelConfig and SpeculativeConfig.

        Never shared between runs: VllmConfig applies the model's config hooks (the Qwen3.5 one sets
        the float32 SSM cache dtype) only once per ModelConfig.
        """
        from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

        model_config = ModelConfig(
            model=str(self.config_dir(case.target)),
            skip_tokenizer_init=True,
            max_model_len=case.max_model_len,
        )
        parallel_config = ParallelConfig()
        speculative_config = None
        if case.drafter is not None:
            speculative_config = SpeculativeConfig(
                method="dflash",
                model=str(self.config_dir(case.drafter)),
                num_speculative_tokens=case.num_speculative_tokens,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            )
        return model_config, parallel_config, speculative_config

    def vllm_config(self, case: Case) -> Any:
        """A fresh VllmConfig (its CacheConfig is what the alignment changes) for one run."""
        from vllm.config import CacheConfig, VllmConfig

        model_config, parallel_config, speculative_config = self.model_configs(case)
        cache_kwargs: dict[str, Any] = {
            "cache_dtype": case.kv_cache_dtype,
            "mamba_ssm_cache_dtype": case.mamba_ssm_cache_dtype,
            "enable_prefix_caching": case.enable_prefix_caching,
        }
        if case.block_size is not None:
            cache_kwargs["block_size"] = case.block_size
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(**cache_kwargs),
            parallel_config=parallel_config,
            speculative_config=speculative_config,
        )

    def run(self, case: Case, patched: bool) -> Outcome:
        import torch
        from vllm.config.vllm import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.models import ModelRegistry
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs
        from vllm.v1.worker.utils import select_common_block_size

        code = self.patched if patched else self.stock
        vllm_config = self.vllm_config(case)
        cache_config = vllm_config.cache_config
        model_config = vllm_config.model_config
        backend = attention_backend_class(case.platform)
        outcome = Outcome(ok=False)

        # 1. hybrid block alignment (update_block_size_for_backend)
        with set_current_vllm_config(vllm_config):
            if case.platform == "cuda" and not cache_config.user_specified_block_size:
                cache_config.block_size = backend.get_preferred_block_size(cache_config.DEFAULT_BLOCK_SIZE)
        with captured_logs(code.interface) as logs:
            if model_config.is_hybrid:
                code.interface.Platform._align_hybrid_block_size(vllm_config, backend)
        outcome.log_lines = logs.lines
        outcome.attention_block_size = cache_config.block_size

        # 2. the layers' KV cache specs
        text_config = model_config.hf_text_config
        specs: dict[str, Any] = {}
        with set_current_vllm_config(vllm_config):
            target_attn = Attention(
                text_config.num_attention_heads,
                model_config.get_head_size(),
                model_config.get_head_size() ** -0.5,
                num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
                cache_config=cache_config,
                prefix="model.layers.full.self_attn.attn",
            )
            target_spec = target_attn.get_kv_cache_spec(vllm_config)
            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
            mamba_spec = None
            if model_config.is_hybrid:
                mamba_spec = MambaSpec(
                    shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                    block_size=cache_config.mamba_block_size,
                    page_size_padded=cache_config.mamba_page_size_padded,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode=cache_config.mamba_cache_mode,
                    num_speculative_blocks=case.num_speculative_tokens if case.drafter is not None else 0,
                )
                outcome.mamba_page_size_bytes = sum(
                    _prod(shape) * dtype.itemsize
                    for shape, dtype in zip(mamba_spec.shapes, mamba_spec.dtypes, strict=True)
                )
            draft_spec = None
            if case.drafter is not None:
                draft = vllm_config.speculative_config.draft_model_config
                draft_hf = draft.hf_config
                head_dim = getattr(draft_hf, "head_dim", None) or draft_hf.hidden_size // draft_hf.num_attention_heads
                draft_attn = Attention(
                    draft_hf.num_attention_heads,
                    head_dim,
                    head_dim**-0.5,
                    num_kv_heads=max(1, draft_hf.num_key_value_heads),
                    cache_config=cache_config,
                    prefix="model.layers.draft.self_attn.attn",
                )
                draft_spec = draft_attn.get_kv_cache_spec(vllm_config)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        roles: dict[str, str] = {}
        for index, layer_type in enumerate(layer_types):
            if layer_type == "full_attention":
                specs[f"model.layers.{index}.self_attn.attn"] = target_spec
                roles[f"model.layers.{index}.self_attn.attn"] = "target attention"
            else:
                specs[f"model.layers.{index}.linear_attn"] = mamba_spec
        if draft_spec is not None:
            # DFlash numbers its layers after the target's (start_layer_id).
            for index in range(vllm_config.speculative_config.draft_model_config.hf_config.num_hidden_layers):
                specs[f"model.layers.{len(layer_types) + index}.self_attn.attn"] = draft_spec
                roles[f"model.layers.{len(layer_types) + index}.self_attn.attn"] = "drafter attention"

        # 3. grouping and page-size unification (get_kv_cache_configs -> get_kv_cache_groups), then
        # the scheduler side: its block sizes and the KV cache manager over the unified config
        try:
            kv_cache_config = code.kv_cache_utils.get_kv_cache_configs(vllm_config, [specs], [case.kv_cache_bytes])[0]
        except (AssertionError, NotImplementedError, ValueError) as exc:
            outcome.stage, outcome.error = "unify", f"{type(exc).__name__}: {exc}"
            return outcome
        groups = kv_cache_config.kv_cache_groups
        # the pool as the engine reports it at start (_report_kv_cache_config)
        outcome.num_blocks = kv_cache_config.num_blocks
        outcome.max_concurrency = code.kv_cache_utils.get_max_concurrency_for_kv_cache_config(
            vllm_config, kv_cache_config
        )
        outcome.kv_tokens = int(outcome.max_concurrency * model_config.max_model_len)
        # the proposer's own check when the runner hands it the KV cache config (one group for every
        # drafting layer: validate_same_kv_cache_group, run on a stand-in that holds only the names)
        if draft_spec is not None:
            from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

            drafting = SimpleNamespace(
                _draft_attn_layer_names=[n for n, r in roles.items() if r == "drafter attention"]
            )
            try:
                SpecDecodeBaseProposer.validate_same_kv_cache_group(drafting, kv_cache_config)
            except AssertionError as exc:
                outcome.stage, outcome.error = "grouping", f"AssertionError: {exc}"
                return outcome
        pages = {group.kv_cache_spec.page_size_bytes for group in groups}
        assert len(pages) == 1, f"get_kv_cache_groups returned several page sizes: {pages}"
        outcome.page_size_bytes = pages.pop()
        for group in groups:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):  # one group of several full-attention geometries
                spec = next(iter(spec.kv_cache_specs.values()))
            if isinstance(spec, MambaSpec) and outcome.mamba_page_size_bytes:
                outcome.padding_pct = round(
                    100 * (spec.page_size_bytes - outcome.mamba_page_size_bytes) / outcome.mamba_page_size_bytes,
                    4,
                )
            if isinstance(spec, AttentionSpec):
                outcome.padded_attention |= spec.page_size_padded is not None
                # A drafter with the target's KV geometry shares the target's group.
                group_roles = {roles[name] for name in group.layer_names if name in roles}
                if "drafter attention" in group_roles:
                    outcome.drafter_block_size = spec.block_size
                if "target attention" in group_roles:
                    outcome.attention_block_size = spec.block_size

        # 4. the runner: kernel block per group, then the KV views over real (small) buffers
        kernel_sizes = []
        with set_current_vllm_config(vllm_config):
            for group in groups:
                spec = group.kv_cache_spec
                if isinstance(spec, AttentionSpec | UniformTypeKVCacheSpecs):
                    try:
                        kernel = select_common_block_size(spec.block_size, [backend])
                    except ValueError as exc:
                        outcome.stage, outcome.error = "kernel", f"ValueError: {exc}"
                        return outcome
                    for role in {roles[name] for name in group.layer_names if name in roles}:
                        outcome.kernel_block_sizes.setdefault(role, kernel)
                    kernel_sizes.append(kernel)
                else:
                    kernel_sizes.append(spec.block_size)
            try:
                check_kv_views(groups, kernel_sizes, backend, cache_config, torch)
            except RuntimeError as exc:
                outcome.stage, outcome.error = "view", f"RuntimeError: {exc}"
                return outcome

        # 5. the scheduler, as EngineCore builds it after the workers' KV caches: its block sizes
        # and the KV cache manager (the coordinator prefix caching picks, with its asserts)
        try:
            # what EngineCore hands the scheduler: a one-group model of several geometries as one of them
            scheduler_config = code.kv_cache_utils.generate_scheduler_kv_cache_config([kv_cache_config])
            scheduler_block_size, hash_block_size = code.kv_cache_utils.resolve_kv_cache_block_sizes(
                scheduler_config, vllm_config
            )
            KVCacheManager(
                scheduler_config,
                case.max_model_len,
                scheduler_block_size,
                hash_block_size,
                enable_caching=cache_config.enable_prefix_caching,
                use_eagle=case.drafter is not None,
            )
        except (AssertionError, ValueError) as exc:
            outcome.stage, outcome.error = "scheduler", f"{type(exc).__name__}: {exc}"
            return outcome
        outcome.scheduler_block_size, outcome.hash_block_size = scheduler_block_size, hash_block_size
        outcome.vllm_config, outcome.kv_cache_config = vllm_config, kv_cache_config
        outcome.ok = True
        return outcome


def register_models_in_process(architectures: tuple[str, ...]) -> None:
    """Register the (same) model classes as imported ones, so vLLM inspects them in this process.

    A lazily registered model is inspected in a fresh subprocess (to keep CUDA out of the parent)
    unless VLLM_CACHE_ROOT holds its model info; that costs ~30 s per architecture on a cold cache.
    """
    from vllm.model_executor.models import ModelRegistry

    for architecture in architectures:
        model_cls = ModelRegistry.models[architecture].load_model_cls()
        ModelRegistry.register_model(architecture, model_cls)


def _prod(shape: tuple[int, ...]) -> int:
    result = 1
    for dim in shape:
        result *= dim
    return result


def attention_backend_class(platform: str) -> type:
    if platform == "cuda":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


def check_kv_views(groups: list[Any], kernel_sizes: list[int], backend: type, cache_config: Any, torch: Any) -> None:
    """Run GPUModelRunner._reshape_kv_cache_tensors on 3-page CPU buffers, one layer per group.

    Raises RuntimeError where the real view does (a mis-strided padded page runs past its buffer);
    asserts that every kernel block of an attention layer lies inside its own page.
    """
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    num_pages = 3
    attn_groups = []
    raw_tensors = {}
    for group_id, group in enumerate(groups):
        spec = group.kv_cache_spec
        # a one-group model of several geometries: the runner views each layer with its own spec
        per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {group.layer_names[0]: spec}
        seen = set()
        for layer, layer_spec in per_layer.items():
            if layer_spec in seen:
                continue
            seen.add(layer_spec)
            group_backend = backend if isinstance(layer_spec, AttentionSpec) else GDNAttentionBackend
            attn_groups.append(AttentionGroup(group_backend, [layer], layer_spec, group_id))
            raw_tensors[layer] = torch.empty(num_pages * layer_spec.page_size_bytes, dtype=torch.int8)
    runner = SimpleNamespace(
        runner_only_attn_layers=set(),
        cache_config=cache_config,
        _kv_cache_spec_attn_group_iterator=lambda: iter(attn_groups),
    )
    runner._update_hybrid_attention_mamba_layout = lambda caches, sizes: (
        GPUModelRunner._update_hybrid_attention_mamba_layout(runner, caches, sizes)
    )
    kv_caches = GPUModelRunner._reshape_kv_cache_tensors(runner, raw_tensors, kernel_sizes)
    for group in attn_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        kernel = kernel_sizes[group.kv_cache_group_id]
        layer = group.layer_names[0]
        cache, raw = kv_caches[layer], raw_tensors[layer]
        block_dim = backend.get_kv_cache_block_dim(kernel, spec.num_kv_heads, spec.head_size)
        per_page = spec.block_size // kernel
        kernel_bytes = spec.real_page_size_bytes // per_page
        for kernel_block in range(cache.shape[block_dim]):
            offset = cache.select(block_dim, kernel_block).data_ptr() - raw.data_ptr()
            page, within = divmod(offset, spec.page_size_bytes)
            assert page == kernel_block // per_page and within == (kernel_block % per_page) * kernel_bytes, (
                f"kernel block {kernel_block} of {layer} starts at byte {offset}, outside page "
                f"{kernel_block // per_page} of {spec.page_size_bytes} bytes"
            )


# --------------------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------------------


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def variant(config: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of a config with some keys changed (in `text_config` when the config has one)."""
    result = copy.deepcopy(config)
    text = result.get("text_config", result)
    text.update(changes)
    return result


def reference_cases() -> list[Case]:
    """The 122B target with both DFlash revisions at the recipe's n values (n=0: the target alone)."""
    target = load_json(TARGET_FIXTURE)
    cases = []
    for n in REFERENCE_NS:
        if n == 0:
            cases.append(Case("target only", target, None, None, 0))
            continue
        for revision, path in DRAFTERS.items():
            cases.append(Case(f"dflash {revision}", target, load_json(path), f"dflash {revision}", n))
    return cases


def grid_cases() -> list[Case]:
    """Variations of KV heads, head dims, window, layers, n and dtypes around the reference."""
    target = load_json(TARGET_FIXTURE)
    drafter = load_json(DRAFTERS["6c7242c"])
    cases = []
    for kv_heads, head_dim in ((1, 128), (2, 128), (2, 192), (4, 64), (4, 192), (4, 256), (8, 64), (16, 128)):
        for n in (1, 8, 12):
            cases.append(
                Case(
                    f"drafter {kv_heads}x{head_dim}",
                    target,
                    variant(drafter, num_key_value_heads=kv_heads, head_dim=head_dim),
                    f"{kv_heads}x{head_dim}",
                    n,
                )
            )
    for window, layers in ((None, 4), (4096, 1), (8192, 6)):
        cases.append(
            Case(
                f"window {window}, {layers} layers",
                target,
                variant(DRAFTERS_JSON["bce6f76"], sliding_window=window, num_hidden_layers=layers),
                f"bce6f76 w{window} l{layers}",
                7,
            )
        )
    # drafter depth against the group size vLLM picks (the smallest layer type, or the largest when
    # none has 1.5 times the smallest): the drafting layers must all land in one KV cache group
    for layers in (6, 12, 13, 24):
        for name, geometry in (("6c7242c", {}), ("target's 2x256", {"num_key_value_heads": 2, "head_dim": 256})):
            cases.append(
                Case(
                    f"{layers}-layer drafter, {name} geometry",
                    target,
                    variant(drafter, num_hidden_layers=layers, **geometry),
                    f"{name} {layers}L",
                    12,
                )
            )
    tiny_like = variant(
        target,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    for layers in (1, 2):
        cases.append(
            Case(
                f"2-layer target, {layers}-layer drafter",
                tiny_like,
                variant(drafter, num_hidden_layers=layers, num_key_value_heads=2, head_dim=256),
                f"target geometry {layers}L",
                4,
            )
        )
    for kv_dtype in ("fp8",):
        for revision in DRAFTERS:
            cases.append(
                Case(
                    f"kv {kv_dtype}",
                    target,
                    DRAFTERS_JSON[revision],
                    f"dflash {revision}",
                    12,
                    kv_cache_dtype=kv_dtype,
                )
            )
    for revision in DRAFTERS:
        cases.append(
            Case(
                "ssm bfloat16",
                target,
                DRAFTERS_JSON[revision],
                f"dflash {revision}",
                12,
                mamba_ssm_cache_dtype="bfloat16",
            )
        )
    # other targets: fewer layers, other GDN and attention geometries
    small = variant(
        target,
        num_hidden_layers=24,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
        linear_num_value_heads=32,
        num_key_value_heads=4,
        head_dim=128,
    )
    for revision in DRAFTERS:
        for n in (2, 15):
            cases.append(Case("target 24L, 4x128", small, DRAFTERS_JSON[revision], f"dflash {revision}", n))
    # a Qwen3-Next target (flat config, no SSM dtype hook: the SSM state follows the model dtype)
    qwen3_next = dict(copy.deepcopy(target["text_config"]), architectures=["Qwen3NextForCausalLM"])
    qwen3_next["model_type"] = "qwen3_next"
    del qwen3_next["mamba_ssm_dtype"]
    for revision in DRAFTERS:
        cases.append(Case("Qwen3-Next target", qwen3_next, DRAFTERS_JSON[revision], f"dflash {revision}", 8))
    # user --block-size (kept by the alignment when larger than its own choice)
    for revision in DRAFTERS:
        cases.append(
            Case("--block-size 4096", target, DRAFTERS_JSON[revision], f"dflash {revision}", 5, block_size=4096)
        )
    # prefix caching off and on (mamba cache mode "align": the GDN group's block becomes the cache block
    # and the KV cache manager gets the hybrid coordinator) over every n from 1 to 16, for the pinned
    # drafters and drafters with 1/2, 1, 2 and 4 times the target's KV bytes per token (the target's own
    # geometry among them); depth and sliding window turn with n, so every geometry meets each of them
    target_bytes = target["text_config"]["num_key_value_heads"] * target["text_config"]["head_dim"]
    sweep = {f"dflash {r}": (DRAFTERS_JSON[r], None) for r in DRAFTERS}
    for factor, (kv_heads, head_dim) in ((0.5, (2, 128)), (1, (2, 256)), (2, (8, 128)), (4, (16, 128)), (4, (8, 256))):
        assert kv_heads * head_dim == factor * target_bytes
        sweep[f"{factor:g}x KV bytes {kv_heads}x{head_dim}"] = (drafter, (kv_heads, head_dim))
    depths, windows = (1, 3, 5, 8, 13), (None, 2048, 4096)
    for caching in (False, True):
        label = "prefix caching" if caching else "no prefix caching"
        cases.append(Case(f"{label}, target only", target, None, None, 0, enable_prefix_caching=caching))
        for name, (config, geometry) in sweep.items():
            for n in range(1, 17):
                if geometry is not None:
                    layers, window = depths[n % len(depths)], windows[n % len(windows)]
                    changes = {"num_key_value_heads": geometry[0], "head_dim": geometry[1]}
                    config = variant(drafter, num_hidden_layers=layers, sliding_window=window, **changes)
                cases.append(Case(label, target, config, name, n, enable_prefix_caching=caching))
    # dense (non-hybrid) targets: one KV cache group, never unified; a drafter of the target's geometry
    # shares its spec, another geometry makes one group of several page sizes (UniformTypeKVCacheSpecs)
    dense = {
        key: value for key, value in drafter.items() if key not in ("dflash_config", "block_size", "sliding_window")
    }
    dense.update(architectures=["Qwen3ForCausalLM"], num_hidden_layers=8, use_sliding_window=False)
    for kv_heads, layers, n in ((4, 1, 3), (8, 2, 6)):
        for platform in ("cuda", "cpu"):
            cases.append(
                Case(
                    "dense target",
                    dense,
                    variant(drafter, num_key_value_heads=kv_heads, num_hidden_layers=layers),
                    f"{kv_heads}x128 {layers}L",
                    n,
                    platform=platform,
                )
            )
    # the full context the profiles serve: the pool and its concurrency at 262,144 tokens
    for revision in DRAFTERS:
        for caching in (False, True):
            cases.append(
                Case(
                    "262,144-token context",
                    target,
                    DRAFTERS_JSON[revision],
                    f"dflash {revision}",
                    12,
                    enable_prefix_caching=caching,
                    max_model_len=262144,
                )
            )
    # the CPU platform (sandbox): block 128, CPU_ATTN
    for revision in DRAFTERS:
        for n in (5, 12):
            cases.append(Case("cpu platform", target, DRAFTERS_JSON[revision], f"dflash {revision}", n, platform="cpu"))
    return cases


DRAFTERS_JSON = {revision: load_json(path) for revision, path in DRAFTERS.items()}


def evaluate(real: RealVLLM, cases: list[Case]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        for patched in (False, True):
            rows.append(
                {
                    "case": case,
                    "patched": patched,
                    "real": real.run(case, patched),
                    "plan": case.plan(patched),
                }
            )
    return rows


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def gpu_like_cache_settings() -> Iterator[None]:
    """The alignment under test is a GPU's. On a CPU with AMX tiles, vLLM's CPU platform turns prefix
    caching off for linear-attention models while it builds the config (and then refuses the Mamba
    block size that prefix caching chose): no GB10 does that, so the probe sees no AMX."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        yield


@pytest.fixture(scope="module")
def no_amx() -> Iterator[None]:
    with gpu_like_cache_settings():
        yield


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory: pytest.TempPathFactory, no_amx: None) -> RealVLLM:
    return RealVLLM(tmp_path_factory.mktemp("kv_unify"))


@pytest.fixture(scope="module")
def reference_rows(real_vllm: RealVLLM) -> list[dict[str, Any]]:
    return evaluate(real_vllm, reference_cases())


@pytest.fixture(scope="module")
def grid_rows(real_vllm: RealVLLM) -> list[dict[str, Any]]:
    return evaluate(real_vllm, grid_cases())


def _find(rows: list[dict[str, Any]], name: str, n: int, patched: bool) -> Outcome:
    for row in rows:
        case = row["case"]
        if case.name == name and case.num_speculative_tokens == n and row["patched"] == patched:
            return row["real"]
    raise KeyError((name, n, patched))


@pytest.mark.parametrize(
    ("n", "block", "padding_line"),
    [
        (5, 2144, None),
        (8, 2192, "Padding mamba page size by 0.55%"),
        (12, 2240, "Padding mamba page size by 0.54%"),
    ],
)
def test_stock_alignment_reproduces_the_reference_log_lines(
    reference_rows: list[dict[str, Any]], n: int, block: int, padding_line: str | None
) -> None:
    outcome = _find(reference_rows, "dflash 6c7242c", n, patched=False)
    assert f"Setting attention block size to {block} tokens" in outcome.log_lines[0]
    paddings = [line for line in outcome.log_lines if line.startswith("Padding mamba page size")]
    if padding_line is None:
        assert paddings == []
    else:
        assert len(paddings) == 1 and paddings[0].startswith(padding_line)


def test_stock_fails_where_it_fails_today(reference_rows: list[dict[str, Any]]) -> None:
    for n in (5, 8, 12, 15):
        assert _find(reference_rows, "dflash 6c7242c", n, patched=False).ok
        failed = _find(reference_rows, "dflash bce6f76", n, patched=False)
        assert not failed.ok and failed.stage == "unify", failed
    assert _find(reference_rows, "target only", 0, patched=False).ok


def test_patched_unifies_every_reference_case(reference_rows: list[dict[str, Any]]) -> None:
    for row in reference_rows:
        if not row["patched"]:
            continue
        real = row["real"]
        assert real.ok, (row["case"].name, row["case"].num_speculative_tokens, real.error)
        assert real.attention_block_size % 16 == 0
        assert real.drafter_block_size is None or real.drafter_block_size % 16 == 0
        assert not real.padded_attention


def test_patch_keeps_what_stock_already_handles(
    reference_rows: list[dict[str, Any]], grid_rows: list[dict[str, Any]]
) -> None:
    rows = reference_rows + grid_rows
    stock_ok = [row for row in rows if not row["patched"] and row["real"].ok]
    assert len(stock_ok) >= 10
    for stock_row in stock_ok:
        patched_row = next(r for r in rows if r["case"] is stock_row["case"] and r["patched"])
        stock, patched = stock_row["real"], patched_row["real"]
        assert (
            patched.ok,
            patched.attention_block_size,
            patched.drafter_block_size,
            patched.page_size_bytes,
        ) == (
            stock.ok,
            stock.attention_block_size,
            stock.drafter_block_size,
            stock.page_size_bytes,
        ), stock_row["case"].name
        assert patched.padding_pct == stock.padding_pct
        assert patched.log_lines == stock.log_lines


def test_planner_matches_real_vllm(reference_rows: list[dict[str, Any]], grid_rows: list[dict[str, Any]]) -> None:
    rows = reference_rows + grid_rows
    assert any(not row["real"].ok for row in rows) and any(row["real"].ok for row in rows)
    for row in rows:
        real, predicted, case = row["real"], row["plan"], row["case"]
        where = f"{case.name} n={case.num_speculative_tokens} {'patched' if row['patched'] else 'stock'}"
        assert predicted.ok == real.ok, (where, real.error, predicted.reason)
        if real.ok:
            assert predicted.attention_block_size == real.attention_block_size, where
            assert predicted.drafter_block_size == real.drafter_block_size, where
            assert predicted.page_size_bytes == real.page_size_bytes, where
            assert predicted.padding_pct == pytest.approx(real.padding_pct, abs=1e-3), where
            assert predicted.kernel_block_sizes == real.kernel_block_sizes, where
            assert (predicted.scheduler_block_size, predicted.hash_block_size) == (
                real.scheduler_block_size,
                real.hash_block_size,
            ), where
            pool = kv_page_plan.kv_pool(predicted, case.kv_cache_bytes, case.max_model_len)
            assert (pool.num_blocks, pool.tokens) == (real.num_blocks, real.kv_tokens), where
            assert pool.max_concurrency == pytest.approx(real.max_concurrency, rel=1e-12), where
        else:
            assert predicted.failure_stage == real.stage, (where, real.error, predicted.reason)
        if real.mamba_page_size_bytes is not None:
            assert predicted.mamba_page_size_bytes == real.mamba_page_size_bytes, where


def test_patched_never_pads_an_attention_page(grid_rows: list[dict[str, Any]]) -> None:
    for row in grid_rows:
        if row["patched"] and row["real"].ok:
            assert not row["real"].padded_attention, row["case"].name


@pytest.mark.parametrize("n", [3, 12])
def test_patched_alignment_ignores_drafterless_speculation(real_vllm: RealVLLM, n: int) -> None:
    """ngram speculation has no drafter attention: the patched alignment is the stock one."""
    from vllm.config import CacheConfig, SpeculativeConfig, VllmConfig

    results = []
    for code in (real_vllm.stock, real_vllm.patched):
        model_config, parallel_config, _ = real_vllm.model_configs(reference_cases()[0])
        speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=n,
            prompt_lookup_max=4,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(enable_prefix_caching=False),
            parallel_config=parallel_config,
            speculative_config=speculative_config,
        )
        vllm_config.cache_config.block_size = 16
        code.interface.Platform._align_hybrid_block_size(vllm_config, attention_backend_class("cuda"))
        results.append((vllm_config.cache_config.block_size, vllm_config.cache_config.mamba_page_size_padded))
    assert results[0] == results[1]
    # the planner models drafter-less speculation as no drafter config with n > 0
    for patched in (False, True):
        predicted = kv_page_plan.plan(load_json(TARGET_FIXTURE), None, n, patched)
        assert predicted.attention_block_size == results[0][0]
        assert predicted.page_size_bytes == (results[0][1] or predicted.mamba_page_size_bytes)


def test_a_padded_attention_page_with_a_smaller_kernel_block_mis_strides(real_vllm: RealVLLM) -> None:
    """The runner's view of a padded attention page (block 1040, kernel 16) overruns its buffer.

    This is the failure the patch and the planner steer clear of; it is reproduced here with the real
    `_reshape_kv_cache_tensors`, and the planner flags it.
    """
    import torch
    from vllm.config.vllm import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    case = reference_cases()[1]
    vllm_config = real_vllm.vllm_config(case)
    backend = attention_backend_class("cuda")
    spec = FullAttentionSpec(block_size=1040, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    padded = FullAttentionSpec(
        block_size=1040,
        num_kv_heads=4,
        head_size=128,
        dtype=torch.bfloat16,
        page_size_padded=spec.page_size_bytes + 4096,
    )
    with set_current_vllm_config(vllm_config):
        check_kv_views([KVCacheGroupSpec(["a"], spec)], [16], backend, vllm_config.cache_config, torch)
        with pytest.raises(RuntimeError, match="out of bounds"):
            check_kv_views([KVCacheGroupSpec(["a"], padded)], [16], backend, vllm_config.cache_config, torch)
    planner_specs = [
        kv_page_plan._Spec(
            "drafter attention",
            "attention",
            1040,
            bytes_per_token=2048,
            page_size_padded=padded.page_size_bytes,
        )
    ]
    with pytest.raises(kv_page_plan._UnifyError, match="setStorage"):
        kv_page_plan._check_runner(planner_specs, [16, 32, 64], {})


@pytest.mark.parametrize(
    ("cache_block", "mamba_block", "drafter_block", "caching", "fails"),
    [
        (2112, 2112, 1056, True, False),  # what the patched build serves: hash on the GCD
        (2112, 2112, 1056, False, False),
        (2112, 4224, 1056, True, True),  # a GDN block off the cache block: the LCM back-off, then the assert
        (4224, 2112, 4224, True, True),
        (2112, 1056, 2112, True, True),
        (2096, 2096, 2096, True, False),  # the drafter shares the target's spec
    ],
)
def test_the_scheduler_block_sizes_and_the_coordinator_asserts_match_the_planner(
    real_vllm: RealVLLM, cache_block: int, mamba_block: int, drafter_block: int, caching: bool, fails: bool
) -> None:
    """resolve_kv_cache_block_sizes and the KV cache coordinator over hand-built groups, including GDN
    blocks no vLLM 0.23 layout reaches (the back-off to the LCM), against the planner's model."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    case = Case("hand-built groups", load_json(TARGET_FIXTURE), None, None, 0, enable_prefix_caching=caching)
    vllm_config = real_vllm.vllm_config(case)
    vllm_config.cache_config.block_size = cache_block
    target = FullAttentionSpec(block_size=cache_block, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
    drafter = FullAttentionSpec(
        block_size=drafter_block,
        num_kv_heads=2 if drafter_block == cache_block else 8,
        head_size=256 if drafter_block == cache_block else 128,
        dtype=torch.bfloat16,
    )
    mamba = MambaSpec(
        shapes=((3, 8192), (64, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=mamba_block if caching else MAX_MODEL_LEN,
        mamba_cache_mode="align" if caching else "none",
    )
    groups = [KVCacheGroupSpec(["t"], target), KVCacheGroupSpec(["g0"], mamba), KVCacheGroupSpec(["g1"], mamba)]
    if drafter != target:
        groups.append(KVCacheGroupSpec(["d"], drafter))
    else:
        groups[0] = KVCacheGroupSpec(["t", "d"], target)
    real: tuple[int, int] | str
    try:
        real = real_vllm.stock.kv_cache_utils.resolve_kv_cache_block_sizes(
            KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups), vllm_config
        )
        KVCacheManager(
            KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
            MAX_MODEL_LEN,
            *real,
            enable_caching=caching,
            use_eagle=True,
        )
    except (AssertionError, ValueError) as exc:
        real = str(exc)
    planner_specs = [
        kv_page_plan._Spec("target attention", "attention", cache_block, bytes_per_token=1024, geometry=(2, 256)),
        kv_page_plan._Spec("GDN state", "mamba", mamba_block, state_bytes=1 << 20),
    ]
    if drafter != target:
        planner_specs.append(
            kv_page_plan._Spec("drafter attention", "attention", drafter_block, bytes_per_token=2048, geometry=(8, 128))
        )
    try:
        predicted: tuple[int, int] | str | None = kv_page_plan._check_scheduler(
            planner_specs, cache_block, caching, MAX_MODEL_LEN
        )
    except kv_page_plan._UnifyError as exc:
        assert exc.stage == "scheduler"
        predicted = str(exc)
    assert isinstance(real, str) == fails, real
    if isinstance(real, str):
        assert isinstance(predicted, str) and real in predicted, (real, predicted)
    else:
        assert predicted == tuple(real)


# --------------------------------------------------------------------------------------------------
# prefix caching on vLLM's real scheduler
# --------------------------------------------------------------------------------------------------

LONG_CONTEXT = 65536  # the scheduler's max_model_len for the long prompts (the specs do not depend on it)


@dataclass
class PrefillRun:
    """One long prompt prefilled by the real Scheduler, then a second request sharing part of it."""

    cache_block: int
    budget: int
    step_ends: list[int]  # the request's computed tokens after each step
    cached: dict[int, int]  # GDN block index -> computed tokens at the step that cached it
    hit: int  # the second request's prefix-cache hit (tokens)
    scheduler_block: int


def prefill_with_prefix_caching(outcome: Outcome, budget: int, prompt_len: int, shared: int) -> PrefillRun:
    """Drive vLLM's Scheduler (its KV cache manager and coordinator) over a prompt of ``prompt_len``
    tokens with ``budget`` tokens a step, feeding it what a model runner would return, then ask the
    KV cache manager what a second request sharing the first ``shared`` tokens finds cached."""
    import random

    from vllm.config.vllm import set_current_vllm_config
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config, kv_cache_config = outcome.vllm_config, outcome.kv_cache_config
    cache_config, scheduler_config = vllm_config.cache_config, vllm_config.scheduler_config
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    vllm_config.model_config.max_model_len = scheduler_config.max_model_len = LONG_CONTEXT
    vllm_config.model_config.multimodal_config = None  # text prompts: no encoder budget to plan
    scheduler_config.max_num_scheduled_tokens = budget
    scheduler_config.max_num_batched_tokens = max(scheduler_config.max_num_batched_tokens, budget)
    with set_current_vllm_config(vllm_config):
        scheduler = Scheduler(
            vllm_config,
            kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=outcome.scheduler_block_size,
            hash_block_size=outcome.hash_block_size,
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(outcome.hash_block_size, hash_fn)
        rng = random.Random(prompt_len)
        prompt = [rng.randrange(1000, 50000) for _ in range(prompt_len)]

        def request(request_id: str, tokens: list[int]) -> Request:
            return Request(request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0), None, block_hasher=hasher)

        first = request("first", prompt)
        scheduler.add_request(first)
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        gdn = [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        step_ends: list[int] = []
        cached: dict[int, int] = {}
        for _ in range(4 * prompt_len // cache_config.block_size + 8):
            output = scheduler.schedule()
            if not output.num_scheduled_tokens:
                break
            step_ends.append(first.num_computed_tokens)
            for group in gdn:
                for index, block in enumerate(managers[group].req_to_blocks.get("first", [])):
                    if block.block_hash is not None and not block.is_null:
                        cached.setdefault(index, first.num_computed_tokens)
            prefilled = first.num_computed_tokens >= first.num_prompt_tokens
            scheduler.update_from_output(
                output,
                ModelRunnerOutput(
                    req_ids=["first"], req_id_to_index={"first": 0}, sampled_token_ids=[[7] if prefilled else []]
                ),
            )
            if first.is_finished():
                break
        second = request("second", prompt[:shared] + [3] * 256)
        _blocks, hit = scheduler.kv_cache_manager.get_computed_blocks(second)
    return PrefillRun(cache_config.block_size, budget, step_ends, cached, hit, outcome.scheduler_block_size)


def prefix_caching_rows(real_vllm: RealVLLM, patched: bool = True) -> list[tuple[Case, Outcome]]:
    """The grid's prefix-caching cases the build serves, at a few n, run afresh (the scheduler run
    changes their configs)."""
    rows = []
    for case in grid_cases():
        if case.enable_prefix_caching and case.drafter is not None and case.num_speculative_tokens in (1, 8, 16):
            # the whole KV_CACHE_BYTES: a pool that holds the long prompt and the second request
            case = dataclasses.replace(case, kv_bytes=KV_CACHE_BYTES)
            outcome = real_vllm.run(case, patched)
            if outcome.ok:
                rows.append((case, outcome))
    return rows


def test_prefix_caching_never_caches_a_gdn_state_under_tokens_it_has_not_seen(real_vllm: RealVLLM) -> None:
    """Over a long prompt prefilled in chunks, every GDN state block the scheduler caches holds the state
    of exactly the tokens its prefix hash covers (a step ended on that block's last token), and a second
    request sharing part of the prompt hits one of those blocks within what it shares: the mamba-state
    invariant of issue 14, on the real Scheduler, KV cache manager and hybrid coordinator."""
    rows = [(case, outcome, True) for case, outcome in prefix_caching_rows(real_vllm)]
    assert len(rows) >= 12, [case.drafter_label for case, _, _ in rows]
    # stock 0.23 serves the pinned drafter (its KV spec is the target's) with prefix caching as well
    stock = [(case, outcome, False) for case, outcome in prefix_caching_rows(real_vllm, patched=False)]
    assert {case.drafter_label for case, _, _ in stock} >= {"dflash 6c7242c"}, stock
    rows += stock
    hashes_finer = hits = 0
    lost: dict[tuple, bool] = collections.defaultdict(bool)
    said: dict[tuple, bool] = {}
    for case, outcome, patched in rows:
        block = outcome.attention_block_size
        hashes_finer += outcome.hash_block_size < outcome.scheduler_block_size
        for budget in (block + block // 3, 3 * block + 17):
            prompt_len, shared = 5 * block + 700, 4 * block + 100
            run = prefill_with_prefix_caching(real_vllm.run(case, patched), budget, prompt_len, shared)
            where = (case.drafter_label, case.num_speculative_tokens, patched, budget, run)
            assert run.step_ends and run.step_ends[-1] == prompt_len, where
            assert run.cached, where
            for index, computed in run.cached.items():
                boundary = (index + 1) * run.cache_block
                assert computed >= boundary and boundary in run.step_ends, where
            # the hit: within what is shared, on the scheduler's alignment, and exactly a cached GDN state
            # (the drafter's eagle-style pop may give back the last aligned block, never more than that)
            assert 0 <= run.hit <= shared and run.hit % run.scheduler_block == 0, where
            assert run.hit == 0 or run.hit // run.cache_block - 1 in run.cached, where
            if run.scheduler_block == run.cache_block:
                # every group's block divides the GDN block: the hit is the longest cached state within what
                # is shared, less at most the block the drafter's eagle-style pop gives back
                within = [(i + 1) * run.cache_block for i in run.cached if (i + 1) * run.cache_block <= shared]
                assert run.hit >= max(within) - run.cache_block > 0, where
                hits += 1
            # what the planner says of the same case with this budget
            predicted = kv_page_plan.plan(
                case.target,
                case.drafter,
                case.num_speculative_tokens,
                patched,
                enable_prefix_caching=True,
                max_num_batched_tokens=budget,
                max_num_seqs=1,
            )
            assert predicted.ok, (where, predicted.reason)
            within = [(i + 1) * run.cache_block for i in run.cached if (i + 1) * run.cache_block <= shared]
            key = (case.drafter_label, case.num_speculative_tokens, patched)
            lost[key] |= run.hit < max(within) - run.cache_block
            said[key] = "hits can be lost" in predicted.reason
    # with a group block above the GDN block the hits fall short of the cached states, and the planner says so
    assert lost == said and any(lost.values()), {key: (lost[key], said[key]) for key in lost}
    assert hashes_finer, "no case hashes finer than it schedules (a drafter block below the GDN block)"
    assert hits >= len(rows), "too few cases where prefix caching must hit"


def test_prefix_caching_with_a_step_budget_below_one_block_never_starts_a_long_prompt(real_vllm: RealVLLM) -> None:
    """The planner refuses prefix caching when a step cannot hold one cache block; the real scheduler
    shows why: the block-aligned split rounds every chunk of a long prompt down to nothing."""
    for case, outcome in prefix_caching_rows(real_vllm)[::4]:
        block = outcome.attention_block_size
        run = prefill_with_prefix_caching(outcome, block - 16, 3 * block, block)
        assert run.step_ends == [] and run.hit == 0, (case.drafter_label, run)
        n = case.num_speculative_tokens
        slots = n - 1  # DFlash drafts in parallel: n - 1 slots per sequence
        predicted = kv_page_plan.plan(
            case.target,
            case.drafter,
            n,
            True,
            enable_prefix_caching=True,
            max_num_batched_tokens=block - 16 + 3 * slots,
            max_num_seqs=3,
        )
        assert not predicted.ok and predicted.failure_stage == "scheduler", predicted.reason
        assert f"only {block - 16} tokens" in predicted.reason and "raise max-num-batched-tokens by at least 16" in (
            predicted.reason
        )
        assert predicted.step_token_budget == block - 16
        # and with prefix caching off the same budget is fine: the scheduler chunks freely
        assert kv_page_plan.plan(
            case.target, case.drafter, n, True, max_num_batched_tokens=block - 16 + 3 * slots, max_num_seqs=3
        ).ok


# --------------------------------------------------------------------------------------------------
# the table (docs/kv-unify.md)
# --------------------------------------------------------------------------------------------------


def _cell(outcome: Outcome) -> str:
    if not outcome.ok:
        return f"fails ({outcome.stage})"
    blocks = f"{outcome.attention_block_size}"
    kernels = f"{outcome.kernel_block_sizes.get('target attention')}"
    if outcome.drafter_block_size is not None:
        blocks += f" / {outcome.drafter_block_size}"
        kernels += f" / {outcome.kernel_block_sizes.get('drafter attention')}"
    cell = f"ok: {blocks} (kernel {kernels}), pad {outcome.padding_pct:.2f}%, sched {outcome.scheduler_block_size}"
    if outcome.hash_block_size != outcome.scheduler_block_size:
        cell += f" / hash {outcome.hash_block_size}"
    return cell


def render_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| case | drafter KV | n | options | stock (real) | patched (real) | planner agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    for index in range(0, len(rows), 2):
        stock_row, patched_row = rows[index], rows[index + 1]
        case = stock_row["case"]
        drafter = "-"
        if case.drafter is not None:
            text = case.drafter.get("text_config", case.drafter)
            drafter = f"{text['num_key_value_heads']}x{text.get('head_dim')}, {text['num_hidden_layers']}L"
            if text.get("sliding_window"):
                drafter += f", w{text['sliding_window']}"
        options = []
        if case.kv_cache_dtype != "auto":
            options.append(f"kv {case.kv_cache_dtype}")
        if case.mamba_ssm_cache_dtype != "auto":
            options.append(f"ssm {case.mamba_ssm_cache_dtype}")
        if case.block_size:
            options.append(f"block {case.block_size}")
        if case.platform != "cuda":
            options.append(case.platform)
        if case.enable_prefix_caching:
            options.append("prefix caching")
        if case.max_model_len != MAX_MODEL_LEN:
            options.append(f"context {case.max_model_len}")
        agrees = all(_agrees(row) for row in (stock_row, patched_row))
        lines.append(
            f"| {case.name} | {drafter} | {case.num_speculative_tokens} | {', '.join(options) or '-'} | "
            f"{_cell(stock_row['real'])} | {_cell(patched_row['real'])} | {'yes' if agrees else 'NO'} |"
        )
    return lines


def _agrees(row: dict[str, Any]) -> bool:
    real, predicted = row["real"], row["plan"]
    if predicted.ok != real.ok:
        return False
    if not real.ok:
        return predicted.failure_stage == real.stage
    pool = kv_page_plan.kv_pool(predicted, row["case"].kv_cache_bytes, row["case"].max_model_len)
    return (
        predicted.attention_block_size,
        predicted.drafter_block_size,
        predicted.page_size_bytes,
        round(predicted.padding_pct, 2),
        predicted.scheduler_block_size,
        predicted.hash_block_size,
        pool.num_blocks,
        pool.tokens,
    ) == (
        real.attention_block_size,
        real.drafter_block_size,
        real.page_size_bytes,
        round(real.padding_pct, 2),
        real.scheduler_block_size,
        real.hash_block_size,
        real.num_blocks,
        real.kv_tokens,
    )


def prefix_caching_section(real: RealVLLM) -> list[str]:
    """The real scheduler over a long prompt for the pinned drafters and a drafter block above the GDN
    block: where steps ended, which GDN states were cached, and what a second request found."""
    lines = [
        "## Prefix caching on the real scheduler",
        "",
        "vLLM 0.23's `Scheduler`, KV cache manager and hybrid coordinator (patched build, prefix caching",
        "on, mamba cache mode `align`) prefill a prompt of 5 cache blocks + 700 tokens with the step",
        "budget shown, then a second request sharing the first 4 blocks + 100 tokens asks what is cached",
        "(`test_prefix_caching_never_caches_a_gdn_state_under_tokens_it_has_not_seen`). A GDN state block",
        "is only ever cached where a step ended on its last token, so no state is served for tokens it has",
        "not seen. Hits are whole scheduler blocks: where a group's block is larger than the GDN block",
        "(a drafter with fewer KV bytes per token than the target), prefill chunks can end past a",
        "scheduler-block boundary and the hit is lost; the planner says so. A step budget below one cache",
        "block never starts a prompt that long (the block-aligned split rounds it to nothing): the",
        "planner refuses it.",
        "",
        "| drafter | n | GDN / drafter block | scheduler / hash block | step budget | steps ended at "
        "| GDN states cached | hit of the shared 4 blocks + 100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, outcome in prefix_caching_rows(real):
        if case.num_speculative_tokens != 8 or not (
            case.drafter_label.startswith("dflash") or case.drafter_label.startswith("0.5x")
        ):
            continue
        block = outcome.attention_block_size
        for budget in (block - 16, block + block // 3, 3 * block + 17):
            run = prefill_with_prefix_caching(real.run(case, True), budget, 5 * block + 700, 4 * block + 100)
            states = ", ".join(str((i + 1) * block) for i in sorted(run.cached)) or "none"
            ends = ", ".join(map(str, run.step_ends)) or "never scheduled"
            lines.append(
                f"| {case.drafter_label} | {case.num_speculative_tokens} | {block} / {outcome.drafter_block_size} | "
                f"{outcome.scheduler_block_size} / {outcome.hash_block_size} | {budget} | {ends} | {states} | "
                f"{run.hit} |"
            )
    return [*lines, ""]


# The one KV cache size a GB10 log gives (reference/bench-log-dflash-conc8.md: the int4-AutoRound-EC target
# with the pinned drafter at n=5, prefix caching on, --gpu-memory-utilization 0.85): "KV cache 27.72 GiB
# (GPU KV = 800,129 tokens -> max concurrency 3.05x at 262K ctx)".
GB10_LOG_KV_GIB = 27.72
GB10_LOG_POOL = (800_129, 3.05)
# The pools the reference reports for dflash and dense at --gpu-memory-utilization 0.82 (DESIGN.md).
REFERENCE_POOLS = (456_664, 426_610)
PROFILES_FILE = REPO_ROOT / "inventory" / "group_vars" / "all" / "profiles.yml"


def profile_pool_cases() -> list[Case]:
    """The shipped single-node profiles (and the dflash profile with the newer drafter revision) at their own n,
    prefix caching and 262,144-token context, planned with the GB10 log's KV cache size."""
    import yaml

    data = yaml.safe_load(PROFILES_FILE.read_text())
    common = data["sparkfleet_serve_args_common"]
    target = load_json(TARGET_FIXTURE)
    kv_bytes = int(GB10_LOG_KV_GIB * (1 << 30))
    cases = []
    for name, profile in data["sparkfleet_profiles_builtin"].items():
        if profile.get("cluster"):  # one rank's share across a cluster: docs/cluster.md
            continue
        args = {**common, **(profile.get("serve_args") or {})}
        n = (profile.get("speculative") or {}).get("num_speculative_tokens", 0)
        revisions = ["6c7242c", "bce6f76"] if name == "dflash" else ["6c7242c"] if profile.get("drafter") else [None]
        for revision in revisions:
            cases.append(
                Case(
                    name,
                    target,
                    DRAFTERS_JSON[revision] if revision else None,
                    f"dflash {revision}" if revision else None,
                    n if revision else 0,
                    enable_prefix_caching=bool(args.get("enable-prefix-caching")),
                    max_model_len=int(args["max-model-len"]),
                    kv_bytes=kv_bytes,
                )
            )
    return cases


def profile_pool_section(real: RealVLLM) -> list[str]:
    """The KV pool the planner predicts for each shipped profile, beside what vLLM's functions build."""
    lines = [
        "## The KV pool at 262,144 tokens of context (the shipped profiles)",
        "",
        "How many tokens the KV cache holds and how many full-context requests fit at once, as vLLM 0.23",
        "reports them at start (`GPU KV cache size: N tokens`, `Maximum concurrency for 262,144 tokens per",
        "request: Cx`), for a KV cache of the size the one GB10 log in `reference/` gives (27.72 GiB: the",
        "conc-8 recipe at `--gpu-memory-utilization 0.85`). vLLM splits the layers into KV cache groups of",
        "one page size (every layer type dealt into groups of the smallest type's size); a request holds",
        "`ceil(262144 / block)` blocks in each attention group and `1 + n` pages in each GDN group (`2 + n`",
        "with prefix caching's `align` mode), and the pool is `KV bytes // (page x layers per group)`",
        "blocks. `planner` is `sparkfleet.serving.kv_page_plan.kv_pool` (stdlib only); `vLLM` is",
        "`get_kv_cache_configs` and `get_max_concurrency_for_kv_cache_config` of the patched build.",
        "",
        "| profile | drafter | n | prefix caching | groups (layers each) | blocks per request | GiB per request "
        "| tokens per GiB | pool at 27.72 GiB (vLLM) | max concurrency | planner agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in profile_pool_cases():
        outcome = real.run(case, True)
        predicted = case.plan(True)
        if not outcome.ok or not predicted.ok:
            lines.append(f"| {case.name} | {case.drafter_label or '-'} | {case.num_speculative_tokens} | "
                         f"{'on' if case.enable_prefix_caching else 'off'} | fails ({outcome.stage}) | | | | | | "
                         f"{'yes' if predicted.ok == outcome.ok else 'NO'} |")  # fmt: skip
            continue
        pool = kv_page_plan.kv_pool(predicted, case.kv_cache_bytes, case.max_model_len)
        agrees = (pool.num_blocks, pool.tokens) == (outcome.num_blocks, outcome.kv_tokens)
        groups = ", ".join(f"{g['groups']} {g['names'][0].split()[0]}" for g in predicted.kv_groups)
        lines.append(
            f"| {case.name} | {case.drafter_label or '-'} | {case.num_speculative_tokens} | "
            f"{'on' if case.enable_prefix_caching else 'off'} | {groups} ({predicted.kv_group_size}) | "
            f"{pool.blocks_per_request} | {pool.bytes_per_request / (1 << 30):.2f} | "
            f"{pool.tokens * (1 << 30) / case.kv_cache_bytes:,.0f} | {outcome.kv_tokens:,} | "
            f"{outcome.max_concurrency:.2f}x | {'yes' if agrees else 'NO'} |"
        )
    cases = {(case.name, case.drafter_label): case for case in profile_pool_cases()}
    conc8 = cases["dflash-conc8", "dflash 6c7242c"]
    pool = kv_page_plan.kv_pool(conc8.plan(True), conc8.kv_cache_bytes, conc8.max_model_len)
    tokens, concurrency = GB10_LOG_POOL
    same = (pool.tokens, round(pool.max_concurrency, 2)) == GB10_LOG_POOL
    # the reference's dflash/dense pools were measured with prefix caching off
    dflash = dataclasses.replace(cases["dflash", "dflash 6c7242c"], enable_prefix_caching=False)
    per_request = kv_page_plan.kv_pool(dflash.plan(True), dflash.kv_cache_bytes, dflash.max_model_len)
    context = dflash.max_model_len
    reachable = {
        reported: [
            blocks for blocks in range(1, 4096) if int(blocks / per_request.blocks_per_request * context) == reported
        ]
        for reported in REFERENCE_POOLS
    }
    lines += [
        "",
        f"The GB10 log's own figures for the conc-8 run are {tokens:,} tokens and {concurrency}x; the planner"
        f" gives {pool.tokens:,} tokens and {pool.max_concurrency:.2f}x ({'the same' if same else 'NOT the same'};"
        " that run was vLLM 0.23.1 nightly). The reference's later dflash and dense pools ("
        + " and ".join(f"{reported:,}" for reported in REFERENCE_POOLS)
        + " tokens at 0.82, n=12, prefix caching off, from its authors' own 0.23.0 build) "
        + (
            "are whole numbers of blocks under this accounting"
            if all(reachable.values())
            else f"are not a whole number of blocks under 0.23.0's accounting ({per_request.blocks_per_request} blocks"
            " per request): that build groups the layers otherwise"
        )
        + ". What the pool is on a host, vLLM logs at every start.",
        "",
    ]
    return lines


def render_document(
    reference: list[dict[str, Any]],
    grid: list[dict[str, Any]],
    seconds: float,
    prefix: list[str] | None = None,
    pools: list[str] | None = None,
) -> str:
    import vllm

    command = "build/venv-vllm/bin/python tests/vllm/test_kv_unify_real.py --write docs/kv-unify.md"
    lines = [
        "# KV page-size unification: stock vs patched vLLM 0.23, and the planner",
        "",
        f"Generated by `{command}` (vllm {vllm.__version__}, {len(reference) + len(grid)} runs of the real code,"
        f" {seconds:.0f} s). Do not edit by hand.",
        "",
        "Each cell is what the real vLLM code did: `ok: A / D (kernel a / d), pad P%` is the target's",
        "attention block A, the drafter's attention block D (after unification), the kernel block sizes the",
        "runner picks for them, and how much the Gated-DeltaNet state page is padded to reach the common",
        "page, then the scheduler's block (`sched`, the LCM of the KV cache groups' blocks; a GDN group's",
        "block is `max_model_len` without prefix caching) and, where it differs, the prefix-cache hash",
        "block (`hash`, their GCD); `fails (stage)` names where it stopped (`unify`: the page-size",
        "assert or NotImplementedError in `get_kv_cache_groups`; `grouping`: the proposer's",
        '`validate_same_kv_cache_group`, "All drafting layers should belong to the same kv cache group";',
        "`kernel`: no kernel block size; `view`: the runner's KV view; `scheduler`:",
        "`resolve_kv_cache_block_sizes` or the KV cache coordinator's asserts). *planner agrees* compares",
        "`sparkfleet kv-plan` with both cells.",
        "CUDA cases use the FLASH_ATTN backend class (kernel blocks 16/32/64 with a float32 SSM state);",
        "prefix caching off (as the recipe serves) unless the options say otherwise.",
        "",
        "## Qwen3.5-122B-A10B with the DFlash drafter revisions",
        "",
        "6c7242c: 4 KV heads x 128, 4 layers, window 2048; bce6f76: 8 KV heads x 128, 6 layers, window 4096.",
        "",
        *render_table(reference),
        "",
        "## Grid around it",
        "",
        *render_table(grid),
        "",
        "## The rule (patch 0001)",
        "",
        "- The hybrid alignment makes the common page a multiple of one kernel-aligned block of the",
        "  target's attention *and* of the drafter's attention (least common multiple); when the",
        "  drafter's bytes per token divide the target's, this is the stock quantum and nothing changes.",
        "- Unification takes the common page from the block-size-invariant (GDN/mamba) specs, fits every",
        "  attention spec to it exactly (block = page / bytes per token), and pads only mamba pages.",
        "- Grouping (stock and patched alike): layers with equal KV specs form one type, the group size is",
        "  the smallest type's layer count (the largest when no type has 1.5 times the smallest), and each",
        "  type is dealt round-robin into groups of that size; every drafting layer must land in one",
        "  group. A DFlash drafter's own sliding window is not used (its layers take the target's",
        "  `cache_config.sliding_window`), so its layers are full attention; with the target's KV",
        "  geometry they join the target's attention layers. On the 122B (36 GDN, 12 attention layers) a",
        "  drafter of another geometry may have up to 12 layers; the tiny 2-layer hybrid only 1.",
        "- An attention page is never padded: the runner views it with one page stride per kernel block,",
        "  which runs past the buffer when the kernel block is smaller than the block (block 1040, kernel",
        "  16: reproduced on the real runner code by",
        "  `test_a_padded_attention_page_with_a_smaller_kernel_block_mis_strides`).",
        "",
        *(prefix or []),
        *(pools or []),
        "## The planner",
        "",
        "`sparkfleet kv-plan` answers the same question from the two config.json files, with neither",
        "vllm nor torch (stdlib only); it judges the patched build unless `--stock` is given, prints one",
        "line, and exits 1 when that build cannot unify (2 for unreadable input):",
        "",
        "```",
        "python -m sparkfleet kv-plan --target-config MODEL_DIR --drafter-config DRAFTER_DIR \\",
        "    --num-speculative-tokens 12 [--stock] [--json] [--kv-cache-dtype fp8] [--platform cpu] \\",
        "    [--enable-prefix-caching] [--max-model-len 262144] [--max-num-batched-tokens 8192 --max-num-seqs 3] \\",
        "    [--kv-cache-gib 27.72]   # also the pool: tokens and max concurrency at --max-model-len",
        "```",
        "",
        "From Python (the Ansible side): `sparkfleet.serving.kv_page_plan.plan(target_config, drafter_config,",
        "num_speculative_tokens, patched, drafter_label=...)` returns a `KVPlan` with `.ok`, `.reason`",
        "(one line naming the drafter and why), `.attention_block_size`, `.drafter_block_size`,",
        "`.page_size_bytes`, `.padding_pct`, `.kernel_block_sizes`, `.scheduler_block_size`,",
        "`.hash_block_size`, `.step_token_budget` and `.failure_stage`; `serving_options(serve_args)` reads",
        "a profile's serve args into its keywords (the deploy's KV check and `make pin` use it);",
        "`kv_pool(plan, kv_cache_bytes, max_model_len)` returns the pool as vLLM logs it (`.tokens`,",
        "`.max_concurrency`, `.num_blocks`, `.blocks_per_request`).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the Markdown table to this file")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kv_unify_") as tmp, contextlib.ExitStack() as stack:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm_cache"))
        stack.enter_context(gpu_like_cache_settings())
        real = RealVLLM(Path(tmp))
        reference = evaluate(real, reference_cases())
        grid = evaluate(real, grid_cases())
        prefix = prefix_caching_section(real)
        pools = profile_pool_section(real)
    document = render_document(reference, grid, time.monotonic() - start, prefix, pools)
    if args.write:
        args.write.write_text(document)
        print(f"wrote {args.write} ({len(reference) + len(grid)} runs)")
    else:
        print(document)
    disagreements = [row for row in reference + grid if not _agrees(row)]
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
