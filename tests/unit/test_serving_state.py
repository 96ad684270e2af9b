"""sparkfleet.serving.serving_state: the schema of a host's state.json and what plays derive from it (the
probe address of a bind address, the probe URL, each served model's revision), against the record the
vllm_service role writes (the plan's unit: vllm_service_spec.state, rendered with Ansible's own templating)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from sparkfleet.serving import serving_state
from tests.unit.test_unit_template import expression

TARGET_REV = "a" * 40
DRAFTER_REV = "6c7242c934a9870d7c59c05240bdbb2467cc1394"


def written(**overrides: Any) -> dict[str, Any]:
    """The state the vllm_service role writes for a speculative profile, through JSON as on disk."""
    speculative = {
        "drafter_path": "/var/lib/sparkfleet/models/tiny-dflash",
        "model_revisions": {"tiny": TARGET_REV, "tiny-dflash": DRAFTER_REV},
    }
    record = expression("vllm_service_spec.state", {**speculative, **overrides})
    return json.loads(json.dumps(record))


def slurp(state: dict[str, Any]) -> dict[str, Any]:
    return {"content": base64.b64encode(json.dumps(state).encode()).decode(), "encoding": "base64"}


def test_what_the_role_writes_passes_the_schema_and_names_its_revisions() -> None:
    view = serving_state.from_slurp(slurp(written()), "spark-01")
    assert set(serving_state.SCHEMA) - {"startup", "cluster"} <= set(view)  # a single-node profile: no cluster
    assert view["revisions"] == {"model": TARGET_REV, "drafter": DRAFTER_REV}
    assert view["probe"] == {"host": "127.0.0.1", "port": 8000, "url": "http://127.0.0.1:8000"}


@pytest.mark.parametrize(
    ("bind", "probe", "url"),
    [
        # a wildcard (or no) bind address is probed on the loopback
        *((wildcard, "127.0.0.1", "http://127.0.0.1:8123") for wildcard in ("0.0.0.0", "::", "")),
        ("10.0.0.5", "10.0.0.5", "http://10.0.0.5:8123"),
        ("fd00::5", "fd00::5", "http://[fd00::5]:8123"),
    ],
)
def test_a_bind_address_gives_the_probe_address(bind: str, probe: str, url: str) -> None:
    view = serving_state.view(serving_state.check({**written(), "host": bind, "port": "8123"}, "h"))
    assert view["probe"] == {"host": probe, "port": 8123, "url": url}
    if bind:  # the plan refuses an empty sparkfleet_api_host; a record from an earlier sparkfleet may hold one
        assert expression("vllm_service_spec.probe_host", sparkfleet_api_host=bind) == probe


def test_a_profile_without_drafter_has_no_drafter_revision() -> None:
    state = written(drafter_path="", model_revisions={"tiny": TARGET_REV})
    assert serving_state.view(serving_state.check(state, "h"))["revisions"] == {"model": TARGET_REV, "drafter": ""}


def test_no_file_is_no_state() -> None:
    assert serving_state.from_slurp({"failed": True, "msg": "file not found"}, "h") == {}


def test_a_record_from_an_earlier_sparkfleet_without_optional_keys_is_read() -> None:
    state = {key: value for key, value in written().items() if serving_state.SCHEMA[key][1]}
    view = serving_state.view(serving_state.check(state, "h"))
    assert view["revisions"] == {"model": "", "drafter": ""}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unit": None}, r"spark-02: state.json unit is None, not a str; deploy the host again"),
        ({"port": "eighty"}, r"spark-02: state.json port is 'eighty', not a int"),
        ({"port": True}, r"port is True, not a int"),
        ({"model_revisions": []}, r"model_revisions is \[\], not a dict"),
    ],
)
def test_a_bad_key_is_named_with_the_fix(change: dict[str, Any], message: str) -> None:
    with pytest.raises(serving_state.StateError, match=message):
        serving_state.from_slurp(slurp({**written(), **change}), "spark-02")


def test_a_missing_key_or_bad_json_is_named_with_the_fix() -> None:
    state = written()
    del state["served_model_name"]
    with pytest.raises(serving_state.StateError, match=r"spark-02: state.json has no 'served_model_name'; deploy"):
        serving_state.check(state, "spark-02")
    with pytest.raises(serving_state.StateError, match=r"spark-02: state.json is not JSON"):
        serving_state.parse("{", "spark-02")
    with pytest.raises(serving_state.StateError, match=r"holds list, not an object"):
        serving_state.parse("[]", "spark-02")
