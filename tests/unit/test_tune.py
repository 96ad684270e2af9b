"""`make tune`'s Python half (sparkfleet/fleet/tune.py) and the profile layer it writes (sparkfleet_tuned)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.fleet import tune
from sparkfleet.serving import kv_page_plan, profiles

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "kv_configs"
TARGET = FIXTURES / "qwen3_5_122b_a10b" / "config.json"
DRAFTER = FIXTURES / "dflash_bce6f76" / "config.json"


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("4-16:2", [4, 6, 8, 10, 12, 14, 16]),
        ("4-7", [4, 5, 6, 7]),
        ("3-12:4", [3, 7, 11]),
        ("12,4,8,4", [4, 8, 12]),
        ("5", [5]),
        ([16, 2], [2, 16]),
    ],
)
def test_a_range_names_its_values(text: Any, values: list[int]) -> None:
    assert tune.parse_range(text) == values


@pytest.mark.parametrize("text", ["16-4", "0-4", "4-40:2", "4-16:0", "four", "", "4;8", "-4", [0, 4], [True]])
def test_a_bad_range_is_one_line_naming_it(text: Any) -> None:
    with pytest.raises(tune.TuneError) as info:
        tune.parse_range(text)
    message = str(info.value)
    assert "\n" not in message and repr(text) in message and "4-16:2" in message


def kv_inputs(**serve_args: Any) -> dict[str, Any]:
    return {
        "target_config": str(TARGET),
        "drafter_config": str(DRAFTER),
        "patched": True,
        "platform": "cuda",
        "serve_args": serve_args,
    }


def test_each_value_is_vetted_by_the_kv_planner() -> None:
    """DFlash holds n - 1 drafting slots per sequence back from the step budget; with prefix caching on the
    hybrid that budget must hold one cache block, so past some n the planner refuses. The tune measures
    exactly the values the planner accepts and names the refused ones with the planner's reason."""
    block = kv_page_plan.plan(
        json.loads(TARGET.read_text()), json.loads(DRAFTER.read_text()), 8, True, enable_prefix_caching=True
    ).attention_block_size
    inputs = kv_inputs(**{"enable-prefix-caching": True, "max-num-batched-tokens": block + 20, "max-num-seqs": 3})
    values = list(range(2, 17))
    accepted, refused = tune.vet(values, inputs)
    assert accepted and refused, "the grid must hold both outcomes"
    assert sorted(accepted + [r["n"] for r in refused]) == values
    for n in values:
        verdict = kv_page_plan.plan(
            json.loads(TARGET.read_text()),
            json.loads(DRAFTER.read_text()),
            n,
            True,
            enable_prefix_caching=True,
            max_num_batched_tokens=block + 20,
            max_num_seqs=3,
        )
        assert (n in accepted) == verdict.ok, n
    for item in refused:
        assert "max-num-batched-tokens" in item["reason"]
    # without a drafter to plan, every value passes
    assert tune.vet(values, {}) == (values, [])


