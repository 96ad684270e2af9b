"""Patch 0005 on vLLM 0.23's own code: which cudagraph a batch replays, and what GDN builds for it.

On a GPU the hybrid + DFlash stack returned wrong greedy tokens with CUDA graphs on (issue 22;
docs/gpu-greedy-equality.md). The cause is in two pieces of Python that run the same on this CPU:

1. ``GPUModelRunner._determine_batch_execution_and_padding`` dispatches by shape: a prefill of
   1 + num_speculative_tokens tokens per request is a "uniform decode" and replays the FULL decode
   cudagraph;
2. ``GDNAttentionMetadataBuilder.build`` classifies by phase: it builds prefill metadata for that
   batch and leaves the persistent buffers the decode graph reads as the last step left them.

For each batch below (requests given as prompt length, tokens computed, tokens scheduled, drafts),
a driver process, once with the stock files and once with the patch (tests/vllm/vllm_trees.py),
runs the real ``CudagraphDispatcher`` (FULL_AND_PIECEWISE, the GPU default), the runner's real
dispatch method with what ``execute_model`` passes it, and the real GDN metadata builder on the
padded batch the runner would build, then reports the mode, the GDN split and whether the metadata
of a FULL replay lives in the builder's persistent buffers. The runner and the configs are stand-ins
(namespaces carrying the attributes these functions read); the dispatcher, the compilation config,
the spec and the builder are vLLM's. What only the GPU shows (the replayed kernels' wrong tokens, the fixed ones' equal
tokens) is tests/gpu/cuda_smoke.py.

The module doubles as the driver: ``python test_gdn_dispatch.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.vllm_trees import build_vllm_tree, run_tree_drivers

pytestmark = pytest.mark.vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES = REPO_ROOT / "files/patches/vllm-0.23.0"
PATCH = SERIES / "0005-uniform-decode-prefill-dispatch.patch"
MAX_NUM_SEQS = 4
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]

# name -> (num_speculative_tokens, requests as (prompt tokens, computed tokens, scheduled tokens, drafts))
BATCHES: dict[str, tuple[int, list[tuple[int, int, int, int]]]] = {
    # "The capital of France is" is 5 tokens: the first request after start at n=4.
    "prefill-of-5-at-n4": (4, [(5, 0, 5, 0)]),
    "four-prefills-of-13-at-n12": (12, [(13, 0, 13, 0)] * 4),
    "last-chunk-of-9-at-n8": (8, [(30, 21, 9, 0)]),
    "decode-and-prefill-of-5-at-n4": (4, [(7, 9, 5, 4), (5, 0, 5, 0)]),
    "decodes-at-n4": (4, [(7, 9, 5, 4), (12, 20, 5, 4)]),
    "decodes-at-n12": (12, [(7, 9, 13, 12)] * 3),
    "one-token-prompt-at-n0": (0, [(1, 0, 1, 0)]),
    "one-token-prompt-at-n4": (4, [(1, 0, 1, 0)]),
    "one-token-prompt-beside-decodes-at-n0": (0, [(9, 12, 1, 0), (1, 0, 1, 0)]),
    "decodes-at-n0": (0, [(9, 12, 1, 0), (4, 5, 1, 0)]),
    "one-token-last-chunk-at-n0": (0, [(10, 9, 1, 0)]),
}
# Batches the dispatcher must still replay as FULL decode graphs (the fast path stays).
DECODES = {"decodes-at-n4", "decodes-at-n12", "decodes-at-n0"}
# What stock vLLM 0.23 gets wrong: FULL replays whose GDN metadata is not in the graph's buffers ...
STOCK_STALE_REPLAY = {
    "prefill-of-5-at-n4",
    "four-prefills-of-13-at-n12",
    "last-chunk-of-9-at-n8",
    "decode-and-prefill-of-5-at-n4",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("gdn_dispatch")
    trees = {"stock": build_vllm_tree(root / "stock", None), "patched": build_vllm_tree(root / "patched", PATCH)}
    return run_tree_drivers(__file__, trees, root)


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_patched_full_replays_read_fresh_metadata(outcomes: dict, batch: str) -> None:
    outcome = outcomes["patched"][batch]
    assert outcome["fresh_for_replay"], outcome


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_patched_replays_full_graphs_for_decodes_only(outcomes: dict, batch: str) -> None:
    outcome = outcomes["patched"][batch]
    assert (outcome["mode"] == "FULL") is (batch in DECODES), outcome


@pytest.mark.parametrize("batch", sorted(DECODES))
def test_decodes_replay_the_same_graph_stock_and_patched(outcomes: dict, batch: str) -> None:
    stock, patched = outcomes["stock"][batch], outcomes["patched"][batch]
    assert stock["mode"] == patched["mode"] == "FULL"
    assert stock["batch_descriptor"] == patched["batch_descriptor"]
    assert stock["split"] == patched["split"]


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_stock_replays_stale_buffers_exactly_here(outcomes: dict, batch: str) -> None:
    """The negative control: stock vLLM 0.23 replays a decode graph on stale buffers for these batches."""
    outcome = outcomes["stock"][batch]
    assert outcome["fresh_for_replay"] is (batch not in STOCK_STALE_REPLAY), outcome
    if batch in STOCK_STALE_REPLAY:
        assert outcome["mode"] == "FULL" and outcome["split"]["num_prefills"] > 0, outcome


def test_execute_model_passes_the_phase_to_the_dispatch(outcomes: dict) -> None:
    # The driver's dispatch calls mirror execute_model's; this holds them to the patched source.
    assert outcomes["patched"]["_source"]["execute_model_passes_phase"] is True
    assert outcomes["stock"]["_source"]["execute_model_passes_phase"] is False


# --------------------------------------------------------------------------------------------------------
# The driver (runs in the subprocess, against whichever vllm tree is first on PYTHONPATH)
# --------------------------------------------------------------------------------------------------------


def _dispatcher(num_spec: int):
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=list(CAPTURE_SIZES),
        max_cudagraph_capture_size=CAPTURE_SIZES[-1],
    )
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    if num_spec:
        compilation.adjust_cudagraph_sizes_for_spec_decode(1 + num_spec, 1)
    speculative = SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False) if num_spec else None
    config = SimpleNamespace(
        compilation_config=compilation,
        speculative_config=speculative,
        lora_config=None,
        parallel_config=SimpleNamespace(data_parallel_size=1, decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        observability_config=SimpleNamespace(cudagraph_metrics=False),
        additional_config={},
        model_config=None,
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1 + num_spec)
    return config, dispatcher


def _runner(config, dispatcher, num_spec: int, requests: list[tuple[int, int, int, int]]):
    """The attributes of a GPUModelRunner that its dispatch methods read, for this batch."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(
        num_spec_tokens=num_spec,
        uniform_decode_query_len=1 + num_spec,
        cudagraph_dispatcher=dispatcher,
        compilation_config=config.compilation_config,
        vllm_config=config,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(
            req_ids=[f"r{i}" for i in range(len(requests))],
            num_computed_tokens_cpu=np.array([r[1] for r in requests], dtype=np.int32),
            num_prompt_tokens=np.array([r[0] for r in requests], dtype=np.int32),
            lora_id_to_lora_request={},
        ),
        _pad_for_sequence_parallelism=lambda num_tokens: num_tokens,
        _is_uniform_decode=GPUModelRunner._is_uniform_decode,
    )
    if hasattr(GPUModelRunner, "_scheduled_reqs_all_decoding"):
        runner._scheduled_reqs_all_decoding = GPUModelRunner._scheduled_reqs_all_decoding.__get__(runner)
    return runner


