"""model_cache's fan-out plan (filter_plugins/model_cache_fanout.py) and the seed's manifest of a built directory.

The plan is what issue 4 asks of a fleet copy: the seed sends once (only when no host holds a verified
copy), then every holder serves one host per round, so the holders double each round; a host that holds
a copy is never sent to; a bad seed host is named in the error.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from sparkfleet.build import hub_cache
from sparkfleet.build.hub_cache import HubCacheError

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("model_cache_fanout", ROOT / "filter_plugins" / "model_cache_fanout.py")
fanout = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fanout)
plan = fanout.model_cache_fanout_plan
HOSTS = [f"spark-{n:02d}" for n in range(1, 9)]


def receivers(rounds: list) -> list[str]:
    return [copy["to"] for copies in rounds for copy in copies]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_the_seed_sends_once_then_holders_double(count: int) -> None:
    hosts = HOSTS[:count]
    rounds = plan(hosts, [])
    assert rounds[0] == [{"to": hosts[0], "from": None}]
    assert [c for copies in rounds for c in copies if c["from"] is None] == rounds[0]  # the seed sends once
    assert sorted(receivers(rounds)) == sorted(hosts)  # every host receives exactly once
    assert len(rounds) == 1 + math.ceil(math.log2(count))  # host-to-host rounds: ceil(log2 N)
    holders = {hosts[0]}
    for copies in rounds[1:]:
        sources = [c["from"] for c in copies]
        assert len(sources) == len(set(sources)), "a source serves two hosts in one round"
        assert set(sources) <= holders, "a host served a copy before it held one"
        assert len(copies) == min(len(holders), count - len(holders))
        holders |= {c["to"] for c in copies}


def test_hosts_that_hold_a_copy_serve_and_are_never_sent_to() -> None:
    rounds = plan(HOSTS[:4], ["spark-03"])
    assert rounds == [
        [{"to": "spark-01", "from": "spark-03"}],
        [{"to": "spark-02", "from": "spark-03"}, {"to": "spark-04", "from": "spark-01"}],
    ]
    assert plan(HOSTS[:3], HOSTS[:3]) == []


def test_the_seed_host_receives_first() -> None:
    rounds = plan(HOSTS[:3], [], "spark-02")
    assert rounds[0] == [{"to": "spark-02", "from": None}]
    assert rounds[1] == [{"to": "spark-01", "from": "spark-02"}]
    # it is only the first receiver when nobody holds a copy
    assert plan(HOSTS[:3], ["spark-01"], "spark-02")[0] == [{"to": "spark-02", "from": "spark-01"}]


@pytest.mark.parametrize(
    ("hosts", "holders", "first", "message"),
    [
        (HOSTS[:2], [], "spark-09", "model_cache_seed_host 'spark-09' is not one of this play's hosts"),
        (HOSTS[:2], ["spark-09"], "", "holders ['spark-09'] are not among the hosts"),
        (["a", "a"], [], "", "names a host twice"),
        ("spark-01", [], "", "hosts must be a list of host names"),
    ],
)
def test_bad_inputs_name_the_value(hosts, holders, first, message: str) -> None:  # noqa: ANN001
    with pytest.raises(fanout.AnsibleFilterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(hosts, holders, first)


def test_a_built_directory_gets_a_manifest_and_is_not_hashed_twice(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    built = tmp_path / "seed" / "built" / "hybrid"
    (built / "sub").mkdir(parents=True)
    (built / "config.json").write_text('{"a": 1}')
    (built / "model-00001-of-00001.safetensors").write_bytes(bytes(range(256)) * 64)
    (built / "sub" / "x.json").write_text("{}")
    revision = "ab" * 20
    first = hub_cache.describe_directory(built, "hybrid", revision, tmp_path / "seed")
    assert first.repo == "built/hybrid" and first.revision == revision
    assert [f.path for f in first.files] == ["config.json", "model-00001-of-00001.safetensors", "sub/x.json"]
    assert first.files[1].sha256 == hub_cache.sha256_of_file(built / "model-00001-of-00001.safetensors")
    assert hub_cache.verify_directory(first, built) == []
    hashed: list[Path] = []
    monkeypatch.setattr(hub_cache, "sha256_of_file", lambda path: hashed.append(path) or "0" * 64)
    again = hub_cache.describe_directory(built, "hybrid", revision, tmp_path / "seed")
    assert again == first and hashed == []  # unchanged files are not read again
    os.utime(built / "config.json", ns=(1, 1))
    hub_cache.describe_directory(built, "hybrid", revision, tmp_path / "seed")
    assert hashed == [built / "config.json"]


def test_the_manifest_cli_writes_the_seed_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = tmp_path / "built"
    built.mkdir()
    (built / "config.json").write_text("{}")
    code = hub_cache.main(["manifest", "--dir", str(built), "--name", "h", "--revision", "cd" * 20,
                           "--seed-dir", str(tmp_path / "seed"), "--json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["revision"] == "cd" * 20 and result["files"] == 1
    manifest = json.loads(Path(result["manifest"]).read_text())
    assert manifest["repo"] == "built/h" and manifest["files"][0]["path"] == "config.json"


@pytest.mark.parametrize(("revision", "make", "message"), [("main", True, "is a branch or tag name"),
                                                           ("ab" * 20, False, "no such directory")])  # fmt: skip
def test_the_manifest_of_a_bad_build_is_refused(tmp_path: Path, revision: str, make: bool, message: str) -> None:
    if make:
        (tmp_path / "b").mkdir()
    with pytest.raises(HubCacheError, match=message):
        hub_cache.describe_directory(tmp_path / "b", "h", revision, tmp_path / "seed")


def test_argument_specs_match_defaults() -> None:
    import yaml

    role = ROOT / "roles" / "model_cache"
    options = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    assert set(options) - {"model_cache_models"} == set(defaults) - {"model_cache_models"}, set(options) ^ set(defaults)
    for name, option in options.items():
        assert name.startswith("model_cache_")
        if name != "model_cache_models" and "{{" not in str(defaults[name]):
            assert option.get("default") == defaults[name], name
