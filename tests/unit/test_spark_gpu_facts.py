"""Unit tests of library/spark_gpu_facts.py: parsing recorded nvidia-smi outputs (GB10, H100, H200,
RTX 4090), a missing or broken nvidia-smi, garbage output, and the module end to end against the
sandbox's nvidia-smi test double (tests/sandbox/nvidia-smi)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia_smi"
STAND_IN = REPO / "tests" / "sandbox" / "nvidia-smi"


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spark_gpu_facts", REPO / "library" / "spark_gpu_facts.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["spark_gpu_facts"] = module
    spec.loader.exec_module(module)
    return module


facts = _load_module()


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def fake_runner(query: tuple[int, str, str], plain: tuple[int, str, str] = (0, "", "")):
    """A run(argv) that answers the query and the plain call from recorded outputs."""
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return query if any(arg.startswith("--query-gpu=") for arg in argv) else plain

    run.calls = calls  # type: ignore[attr-defined]
    return run


def gpu_from(query_file: str, plain_file: str | None = None, gpu_index: int = 0) -> dict[str, Any]:
    plain = (0, fixture(plain_file), "") if plain_file else (0, "", "")
    return facts.read_gpu(
        "/usr/bin/nvidia-smi", "nvidia-smi", fake_runner((0, fixture(query_file), ""), plain), gpu_index
    )


# --- recorded outputs ---------------------------------------------------------------------------


def test_gb10_unified_memory_reads_as_none_not_zero() -> None:
    gpu = gpu_from("gb10_query.csv", "gb10_plain.txt")
    assert gpu["present"] is True
    assert gpu["name"] == "NVIDIA GB10"
    assert gpu["compute_cap"] == "12.1"
    assert gpu["driver_version"] == "580.95.05"
    assert gpu["driver_branch"] == "580"
    assert gpu["cuda_version"] == "13.0"
    assert gpu["count"] == 1
    assert gpu["memory_total_mib"] is None
    assert gpu["memory_free_mib"] is None
    assert gpu["unified_memory"] is True
    assert gpu["persistence_mode"] == "Enabled"
    assert gpu["clocks"]["max_graphics_mhz"] == 3003
    assert gpu["clocks"]["memory_mhz"] is None
    assert gpu["unavailable_fields"]["memory.total"] == "[N/A]"
    assert gpu["pci_bus_id"] == "0000000F:01:00.0"


def test_gb10_not_supported_marker_is_also_unified() -> None:
    gpu = gpu_from("gb10_not_supported_query.csv")
    assert gpu["unified_memory"] is True
    assert gpu["memory_total_mib"] is None
    assert gpu["unavailable_fields"]["memory.used"] == "[Not Supported]"
    assert gpu["driver_branch"] == "580"
    assert gpu["persistence_mode"] == "Disabled"
    assert gpu["cuda_version"] is None  # no plain output given


def test_gb10_on_590_reports_the_590_branch() -> None:
    gpu = gpu_from("gb10_590_query.csv", "gb10_590_plain.txt")
    assert (gpu["driver_branch"], gpu["cuda_version"]) == ("590", "13.1")


def test_h100_x86_has_dedicated_memory() -> None:
    gpu = gpu_from("h100_query.csv", "h100_plain.txt")
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["compute_cap"] == "9.0"
    assert gpu["cuda_version"] == "12.4"
    assert gpu["memory_total_mib"] == 81559
    assert gpu["memory_free_mib"] == 81079
    assert gpu["unified_memory"] is False
    assert gpu["unavailable_fields"] == {}


def test_h200_eight_gpus_select_by_index() -> None:
    gpu = gpu_from("h200_query.csv", gpu_index=5)
    assert gpu["count"] == 8
    assert gpu["index"] == 5
    assert gpu["uuid"].endswith("15")
    assert gpu["memory_total_mib"] == 143771
    assert gpu["driver_branch"] == "570"


def test_h200_unknown_index_names_the_listed_ones() -> None:
    with pytest.raises(facts.GpuOutputError, match=r"gpu_index 9 is not among .*0, 1, 2, 3, 4, 5, 6, 7"):
        gpu_from("h200_query.csv", gpu_index=9)


def test_rtx_4090() -> None:
    gpu = gpu_from("rtx4090_query.csv", "rtx4090_plain.txt")
    assert (gpu["name"], gpu["compute_cap"], gpu["cuda_version"]) == (
        "NVIDIA GeForce RTX 4090",
        "8.9",
        "12.6",
    )
    assert gpu["persistence_mode"] == "Disabled"
    assert gpu["clocks"]["max_memory_mhz"] == 10501


def test_query_is_an_argument_list_with_the_csv_format() -> None:
    run = fake_runner((0, fixture("gb10_query.csv"), ""), (0, fixture("gb10_plain.txt"), ""))
    facts.read_gpu("/usr/bin/nvidia-smi", "nvidia-smi", run, 0)
    query, plain = run.calls
    assert query == [
        "/usr/bin/nvidia-smi",
        "--query-gpu=" + ",".join(facts.QUERY_FIELDS),
        "--format=csv,noheader,nounits",
    ]
    assert plain == ["/usr/bin/nvidia-smi"]


# --- missing, broken, garbage -------------------------------------------------------------------


def test_missing_nvidia_smi_is_a_fact_with_the_fix() -> None:
    gpu = facts.read_gpu(None, "nvidia-smi", fake_runner((0, "", "")), 0)
    assert gpu["present"] is False
    assert "not found" in gpu["error"]
    assert "nvidia_driver_manage: true" in gpu["error"]
    assert set(facts.GPU_FACT_KEYS) <= set(gpu)  # same shape as a present GPU
    assert gpu["driver_branch"] is None


def test_driver_not_loaded_reports_the_message_and_rc() -> None:
    gpu = facts.read_gpu("/usr/bin/nvidia-smi", "nvidia-smi", fake_runner((9, fixture("no_driver.txt"), "")), 0)
    assert gpu["present"] is False
    assert "exited 9" in gpu["error"]
    assert "couldn't communicate with the NVIDIA driver" in gpu["error"]


def test_no_gpu_listed() -> None:
    gpu = facts.read_gpu("/usr/bin/nvidia-smi", "nvidia-smi", fake_runner((0, "\n", "")), 0)
    assert gpu["present"] is False
    assert "lists no GPU" in gpu["error"]


def test_garbage_output_raises_and_quotes_it() -> None:
    with pytest.raises(facts.GpuOutputError, match=r"row 1 has 1 fields, expected 16.*502 Bad Gateway"):
        gpu_from("garbage_query.txt")


def test_text_in_a_number_field_names_the_field_and_value() -> None:
    with pytest.raises(facts.GpuOutputError, match=r"memory.total is not a number: '80GB'"):
        gpu_from("bad_number_query.csv")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("driver_version", "unknown", "driver_version 'unknown'"),
        ("compute_cap", "sm121", "compute_cap 'sm121'"),
    ],
)
def test_malformed_versions_are_refused(field: str, value: str, message: str) -> None:
    row = fixture("gb10_query.csv").strip().split(", ")
    row[facts.QUERY_FIELDS.index(field)] = value
    with pytest.raises(facts.GpuOutputError, match=message):
        facts.parse_gpu_query(", ".join(row))


def test_cuda_version_absent_from_unrelated_text() -> None:
    assert facts.parse_cuda_version(fixture("no_driver.txt")) is None
    assert facts.parse_cuda_version("| CUDA Version: 13.0 |") == "13.0"


# --- system facts -------------------------------------------------------------------------------


MEMINFO_GB10 = "MemTotal:       125514308 kB\nMemFree:        110000000 kB\nMemAvailable:   118000000 kB\nSwapTotal:      16777212 kB\n"  # noqa: E501


def test_meminfo_in_bytes() -> None:
    values = facts.parse_meminfo(MEMINFO_GB10)
    assert values["MemTotal"] == 125514308 * 1024
    assert values["SwapTotal"] == 16777212 * 1024


def test_meminfo_without_memtotal_is_an_error() -> None:
    with pytest.raises(ValueError, match="no MemTotal"):
        facts.parse_meminfo("garbage\n")


def test_os_release_quotes_removed() -> None:
    text = 'PRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu\nVERSION_ID="24.04"\nVERSION_CODENAME=noble\n# c\n'
    assert facts.parse_os_release(text) == {
        "pretty_name": "Ubuntu 24.04.3 LTS",
        "id": "ubuntu",
        "version_id": "24.04",
        "version_codename": "noble",
    }


def test_nearest_existing_path(tmp_path: Path) -> None:
    assert facts.nearest_existing_path(str(tmp_path / "a" / "b" / "c")) == str(tmp_path)
    assert facts.nearest_existing_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="must be absolute, got 'relative/hf'"):
        facts.nearest_existing_path("relative/hf")


def test_directory_usage_counts_hard_links_once_and_skips_symlink_targets(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_bytes(b"x" * 1_000_000)
    os.link(blob, tmp_path / "hardlink")
    (tmp_path / "link").symlink_to(blob)
    once = os.stat(blob).st_blocks * 512
    used = facts.directory_usage_bytes(str(tmp_path))
    assert once <= used < 2 * once


def test_system_facts_measure_the_nearest_parent(tmp_path: Path) -> None:
    system = facts.system_facts(
        MEMINFO_GB10, "ID=ubuntu\nVERSION_ID=24.04\n", "aarch64", str(tmp_path / "hf" / "hub"), True
    )
    stat = os.statvfs(tmp_path)
    assert system["architecture"] == "aarch64"
    assert system["memory_total_gib"] == round(125514308 / 1024 / 1024, 2)
    assert system["os"]["id"] == "ubuntu"
    assert system["cache_path_measured"] == str(tmp_path)
    assert system["cache_path_exists"] is False
    assert system["cache_used_gib"] == 0.0
    assert abs(system["disk_free_gib"] - stat.f_bavail * stat.f_frsize / 1024**3) < 0.5


def test_system_facts_without_cache_path_have_no_disk_keys() -> None:
    system = facts.system_facts(MEMINFO_GB10, "", "x86_64", None, True)
    assert "disk_free_gib" not in system
    assert system["os"]["id"] is None


def test_clock_lock_record() -> None:
    assert facts.parse_clock_lock("200,2400\n") == {"min_mhz": 200, "max_mhz": 2400}
    assert facts.parse_clock_lock("") is None
    assert facts.parse_clock_lock("fast") is None


# --- the module end to end, against the sandbox's nvidia-smi test double ------------------------


def run_module(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: dict[str, Any],
    check_mode: bool = False,
) -> dict[str, Any]:
    from ansible.module_utils import basic

    payload = {"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check_mode}}
    monkeypatch.setattr(basic, "_ANSIBLE_ARGS", json.dumps(payload).encode())
    monkeypatch.setattr(basic, "_ANSIBLE_PROFILE", "legacy", raising=False)
    with pytest.raises(SystemExit):
        facts.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def stand_in_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test double's state file, in a temporary directory; returns its path."""
    state = tmp_path / "gpu.json"
    monkeypatch.setenv("SPARKFLEET_TEST_GPU_JSON", str(state))
    return state


