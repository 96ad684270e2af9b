"""The CUDA smoke, controller side: what the GPU machine needs, in pieces the device tool can carry.

    .venv/bin/python tests/gpu/smoke_prepare.py prepare [--python python3.12]
    .venv/bin/python tests/gpu/smoke_prepare.py stage N        # piece N into the carried folder

``prepare`` (idempotent; each step reuses what is already there and checks it):

1. the pinned x86_64 GPU source wheel (``gpu-x86_64`` in sparkfleet/build/wheel_sources.yml), checked by
   sha256, and the patched wheel built from it here (the GPU machine builds it again from the same
   source and series: both sha256s go into the results, so the build is shown reproducible there);
2. the dependency closure of that wheel for the GPU machine, by pip's resolver run with the machine's
   Python (markers) against a stand-in environment holding every package the machine reported
   (benchmarks/results/gpu/h200-machine.json, its ``pip list``): pip keeps each installed version that
   satisfies and lists what it would add or replace, as it would there (sparkfleet/build/wheel_closure.py);
   the requirements of backends the cases do not use are left out (``NOT_CARRIED``, with reasons);
3. exactly the wheels the machine lacks (missing, or installed at a version the closure refuses),
   downloaded with ``pip download --no-deps`` and checked against the resolver's sha256;
4. the models the cases name (tests/gpu/smoke_cases.py): the tiny ones from build/models, the
   hybrid DFlash drafter trained by tests/fixtures/tiny_models.py, and untrained drafters with the
   other KV geometries;
5. the source wheel and the needed wheels in one uncompressed tar, cut into pieces under the device
   tool's 64 MiB-a-call limit, with a manifest (the sha256 of every file, of the tar and of each
   piece) that the GPU side checks before it installs anything.

Everything lands under build/gpu-smoke/ (ignored). tests/gpu/README.md gives the calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

import smoke_cases  # noqa: E402

from sparkfleet.build import wheel_build, wheel_closure  # noqa: E402

WORK = REPO / "build" / "gpu-smoke"
MACHINE_FILE = REPO / "benchmarks" / "results" / "gpu" / "h200-machine.json"
SOURCE = "gpu-x86_64"
PIECE_BYTES = 56 << 20  # under the device tool's 64 MiB a call, with room for the working tree
# manylinux glibc levels the resolver may pick for the GPU machine (glibc 2.39): pip matches each
# manylinux_2_N tag exactly, so every N a wheel of the stack uses is named.
MANYLINUX = tuple(f"2_{n}" for n in (5, 12, 17, 18, 24, 25, 26, 27, 28, 31, 34, 35, 39))


def say(message: str) -> None:
    print(f"smoke-prepare: {message}", flush=True)


sha256 = wheel_build.sha256_file


def machine() -> tuple[wheel_closure.TargetMachine, dict[str, str]]:
    data = json.loads(MACHINE_FILE.read_text(encoding="utf-8"))
    installed = wheel_closure.load_installed(data["packages"])
    installed.pop("pip", None)  # pip is the installer, not part of any closure
    target = wheel_closure.TargetMachine(data["python"], data["platform_machine"], MANYLINUX)
    return target, installed


def source_wheel() -> tuple[Path, str]:
    pin = wheel_build.load_pinned_sources()[SOURCE]
    path, digest = wheel_build.resolve_source(SOURCE, None, wheel_build.DEFAULT_CACHE, [])
    assert digest == pin["sha256"]
    return path, digest


# vLLM requirements the smoke does not carry, each with why: GPU kernel libraries that vLLM imports
# only for a backend, quantization or model family the smoke's cases do not use. Their wheels are
# large and drag in CUDA packages of their own (cuda-python, cutlass) that would shadow the machine's.
NOT_CARRIED = {
    "flashinfer-python": "FlashInfer backends only: the cases pin FLASH_ATTN, and GDN prefill to Triton/FLA "
    "(what vLLM 0.23 picks on a GB10, SM121, anyway; it picks FlashInfer only on SM90/SM10x)",
    "flashinfer-cubin": "FlashInfer's prebuilt kernels (see flashinfer-python)",
    "apache-tvm-ffi": "FlashInfer/TileLang's FFI (see flashinfer-python, tilelang)",
    "tilelang": "TileLang kernels of DeepSeek-style sparse attention; not in these models",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (cutedsl GDN prefill on SM10x, DeepSeek V4 ops); not selected here",
    "quack-kernels": "CuTe-DSL kernels (see nvidia-cutlass-dsl)",
    "tokenspeed-mla": "MLA attention (DeepSeek-style models); not in these models",
    "humming-kernels": "Humming quantized MoE kernels; the tiny models are unquantized and dense",
    "nvidia-cudnn-frontend": "cuDNN attention frontend; not selected by FLASH_ATTN",
    "fastsafetensors": "--load-format fastsafetensors; the tiny checkpoints load with the default loader",
}
# Installed packages used as they are although a requirement of the closure refuses their version:
# a carried replacement would shadow them for the machine's own torch, opencv and scipy, which are
# built against its numpy.
KEEP_MACHINE = {
    "numpy": "mistral-common caps numpy<2.4 on Python 3.12 and numba 0.65 <2.5; the machine's 2.5.2 stays",
    "numba": "vLLM pins numba==0.65.0 (its n-gram proposer, not used here); 0.65 would need numpy<2.5",
}


def vllm_requirements(source: Path, target: wheel_closure.TargetMachine) -> tuple[list[str], dict[str, str]]:
    """The source wheel's Requires-Dist for the target, less what is not carried (with the reasons)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(source) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = [
            line.split(":", 1)[1].strip()
            for line in wheel.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    kept, left_out = [], {}
    skip = NOT_CARRIED
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(target.environment("")):
            continue
        name = wheel_build.canonical_name(requirement.name)
        if name in skip:
            left_out[name] = f"{line}: {skip[name]}"
        else:
            kept.append(line)
    return kept, left_out


