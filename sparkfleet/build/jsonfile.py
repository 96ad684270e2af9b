"""A JSON object read from a file (a model's config.json, a safetensors index), or one phrase saying why not.

The callers (the checkpoint reader, the KV planner, its Ansible lookup) each put the phrase after the
path in their own error, with their own fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class NotAJsonObject(ValueError):
    """Why a file is not a JSON object, as a phrase to follow its path: "no such file",
    "cannot read (Permission denied)", "not valid JSON (...)", "holds a list, not an object"."""


def read_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; NotAJsonObject when it is missing, unreadable, not JSON
    (or not UTF-8 text) or holds something else."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotAJsonObject("no such file") from None
    except OSError as error:
        raise NotAJsonObject(f"cannot read ({error.strerror})") from None
    except ValueError as error:  # a JSONDecodeError, or a UnicodeDecodeError
        raise NotAJsonObject(f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise NotAJsonObject(f"holds a {type(data).__name__}, not an object")
    return data
