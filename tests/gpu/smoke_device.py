"""The CUDA smoke, GPU side: receive the pieces, install, run the matrix. Python 3 stdlib + packaging.

    python3 tests/gpu/smoke_device.py receive            # this call's carried pieces -> /tmp/sf-smoke
    python3 tests/gpu/smoke_device.py install            # check, build the patched wheel, install, verify
    python3 tests/gpu/smoke_device.py run --wave A       # tests/gpu/cuda_smoke.py with the installed trees

Pieces stay in /tmp/sf-smoke while the machine is warm (each call's carried folder is replaced by
the next call's). ``install`` refuses to go on unless every piece and every file has the sha256
of the manifest that build/gpu-smoke/carry/manifest.json carries, then:

- builds the patched wheel from the carried stock source with this repository's own builder and
  series (``python -m sparkfleet.build.wheel_build build``), and records whether its sha256 equals the
  controller's build;
- installs it and the carried dependency wheels with ``pip install --no-index --no-deps --target``;
- makes the ``stock`` tree: the installed vllm package linked file by file, with the file patch
  0005 touches put back to the stock source's bytes;
- walks vllm's requirements through the installed metadata (markers evaluated on this machine) and
  fails on any that nothing installed meets.
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
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("SF_SMOKE_WORK", "/tmp/sf-smoke"))
CARRY = REPO / "build" / "gpu-smoke" / "carry"
MODELS = REPO / "build" / "gpu-smoke" / "models"
SITE = WORK / "site"
STOCK_SITE = WORK / "stock"
# The patches whose effect the smoke shows by difference: the ``stock`` tree has their files as vLLM ships them.
SERIES = REPO / "files" / "patches" / "vllm-0.23.0"
REVERTED = (SERIES / "0005-uniform-decode-prefill-dispatch.patch",)


def say(message: str) -> None:
    print(f"[smoke-device {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest() -> dict:
    return json.loads((CARRY / "manifest.json").read_text(encoding="utf-8"))


def _pieces(info: dict) -> dict[str, dict]:
    return {piece["name"]: piece for bundle in info["bundles"].values() for piece in bundle["pieces"]}


def receive(_args: argparse.Namespace) -> int:
    pieces = WORK / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    expected = _pieces(manifest())
    for path in sorted(CARRY.glob("*-[0-9][0-9]")):
        if path.name not in expected or sha256(path) != expected[path.name]["sha256"]:
            raise SystemExit(f"smoke-device: {path.name} is not a piece of this manifest: stage and carry it again")
        shutil.copyfile(path, pieces / path.name)
    have = sorted(p.name for p in pieces.iterdir() if p.name in expected)
    say(f"received {len(have)}/{len(expected)} pieces: {', '.join(have)}")
    return 0


def _assemble_bundle(name: str, bundle: dict, files: Path) -> None:
    if all((files / n).is_file() and sha256(files / n) == h for n, h in bundle["files"].items()):
        return
    pieces = WORK / "pieces"
    missing = [p["name"] for p in bundle["pieces"] if not (pieces / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"smoke-device: pieces {', '.join(missing)} are not here yet: carry and receive them first")
    tar_path = WORK / f"{name}.tar"
    digest = hashlib.sha256()
    with tar_path.open("wb") as out:
        for piece in bundle["pieces"]:
            data = (pieces / piece["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                raise SystemExit(f"smoke-device: {piece['name']} is damaged: carry and receive it again")
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != bundle["tar_sha256"]:
        raise SystemExit(f"smoke-device: the reassembled {name} bundle's sha256 differs from the manifest's")
    with tarfile.open(tar_path) as tar:
        tar.extractall(files, filter="data")
    tar_path.unlink()
    for file_name, expected in bundle["files"].items():
        if sha256(files / file_name) != expected:
            raise SystemExit(f"smoke-device: {file_name} sha256 differs from the manifest's")
    for piece in bundle["pieces"]:
        (pieces / piece["name"]).unlink()
    say(f"bundle {name}: {len(bundle['files'])} files checked")


def _assemble(info: dict) -> Path:
    files = WORK / "files"
    files.mkdir(parents=True, exist_ok=True)
    for name, bundle in info["bundles"].items():
        _assemble_bundle(name, bundle, files)
    wanted = {n for bundle in info["bundles"].values() for n in bundle["files"]}
    for path in files.iterdir():
        if path.name not in wanted:
            path.unlink()  # a wheel of an earlier dependency set
    return files


def _build_patched(info: dict, files: Path) -> tuple[Path, str]:
    out = WORK / "wheel"
    command = [
        sys.executable, "-m", "sparkfleet.build.wheel_build", "build",
        "--source", str(files / info["source"]), "--sha256", info["source_sha256"],
        "--out", str(out), "--cache", str(WORK / "wheel-cache"),
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wheels = sorted(out.glob("vllm-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], sha256(wheels[0])


def _stock_tree(info: dict, files: Path) -> None:
    shutil.rmtree(STOCK_SITE, ignore_errors=True)
    STOCK_SITE.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(SITE / "vllm"), str(STOCK_SITE / "vllm")], check=True)
    touched = [
        line[6:].split("\t")[0]
        for patch in REVERTED
        for line in patch.read_text().splitlines()
        if line.startswith("+++ b/")
    ]
    with zipfile.ZipFile(files / info["source"]) as source:
        for rel in touched:
            target = STOCK_SITE / rel
            target.unlink()
            target.write_bytes(source.read(rel))
    say(f"stock tree: {STOCK_SITE} ({', '.join(touched)} as in the stock wheel)")


def verify_closure(paths: list[str]) -> list[tuple[str, str]]:
    """vllm's requirements, walked through the installed metadata on ``paths`` + sys.path."""
    from importlib.metadata import PathDistribution, distributions

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, PathDistribution] = {}
    for dist in distributions(path=[*paths, *sys.path]):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    unmet: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    queue = [("vllm", frozenset(), "(root)")]
    while queue:
        name, extras, parent = queue.pop()
        for extra in {"", *extras}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            dist = found[name]
            for line in dist.requires or []:
                requirement = Requirement(line)
                env = {**default_environment(), "extra": extra}
                if requirement.marker is not None and not requirement.marker.evaluate(env):
                    continue
                child = canonicalize_name(requirement.name)
                have = found.get(child)
                if have is None or not requirement.specifier.contains(have.version, prereleases=True):
                    unmet.append((child, f"{name} requires {requirement} (have {have.version if have else 'none'})"))
                    continue
                queue.append((child, frozenset(requirement.extras), name))
    say(f"closure check: {len(seen)} (distribution, extra) pairs walked, {len(unmet)} unmet")
    return unmet


