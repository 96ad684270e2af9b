"""The CUDA smoke's matrix: which servers start, with what, and which requests each one answers.

Imported by the runner on the GPU machine (tests/gpu/cuda_smoke.py) and by the CPU-side checks of a
committed run (tests/unit/test_cuda_smoke_results.py): the same case names, flags and requests on
both sides. Standard library only.

Every case is one ``vllm serve`` of the patched wheel on one GPU, side by side with the others (tiny
models, small KV pools). ``tree`` picks the vLLM code: ``fixed`` is the whole patch series,
``stock`` the same wheel with patches 0005 (uniform-decode dispatch) and 0006 (GDN one-token
prefill) taken back out, so the difference between the two is those patches alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The hybrid target's flags, as the real profiles run it (GB10: --mamba-ssm-cache-dtype comes from
# the checkpoint's mamba_ssm_dtype, float32; FLASH_ATTN for attention; GDN prefill on Triton/FLA,
# which is what vLLM 0.23 picks on SM121 anyway and what the profiles set explicitly).
HYBRID_ARGS = (
    "--language-model-only",
    "--mamba-ssm-cache-dtype",
    "float32",
    "--gdn-prefill-backend",
    "triton",
)
COMMON_ARGS = (
    "--served-model-name",
    "qwen",
    "--host",
    "127.0.0.1",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "2048",
    "--enable-chunked-prefill",
    "--attention-backend",
    "FLASH_ATTN",
    "--seed",
    "0",
    # Side by side on one GPU: a fixed KV pool instead of a share of free memory (which the other
    # servers' start-up would move), and a small utilisation so that vLLM's start-up check passes.
    "--gpu-memory-utilization",
    "0.04",
    "--kv-cache-memory-bytes",
    str(1 << 30),
    # CUDA graphs up to 64 tokens (4 sequences x 13 tokens at n=12): every decode batch replays one.
    "--compilation-config",
    '{"max_cudagraph_capture_size": 64}',
)

# A dry run of the runner's mechanics on vLLM's CPU build (cuda_smoke.py --cpu): the cases that
# build can serve, with its own flags instead of the GPU-only ones.
CPU_ARGS = (*COMMON_ARGS[: COMMON_ARGS.index("--attention-backend")], "--seed", "0", "--enforce-eager")

HYBRID_TARGET = "tiny-qwen35"
HYBRID_DRAFTER = "tiny-qwen35-dflash"
DENSE_TARGET = "tiny-qwen3"
DENSE_DRAFTER = "tiny-qwen3-dflash"


@dataclass(frozen=True)
class DrafterVariant:
    """An untrained drafter for tiny-qwen35 with another KV geometry (start-up and KV layout only)."""

    name: str
    num_hidden_layers: int
    num_key_value_heads: int
    sliding_window: int | None  # None: full attention
    head_dim: int = 64
    num_attention_heads: int = 2  # the target's; GQA needs it to be a multiple of the KV heads
    wave: str = "B"


# Geometries beside the trained drafter (1 layer, 1 KV head x 64 = the target's attention page):
# more layers, 2x and 4x the target's KV bytes per token, a sliding window, and the by-hand failure.
DRAFTER_VARIANTS = (
    DrafterVariant("drafter-2layers", 2, 1, None),
    DrafterVariant("drafter-2kv", 1, 2, None),
    DrafterVariant("drafter-4kv", 1, 4, None, num_attention_heads=4, wave="C"),
    DrafterVariant("drafter-swa64", 1, 1, 64),
    DrafterVariant("drafter-2layers-2kv", 2, 2, None),
)


@dataclass(frozen=True)
class Case:
    """One server of the matrix."""

    name: str
    wave: str  # "A" or "B": the cases of one wave start together
    target: str
    drafter: str | None = None
    num_speculative_tokens: int = 0
    eager: bool = False
    tree: str = "fixed"  # "fixed" or "stock"
    prefix_caching: bool = False
    int8_lm_head: bool = False
    baseline: str | None = None  # the case whose greedy outputs this one must equal
    requests: str = "greedy"  # "greedy": the whole request set; "boot": a start-up and one request
    env: tuple[tuple[str, str], ...] = field(default=())
    extra_args: tuple[str, ...] = ()

    @property
    def hybrid(self) -> bool:
        return self.target == HYBRID_TARGET

    def serve_args(self, model_dir: str, drafter_dir: str | None, port: int, cpu: bool = False) -> list[str]:
        """The ``vllm serve`` arguments after the model path (``cpu``: the runner's dry run on vLLM's CPU build)."""
        args = [*(CPU_ARGS if cpu else COMMON_ARGS), "--port", str(port)]
        if self.hybrid:
            args += HYBRID_ARGS
        args.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.eager and not cpu:
            args.append("--enforce-eager")
        args += self.extra_args
        if self.drafter is not None:
            assert drafter_dir is not None
            import json

            spec = {
                "method": "dflash",
                "model": drafter_dir,
                "num_speculative_tokens": self.num_speculative_tokens,
                "attention_backend": "FLASH_ATTN",
            }
            args += ["--speculative-config", json.dumps(spec)]
        return args

    def environment(self) -> dict[str, str]:
        # FlashInfer is not carried (smoke_prepare.NOT_CARRIED); on CUDA vLLM 0.23 imports it for its
        # top-k/top-p sampler unless told not to. Greedy requests never reach that sampler.
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", **dict(self.env)}
        if self.int8_lm_head:
            env["VLLM_SPARKFLEET_INT8_LMHEAD"] = "1"
        return env


def _matrix() -> tuple[Case, ...]:
    cases: list[Case] = [
        Case("hybrid", "A", HYBRID_TARGET),
        Case("hybrid-eager", "A", HYBRID_TARGET, eager=True, baseline="hybrid"),
        # Without speculation the uniform decode is one token: a one-token prompt takes the same paths.
        Case("hybrid-stock", "A", HYBRID_TARGET, tree="stock", baseline="hybrid"),
        Case("hybrid-eager-stock", "A", HYBRID_TARGET, eager=True, tree="stock", baseline="hybrid-eager"),
    ]
    for n in (4, 8, 12):
        cases += [
            Case(f"hybrid-dflash{n}", "A", HYBRID_TARGET, HYBRID_DRAFTER, n, baseline="hybrid"),
            Case(f"hybrid-dflash{n}-stock", "A", HYBRID_TARGET, HYBRID_DRAFTER, n, tree="stock", baseline="hybrid"),
            Case(f"hybrid-dflash{n}-eager", "A", HYBRID_TARGET, HYBRID_DRAFTER, n, eager=True, baseline="hybrid-eager"),
        ]
    cases += [
        Case("dense", "B", DENSE_TARGET),
        Case("dense-dflash4", "B", DENSE_TARGET, DENSE_DRAFTER, 4, baseline="dense"),
        Case("hybrid-dflash12-prefix", "B", HYBRID_TARGET, HYBRID_DRAFTER, 12, prefix_caching=True, baseline="hybrid"),
        Case("hybrid-dflash12-int8", "B", HYBRID_TARGET, HYBRID_DRAFTER, 12, int8_lm_head=True, baseline="hybrid"),
    ]
    for variant in DRAFTER_VARIANTS:
        cases.append(Case(f"hybrid-{variant.name}", variant.wave, HYBRID_TARGET, variant.name, 12, requests="boot"))
    # A small KV pool, so that blocks freed by earlier requests are handed out again before
    # "len1-again": a request's state slot then holds another request's final state.
    small_pool = ("--num-gpu-blocks-override", "40")  # 40 x 80 tokens: one 2048-token request fits
    for tree in ("fixed", "stock"):
        suffix = "" if tree == "fixed" else "-stock"
        cases.append(
            Case(f"hybrid-reuse{suffix}", "C", HYBRID_TARGET, tree=tree, baseline="hybrid", extra_args=small_pool)
        )
    return tuple(cases)


CASES: tuple[Case, ...] = _matrix()
CASES_BY_NAME: dict[str, Case] = {case.name: case for case in CASES}


# --------------------------------------------------------------------------------------------------
# Requests. Prompts are token ids, so that their lengths are exact: a prompt of 1 + n tokens is the
# shape of a speculative decode step at n, and a 1-token prompt that of a plain decode step.


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str | None  # tokenized whole, or
    cut_from: str | None = None  # the first ``length`` tokens of this text
    length: int | None = None
    max_tokens: int = 24


FIRST = Prompt("first", "The capital of France is", max_tokens=16)
COUNTING = " ".join(str(i) for i in range(1, 41))
SEQUENTIAL = (
    FIRST,
    Prompt("len1", None, "The capital of France is Paris.", 1),
    Prompt("len5", None, COUNTING, 5),
    Prompt("len9", None, COUNTING, 9),
    Prompt("len13", None, COUNTING, 13),
    Prompt("capital-germany", "The capital of Germany is", max_tokens=16),
    Prompt("repeat-first", "The capital of France is", max_tokens=16),
    Prompt("chat", "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n"),
    Prompt("long", None, COUNTING, 16, max_tokens=192),
    # The one-token prompt again, last: on a server whose blocks have been reused by now.
    Prompt("len1-again", None, "The capital of France is Paris.", 1),
)
# Sent at once: the scheduler mixes their prefills and decodes.
BATCH = (
    Prompt("batch-france", "The capital of France is", max_tokens=32),
    Prompt("batch-week", "The days of the week are", max_tokens=32),
    Prompt("batch-len9", None, COUNTING, 9, max_tokens=32),
    Prompt("batch-rainbow", "The colours of the rainbow are", max_tokens=32),
)
BOOT = (FIRST,)
# Prefix caching: the same long prompt twice (the second must hit the cache), then a request that
# shares its first half only.
PREFIX_TEXT = " ".join(f"The capital of {c} is {p}." for c, p in [("France", "Paris"), ("Italy", "Rome")] * 40)
PREFIX = (
    Prompt("prefix-cold", PREFIX_TEXT, max_tokens=16),
    Prompt("prefix-warm", PREFIX_TEXT, max_tokens=16),
)


def prompt_ids(prompt: Prompt, encode) -> list[int]:
    """The token ids of ``prompt`` with ``encode(text) -> list[int]`` (the models' tokenizer)."""
    if prompt.text is not None:
        return list(encode(prompt.text))
    assert prompt.cut_from is not None and prompt.length is not None
    ids = list(encode(prompt.cut_from))
    if len(ids) < prompt.length:
        raise ValueError(f"{prompt.name}: {prompt.cut_from!r} has {len(ids)} tokens, fewer than {prompt.length}")
    return ids[: prompt.length]


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """The first position where two greedy outputs differ (a length difference counts), or None."""
    for index, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return index
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None
