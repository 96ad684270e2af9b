"""Make variables that reach a shell are one quoted word each: an operator's value cannot run code.

`make deploy 'PROFILE=dflash; touch /tmp/x #'` used to run `touch` (PROFILE reached the shell
unquoted). Every value an operator types now goes through the Makefile's sh_quote and is taken as
text, `$(...)` included, so a hostile value is refused as what it is: an unknown profile.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "template",
    [
        "dflash; touch {marker} #",
        "dflash && touch {marker}",
        "$(touch {marker})",
        "`touch {marker}`",
        "dflash' ; touch {marker} ; echo '",
    ],
)
def test_a_hostile_profile_is_refused_by_name_and_runs_nothing(tmp_path: Path, template: str) -> None:
    marker = tmp_path / "ran"
    value = template.format(marker=marker)
    result = make("check-profile", f"PROFILE={value}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "sparkfleet: unknown profile" in result.stderr and "valid profiles are" in result.stderr
    assert not marker.exists(), f"{value!r} ran a command"


def test_make_syntax_in_a_value_is_text(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = make("-n", "deploy", f"PROFILE=x$(shell touch {marker})", f"LIMIT=a$(shell touch {marker})")
    assert not marker.exists()
    assert f"sparkfleet_profile='x$(shell touch {marker})'" in result.stdout
    assert f"--limit 'a$(shell touch {marker})'" in result.stdout


def test_every_variable_an_operator_sets_is_quoted_in_the_commands() -> None:
    result = make(
        "-n", "rolling", "PROFILE=dense", "INVENTORY=inventory/x y", "LIMIT=spark-01", "SERIAL=25%", "ROLL_BENCH=decode"
    )
    assert result.returncode == 0, result.stderr
    playbook = next(line for line in result.stdout.splitlines() if "playbooks/rolling.yml" in line)
    for quoted in ("-i 'inventory/x y'", "--limit 'spark-01'", "sparkfleet_profile='dense'", "serial='25%'"):
        assert quoted in playbook, (quoted, playbook)
    assert "sparkfleet_rolling_bench_methods='decode'" in result.stdout
    logs = make("-n", "logs", "LINES=5; id", "LIMIT=h").stdout
    assert "--lines '5; id'" in logs and "-l 'h'" in logs


TUNE_REFUSAL = {"WORKLOAD": "is not a workload", "RANGE": "is not a range"}


@pytest.mark.parametrize(
    ("variable", "template"),
    [
        *(("WORKLOAD", value) for value in ("code; touch {marker}", "{{{{ lookup('pipe', 'touch {marker}') }}}}", "")),
        *(("RANGE", value) for value in ("4-8 $(touch {marker})", "4,8'; touch {marker}; '")),
    ],
)
def test_make_tune_refuses_a_hostile_workload_or_range_and_runs_nothing(
    tmp_path: Path, variable: str, template: str
) -> None:
    """WORKLOAD and RANGE reach ansible-playbook as extra vars, which Ansible templates: anything but a
    workload name or a range is refused before a playbook runs (a Jinja expression included)."""
    message = TUNE_REFUSAL[variable]
    marker = tmp_path / "ran"
    values = {"WORKLOAD": "code", "RANGE": "4-16:2", variable: template.format(marker=marker)}
    result = make("tune", "PROFILE=dflash", *(f"{k}={v}" for k, v in values.items()))
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[0]
    assert line.startswith(f"make tune: {variable}=") and message in line, result.stderr
    assert "ansible-playbook" not in result.stdout
    assert not marker.exists()
