"""sparkfleet.build.cuda_arch: the wheel's CUDA code, listed by NVIDIA's real cuobjdump, judged against a GPU.

The fixtures (tests/fixtures/cuda/*.o, built by build.sh with nvcc from arch_probe.cu) hold one
kernel compiled for chosen architectures; a test wheel places them where vLLM's binaries sit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sparkfleet.build import cuda_arch as ca

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cuda"


def make_wheel(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, fixture in members.items():
            wheel.write(FIXTURES / fixture, name)
        wheel.writestr("vllm/__init__.py", "")
    return path


PYPI_LIKE = {  # what PyPI's vllm-0.23.0 aarch64 wheel carries, in kind (docs/gpu-wheel-cuda.md)
    "vllm/_C.abi3.so": "sm90-sm120.o",
    "vllm/_moe_C.abi3.so": "sm90-sm120.o",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "sm80-ptx80.o",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "sm90a.o",
    "vllm/_cpu_helper.abi3.so": "host-only.o",
}


def test_the_controller_venv_has_nvidia_s_cuobjdump() -> None:
    tool = ca.cuobjdump()
    assert ca.tool_version(tool).startswith("cuobjdump 13."), tool


def test_scan_lists_each_binary_s_sass_and_ptx_with_the_real_cuobjdump(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "vllm.whl", PYPI_LIKE | {"vllm/sm121.so.1": "sm121.o"})
    cuda = ca.scan_wheel(wheel)
    assert cuda["binaries"] == {
        "vllm/_C.abi3.so": {"sass": ["sm_90", "sm_120"], "ptx": []},
        "vllm/_moe_C.abi3.so": {"sass": ["sm_90", "sm_120"], "ptx": []},
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": {"sass": ["sm_80"], "ptx": ["compute_80"]},
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": {"sass": ["sm_90a"], "ptx": []},
        "vllm/sm121.so.1": {"sass": ["sm_121"], "ptx": []},
    }  # the host-only library has no device code and is not listed
    assert cuda["required"] == list(ca.REQUIRED_BINARIES)
    assert cuda["tool"].startswith("cuobjdump 13.")


def test_a_pypi_like_wheel_runs_on_the_gb10_with_fa2_jit_compiled(tmp_path: Path) -> None:
    cuda = ca.scan_wheel(make_wheel(tmp_path / "vllm.whl", PYPI_LIKE))
    result = ca.check(cuda, "12.1")
    assert result == {
        "ok": True,
        "checked": True,
        "native": ["vllm/_C.abi3.so (sm_120)", "vllm/_moe_C.abi3.so (sm_120)"],
        "jit": ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (compute_80)"],
        "none": ["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (sm_90a)"],  # Hopper-only, not required
        "reason": "",
    }


def test_a_hopper_only_build_is_refused_on_the_gb10_naming_the_binary_and_its_code(tmp_path: Path) -> None:
    cuda = ca.scan_wheel(make_wheel(tmp_path / "vllm.whl", PYPI_LIKE | {"vllm/_C.abi3.so": "sm90a.o"}))
    result = ca.check(cuda, "12.1")
    assert result["ok"] is False
    assert result["reason"] == "vllm/_C.abi3.so has only sm_90a"
    # ... which the same wheel does not say of an H200
    assert ca.check(cuda, "9.0")["ok"] is True


def test_a_wheel_with_no_code_for_the_gpu_anywhere_is_refused(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "vllm.whl", {"vllm/custom_ops.so": "sm120a-ptx121a.o", "vllm/extra.so": "sm90a.o"})
    assert ca.check(ca.scan_wheel(wheel), "12.0")["ok"] is True  # sm_120a is 12.0's own
    refused = ca.check(ca.scan_wheel(wheel), "10.0")
    assert refused["ok"] is False
    assert refused["reason"] == "no binary of the wheel has code for compute capability 10.0"


def test_a_cpu_wheel_has_nothing_to_check() -> None:
    for cuda in (None, {}, {"binaries": {}}):
        assert ca.check(cuda, "12.1")["checked"] is False and ca.check(cuda, "12.1")["ok"] is True


@pytest.mark.parametrize(
    ("code", "capability", "runs"),
    [
        ("sm_120", "12.1", True),  # a 12.0 cubin runs on 12.1
        ("sm_121", "12.1", True),
        ("sm_121", "12.0", False),  # never on an older minor
        ("sm_120a", "12.1", False),  # architecture-specific: 12.0 only
        ("sm_121a", "12.1", True),
        ("sm_120f", "12.1", True),  # the family runs on newer minors
        ("sm_100", "12.1", False),  # another major
        ("sm_90", "9.0", True),
        ("sm_90a", "9.0", True),
        ("sm_80", "8.9", True),
        ("sm_89", "8.0", False),
        ("compute_80", "12.1", True),  # PTX JIT-compiles for any newer GPU
        ("compute_120", "12.1", True),
        ("compute_121", "12.0", False),  # never for an older one
        ("compute_121a", "12.1", True),
        ("compute_120a", "12.1", False),
        ("compute_120f", "12.1", True),
        ("compute_100f", "12.1", False),
        ("compute_90", "10.0", True),
    ],
)
def test_sass_and_ptx_run_by_nvidia_s_rules(code: str, capability: str, runs: bool) -> None:
    """sm_* is a cubin (SASS, ca.sass_runs), compute_* is PTX (ca.ptx_runs)."""
    runs_on = ca.sass_runs if code.startswith("sm_") else ca.ptx_runs
    assert runs_on(code, ca._capability(capability)) is runs


def test_garbage_and_a_missing_tool_are_named(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "vllm.whl"
    with zipfile.ZipFile(bad, "w") as wheel:
        wheel.writestr("vllm/_C.abi3.so", b"garbage\n")  # cuobjdump: "Invalid fatbin header"
    with pytest.raises(ca.CudaArchError, match=r"cuobjdump could not list binary.so: .*fatbin"):
        ca.scan_wheel(bad)
    monkeypatch.setenv("SPARKFLEET_CUOBJDUMP", str(tmp_path / "no-such-cuobjdump"))
    with pytest.raises(ca.CudaArchError, match=r"cannot run cuobjdump .*no-such-cuobjdump .*SPARKFLEET_CUOBJDUMP"):
        ca.scan_wheel(bad)
    with pytest.raises(ValueError, match=r"compute capability '12' is not MAJOR.MINOR"):
        ca.check({"binaries": {"x.so": {"sass": ["sm_120"], "ptx": []}}}, "12")


def test_the_preflight_filter_answers_what_cuda_arch_does() -> None:
    root = Path(__file__).resolve().parents[2]
    script = (
        "import json, sys; sys.path.insert(0, 'filter_plugins'); import spark_cuda; "
        "f = spark_cuda.FilterModule().filters()['spark_wheel_cuda_check']; "
        "print(json.dumps(f({'binaries': {'vllm/_C.abi3.so': {'sass': ['sm_90a'], 'ptx': []}}}, 12.1)))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["reason"] == "vllm/_C.abi3.so has only sm_90a"