def test_candidates_command_refuses_when_nothing_is_left() -> None:
    inputs = kv_inputs(**{"enable-prefix-caching": True, "max-num-batched-tokens": 64, "max-num-seqs": 3})
    out = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "tune", "candidates", "--range", "4-8:2", "--kv-plan", json.dumps(inputs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2, out
    last = out.stderr.strip().splitlines()[-1]
    assert "refuses every value of tune range '4-8:2'" in last and "sparkfleet kv-plan" in last


def decode_result(workload: str, client: float, server: float, acceptance: float, valid: bool = True) -> dict:
    headline = client if valid else server
    return {
        "kind": "decode",
        "utc_time": "2026-12-03T10:00:00Z",
        "figures": {
            f"decode_tok_s_median[{workload}]": headline,
            f"client_decode_tok_s_median[{workload}]": client,
            f"server_decode_tok_s_median[{workload}]": server,
            f"acceptance_length[{workload}]": acceptance,
        },
        "details": {"headline": {workload: {"source": "client" if valid else "server", "value": headline}}},
    }


def test_the_winner_is_the_honest_figure_not_a_collapsed_client_one() -> None:
    """n=8's client figure collapsed (400x its server's): the row carries the server's figure, and the
    winner is chosen on the headline figures."""
    rows = [
        tune.row_from_result(4, "code", decode_result("code", 50.0, 49.5, 3.1)),
        tune.row_from_result(8, "code", decode_result("code", 20000.0, 48.0, 4.0, valid=False)),
        tune.row_from_result(12, "code", decode_result("code", 61.0, 60.2, 5.2)),
    ]
    assert rows[1].decode_tok_s == 48.0 and rows[1].source == "server"
    winner = tune.best(rows)
    assert (winner.n, winner.decode_tok_s, winner.acceptance_length, winner.source) == (12, 61.0, 5.2, "client")


def test_a_tie_goes_to_the_smaller_n_and_failures_are_kept() -> None:
    rows = [
        tune.Row(n=6, error="failed at the health gate"),
        tune.row_from_result(8, "prose", decode_result("prose", 40.0, 40.0, 2.0)),
        tune.row_from_result(4, "prose", decode_result("prose", 40.0, 40.0, 1.8)),
        tune.row_from_result(10, "prose", {"figures": {}, "details": {}}),
    ]
    assert tune.best(rows).n == 4
    assert rows[3].error and "prose" in rows[3].error
    text = tune.table(rows, tune.best(rows), [{"n": 16, "reason": "the step budget"}])
    lines = text.splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["4", "6", "8", "10", "16"]
    assert "BEST" in lines[2] and "failed at the health gate" in lines[3] and "refused: the step budget" in lines[6]


def test_nothing_measured_is_an_error_naming_each_value() -> None:
    with pytest.raises(tune.TuneError, match=r"n=4 \(down\), n=6 \(not measured\)"):
        tune.best([tune.Row(n=4, error="down"), tune.Row(n=6)])


def test_the_chart_draws_both_panels() -> None:
    rows = [tune.row_from_result(n, "code", decode_result("code", 40.0 + n, 40.0 + n, 1 + n / 4)) for n in (4, 8, 12)]
    fig_png = tune.chart_png("spark-01 dflash: code", rows, tune.best(rows))
    assert fig_png.startswith(b"\x89PNG")
    from sparkfleet.fleet import charts

    fig = charts.tune_figure("t", [(r.n, r.decode_tok_s, r.acceptance_length) for r in rows], 12)
    left, right = fig.axes[:2]
    assert left.get_ylabel() == "decode tok/s" and right.get_ylabel() == "acceptance length"
    assert [t.get_text() for t in left.get_xticklabels()] == ["4", "8", "12"]


# -- the host's inventory vars --------------------------------------------------------------------

ENTRY = {"num_speculative_tokens": 8, "workload": "code", "decode_tok_s": 61.0}


def read_vars(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=tune._TaggedLoader)  # noqa: S506 - a SafeLoader


def test_a_new_host_gets_a_host_vars_file(tmp_path: Path) -> None:
    written = tune.write_tuned(tmp_path, "spark-07", "dflash", ENTRY)
    assert written == tmp_path / "host_vars" / "spark-07.yml"
    assert read_vars(written) == {"sparkfleet_tuned": {"dflash": ENTRY}}


def test_an_operators_file_keeps_every_other_line(tmp_path: Path) -> None:
    path = tmp_path / "host_vars" / "spark-01.yml"
    path.parent.mkdir()
    text = (
        "---\n# spark-01 sits in rack 3\nsparkfleet_serve_args_host:\n  max-num-seqs: 4  # measured\n"
        "sparkfleet_tuned:\n  dense:\n    num_speculative_tokens: 6\n\n# the API key\n"
        "sparkfleet_api_key: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n"
    )
    path.write_text(text)
    assert tune.write_tuned(tmp_path, "spark-01", "dflash", ENTRY) == path
    new = path.read_text()
    for line in (
        "# spark-01 sits in rack 3",
        "  max-num-seqs: 4  # measured",
        "# the API key",
        "sparkfleet_api_key: !vault |",
    ):
        assert line in new
    data = read_vars(path)
    assert data["sparkfleet_tuned"] == {"dense": {"num_speculative_tokens": 6}, "dflash": ENTRY}
    assert data["sparkfleet_serve_args_host"] == {"max-num-seqs": 4}
    # flow style and a quoted key are replaced in place too
    flow = tmp_path / "host_vars" / "spark-05.yml"
    flow.write_text('"sparkfleet_tuned": {dense: {num_speculative_tokens: 6}}\nother: 1\n')
    tune.write_tuned(tmp_path, "spark-05", "dflash", ENTRY)
    assert flow.read_text().count("sparkfleet_tuned") == 1 and flow.read_text().endswith("other: 1\n")
    assert read_vars(flow) == {
        "other": 1,
        "sparkfleet_tuned": {"dense": {"num_speculative_tokens": 6}, "dflash": ENTRY},
    }
    # again: the entry is replaced, nothing else moves
    tune.write_tuned(tmp_path, "spark-01", "dflash", {**ENTRY, "num_speculative_tokens": 10})
    assert read_vars(path)["sparkfleet_tuned"]["dflash"]["num_speculative_tokens"] == 10
    assert path.read_text().replace("10", "8") == new


def test_a_host_vars_directory_gets_its_own_file(tmp_path: Path) -> None:
    """Ansible reads host_vars/<host>/ when it exists and then ignores host_vars/<host>.yml: the tune
    writes where Ansible will read it."""
    (tmp_path / "host_vars" / "spark-02").mkdir(parents=True)
    (tmp_path / "host_vars" / "spark-02.yml").write_text("ignored: true\n")
    written = tune.write_tuned(tmp_path, "spark-02", "dflash", ENTRY)
    assert written == tmp_path / "host_vars" / "spark-02" / tune.TUNE_FILE
    assert read_vars(written) == {"sparkfleet_tuned": {"dflash": ENTRY}}


def test_a_json_host_vars_file_is_updated(tmp_path: Path) -> None:
    path = tmp_path / "host_vars" / "spark-03.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sparkfleet_profile": "dense"}))
    assert tune.write_tuned(tmp_path, "spark-03", "dflash", ENTRY) == path
    assert json.loads(path.read_text()) == {"sparkfleet_profile": "dense", "sparkfleet_tuned": {"dflash": ENTRY}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("$ANSIBLE_VAULT;1.1;AES256\n6162\n", "encrypted with Ansible Vault"),
        ("sparkfleet_tuned: &t\n  dense: {num_speculative_tokens: 6}\nother: *t\n", "an anchor or alias"),
        ("- a list\n", "not a mapping of variables"),
        ("sparkfleet_tuned: 3\n", "not a mapping of profile"),
        ("key: [unclosed\n", "is not YAML"),
    ],
)
def test_a_file_that_cannot_be_edited_safely_is_left_as_it_is(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "host_vars" / "spark-04.yml"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(tune.TuneError, match=message) as info:
        tune.write_tuned(tmp_path, "spark-04", "dflash", ENTRY)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert path.read_text() == text


# -- the profile layer ---------------------------------------------------------------------------

PROFILES = {
    "dflash": {
        "target": "t",
        "drafter": "d",
        "speculative": {"method": "dflash", "num_speculative_tokens": 12},
        "serve_args": {},
        "health": {"min_acceptance_length": 6.0},
    },
    "base": {"target": "t", "speculative": None, "serve_args": {}},
}


def test_a_tuned_host_serves_its_n_with_a_gate_scaled_to_it() -> None:
    resolved = profiles.resolve(PROFILES, "dflash", tuned={"dflash": {"num_speculative_tokens": 6, "workload": "code"}})
    assert resolved["speculative"] == {"method": "dflash", "num_speculative_tokens": 6}
    # (6.0 - 1) / 12 accepted per drafted position, at n=6
    assert resolved["health"]["min_acceptance_length"] == 3.5
    untouched = profiles.resolve(PROFILES, "dflash", tuned={"dense": {"num_speculative_tokens": 4}})
    assert (
        untouched["speculative"]["num_speculative_tokens"] == 12 and untouched["health"]["min_acceptance_length"] == 6
    )
    back = profiles.with_speculative_tokens(resolved, 12)
    assert back["health"]["min_acceptance_length"] == 6.0


@pytest.mark.parametrize(
    ("tuned", "message"),
    [
        ({"dflash": {"num_speculative_tokens": 0}}, "sparkfleet_tuned.dflash.num_speculative_tokens is 0"),
        ({"dflash": {"num_speculative_tokens": "8"}}, "sparkfleet_tuned.dflash.num_speculative_tokens is '8'"),
        ({"dflash": {"workload": "code"}}, "it needs num_speculative_tokens"),
        ({"base": {"num_speculative_tokens": 4}}, "profile 'base' does not speculate"),
        ([4], "sparkfleet_tuned is [4]"),
    ],
)
def test_a_bad_tuned_entry_is_refused_naming_it(tuned: Any, message: str) -> None:
    name = "base" if isinstance(tuned, dict) and "base" in tuned else "dflash"
    with pytest.raises(profiles.ProfileError) as info:
        profiles.resolve(PROFILES, name, tuned=tuned)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_tune_command_is_registered() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sparkfleet", "tune", "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "candidates" in out.stdout and "finish" in out.stdout and "record" in out.stdout


def test_the_report_shows_each_tuning(tmp_path: Path) -> None:
    """`make report` renders results/tune/<host>/*-tune-*.json: the table and the chart; the decode runs
    of a tune (each at another n than the profile's) stay out of the profile's sections."""
    from sparkfleet.fleet import report

    results = tmp_path / "results"
    runs = []
    for n, tok_s in ((4, 41.0), (8, 47.5)):
        result = decode_result("code", tok_s, tok_s, 1 + n / 3)
        runs.append({"n": n, "result": result})
    host_dir = results / "tune" / "spark-01"
    host_dir.mkdir(parents=True)
    (host_dir / "20261203T160448Z-decode.json").write_text(json.dumps(runs[0]["result"]))  # a tune's decode run
    measurements = tmp_path / "m.json"
    measurements.write_text(json.dumps({"runs": runs, "refused": [{"n": 16, "reason": "the step budget"}]}))
    args = tune.argparse.Namespace(
        measurements=str(measurements), host="spark-01", profile="dflash", workload="code", out_dir=str(host_dir)
    )
    assert tune._finish(args) == 0
    out = tmp_path / "report.md"
    (results / "spark-02").mkdir()
    written = report.build_report(results, out)
    written.write()
    text = out.read_text()
    assert "## Tuning num_speculative_tokens (make tune)" in text and "### spark-01 / dflash on code" in text
    assert "|  8 | 47.5 | client | 3.67 |" in text and "BEST" in text and "refused: the step budget" in text
    assert any(p.name.startswith("tune-spark-01-dflash-code") for p in written.plots)
    # the tune's decode run is neither a profile run nor a skipped file
    assert "spark-01 / dflash" not in text.split("## Tuning")[0] and "Skipped files" not in text