def closure(source: Path, python: str) -> dict:
    """What the machine lacks, by pip's resolver; reused while the source and the machine list stay."""
    target, installed = machine()
    requirements, left_out = vllm_requirements(source, target)
    key = {
        "source": sha256(source),
        "machine": sha256(MACHINE_FILE),
        "requirements": requirements,
        "keep": sorted(KEEP_MACHINE),
    }
    cached = WORK / "closure.json"
    if cached.is_file():
        previous = json.loads(cached.read_text(encoding="utf-8"))
        if previous.get("key") == key:
            say(f"closure: up to date ({len(previous['carried'])} wheels to carry)")
            return previous
    report = WORK / "closure" / f"{source.stem}.report.json"
    dists = wheel_closure.resolve(requirements, target, report, installed=installed, python=python)
    needs, met = wheel_closure.needed(
        dists, requirements, target, installed, parent="vllm==0.23.0", keep=frozenset(KEEP_MACHINE)
    )
    say(
        f"closure: {len(dists) + len(met)} distributions; the machine has {len(met)}, "
        f"lacks {sum(n.reason == 'missing' for n in needs)}, "
        f"has {sum(n.reason == 'conflict' for n in needs)} at a version the closure refuses; "
        f"not carried: {', '.join(left_out)}"
    )
    result = {
        "key": key,
        "distributions": len(dists) + len(met),
        "met_by_machine": met,
        "not_carried": left_out,
        "kept_machine": {name: installed.get(name) for name in KEEP_MACHINE},
        "carried": [
            {
                "name": need.dist.name,
                "version": need.dist.version,
                "filename": need.dist.filename,
                "url": need.dist.url,
                "sha256": need.dist.sha256,
                "reason": need.reason,
                "installed": need.installed,
                "required_by": need.required_by,
            }
            for need in needs
        ],
    }
    cached.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def download(carried: list[dict]) -> list[Path]:
    """The exact files the resolver chose (its URLs), each checked against the resolver's sha256."""
    wheels = WORK / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    paths = []
    todo = [entry for entry in carried if not (wheels / entry["filename"]).is_file()]
    if todo:
        say(f"download: {len(todo)} wheel(s)")
    for number, entry in enumerate(todo, 1):
        wheel_build._fetch_url(entry["url"], wheels / entry["filename"])
        if number % 10 == 0:
            say(f"download: {number}/{len(todo)}")
    for entry in carried:
        path = wheels / entry["filename"]
        if not entry["sha256"] or sha256(path) != entry["sha256"]:
            raise SystemExit(f"smoke-prepare: {path} does not have the resolver's sha256 {entry['sha256'][:12]}")
        paths.append(path)
    for path in wheels.iterdir():
        if path.name not in {entry["filename"] for entry in carried}:
            path.unlink()  # of an earlier closure
    return paths


def build_models() -> Path:
    """build/gpu-smoke/models: every model a case names."""
    models = WORK / "models"
    models.mkdir(parents=True, exist_ok=True)
    built = REPO / "build" / "models"
    venv_python = REPO / "build" / "venv-vllm" / "bin" / "python"
    subprocess.run(
        [
            str(venv_python),
            str(REPO / "tests/fixtures/tiny_models.py"),
            "--out",
            str(built),
            "--only",
            smoke_cases.HYBRID_DRAFTER,
            "--only",
            smoke_cases.HYBRID_TARGET,
            "--only",
            smoke_cases.DENSE_TARGET,
            "--only",
            smoke_cases.DENSE_DRAFTER,
        ],
        check=True,
    )
    for name in (
        smoke_cases.HYBRID_TARGET,
        smoke_cases.HYBRID_DRAFTER,
        smoke_cases.DENSE_TARGET,
        smoke_cases.DENSE_DRAFTER,
    ):
        shutil.rmtree(models / name, ignore_errors=True)
        shutil.copytree(built / name, models / name)
    subprocess.run([str(venv_python), str(REPO / "tests/gpu/smoke_drafters.py"), "--out", str(models)], check=True)
    return models


