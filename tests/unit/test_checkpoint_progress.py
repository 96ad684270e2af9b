"""The checkpoint build's progress (issue 15 point 5): the builder keeps one line in ``--progress-file``
while it runs (what it does, then shards, tensors and bytes written of the total, and its rate), and
model_cache runs each build as an async job while a poll prints that line (files/bin/sparkfleet-job-progress)
for the sparkfleet_progress callback to show. The builder's stdout JSON (``changed``) stays as it was.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.build.checkpoint import BuildOptions, BuildProgress, LocalDonor, _human, build_hybrid
from sparkfleet.cli import main as cli_main
from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint
from tests.unit.helpers import needs_ansible_playbook, run_playbook, write_hosts, write_play

REVISION = "0123456789abcdef0123456789abcdef01234567"
LINE = re.compile(r"(\d+)/(\d+) shards, (\d+) of (\d+) tensors, (.+) of (.+) written, .+/s")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An INT4 base with BF16 shared experts ("none") and an FP8 release to take them from ("block")."""
    root = tmp_path_factory.mktemp("ckpts")
    return {form: write_hybrid_fp8_checkpoint(root / form, fp8_scales=form).path for form in ("none", "block")}


def test_the_line_counts_the_tensors_and_bytes_of_the_shard_being_written(tmp_path: Path) -> None:
    progress = BuildProgress(None)
    assert progress.line() == "starting"
    progress.say("planning: reading the base")
    assert progress.line() == "planning: reading the base"
    progress.plan([(100, [40, 80, 100]), (50, [50])])  # two output shards: bytes, tensor end offsets
    assert LINE.fullmatch(progress.line()).groups()[:6] == ("0", "2", "0", "4", "0 B", "150 B")
    partial = tmp_path / "model-1.safetensors.partial"
    partial.write_bytes(b"x" * 85)  # two tensors and part of the third
    progress.writing(1, partial)
    assert LINE.fullmatch(progress.line()).groups()[:6] == ("0", "2", "2", "4", "85 B", "150 B")
    partial.rename(tmp_path / "model-1.safetensors")  # complete, not yet reported
    assert LINE.fullmatch(progress.line()).groups()[:6] == ("0", "2", "3", "4", "100 B", "150 B")
    progress.written(1)
    progress.writing(2, tmp_path / "model-2.safetensors.partial")  # not opened yet
    assert LINE.fullmatch(progress.line()).groups()[:6] == ("1", "2", "3", "4", "100 B", "150 B")
    progress.written(2)
    assert LINE.fullmatch(progress.line()).groups()[:6] == ("2", "2", "4", "4", "150 B", "150 B")


def test_a_build_keeps_its_line_in_the_file_while_it_runs_and_removes_it(
    tmp_path: Path, ckpts: dict[str, Path]
) -> None:
    path = tmp_path / "built" / "hybrid.progress"
    seen: list[str] = []  # the file as each log line is written (after each shard, the shard's line)
    donor = LocalDonor(ckpts["block"])
    options = BuildOptions(base=ckpts["none"], out=tmp_path / "hybrid", donor=donor, error_report=False)
    with BuildProgress(path, interval=0.05) as progress:
        manifest = build_hybrid(options, log=lambda _line: seen.append(path.read_text().strip()), progress=progress)
    assert not path.exists() and not list(path.parent.iterdir()), "the progress file outlived the build"
    assert seen[0].startswith("planning: reading the base none and fetching the tensors it needs of donor ")
    shards = manifest["output_shards"]
    tensors = sum(shard["tensors"] for shard in shards)
    lines = [LINE.fullmatch(text) for text in seen[1 : 1 + len(shards)]]  # then the summary: the same line
    assert all(lines), seen
    assert [m.groups()[:4] for m in lines] == [
        (str(n), str(len(shards)), str(sum(s["tensors"] for s in shards[:n])), str(tensors))
        for n in range(1, len(shards) + 1)
    ], seen
    assert lines[-1][5] == lines[-1][6] == _human(manifest["bytes_written"])