def _dispatch(runner, requests: list[tuple[int, int, int, int]]):
    """The mode and batch descriptor execute_model gets for this batch (stock or patched call)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    scheduled = np.array([r[2] for r in requests], dtype=np.int32)
    kwargs = {}
    if hasattr(runner, "_scheduled_reqs_all_decoding"):
        scheduler_output = SimpleNamespace(
            scheduled_spec_decode_tokens={f"r{i}": [0] * r[3] for i, r in enumerate(requests) if r[3]}
        )
        decoding = runner._scheduled_reqs_all_decoding(scheduler_output, len(requests))
        kwargs["force_uniform_decode"] = None if decoding else False
    mode, descriptor, *_ = GPUModelRunner._determine_batch_execution_and_padding(
        runner,
        num_tokens=int(scheduled.sum()),
        num_reqs=len(requests),
        num_scheduled_tokens_np=scheduled,
        max_num_scheduled_tokens=int(scheduled.max()),
        use_cascade_attn=False,
        **kwargs,
    )
    return mode, descriptor


def _gdn_metadata(config, num_spec: int, requests: list[tuple[int, int, int, int]], descriptor):
    """What GDNAttentionMetadataBuilder builds for the batch, padded as the runner pads it."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(
        block_size=80,
        shapes=((3 + num_spec, 256), (4, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="none",
        num_speculative_blocks=num_spec,
    )
    builder = GDNAttentionMetadataBuilder(spec, ["linear_attn"], config, torch.device("cpu"))
    num_reqs = len(requests)
    num_tokens = sum(r[2] for r in requests)
    reqs_padded = descriptor.num_reqs if descriptor.num_reqs is not None else num_reqs
    tokens_padded = descriptor.num_tokens
    query_lens = [r[2] for r in requests] + [0] * (reqs_padded - num_reqs)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([r[1] + r[2] for r in requests] + [0] * (reqs_padded - num_reqs), dtype=torch.int32)
    is_prefilling = torch.tensor([r[1] < r[0] for r in requests] + [False] * (reqs_padded - num_reqs))
    blocks = torch.zeros((reqs_padded, 1 + num_spec), dtype=torch.int32)
    for index in range(num_reqs):
        blocks[index] = torch.arange(1 + num_spec, dtype=torch.int32) + 1 + index * (1 + num_spec)
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        _seq_lens_cpu=seq_lens.clone(),
        _num_computed_tokens_cpu=torch.tensor([r[1] for r in requests] + [0] * (reqs_padded - num_reqs)),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=reqs_padded,
        num_actual_tokens=tokens_padded,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=blocks,
        slot_mapping=torch.zeros(tokens_padded, dtype=torch.int64),
        causal=True,
        is_prefilling=is_prefilling,
    )
    extra = {}
    if any(r[3] for r in requests):  # the runner passes these when any request has drafts scheduled
        drafts = [r[3] if r[1] >= r[0] else -1 for r in requests] + [-1] * (reqs_padded - num_reqs)
        extra = {
            "num_accepted_tokens": torch.ones(reqs_padded, dtype=torch.int32),
            "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32),
        }
    metadata = builder.build(0, common, **extra)
    assert num_tokens <= tokens_padded
    return builder, metadata


