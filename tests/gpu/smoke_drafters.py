"""Untrained DFlash drafters for tiny-qwen35 with the KV geometries of tests/gpu/smoke_cases.py.

What these cases test is start-up and the KV-cache layout vLLM builds (which only the config
decides), so the weights are seeded random ones in the drafter checkpoint layout of
tests/fixtures/tiny_models.py. Run with build/venv-vllm/bin/python (torch, safetensors):

    build/venv-vllm/bin/python tests/gpu/smoke_drafters.py --out build/gpu-smoke/models
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

import smoke_cases  # noqa: E402

from tests.fixtures import tiny_models  # noqa: E402


def drafter_config(variant: smoke_cases.DrafterVariant, target_text: dict) -> dict:
    shape = tiny_models.DrafterShape(
        num_hidden_layers=variant.num_hidden_layers,
        num_key_value_heads=variant.num_key_value_heads,
        sliding_window=variant.sliding_window or 1024,
    )
    config = tiny_models.drafter_config(target_text, shape, tiny_models.HYBRID_DRAFTER_TARGET_LAYER_IDS)
    config["head_dim"] = variant.head_dim
    config["num_attention_heads"] = variant.num_attention_heads
    if variant.sliding_window is not None:
        # As the real z-lab drafters set it: every layer windowed.
        config["use_sliding_window"] = True
        config["max_window_layers"] = 0
        config["layer_types"] = ["sliding_attention"] * variant.num_hidden_layers
    return config


def build(out: Path, models: Path) -> None:
    import torch

    target_dir = models / smoke_cases.HYBRID_TARGET
    target_text = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))["text_config"]
    for index, variant in enumerate(smoke_cases.DRAFTER_VARIANTS):
        directory = out / variant.name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        config = drafter_config(variant, target_text)
        torch.manual_seed(1000 + index)
        module = tiny_models.make_drafter_module(config)
        tiny_models.write_json(directory / "config.json", config)
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(target_dir / name, directory / name)
        tiny_models.save_weights(module.state_dict(), directory / "model.safetensors", torch.bfloat16)
        print(
            f"smoke-drafters: {variant.name}: {config['num_hidden_layers']} layer(s), "
            f"{config['num_key_value_heads']} KV head(s) x {config['head_dim']}, "
            f"window {variant.sliding_window or 'none'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, default=REPO / "build" / "models", help="where tiny-qwen35 is")
    args = parser.parse_args(argv)
    build(args.out, args.models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
