"""tests/fixtures/tiny_model_cache.py: a model whose cached copy carries the stamp the builder would write
is copied, not trained again (a fresh clone on the same machine, CI after a session); another stamp
builds, and what was built is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import tiny_model_cache

MODELS = tiny_model_cache.tiny_models


@pytest.fixture
def fake_models(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two cheap models, b built on a; the list records every real build."""
    builds: list[str] = []

    def builder(name: str):  # noqa: ANN202 - the spec's callable
        def build(out_dir: Path, models_root: Path, steps: int) -> None:
            builds.append(name)
            (out_dir / "weights.bin").write_bytes(f"{name} {steps}".encode())

        return build

    monkeypatch.setattr(
        MODELS,
        "MODELS",
        {
            "a": MODELS.TinyModelSpec("a", (), builder("a"), "test model a", 3),
            "b": MODELS.TinyModelSpec("b", ("a",), builder("b"), "test model b", 3),
        },
    )
    return builds


def build(out: Path, cache: Path, stamp: str) -> list[str]:
    """What tiny_model_cache.main does around the builder, with a given stamp: the models copied."""
    copied = tiny_model_cache.from_cache(out, cache, ["b"], stamp)
    MODELS.build_model("b", out, stamp, [])
    tiny_model_cache.to_cache(out, cache, ["b"], stamp)
    return copied


def test_a_current_cached_model_is_copied_not_trained(fake_models: list[str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert build(tmp_path / "clone1", cache, "stamp-1") == []
    assert fake_models == ["a", "b"]
    assert (cache / "b" / "weights.bin").read_bytes() == b"b 3" and MODELS.is_current(cache / "a", "stamp-1")

    assert build(tmp_path / "clone2", cache, "stamp-1") == ["a", "b"]
    assert fake_models == ["a", "b"], "copied, not trained"
    assert (tmp_path / "clone2" / "b" / "weights.bin").read_bytes() == b"b 3"

    assert build(tmp_path / "clone3", cache, "stamp-2") == []  # another builder: trained, then kept
    assert fake_models == ["a", "b", "a", "b"] and MODELS.is_current(cache / "b", "stamp-2")
    assert not list(cache.glob(".*.partial"))


def test_a_cache_that_cannot_be_written_costs_time_only(fake_models: list[str], tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache would go")
    assert build(tmp_path / "clone", blocked, "stamp-1") == []
    assert MODELS.is_current(tmp_path / "clone" / "b", "stamp-1")
    assert tiny_model_cache.closure(["b", "a"]) == ["a", "b"]


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPARKFLEET_MODEL_CACHE", str(tmp_path / "here"))
    assert tiny_model_cache.default_cache() == tmp_path / "here"
    monkeypatch.delenv("SPARKFLEET_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_model_cache.default_cache() == tmp_path / "xdg" / "sparkfleet" / "tiny-models"