def _cut(name: str, tar_path: Path, pieces_dir: Path) -> list[dict]:
    pieces = []
    with tar_path.open("rb") as stream:
        index = 0
        while block := stream.read(PIECE_BYTES):
            piece = pieces_dir / f"{name}-{index:02d}"
            piece.write_bytes(block)
            pieces.append({"name": piece.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            index += 1
    return pieces


def bundle(groups: dict[str, list[Path]], manifest_extra: dict) -> dict:
    """Each group of files in one uncompressed tar, cut into pieces: ``<group>-NN``.

    Groups are carried apart, so that a change of the dependency set does not send the 274 MB
    source wheel again.
    """
    pieces_dir = WORK / "pieces"
    pieces_dir.mkdir(parents=True, exist_ok=True)
    bundles = {}
    for group, files in groups.items():
        tar_path = WORK / f"{group}.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in files:
                info = tar.gettarinfo(str(path), arcname=path.name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with path.open("rb") as stream:
                    tar.addfile(info, stream)
        tar_sha = sha256(tar_path)
        previous = [p for p in pieces_dir.glob(f"{group}-*")]
        old = json.loads((WORK / "manifest.json").read_text()) if (WORK / "manifest.json").is_file() else {}
        if old.get("bundles", {}).get(group, {}).get("tar_sha256") == tar_sha and previous:
            bundles[group] = old["bundles"][group]
        else:
            for piece in previous:
                piece.unlink()
            bundles[group] = {
                "tar_sha256": tar_sha,
                "tar_bytes": tar_path.stat().st_size,
                "files": {path.name: sha256(path) for path in files},
                "pieces": _cut(group, tar_path, pieces_dir),
            }
        tar_path.unlink()
        say(
            f"bundle {group}: {len(files)} files, {bundles[group]['tar_bytes'] / 2**20:.0f} MiB in "
            f"{len(bundles[group]['pieces'])} pieces"
        )
    manifest = {**manifest_extra, "bundles": bundles}
    (WORK / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


def prepare(args: argparse.Namespace) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    source, source_sha = source_wheel()
    patched = wheel_build.build_wheel(SOURCE, out_dir=WORK / "wheel")
    result = closure(source, args.python)
    deps = download(result["carried"])
    build_models()
    manifest = bundle(
        {"source": [source], "deps": deps},
        {
            "source": source.name,
            "source_sha256": source_sha,
            "patched_wheel": patched.name,
            "patched_wheel_sha256": sha256(patched),
            "carried": [entry["name"] for entry in result["carried"]],
            "not_carried": sorted(result["not_carried"]),
            "kept_machine": result["kept_machine"],
        },
    )
    total = sum(path.stat().st_size for path in deps)
    say(
        f"ready: {len(deps)} dependency wheels ({total / 2**20:.0f} MiB) + the source wheel, "
        f"pieces {', '.join(p['name'] for b in manifest['bundles'].values() for p in b['pieces'])}"
    )
    return 0


def stage(args: argparse.Namespace) -> int:
    manifest = json.loads((WORK / "manifest.json").read_text(encoding="utf-8"))
    carry = WORK / "carry"
    shutil.rmtree(carry, ignore_errors=True)
    carry.mkdir(parents=True)
    shutil.copyfile(WORK / "manifest.json", carry / "manifest.json")
    known = {p["name"] for b in manifest["bundles"].values() for p in b["pieces"]}
    for name in args.pieces:
        if name not in known:
            raise SystemExit(f"smoke-prepare: no piece {name}; the manifest has {', '.join(sorted(known))}")
        os.link(WORK / "pieces" / name, carry / name)
    size = sum(path.stat().st_size for path in carry.iterdir())
    say(f"staged {', '.join(args.pieces) or 'the manifest only'} in {carry} ({size / 2**20:.1f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="source and patched wheel, closure, wheels, models, pieces")
    p.add_argument("--python", default="python3.12", help="a Python of the GPU machine's version (markers)")
    p.set_defaults(func=prepare)
    s = sub.add_parser("stage", help="put pieces into build/gpu-smoke/carry (the folder each call carries)")
    s.add_argument("pieces", nargs="*", help="piece names, e.g. source-00 deps-01 (none: only the manifest)")
    s.set_defaults(func=stage)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
