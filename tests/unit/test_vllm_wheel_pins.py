"""vllm_wheel's converged-venv check (`__vllm_wheel_pins_check`): exit 0 only when every pin is installed
at its version, so that a matching venv skips pip and anything else goes to pip as before."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = yaml.safe_load((ROOT / "roles/vllm_wheel/vars/main.yml").read_text())["__vllm_wheel_pins_check"]
PYYAML = version("pyyaml")


def check(*pins: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, *pins], capture_output=True, text=True, check=False)


def test_installed_pins_match() -> None:
    result = check(f"pyyaml=={PYYAML}", f"Jinja2=={version('jinja2')}")  # names match as pip's do
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "all pins installed"


@pytest.mark.parametrize(
    ("pin", "says"),
    [
        ("pyyaml==0.0.1", f"pyyaml: {PYYAML}, pinned 0.0.1"),
        ("no-such-dist-sparkfleet==1.0", "no-such-dist-sparkfleet: missing, pinned 1.0"),
        (f"pyyaml=={PYYAML}+cpu", f"pyyaml: {PYYAML}, pinned {PYYAML}+cpu"),  # a local label must match exactly
        ("pyyaml>=1", "pyyaml>=1: not an exact pin, left to pip"),
    ],
)
def test_any_other_pin_goes_to_pip_and_is_named(pin: str, says: str) -> None:
    result = check(f"jinja2=={version('jinja2')}", pin)
    assert result.returncode == 3
    assert says in result.stdout and "jinja2" not in result.stdout


def test_a_pin_without_a_local_label_matches_a_local_build(tmp_path: Path) -> None:
    """torch==2.11.0 is satisfied by torch 2.11.0+cpu, as pip's == is."""
    dist = tmp_path / "fake_torch-2.11.0+cpu.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-torch\nVersion: 2.11.0+cpu\n")
    env_path = {"PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, "fake-torch==2.11.0", "fake-torch==2.11.0+cpu"],
        capture_output=True,
        text=True,
        check=False,
        env=env_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    off = subprocess.run(
        [sys.executable, "-c", SCRIPT, "fake-torch==2.11.1"], capture_output=True, text=True, check=False, env=env_path
    )
    assert off.returncode == 3 and "fake-torch: 2.11.0+cpu, pinned 2.11.1" in off.stdout


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_the_pins_of_a_lock_are_its_name_version_lines_as_ansible_renders_them(tmp_path: Path, flavor: str) -> None:
    """The role's pins from a hash-pinned lock (each NAME==VERSION line continues with `\\` and its hash)."""
    from sparkfleet.build import wheelhouse

    spec = wheelhouse.FLAVORS[flavor]
    play = tmp_path / "pins.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars": {"vllm_wheel_lock": str(spec.lock)},
                    "tasks": [
                        {"ansible.builtin.include_vars": str(ROOT / "roles/vllm_wheel/vars/main.yml")},
                        {"ansible.builtin.copy": {"content": "{{ __vllm_wheel_lock_pins | to_json }}",
                                                  "dest": str(tmp_path / "pins.json")}},
                    ],
                }
            ]
        )
    )  # fmt: skip
    run = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    pins = yaml.safe_load((tmp_path / "pins.json").read_text())
    lock = wheelhouse.load_lock(spec.lock)
    assert pins == [f"{name}=={version}" for name, (version, _) in lock.items()]
