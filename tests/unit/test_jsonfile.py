"""sparkfleet.build.jsonfile: a JSON object from a file, or the phrase that says why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkfleet.build import jsonfile


def test_an_object_is_returned(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_next", "layers": 48}', encoding="utf-8")
    assert jsonfile.read_object(path) == {"model_type": "qwen3_next", "layers": 48}
    assert jsonfile.read_object(str(path)) == {"model_type": "qwen3_next", "layers": 48}


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (None, "no such file"),
        ("directory", "cannot read (Is a directory)"),
        (b"{not json", "not valid JSON (Expecting property name"),
        (b"\xff\xfe{}", "not valid JSON ('utf-8' codec can't decode"),
        (b"[1, 2]", "holds a list, not an object"),
        (b'"text"', "holds a str, not an object"),
    ],
)
def test_what_is_not_an_object_is_one_phrase(tmp_path: Path, content: bytes | str | None, phrase: str) -> None:
    path = tmp_path / "config.json"
    if content == "directory":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(jsonfile.NotAJsonObject) as caught:
        jsonfile.read_object(path)
    assert str(caught.value).startswith(phrase)
    assert isinstance(caught.value, ValueError)
