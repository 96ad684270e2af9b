"""Benchmark `sparkfleet checkpoint hybrid-fp8` on a synthetic checkpoint with the 122B's per-layer geometry.

The synthetic base has Qwen3.5-122B-A10B's real tensor names and shapes per decoder layer (hidden 3072; 256
routed experts of intermediate 1024 and the Gated-DeltaNet projections as INT4 GPTQ: qweight/qzeros/scales;
BF16 shared expert 1024 wide, router, norms), for `--layers` layers, packed into shards of about `--shard-gb`
GB (the real checkpoint has ~4.6 GB shards; use 1-2 GB where disk is short), with a 32768-token vocabulary instead of
248320 (embeddings and lm_head are plain copies either way). Tensor data is random: the
INT4 bytes are noise, the BF16 shared experts are N(0, 0.02) (so the FP8 error figures are those of Gaussian
weights, not of the real model's).

Each build runs in its own process (`python -m sparkfleet checkpoint hybrid-fp8`). Reported per run: wall
time, MB/s (bytes written / wall time, process start and torch import included) and peak RSS (VmHWM, as the
build records it in its manifest). Runs: quantizing here (block scales); taking the FP8 tensors from a donor
with the error report; from a donor with --no-error-report (no torch: the streaming copy alone), also with
--no-hash; importing torch alone. A plain file copy of the same shards gives the machine's ceiling. The base
was just written, so it is likely in the page cache (caches are not dropped on a shared machine): the figures
are the tool's, not a cold disk's.

    build/venv-vllm/bin/python benchmarks/bench_checkpoint.py --work DIR [--layers 3] [--shard-gb 1.5]
        [--json OUT.json] [--update-doc docs/dense-checkpoint.md] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sparkfleet.build.checkpoint import INDEX_NAME, MANIFEST_NAME, inspect_checkpoint  # noqa: E402
from sparkfleet.build.safetensors_stream import ShardEntry, write_shard  # noqa: E402

HIDDEN = 3072
EXPERTS = 256
MOE_INTERMEDIATE = 1024
SHARED_INTERMEDIATE = 1024
GDN_KEY_DIM = 16 * 128
GDN_VALUE_DIM = 64 * 128
GDN_VALUE_HEADS = 64
ATTN_Q_OUT = 2 * 32 * 256  # gated full attention: query + gate
ATTN_KV_OUT = 2 * 256
GROUP = 128
# The real vocabulary is 248320 (embeddings and lm_head 1.5 GB each, copied unchanged like any INT4 tensor);
# 32768 keeps the synthetic base small on a machine short of disk.
VOCAB = 32768
DOC_BEGIN = "<!-- bench_checkpoint:begin -->"
DOC_END = "<!-- bench_checkpoint:end -->"


def _int4(module: str, out_features: int, in_features: int) -> list[ShardEntry]:
    groups = in_features // GROUP
    qweight_bytes = in_features // 8 * out_features * 4
    qzeros_words = groups * out_features // 8
    return [
        ShardEntry(f"{module}.qweight", "I32", (in_features // 8, out_features), lambda: os.urandom(qweight_bytes)),
        ShardEntry(f"{module}.qzeros", "I32", (groups, out_features // 8), lambda: b"\x77" * 4 * qzeros_words),
        ShardEntry(f"{module}.scales", "F16", (groups, out_features), lambda: _f16(groups * out_features)),
    ]


def _f16(count: int) -> bytes:
    import torch

    return (torch.rand(count) * 3e-3 + 1e-3).to(torch.float16).numpy().tobytes()


def _bf16(name: str, *shape: int, std: float = 0.02) -> ShardEntry:
    def produce() -> bytes:
        import torch

        return (torch.randn(*shape) * std).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()

    return ShardEntry(name, "BF16", shape, produce)


def _layer_entries(index: int, layer_type: str) -> list[ShardEntry]:
    prefix = f"model.language_model.layers.{index}"
    entries = [
        _bf16(f"{prefix}.input_layernorm.weight", HIDDEN),
        _bf16(f"{prefix}.post_attention_layernorm.weight", HIDDEN),
    ]
    if layer_type == "linear_attention":
        attn = f"{prefix}.linear_attn"
        entries += _int4(f"{attn}.in_proj_qkv", 2 * GDN_KEY_DIM + GDN_VALUE_DIM, HIDDEN)
        entries += _int4(f"{attn}.in_proj_z", GDN_VALUE_DIM, HIDDEN)
        entries += _int4(f"{attn}.out_proj", HIDDEN, GDN_VALUE_DIM)
        entries += [
            _bf16(f"{attn}.in_proj_a.weight", GDN_VALUE_HEADS, HIDDEN),
            _bf16(f"{attn}.in_proj_b.weight", GDN_VALUE_HEADS, HIDDEN),
        ]
        entries += [
            _bf16(f"{attn}.conv1d.weight", 2 * GDN_KEY_DIM + GDN_VALUE_DIM, 1, 4),
            _bf16(f"{attn}.A_log", GDN_VALUE_HEADS),
        ]
        entries += [_bf16(f"{attn}.dt_bias", GDN_VALUE_HEADS), _bf16(f"{attn}.norm.weight", 128)]
    else:
        attn = f"{prefix}.self_attn"
        entries += _int4(f"{attn}.q_proj", ATTN_Q_OUT, HIDDEN) + _int4(f"{attn}.k_proj", ATTN_KV_OUT, HIDDEN)
        entries += _int4(f"{attn}.v_proj", ATTN_KV_OUT, HIDDEN) + _int4(f"{attn}.o_proj", HIDDEN, ATTN_Q_OUT // 2)
        entries += [_bf16(f"{attn}.q_norm.weight", 256), _bf16(f"{attn}.k_norm.weight", 256)]
    mlp = f"{prefix}.mlp"
    for expert in range(EXPERTS):
        entries += _int4(f"{mlp}.experts.{expert}.gate_proj", MOE_INTERMEDIATE, HIDDEN)
        entries += _int4(f"{mlp}.experts.{expert}.up_proj", MOE_INTERMEDIATE, HIDDEN)
        entries += _int4(f"{mlp}.experts.{expert}.down_proj", HIDDEN, MOE_INTERMEDIATE)
    entries += [
        _bf16(f"{mlp}.shared_expert.gate_proj.weight", SHARED_INTERMEDIATE, HIDDEN),
        _bf16(f"{mlp}.shared_expert.up_proj.weight", SHARED_INTERMEDIATE, HIDDEN),
        _bf16(f"{mlp}.shared_expert.down_proj.weight", HIDDEN, SHARED_INTERMEDIATE),
        _bf16(f"{mlp}.gate.weight", EXPERTS, HIDDEN),
        _bf16(f"{mlp}.shared_expert_gate.weight", 1, HIDDEN),
    ]
    return entries


def write_synthetic_base(dest: Path, layers: int, shard_bytes: int) -> dict[str, Any]:
    """Write the synthetic base shard by shard (never holding more than one tensor) and its index/config."""
    dest.mkdir(parents=True)
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    pending: list[ShardEntry] = [_bf16("model.language_model.embed_tokens.weight", VOCAB, HIDDEN)]
    shards: list[list[ShardEntry]] = []
    for index, layer_type in enumerate(layer_types):
        for entry in _layer_entries(index, layer_type):
            if pending and sum(e.nbytes for e in pending) + entry.nbytes > shard_bytes:
                shards.append(pending)
                pending = []
            pending.append(entry)
    pending += [_bf16("model.language_model.norm.weight", HIDDEN), _bf16("lm_head.weight", VOCAB, HIDDEN)]
    shards.append(pending)
    weight_map: dict[str, str] = {}
    total = 0
    for number, entries in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        written = write_shard(dest / name, entries, {"format": "pt"}, hash_output=False)
        print(f"  synthetic base: {name} {written.size / 1e9:.2f} GB", flush=True)
        for entry in entries:
            weight_map[entry.name] = name
            total += entry.nbytes
    (dest / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    extra = {f"model.language_model.layers.{i}.mlp.shared_expert.{p}": {"bits": 16, "data_type": "float"}
             for i in range(layers) for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {"hidden_size": HIDDEN, "num_hidden_layers": layers, "layer_types": layer_types},
        "quantization_config": {"quant_method": "auto-round", "bits": 4, "group_size": GROUP, "sym": True,
                                "packing_format": "auto_round:auto_gptq", "extra_config": extra},
    }  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return {"shards": len(shards), "bytes": sum((dest / n).stat().st_size for n in set(weight_map.values()))}


def run_build(args: list[str]) -> dict[str, Any]:
    """One build in a child process: wall time, and its peak RSS as the child measured it (VmHWM)."""
    command = [sys.executable, "-m", "sparkfleet", "checkpoint", "hybrid-fp8", *args]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"build failed ({' '.join(command)}):\n{(result.stdout + result.stderr)[-4000:]}")
    print("    " + result.stdout.strip().splitlines()[-1], flush=True)
    out = Path(args[args.index("--out") + 1])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    return {"seconds": seconds, "peak_rss_mib": manifest["peak_rss_mib"], "build_seconds": manifest["seconds"]}


def torch_import_rss() -> dict[str, Any]:
    """What importing torch alone costs in time and RSS (it dominates the builds that use it)."""
    code = (
        "import time; t = time.monotonic(); import torch; from sparkfleet.build.checkpoint import peak_rss_mib; "
        "print(time.monotonic() - t, peak_rss_mib())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    seconds, rss = (float(v) for v in out.stdout.split())
    return {"seconds": seconds, "peak_rss_mib": rss, "mb_per_s": None}


def copy_ceiling(base: Path, dest: Path) -> dict[str, Any]:
    dest.mkdir()
    started = time.monotonic()
    size = 0
    for shard in sorted(base.glob("*.safetensors")):
        shutil.copyfile(shard, dest / shard.name)
        size += shard.stat().st_size
    with open(dest / "sync", "wb") as handle:
        os.fsync(handle.fileno())
    os.sync()
    seconds = time.monotonic() - started
    shutil.rmtree(dest)
    return {"seconds": seconds, "mb_per_s": size / 1e6 / seconds}


def measure(work: Path, layers: int, shard_gb: float) -> dict[str, Any]:
    base, quantized, donor_built, copied = (
        work / "base",
        work / "hybrid-quantized",
        work / "hybrid-donor",
        work / "copy",
    )
    print(f"writing the synthetic base ({layers} layers, ~{shard_gb} GB shards) under {work}", flush=True)
    base_info = write_synthetic_base(base, layers, int(shard_gb * 1e9))
    started = time.monotonic()
    report = inspect_checkpoint(base)
    inspect_seconds = time.monotonic() - started
    results: dict[str, Any] = {}
    print("plain copy of the shards (the ceiling)", flush=True)
    results["plain copy (shutil.copyfile + fsync)"] = copy_ceiling(base, copied)
    print("quantize here (block scales)", flush=True)
    results["quantize here, block scales"] = run_build(["--base", str(base), "--out", str(quantized)])
    manifest = json.loads((quantized / MANIFEST_NAME).read_text())
    print("donor (the quantized output as the FP8 release), error report", flush=True)
    results["donor, error report"] = run_build(
        ["--base", str(base), "--out", str(donor_built), "--donor", str(quantized)]
    )
    shutil.rmtree(donor_built)
    print("donor, --no-error-report (no torch)", flush=True)
    results["donor, no error report (no torch)"] = run_build(
        ["--base", str(base), "--out", str(donor_built), "--donor", str(quantized), "--no-error-report"]
    )
    shutil.rmtree(donor_built)
    print("donor, --no-error-report --no-hash", flush=True)
    results["donor, no error report, no sha256"] = run_build(
        ["--base", str(base), "--out", str(donor_built), "--donor", str(quantized), "--no-error-report", "--no-hash"]
    )
    written = json.loads((donor_built / MANIFEST_NAME).read_text())["bytes_written"]
    results["import torch alone (RSS baseline)"] = torch_import_rss()
    for result in results.values():
        if "mb_per_s" not in result and "build_seconds" in result:
            result["mb_per_s"] = written / 1e6 / result["seconds"]
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},
        "layers": layers,
        "shard_gb_target": shard_gb,
        "base_shards": base_info["shards"],
        "base_bytes": base_info["bytes"],
        "largest_shard_bytes": max(p.stat().st_size for p in base.glob("*.safetensors")),
        "output_bytes": written,
        "inspect_seconds": inspect_seconds,
        "inspect_totals": report["totals"],
        "fp8_modules": len(manifest["fp8_modules"]),
        "fp8_error_summary": manifest["error_summary"],
        "bytes_saved": manifest["bytes_saved"],
        "runs": results,
    }


def render(result: dict[str, Any]) -> str:
    gb = 1e9
    busy = result["machine"]["load_avg_1m"] > result["machine"]["cpus"]
    shared = ": more runnable work than CPUs, other work shared the machine" if busy else ""
    lines = [
        DOC_BEGIN,
        "Measured by `benchmarks/bench_checkpoint.py "
        f"--layers {result['layers']} --shard-gb {result['shard_gb_target']}` "
        f"on {result['machine']['cpus']} CPUs (1-minute load average {result['machine']['load_avg_1m']:.1f} at the "
        f"end{shared}): a synthetic base of {result['base_shards']} shards, "
        f"{result['base_bytes'] / gb:.2f} GB (largest shard {result['largest_shard_bytes'] / gb:.2f} GB), "
        f"{result['fp8_modules']} shared-expert modules made FP8, output {result['output_bytes'] / gb:.2f} GB.",
        "",
        "| run | wall s | MB/s written | peak RSS MiB |",
        "|---|---:|---:|---:|",
    ]
    for name, run in result["runs"].items():
        rss = f"{run['peak_rss_mib']:.0f}" if "peak_rss_mib" in run else "-"
        rate = f"{run['mb_per_s']:.0f}" if run.get("mb_per_s") else "-"
        lines.append(f"| {name} | {run['seconds']:.1f} | {rate} | {rss} |")
    errors = result["fp8_error_summary"]
    lines += [
        "",
        f"`inspect` of the same base (headers only): {result['inspect_seconds'] * 1000:.0f} ms. FP8 relative error "
        f"(Frobenius, block scales, Gaussian weights): median {errors['rel_fro_median']:.4f}, max "
        f"{errors['rel_fro_max']:.4f}. Saved {result['bytes_saved'] / 1e6:.1f} MB "
        f"({result['bytes_saved'] / result['fp8_modules'] / 1e6:.2f} MB per module; x144 modules on the 122B).",
        DOC_END,
    ]
    return "\n".join(lines)


def write_out(result: dict[str, Any], json_path: Path | None, doc_path: Path | None) -> int:
    """Print the rendered block; save the JSON; replace the doc's generated block. 2 when the doc lacks it."""
    text = render(result)
    print(text)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if doc_path:
        doc = doc_path.read_text()
        if DOC_BEGIN not in doc or DOC_END not in doc:
            print(f"error: {doc_path} lacks the {DOC_BEGIN} ... {DOC_END} block", file=sys.stderr)
            return 2
        head, rest = doc.split(DOC_BEGIN, 1)
        doc_path.write_text(head + text + rest.split(DOC_END, 1)[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (needs ~3x the base size)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--shard-gb", type=float, default=1.5)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--update-doc", type=Path, help="replace the generated block of this markdown file")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    parser.add_argument("--render", type=Path, metavar="JSON", help="render a saved --json result (no run)")
    args = parser.parse_args(argv)
    if args.render:
        return write_out(json.loads(args.render.read_text()), None, args.update_doc)
    if args.work is None:
        print("error: --work is required: a scratch directory with ~3x the base size free", file=sys.stderr)
        return 2
    if args.layers < 1 or not 0.1 <= args.shard_gb <= 20:
        print(
            f"error: --layers {args.layers} / --shard-gb {args.shard_gb}: use >= 1 layer and 0.1-20 GB", file=sys.stderr
        )
        return 2
    work = args.work / "bench-checkpoint"
    if work.exists():
        print(f"error: {work} exists; remove it or pick another --work", file=sys.stderr)
        return 2
    need = args.layers * 1.3e9 * 3.2
    free = shutil.disk_usage(args.work).free
    if free < need:
        print(
            f"error: --work {args.work} has {free / 1e9:.1f} GB free, needs ~{need / 1e9:.1f}; fewer --layers",
            file=sys.stderr,
        )
        return 2
    try:
        result = measure(work, args.layers, args.shard_gb)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if write_out(result, args.json, args.update_doc):
        return 2
    fastest = max(
        ((name, run) for name, run in result["runs"].items() if run.get("mb_per_s")),
        key=lambda item: item[1]["mb_per_s"],
    )
    print(
        f"benchmark done: {len(result['runs'])} runs on {result['base_bytes'] / 1e9:.2f} GB, fastest {fastest[0]} "
        f"at {fastest[1]['mb_per_s']:.0f} MB/s; synthetic checkpoints {'kept' if args.keep else 'deleted'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