def install(_args: argparse.Namespace) -> int:
    info = manifest()
    files = _assemble(info)
    patched, patched_sha = _build_patched(info, files)
    same = patched_sha == info["patched_wheel_sha256"]
    verdict = "same as" if same else "DIFFERS from"
    say(f"patched wheel {patched.name}: sha256 {patched_sha[:12]} ({verdict} the controller's)")
    shutil.rmtree(SITE, ignore_errors=True)
    deps = [files / name for name in info["bundles"]["deps"]["files"]]
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", str(SITE), str(patched), *map(str, deps)]  # fmt: skip
    started = time.monotonic()
    subprocess.run(command, check=True)
    say(f"installed {1 + len(deps)} wheels into {SITE} in {time.monotonic() - started:.0f} s")
    _stock_tree(info, files)
    unmet = verify_closure([str(SITE)])
    accepted = set(info.get("not_carried", [])) | set(info.get("kept_machine", {}))
    record = {
        "patched_wheel": patched.name,
        "patched_wheel_sha256": patched_sha,
        "same_as_controller_build": same,
        "carried_wheels": len(deps),
        "unmet_accepted": [line for name, line in unmet if name in accepted],
        "unmet_requirements": [line for name, line in unmet if name not in accepted],
    }
    (WORK / "install.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    for line in record["unmet_accepted"]:
        say(f"unmet, not carried on purpose (manifest): {line}")
    for line in record["unmet_requirements"]:
        say(f"UNMET: {line}")
    check = [sys.executable, "-c", "import numpy, torch, vllm, vllm._C; print('import check:', vllm.__version__, "
             "'numpy', numpy.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"]  # fmt: skip
    imported = subprocess.run(check, env={**os.environ, "PYTHONPATH": str(SITE)}, capture_output=True, text=True)
    print(imported.stdout.strip() or imported.stderr[-3000:], flush=True)
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except FileNotFoundError:
        gpu = "no nvidia-smi"
    record["gpu"] = gpu
    record["import_check"] = imported.stdout.strip() or imported.stderr[-2000:]
    (WORK / "install.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 1 if record["unmet_requirements"] or imported.returncode else 0


def run(args: argparse.Namespace) -> int:
    """The waves, then: each wave's JSON and a tar of its logs in OUT (8 files come back at most)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = WORK / "results"
    results.mkdir(parents=True, exist_ok=True)
    if (WORK / "install.json").is_file():
        shutil.copyfile(WORK / "install.json", out / "install.json")
    env = {**os.environ, "PYTHONPATH": str(SITE)}
    logs = WORK / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    command = [sys.executable, str(REPO / "tests/gpu/cuda_smoke.py"), "--site", str(SITE),
               "--stock-site", str(STOCK_SITE), "--models", str(MODELS), "--out", str(results),
               "--logs", str(logs), "--work", str(WORK / "work"),
               "--deadline-s", str(args.deadline_s)]  # fmt: skip
    for wave in args.wave:
        command += ["--wave", wave]
    for name in args.only or []:
        command += ["--only", name]
    code = subprocess.run(command, env=env).returncode
    for wave in args.wave:
        if (results / f"wave-{wave}.json").is_file():
            shutil.copyfile(results / f"wave-{wave}.json", out / f"wave-{wave}.json")
    with tarfile.open(out / f"logs-{'-'.join(args.wave)}.tar.gz", "w:gz") as tar:
        if logs.is_dir():
            tar.add(logs, arcname="logs")
    if (WORK / "install.json").is_file():
        shutil.copyfile(WORK / "install.json", results / "install.json")
    report = [sys.executable, str(REPO / "tests/gpu/smoke_report.py"), str(results)]
    summary = subprocess.run(report, capture_output=True, text=True)
    (out / "summary.txt").write_text(summary.stdout + summary.stderr, encoding="utf-8")
    print(summary.stdout + summary.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("receive").set_defaults(func=receive)
    sub.add_parser("install").set_defaults(func=install)
    r = sub.add_parser("run")
    r.add_argument("--wave", action="append", required=True, choices=["A", "B", "C"])
    r.add_argument("--only", action="append")
    r.add_argument("--out", default=os.environ.get("OUT", "out"))
    r.add_argument("--deadline-s", type=float, default=540.0)
    r.set_defaults(func=run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