def _in_buffer(view, buffer) -> bool:
    return view is not None and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def _outcome(num_spec: int, requests: list[tuple[int, int, int, int]]) -> dict[str, Any]:
    config, dispatcher = _dispatcher(num_spec)
    runner = _runner(config, dispatcher, num_spec, requests)
    mode, descriptor = _dispatch(runner, requests)
    builder, metadata = _gdn_metadata(config, num_spec, requests, descriptor)
    if metadata.num_spec_decodes:
        in_buffers = _in_buffer(metadata.spec_state_indices_tensor, builder.spec_state_indices_tensor)
    else:
        in_buffers = _in_buffer(metadata.non_spec_state_indices_tensor, builder.non_spec_state_indices_tensor)
    return {
        "mode": mode.name,
        "batch_descriptor": [descriptor.num_tokens, descriptor.num_reqs, descriptor.uniform],
        "split": {
            "num_prefills": metadata.num_prefills,
            "num_decodes": metadata.num_decodes,
            "num_spec_decodes": metadata.num_spec_decodes,
        },
        "metadata_in_graph_buffers": in_buffers,
        # A FULL replay reads the builder's persistent buffers: they must hold this step's metadata.
        "fresh_for_replay": mode.name != "FULL" or in_buffers,
    }


def _driver(out_path: str) -> int:
    import inspect
    import logging

    logging.disable(logging.WARNING)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    results: dict[str, Any] = {name: _outcome(n, requests) for name, (n, requests) in BATCHES.items()}
    source = inspect.getsource(GPUModelRunner.execute_model)
    results["_source"] = {
        "execute_model_passes_phase": "force_uniform_decode=" in source
        and "self._scheduled_reqs_all_decoding(scheduler_output, num_reqs)" in source
    }
    Path(out_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_driver(sys.argv[1]))