def test_the_cli_keeps_its_json_and_leaves_no_progress_file(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    progress = tmp_path / "out.progress"
    argv = ["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(tmp_path / "out"), "--donor",
            str(ckpts["block"]), "--no-error-report", "--json", "--progress-file", str(progress)]  # fmt: skip
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is True
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is False
    assert not progress.exists()


# ---------------------------------------------------------------------------------------------- the role


def run_builds(tmp_path: Path, models: list[dict], **role_vars: object) -> subprocess.CompletedProcess[str]:
    """model_cache's build_one.yml for each model (as build.yml includes it) on this machine, then the
    names and changed flags of what __model_cache_built collected."""
    tasks = [
        {"ansible.builtin.set_fact": {"__model_cache_built": {"results": []}}},
        {
            "ansible.builtin.include_role": {"name": "model_cache", "tasks_from": "build_one.yml"},
            "loop": models,
            "loop_control": {"label": "{{ item.name }}"},
        },
        {
            "ansible.builtin.debug": {
                "msg": "built: {{ __model_cache_built.results | map(attribute='item.name') | join(',') }} "
                "changed {{ __model_cache_built.results | map(attribute='changed') | join(',') }}"
            }
        },
    ]
    extra = tmp_path / "vars.json"
    extra.write_text(json.dumps({"model_cache_hub_seed_dir": str(tmp_path / "seed"), **role_vars}))
    hosts = write_hosts(tmp_path / "inventory")
    proc = run_playbook(hosts, write_play(tmp_path / "play.yml", tasks), "-e", f"@{extra}")
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    return proc


# A build that takes 10 s and keeps a line in its progress file meanwhile, then answers as the builder does.
SLOW_BUILD = """
import json, pathlib, sys, time
progress = pathlib.Path(sys.argv[1])
progress.parent.mkdir(parents=True, exist_ok=True)
progress.write_text("2/4 shards, 10 of 20 tensors, 1.0 MiB of 2.0 MiB written, 1.0 MiB/s\\n")
time.sleep(10 if sys.argv[2] == "ok" else 0)
progress.unlink()
if sys.argv[2] == "fail":
    print("error: base /nowhere has no config.json; pass the INT4 base checkpoint directory", file=sys.stderr)
    sys.exit(2)
print(json.dumps({"changed": True}))
"""
FAKE = {"name": "fake", "build": "hybrid-fp8", "base": {"repo": "org/base", "revision": REVISION}}


@needs_ansible_playbook
def test_the_role_shows_the_builds_progress_while_it_runs(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", SLOW_BUILD, "{{ __model_cache_build_progress }}", "{{ item.outcome }}"]
    ok = run_builds(
        tmp_path, [{**FAKE, "outcome": "ok"}], __model_cache_build_argv=argv, model_cache_progress_interval=1
    )
    assert ok.returncode == 0, ok.stdout[-3000:]
    shown = [line.strip() for line in ok.stdout.splitlines() if line.strip().startswith("[spark-x] checkpoint ")]
    assert len(shown) >= 2, ok.stdout[-3000:]  # a line a second or two for 10 s
    for line in shown:
        assert re.fullmatch(r"\[spark-x\] checkpoint fake, \d+ s: 2/4 shards, 10 of 20 tensors, .+", line), line
    assert "built: fake changed True" in ok.stdout

    failed = run_builds(tmp_path, [{**FAKE, "outcome": "fail"}], __model_cache_build_argv=argv)
    assert failed.returncode != 0
    assert "error: base /nowhere has no config.json; pass the INT4 base checkpoint directory" in failed.stdout


@needs_ansible_playbook
def test_the_role_builds_with_the_real_builder_once(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    snapshot = tmp_path / "seed" / "models--org--base" / "snapshots" / REVISION
    shutil.copytree(ckpts["none"], snapshot)
    model = {**FAKE, "name": "hybrid", "donor": {"repo": str(ckpts["block"]), "revision": REVISION}}
    first = run_builds(tmp_path, [model])
    assert first.returncode == 0, first.stdout[-3000:]
    assert "built: hybrid changed True" in first.stdout
    (built,) = (tmp_path / "seed" / "built").iterdir()  # the build, and no progress file beside it
    assert built.name.startswith("hybrid@") and (built / "sparkfleet-checkpoint.json").is_file()
    again = run_builds(tmp_path, [model])
    assert again.returncode == 0 and "built: hybrid changed False" in again.stdout, again.stdout[-3000:]
