"""The tiny-model fixture: deterministic bytes, the configs vLLM needs, and targets transformers can run.

Builds use a handful of training steps (``--train-steps``) to stay fast; the code path is the one the
full build takes. Run with ``build/venv-vllm/bin/python -m pytest tests/vllm/test_tiny_models.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures import tiny_models

pytestmark = pytest.mark.vllm

QUICK_STEPS = 3


def build(out: Path, *names: str, extra: tuple[str, ...] = ()) -> None:
    """Run the fixture's CLI entry point for ``names`` with quick training."""
    argv = ["--out", str(out), "--train-steps", str(QUICK_STEPS), *extra]
    for name in names:
        argv += ["--only", name]
    assert tiny_models.main(argv) == 0


@pytest.fixture(scope="module")
def quick_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny model, built once with quick training."""
    out = tmp_path_factory.mktemp("tiny-models")
    build(out)
    return out


def test_two_builds_are_byte_identical(quick_models: Path, tmp_path: Path) -> None:
    build(tmp_path, "tiny-qwen3-dflash")
    for name in ("tiny-qwen3", "tiny-qwen3-dflash"):
        first = tiny_models.directory_digest(quick_models / name)
        second = tiny_models.directory_digest(tmp_path / name)
        assert "model.safetensors" in first and "tokenizer.json" in first
        assert first == second, f"{name} differs between two builds"


def test_current_stamp_skips_and_force_rebuilds(quick_models: Path, capsys: pytest.CaptureFixture) -> None:
    weights = quick_models / "tiny-qwen3" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    build(quick_models, "tiny-qwen3")
    assert weights.stat().st_mtime_ns == before
    assert "built 0 (none), 1 already current" in capsys.readouterr().out
    build(quick_models, "tiny-qwen3", extra=("--force",))
    assert weights.stat().st_mtime_ns != before
    assert "built 1 (tiny-qwen3)" in capsys.readouterr().out


def test_quick_build_never_passes_for_full_build(quick_models: Path) -> None:
    stamp = (quick_models / "tiny-qwen3" / tiny_models.STAMP_FILE).read_text().strip()
    full = tiny_models.model_stamp(tiny_models.builder_hash(), None)
    assert stamp == tiny_models.model_stamp(tiny_models.builder_hash(), QUICK_STEPS)
    assert not tiny_models.is_current(quick_models / "tiny-qwen3", full)


def test_bad_train_steps_is_refused(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        tiny_models.main(["--out", str(tmp_path), "--train-steps", "0"])
    assert "0 is not a positive step count" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def read_config(models: Path, name: str) -> dict:
    return json.loads((models / name / "config.json").read_text())


def test_qwen35_config_fits_vllm_cpu(quick_models: Path) -> None:
    config = read_config(quick_models, "tiny-qwen35")
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["hidden_size"] == 128
    assert text["layer_types"] == ["linear_attention", "full_attention"]
    # CPU attention head sizes.
    assert text["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    rotary_pairs = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    assert sum(text["rope_parameters"]["mrope_section"]) == rotary_pairs
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]


def test_drafter_config_and_weights_match_vllm_dflash(quick_models: Path) -> None:
    from safetensors import safe_open

    target = read_config(quick_models, "tiny-qwen3")
    assert target["architectures"] == ["Qwen3ForCausalLM"]
    for name, layers in (("tiny-qwen3-dflash", 1), ("tiny-qwen3-dflash-wide", 2)):
        drafter = read_config(quick_models, name)
        assert drafter["architectures"] == ["DFlashDraftModel"]
        assert drafter["model_type"] == "qwen3"
        assert drafter["num_hidden_layers"] == layers
        layer_ids = drafter["dflash_config"]["target_layer_ids"]
        # vLLM collects the target's state before layer id + 1, so the last layer cannot be named.
        assert max(layer_ids) + 1 < target["num_hidden_layers"]
        tokenizer = tiny_models.load_tokenizer(quick_models / name)
        assert tokenizer.get_vocab_size() <= drafter["dflash_config"]["mask_token_id"] < target["vocab_size"]
        with safe_open(str(quick_models / name / "model.safetensors"), "pt") as weights:
            names = set(weights.keys())
            fc_shape = tuple(weights.get_slice("fc.weight").get_shape())
        assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
        assert not any("embed_tokens" in n or "lm_head" in n for n in names)
        assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {str(i) for i in range(layers)}
        assert fc_shape == (target["hidden_size"], len(layer_ids) * target["hidden_size"])
    narrow = read_config(quick_models, "tiny-qwen3-dflash")
    wide = read_config(quick_models, "tiny-qwen3-dflash-wide")
    assert wide["num_key_value_heads"] > narrow["num_key_value_heads"]
    assert wide["sliding_window"] > narrow["sliding_window"]


def test_chat_template_renders_chatml_and_tool_calls(quick_models: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(quick_models / "tiny-qwen3"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    # The ChatML markers are single tokens.
    assert len(tokenizer.encode("<|im_start|><|im_end|><tool_call>", add_special_tokens=False)) == 3


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen35", "tiny-qwen3-dflash"])
def test_serving_tokenizer_matches_training_tokenizer(quick_models: Path, name: str) -> None:
    # transformers picks the tokenizer class by model_type (Qwen3_5Tokenizer rebuilds the pipeline in
    # code): what vLLM serves with must split text exactly as the builder did while training.
    from transformers import AutoTokenizer

    served = AutoTokenizer.from_pretrained(str(quick_models / name))
    trained = tiny_models.load_tokenizer(quick_models / name)
    for text in ("1 2 3 4 10 11 12", "The capital of France is Paris.", "Ünïcode  spaces\n\nnew lines"):
        assert served(text, add_special_tokens=False)["input_ids"] == trained.encode(text).ids, text
        assert served.decode(trained.encode(text).ids) == text


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen35"])
def test_transformers_loads_and_generates(quick_models: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    loader = AutoModelForImageTextToText if name == "tiny-qwen35" else AutoModelForCausalLM
    model = loader.from_pretrained(str(quick_models / name), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(quick_models / name))
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    new_tokens = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 5 and all(0 <= token < model.config.get_text_config().vocab_size for token in new_tokens)