def test_module_gathers_gb10_facts_from_the_stand_in(
    stand_in_gpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "clock-lock"
    lock.write_text("200,2400\n")
    result = run_module(
        monkeypatch,
        capsys,
        {
            "nvidia_smi": str(STAND_IN),
            "cache_path": str(tmp_path / "cache"),
            "clock_lock_state_path": str(lock),
        },
    )
    assert result.get("failed") is not True, result
    assert result["changed"] is False
    gpu = result["ansible_facts"]["spark_gpu"]
    system = result["ansible_facts"]["spark_system"]
    # the double and the hand-written GB10 recording agree on everything a preflight reads
    recorded = gpu_from("gb10_query.csv", "gb10_plain.txt")
    for key in ("name", "compute_cap", "driver_version", "driver_branch", "cuda_version", "unified_memory"):
        assert gpu[key] == recorded[key], key
    assert gpu["usable_memory_gib"] == system["memory_total_gib"] > 0
    assert gpu["clock_lock"] == {"min_mhz": 200, "max_mhz": 2400}
    assert system["cache_path_measured"] == str(tmp_path)


def test_module_in_check_mode_reports_the_same(
    stand_in_gpu: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in_gpu.write_text(
        json.dumps(
            {
                "driver_version": "590.44.01",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_mib": 81559,
                "memory_used_mib": 0,
            }
        )
    )
    result = run_module(monkeypatch, capsys, {"nvidia_smi": str(STAND_IN)}, check_mode=True)
    gpu = result["ansible_facts"]["spark_gpu"]
    assert (gpu["driver_branch"], gpu["name"], gpu["unified_memory"]) == (
        "590",
        "NVIDIA H100 80GB HBM3",
        False,
    )
    assert gpu["usable_memory_gib"] == round(81559 / 1024, 2)
    assert gpu["clock_lock"] is None


def test_module_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_module(monkeypatch, capsys, {"nvidia_smi": "nvidia-smi-that-does-not-exist"})
    assert result.get("failed") is not True
    gpu = result["ansible_facts"]["spark_gpu"]
    assert gpu["present"] is False
    assert "'nvidia-smi-that-does-not-exist' is not in PATH" in gpu["error"]


def test_module_fails_on_garbage_quoting_it(
    stand_in_gpu: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in_gpu.write_text(json.dumps({"query_output": "Segmentation fault\n"}))
    result = run_module(monkeypatch, capsys, {"nvidia_smi": str(STAND_IN)})
    assert result["failed"] is True
    assert "expected 16" in result["msg"] and "Segmentation fault" in result["msg"]


def test_module_reports_a_driver_that_is_not_loaded(
    stand_in_gpu: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in_gpu.write_text(json.dumps({"fail": {"rc": 9, "message": fixture("no_driver.txt")}}))
    result = run_module(monkeypatch, capsys, {"nvidia_smi": str(STAND_IN)})
    gpu = result["ansible_facts"]["spark_gpu"]
    assert gpu["present"] is False and "exited 9" in gpu["error"]


# --- the test double's own contract -------------------------------------------------------------


def stand_in(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(STAND_IN), *argv], capture_output=True, text=True, check=False)


def test_stand_in_records_persistence_and_clock_lock(stand_in_gpu: Path) -> None:
    stand_in_gpu.write_text(json.dumps({"persistence_mode": "Disabled"}))
    if os.geteuid() != 0:
        pytest.skip("-pm and -lgc need root, as on a real host")
    assert stand_in("-pm", "1").returncode == 0
    assert stand_in("-lgc", "200,2400").returncode == 0
    state = json.loads(stand_in_gpu.read_text())
    assert state["persistence_mode"] == "Enabled"
    assert state["locked_clocks"] == [200, 2400]
    assert state["calls"] == [["nvidia-smi", "-pm", "1"], ["nvidia-smi", "-lgc", "200,2400"]]
    query = stand_in("--query-gpu=persistence_mode", "--format=csv,noheader")
    assert query.stdout.strip() == "Enabled"
    assert stand_in("-rgc").returncode == 0
    assert json.loads(stand_in_gpu.read_text())["locked_clocks"] is None


def test_stand_in_refuses_what_it_does_not_implement(stand_in_gpu: Path) -> None:
    assert stand_in("-q").returncode == 2
    assert stand_in("-lgc", "2400,200").returncode == 2
    bad_field = stand_in("--query-gpu=temperature.gpu", "--format=csv")
    assert bad_field.returncode == 2 and 'Field "temperature.gpu" is not a valid field' in bad_field.stdout
