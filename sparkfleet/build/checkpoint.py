"""The dense profile's checkpoint: build the hybrid INT4 + FP8 checkpoint by streaming, and inspect checkpoints.

The `dense` profile serves an Intel AutoRound INT4 checkpoint whose BF16 MoE shared-expert projections are
FP8 E4M3 (vLLM 0.23 with patch 0002 serves those layers with Fp8LinearMethod). A prebuilt copy exists; this
command is the reproducible way to make one:

    sparkfleet checkpoint hybrid-fp8 --base INT4_DIR --out OUT_DIR [--donor DIR | --donor REPO --donor-revision SHA]
    sparkfleet checkpoint inspect CHECKPOINT_DIR [--json]

`hybrid-fp8` reads the INT4 base shard by shard and writes the same shards, with every selected BF16 module
(default: the shared experts' gate/up/down projections) replaced by an F8_E4M3 weight and its float32 scale:
the calibrated tensors of an FP8 donor release when `--donor` is given (only the donor shards that hold them
are fetched, found through the donor's `model.safetensors.index.json`), else quantized here from the BF16
weights (`--scales block`: 128x128 `weight_scale_inv`, the FP8 releases' layout; `--scales tensor`: one
`weight_scale`). Every other tensor is copied byte for byte, through a fixed buffer: peak memory is the
buffer plus one replaced tensor, never a shard. The index, the AutoRound `quantization_config` (the FP8
modules' `extra_config` entries say 8-bit FP8, so a vLLM without the patch fails loudly instead of loading
FP8 bytes as BF16 values) and a manifest (`sparkfleet-checkpoint.json`: inputs, options, per-tensor relative
error of the FP8 weights against the BF16 ones, output shards with sha256) are written; the output appears
under its final name only when complete. Re-running with the same inputs finds the manifest and does nothing.

`inspect` reads safetensors headers only (standard library) and reports which modules are INT4, FP8, BF16.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import re
import resource
import shutil
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkfleet.build import jsonfile
from sparkfleet.build.safetensors_stream import (
    DEFAULT_CHUNK_BYTES,
    ByteRange,
    SafetensorsError,
    ShardEntry,
    ShardHeader,
    TensorInfo,
    copy_file,
    encode_header,
    header_length,
    parse_header,
    read_header,
    read_tensor_bytes,
    write_shard,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
MANIFEST_NAME = "sparkfleet-checkpoint.json"
MANIFEST_FORMAT = 1
# The MoE shared experts of the decoder layers: dense, read every token (FINDINGS §4: 48 layers x 3 = 144
# modules on the 122B). The router (`mlp.gate`) and the `shared_expert_gate` stay BF16, as in the FP8
# releases; an MTP head (`mtp.*`), which the dense profile does not run, is left as it is.
DEFAULT_MODULE_PATTERN = r"^model\.language_model\.layers\.\d+\.mlp\.shared_expert\.(gate|up|down)_proj$"
# Checkpoint modules vLLM fuses into one layer: all of a group must share one format (patch 0002 refuses
# a partly FP8 fused layer).
FUSED_GROUPS = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"))
FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale", "input_scale")


class CheckpointError(ValueError):
    """A bad input: the message names the value and the fix."""


# ---------------------------------------------------------------------------------------------------------
# Reading a checkpoint's layout (headers only)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CheckpointLayout:
    """A checkpoint directory's shards and their headers, without tensor data."""

    path: Path
    shard_names: list[str]
    headers: dict[str, ShardHeader]
    index: dict[str, Any] | None
    config: dict[str, Any] | None

    def tensor(self, name: str) -> tuple[str, TensorInfo] | None:
        for shard in self.shard_names:
            info = self.headers[shard].tensors.get(name)
            if info is not None:
                return shard, info
        return None

    def all_tensors(self) -> dict[str, tuple[str, TensorInfo]]:
        return {name: (shard, info) for shard in self.shard_names for name, info in self.headers[shard].tensors.items()}


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return jsonfile.read_object(path)
    except jsonfile.NotAJsonObject as error:
        raise CheckpointError(f"{what} {path}: {error}") from error


def read_index(path: Path) -> dict[str, Any]:
    index = _read_json(path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"safetensors index {path} has no weight_map; is it a model.safetensors.index.json?")
    return index


def read_layout(path: Path) -> CheckpointLayout:
    """The layout of a checkpoint directory: its index (or single shard) and every shard header."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory; pass the directory holding config.json")
    index = None
    if (path / INDEX_NAME).is_file():
        index = read_index(path / INDEX_NAME)
        shard_names = sorted(set(index["weight_map"].values()))
    elif (path / SINGLE_SHARD_NAME).is_file():
        shard_names = [SINGLE_SHARD_NAME]
    else:
        raise CheckpointError(
            f"checkpoint {path} has neither {INDEX_NAME} nor {SINGLE_SHARD_NAME}; pass a safetensors checkpoint"
        )
    headers: dict[str, ShardHeader] = {}
    for shard in shard_names:
        if not (path / shard).is_file():
            raise CheckpointError(f"checkpoint {path}: shard {shard} named in {INDEX_NAME} is missing")
        try:
            headers[shard] = read_header(path / shard)
        except SafetensorsError as error:
            raise CheckpointError(str(error)) from error
    if index is not None:
        for name, shard in index["weight_map"].items():
            if name not in headers[shard].tensors:
                raise CheckpointError(f"checkpoint {path}: {INDEX_NAME} puts {name} in {shard}, which lacks it")
    config = _read_json(path / "config.json", "config") if (path / "config.json").is_file() else None
    return CheckpointLayout(path, shard_names, headers, index, config)


# ---------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------

_MODULE_TENSOR_SUFFIXES = ("weight", "qweight")


def _quant_bits(config: dict[str, Any] | None, module: str) -> int | None:
    quant = (config or {}).get("quantization_config") or {}
    extra = quant.get("extra_config") or {}
    if isinstance(extra.get(module), dict) and "bits" in extra[module]:
        return int(extra[module]["bits"])
    return int(quant["bits"]) if "bits" in quant else None


def module_format(tensors: dict[str, TensorInfo], module: str, config: dict[str, Any] | None) -> str:
    """INT4 / FP8 E4M3 (block 128x128 | per-tensor) / BF16 ... for the module owning `tensors`."""
    if f"{module}.qweight" in tensors:
        bits = _quant_bits(config, module)
        return f"INT{bits}" if bits and bits < 16 else "INT (packed, bits unknown)"
    weight = tensors[f"{module}.weight"]
    if weight.dtype in FP8_DTYPES:
        kind = weight.dtype.replace("F8_", "FP8 ")
        inv = tensors.get(f"{module}.weight_scale_inv")
        if inv is not None:
            return f"{kind} block " + "x".join(
                str(-(-dim // max(1, blocks))) for dim, blocks in zip(weight.shape, inv.shape, strict=False)
            )
        if f"{module}.weight_scale" in tensors:
            return f"{kind} per-tensor"
        return f"{kind} (no scale)"
    return weight.dtype


def _role(module: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """Every module (a tensor named .weight or .qweight) with its format, grouped by role; headers only."""
    layout = read_layout(path)
    tensors = {name: info for name, (_shard, info) in layout.all_tensors().items()}
    modules: dict[str, dict[str, Any]] = {}
    for name in tensors:
        module, _, suffix = name.rpartition(".")
        if (
            suffix in _MODULE_TENSOR_SUFFIXES
            and module not in modules
            and (suffix == "qweight" or f"{module}.qweight" not in tensors)
        ):
            owned = [
                n
                for n in (
                    f"{module}.{s}"
                    for s in ("weight", "qweight", "qzeros", "scales", "g_idx", "bias", *FP8_SCALE_NAMES)
                )
                if n in tensors
            ]
            modules[module] = {
                "format": module_format(tensors, module, layout.config),
                "bytes": sum(tensors[n].nbytes for n in owned),
                "tensors": owned,
            }
    owned_names = {n for info in modules.values() for n in info["tensors"]}
    groups: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"modules": 0, "bytes": 0})
    for module, info in modules.items():
        group = groups[(_role(module), info["format"])]
        group["modules"] += 1
        group["bytes"] += info["bytes"]
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"modules": 0, "bytes": 0})
    for info in modules.values():
        family = info["format"].split(" ")[0]
        totals[family]["modules"] += 1
        totals[family]["bytes"] += info["bytes"]
    other = Counter()
    other_bytes: Counter[str] = Counter()
    for name, info in tensors.items():
        if name not in owned_names:
            other[info.dtype] += 1
            other_bytes[info.dtype] += info.nbytes
    layers: dict[str, Counter[str]] = defaultdict(Counter)
    for module, info in modules.items():
        match = re.search(r"\.layers\.(\d+)\.", module)
        if match and not module.startswith("model.visual"):
            layers[match.group(1)][info["format"].split(" ")[0]] += 1
    return {
        "path": str(layout.path),
        "shards": len(layout.shard_names),
        "bytes": sum(h.file_size for h in layout.headers.values()),
        "modules": modules,
        "groups": [{"role": role, "format": fmt, **counts} for (role, fmt), counts in sorted(groups.items())],
        "totals": dict(sorted(totals.items())),
        "layers": {k: dict(sorted(v.items())) for k, v in sorted(layers.items(), key=lambda kv: int(kv[0]))},
        "other_tensors": {dtype: {"tensors": other[dtype], "bytes": other_bytes[dtype]} for dtype in sorted(other)},
    }


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def format_inspection(report: dict[str, Any]) -> str:
    lines = [f"{report['path']}: {report['shards']} shards, {_human(report['bytes'])}"]
    width = max((len(g["role"]) for g in report["groups"]), default=10)
    lines.append(f"  {'module role':<{width}}  {'format':<22} {'modules':>7}  bytes")
    for group in report["groups"]:
        lines.append(
            f"  {group['role']:<{width}}  {group['format']:<22} {group['modules']:>7}  {_human(group['bytes'])}"
        )
    lines.append(
        "  totals: "
        + ", ".join(f"{fmt} {t['modules']} modules ({_human(t['bytes'])})" for fmt, t in report["totals"].items())
    )
    if report["layers"]:
        per_layer = defaultdict(list)
        for layer, counts in report["layers"].items():
            per_layer[", ".join(f"{fmt} {n}" for fmt, n in counts.items())].append(int(layer))
        for counts, layer_ids in per_layer.items():
            lines.append(f"  decoder layers {_ranges(layer_ids)}: {counts}")
    if report["other_tensors"]:
        lines.append(
            "  other tensors: "
            + ", ".join(
                f"{dtype} {o['tensors']} ({_human(o['bytes'])})" for dtype, o in report["other_tensors"].items()
            )
        )
    return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    values = sorted(values)
    spans: list[str] = []
    start = prev = values[0]
    for value in values[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(spans)


# ---------------------------------------------------------------------------------------------------------
# Donors: where calibrated FP8 tensors come from
# ---------------------------------------------------------------------------------------------------------


class Donor:
    """An FP8 release: its index, and its shards on local disk (fetched on demand)."""

    description: str

    def weight_map(self) -> dict[str, str]:
        raise NotImplementedError

    def shard_path(self, shard: str) -> Path:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def locate(self, wanted: dict[str, str]) -> dict[str, tuple[Path, TensorInfo]]:
        """Where each wanted tensor (name -> donor shard, from the index) can be read locally.

        Here: every shard that holds one is opened (a Hub donor downloads it whole, once, into the HF cache).
        """
        located: dict[str, tuple[Path, TensorInfo]] = {}
        self.fetched = sorted(set(wanted.values()))
        for shard in self.fetched:
            path = self.shard_path(shard)
            try:
                header = read_header(path)
            except SafetensorsError as error:
                raise CheckpointError(f"donor {self.description}: {error}") from error
            for name in (n for n, s in wanted.items() if s == shard):
                if name not in header.tensors:
                    raise CheckpointError(f"donor {self.description}: index puts {name} in {shard}, which lacks it")
                located[name] = (path, header.tensors[name])
        return located

    def fetch_record(self) -> dict[str, Any]:
        return {"mode": "shards", "shards": list(getattr(self, "fetched", []))}


class LocalDonor(Donor):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / INDEX_NAME).is_file():
            raise CheckpointError(
                f"donor {self.path} has no {INDEX_NAME}; pass the FP8 release's directory (or a Hub repo id "
                "with --donor-revision)"
            )
        self._index = read_index(self.path / INDEX_NAME)
        self.description = str(self.path)

    def weight_map(self) -> dict[str, str]:
        return dict(self._index["weight_map"])

    def shard_path(self, shard: str) -> Path:
        path = self.path / shard
        if not path.is_file():
            raise CheckpointError(f"donor {self.path}: shard {shard} named in its index is missing")
        return path

    def identity(self) -> dict[str, Any]:
        raw = (self.path / INDEX_NAME).read_bytes()
        return {"kind": "local", "path": str(self.path), "index_sha256": hashlib.sha256(raw).hexdigest()}


class HubDonor(Donor):
    """A Hub repo at a pinned revision; files go through huggingface_hub (its cache, resume, offline mode)."""

    def __init__(self, repo: str, revision: str, cache_dir: Path | None) -> None:
        if not re.fullmatch(r"[0-9a-f]{40}", revision or ""):
            raise CheckpointError(
                f"--donor-revision {revision!r} is not a 40-hex commit; pin the donor repo {repo} to a commit"
            )
        self.repo, self.revision, self.cache_dir = repo, revision, cache_dir
        self.description = f"{repo}@{revision}"
        self._index = read_index(self._download(INDEX_NAME))

    def _download(self, filename: str) -> Path:
        try:
            from huggingface_hub import hf_hub_download
        except ModuleNotFoundError as error:
            raise CheckpointError("a Hub donor needs huggingface_hub; pass a local --donor directory") from error
        print(f"  fetching {self.repo}/{filename} @ {self.revision[:12]}", file=sys.stderr, flush=True)
        return Path(
            hf_hub_download(
                self.repo,
                filename,
                revision=self.revision,
                cache_dir=str(self.cache_dir) if self.cache_dir else None,
            )
        )

    def weight_map(self) -> dict[str, str]:
        return dict(self._index["weight_map"])

    def shard_path(self, shard: str) -> Path:
        return self._download(shard)

    def identity(self) -> dict[str, Any]:
        return {"kind": "hub", "repo": self.repo, "revision": self.revision}


RangeReader = Callable[[str, int, int], bytes]  # (file in the repo, start, length) -> exactly those bytes


class HubRangeDonor(HubDonor):
    """A Hub donor read by HTTP ranges: each needed shard's header, then only the wanted tensors' bytes.

    The wanted tensors are written, one at a time, into a small local extract (a safetensors file in the
    cache, named by the donor commit and the set of tensors), which a rerun reuses. For the 122B this
    reads ~0.5 GB instead of the donor shards that hold the shared experts (most of its ~120 GB).
    """

    def __init__(self, repo: str, revision: str, cache_dir: Path | None, read_range: RangeReader | None = None) -> None:
        super().__init__(repo, revision, cache_dir)
        self._read_range = read_range or self._http_range
        self.bytes_fetched = 0
        self.extract: Path | None = None

    def _http_range(self, filename: str, start: int, length: int) -> bytes:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        url = hf_hub_url(self.repo, filename, revision=self.revision)
        headers = build_hf_headers()
        headers["Range"] = f"bytes={start}-{start + length - 1}"
        data = bytearray()
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
            hf_raise_for_status(response)
            if response.status_code != 206 and start:
                raise CheckpointError(
                    f"donor {self.description}: the server ignored a range request for {filename} "
                    f"(HTTP {response.status_code}); use --donor-fetch shards"
                )
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) >= length:
                    break  # a server may send past the range's end; never read more than asked
        if len(data) < length:
            raise CheckpointError(f"donor {self.description}: {filename} bytes {start}+{length} came back short")
        return bytes(data[:length])

    def _fetch(self, filename: str, start: int, length: int) -> bytes:
        data = self._read_range(filename, start, length)
        if len(data) != length:
            raise CheckpointError(f"donor {self.description}: {filename} bytes {start}+{length} came back short")
        self.bytes_fetched += length
        return data

    def locate(self, wanted: dict[str, str]) -> dict[str, tuple[Path, TensorInfo]]:
        from huggingface_hub import constants

        root = Path(self.cache_dir or constants.HF_HUB_CACHE) / "sparkfleet-donor-extracts"
        key = hashlib.sha256(json.dumps(sorted(wanted.items())).encode()).hexdigest()[:16]
        extract = root / f"{self.repo.replace('/', '--')}@{self.revision}" / f"extract-{key}.safetensors"
        self.extract = extract
        if extract.is_file():
            try:
                header = read_header(extract)
                if set(header.tensors) == set(wanted):
                    return {name: (extract, header.tensors[name]) for name in wanted}
            except SafetensorsError:
                pass  # rebuilt below
        remote: dict[str, TensorInfo] = {}
        for shard in sorted(set(wanted.values())):
            where = f"{self.repo}@{self.revision[:12]}/{shard}"
            try:
                length = header_length(self._fetch(shard, 0, 8), where)
                header = parse_header(self._fetch(shard, 8, length), where)
            except SafetensorsError as error:
                raise CheckpointError(f"donor {self.description}: {error}") from error
            for name in (n for n, s in wanted.items() if s == shard):
                if name not in header.tensors:
                    raise CheckpointError(f"donor {self.description}: index puts {name} in {shard}, which lacks it")
                remote[name] = header.tensors[name]
        entries = [
            ShardEntry(
                name,
                info.dtype,
                info.shape,
                lambda name=name, info=info: self._fetch(wanted[name], info.start, info.nbytes),
            )
            for name, info in sorted(remote.items())
        ]
        extract.parent.mkdir(parents=True, exist_ok=True)
        print(f"  reading {len(entries)} donor tensors by range into {extract}", file=sys.stderr, flush=True)
        write_shard(extract, entries, {"format": "pt", "source": self.description}, hash_output=False)
        header = read_header(extract)
        return {name: (extract, header.tensors[name]) for name in wanted}

    def fetch_record(self) -> dict[str, Any]:
        return {"mode": "ranges", "bytes": self.bytes_fetched, "extract": str(self.extract) if self.extract else None}


def open_donor(spec: str | None, revision: str | None, cache_dir: Path | None, fetch: str = "shards") -> Donor | None:
    if spec is None:
        if revision:
            raise CheckpointError("--donor-revision without --donor; name the donor repo or drop the revision")
        return None
    if Path(spec).is_dir():
        if fetch != "shards":
            raise CheckpointError(f"--donor-fetch {fetch} is for a Hub donor; {spec} is a local directory")
        return LocalDonor(Path(spec))
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        if not revision:
            raise CheckpointError(f"--donor {spec} is a Hub repo: pin it with --donor-revision <40-hex commit>")
        if fetch == "ranges":
            return HubRangeDonor(spec, revision, cache_dir)
        return HubDonor(spec, revision, cache_dir)
    raise CheckpointError(f"--donor {spec!r} is neither a directory nor a Hub repo id (owner/name)")


# ---------------------------------------------------------------------------------------------------------
# hybrid-fp8
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ModulePlan:
    """One BF16 module of the base that becomes FP8."""

    module: str
    base_shard: str
    base_weight: TensorInfo
    scale_name: str  # weight_scale_inv (block) or weight_scale (per tensor)
    scale_shape: tuple[int, ...]
    donor_tensors: dict[str, tuple[Path, TensorInfo]] = field(default_factory=dict)  # suffix -> where
    error: dict[str, float] | None = None


@dataclass
class BuildOptions:
    base: Path
    out: Path
    donor: Donor | None = None
    scales: str = "block"
    module_pattern: str = DEFAULT_MODULE_PATTERN
    error_report: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    force: bool = False
    hash_output: bool = True


def select_modules(layout: CheckpointLayout, pattern: str) -> dict[str, tuple[str, TensorInfo]]:
    """Base modules whose name matches `pattern` and whose weight is BF16/F16/F32, 2-D."""
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise CheckpointError(f"--modules {pattern!r} is not a valid regular expression ({error})") from error
    selected: dict[str, tuple[str, TensorInfo]] = {}
    matched_other: list[str] = []
    for name, (shard, info) in layout.all_tensors().items():
        if not name.endswith(".weight"):
            continue
        module = name.removesuffix(".weight")
        if not regex.search(module):
            continue
        if info.dtype in FLOAT_WEIGHT_DTYPES and len(info.shape) == 2:
            selected[module] = (shard, info)
        else:
            matched_other.append(f"{module} ({info.dtype} {list(info.shape)})")
    if matched_other:
        raise CheckpointError(
            f"--modules {pattern!r} matches modules that are not 2-D BF16/F16/F32 in the base: "
            f"{', '.join(sorted(matched_other)[:3])}; pass the INT4 base (not a hybrid) or narrow --modules"
        )
    if not selected:
        raise CheckpointError(
            f"--modules {pattern!r} matches no BF16 weight in {layout.path}; check the pattern against "
            "`sparkfleet checkpoint inspect`"
        )
    for module in selected:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group:
                siblings = [f"{parent}.{s}" for s in group if layout.tensor(f"{parent}.{s}.weight")]
                missing = [s for s in siblings if s not in selected]
                if missing:
                    raise CheckpointError(
                        f"--modules {pattern!r} selects {module} but not {missing[0]}; vLLM fuses them into "
                        "one layer, so select all of them or none"
                    )
    return dict(sorted(selected.items()))


def _plan_modules(layout: CheckpointLayout, options: BuildOptions) -> dict[str, ModulePlan]:
    selected = select_modules(layout, options.module_pattern)
    plans: dict[str, ModulePlan] = {}
    for module, (shard, info) in selected.items():
        rows, cols = info.shape
        if options.scales == "block":
            plan = ModulePlan(module, shard, info, "weight_scale_inv", (-(-rows // 128), -(-cols // 128)))
        else:
            plan = ModulePlan(module, shard, info, "weight_scale", ())
        plans[module] = plan
    if options.donor is not None:
        _plan_donor(plans, options.donor)
    return plans


def _plan_donor(plans: dict[str, ModulePlan], donor: Donor) -> None:
    """Find each module's FP8 weight and scales in the donor; fetch only the shards holding them."""
    weight_map = donor.weight_map()
    wanted: dict[str, str] = {}
    for module in plans:
        if f"{module}.weight" not in weight_map:
            raise CheckpointError(
                f"donor {donor.description} has no {module}.weight; is it the FP8 release of the same model?"
            )
        for suffix in ("weight", *FP8_SCALE_NAMES):
            name = f"{module}.{suffix}"
            if name in weight_map:
                wanted[name] = weight_map[name]
    located = donor.locate(wanted)
    for module, plan in plans.items():
        for suffix in ("weight", *FP8_SCALE_NAMES):
            name = f"{module}.{suffix}"
            if name in located:
                plan.donor_tensors[suffix] = located[name]
        weight = plan.donor_tensors["weight"][1]
        if weight.dtype != "F8_E4M3":
            raise CheckpointError(
                f"donor {donor.description}: {module}.weight is {weight.dtype}, not F8_E4M3; pass an FP8 E4M3 "
                "release as --donor, or drop --donor to quantize here"
            )
        if weight.shape != plan.base_weight.shape:
            raise CheckpointError(
                f"donor {donor.description}: {module}.weight has shape {list(weight.shape)}, the base "
                f"{list(plan.base_weight.shape)}; the donor is not the same model"
            )
        rows, cols = weight.shape
        if "weight_scale_inv" in plan.donor_tensors:
            plan.scale_name = "weight_scale_inv"
            plan.scale_shape = (-(-rows // 128), -(-cols // 128))
        elif "weight_scale" in plan.donor_tensors:
            plan.scale_name, plan.scale_shape = "weight_scale", plan.donor_tensors["weight_scale"][1].shape
            if plan.donor_tensors["weight_scale"][1].numel != 1:
                raise CheckpointError(f"donor {donor.description}: {module}.weight_scale is not one value")
        else:
            raise CheckpointError(
                f"donor {donor.description}: {module}.weight is FP8 but has neither weight_scale_inv nor "
                "weight_scale; the donor cannot be dequantized"
            )
        scale = plan.donor_tensors[plan.scale_name][1]
        if scale.dtype != "F32" or scale.shape != plan.scale_shape:
            raise CheckpointError(
                f"donor {donor.description}: {module}.{plan.scale_name} is {scale.dtype} {list(scale.shape)}; "
                f"expected F32 {list(plan.scale_shape)} (128x128 blocks)"
            )


class _ModuleProducer:
    """Produces a module's FP8 weight, then its scales, as the shard writer reaches them (one at a time)."""

    def __init__(self, plan: ModulePlan, options: BuildOptions) -> None:
        self.plan, self.options = plan, options
        self._pending: dict[str, bytes] = {}

    def weight(self) -> bytes:
        plan = self.plan
        needs_base = self.options.error_report or not plan.donor_tensors
        base_bytes = read_tensor_bytes(self.options.base / plan.base_shard, plan.base_weight) if needs_base else b""
        if plan.donor_tensors:
            produced = {suffix: read_tensor_bytes(path, info) for suffix, (path, info) in plan.donor_tensors.items()}
            if self.options.error_report:
                from sparkfleet.build import fp8_quant

                reference = fp8_quant.tensor_from_bytes(base_bytes, plan.base_weight.dtype, plan.base_weight.shape)
                fp8 = fp8_quant.tensor_from_bytes(produced["weight"], "F8_E4M3", plan.base_weight.shape)
                scale = fp8_quant.tensor_from_bytes(produced[plan.scale_name], "F32", plan.scale_shape)
                plan.error = fp8_quant.relative_error(reference, fp8_quant.dequantize(fp8, scale))
        else:
            from sparkfleet.build import fp8_quant

            reference = fp8_quant.tensor_from_bytes(base_bytes, plan.base_weight.dtype, plan.base_weight.shape)
            fp8, scale = fp8_quant.quantize(reference, self.options.scales)
            produced = {"weight": fp8_quant.tensor_to_bytes(fp8), plan.scale_name: fp8_quant.tensor_to_bytes(scale)}
            if self.options.error_report:
                plan.error = fp8_quant.relative_error(reference, fp8_quant.dequantize(fp8, scale))
        weight = produced.pop("weight")
        self._pending = produced
        return weight

    def extra(self, suffix: str) -> Callable[[], bytes]:
        return lambda: self._pending.pop(suffix)

    def extra_tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(suffix, dtype, shape) of the tensors written after the weight."""
        if self.plan.donor_tensors:
            return [
                (suffix, info.dtype, info.shape)
                for suffix, (_path, info) in self.plan.donor_tensors.items()
                if suffix != "weight"
            ]
        return [(self.plan.scale_name, "F32", self.plan.scale_shape)]


def _fingerprint(layout: CheckpointLayout, options: BuildOptions) -> str:
    digest = hashlib.sha256()
    for name in (INDEX_NAME, "config.json"):
        if (layout.path / name).is_file():
            digest.update(hashlib.sha256((layout.path / name).read_bytes()).digest())
    for shard in layout.shard_names:
        header = layout.headers[shard]
        digest.update(shard.encode())
        digest.update(str(header.file_size).encode())
        digest.update(json.dumps([(i.name, i.dtype, i.shape) for i in header.tensors.values()]).encode())
    digest.update(json.dumps(_options_record(options), sort_keys=True).encode())
    return digest.hexdigest()


def _options_record(options: BuildOptions) -> dict[str, Any]:
    return {
        "donor": options.donor.identity() if options.donor else None,
        "scales": None if options.donor else options.scales,
        "modules": options.module_pattern,
        "error_report": options.error_report,
    }


def _up_to_date(out: Path, fingerprint: str) -> dict[str, Any] | None:
    manifest_path = out / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("inputs_fingerprint") != fingerprint:
        return None
    for shard in manifest.get("output_shards", []):
        path = out / shard["name"]
        if not path.is_file() or path.stat().st_size != shard["size"]:
            return None
    return manifest


def _updated_config(config: dict[str, Any], plans: dict[str, ModulePlan], source: str) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        raise CheckpointError(
            "base config.json has no quantization_config; hybrid-fp8 takes the AutoRound INT4 base checkpoint"
        )
    block = {plan.scale_name for plan in plans.values()} == {"weight_scale_inv"}
    extra = quant.setdefault("extra_config", {})
    for module in plans:
        # Not 16-bit any more: a vLLM without patch 0002 must not load these FP8 bytes as BF16 values.
        extra[module] = {"bits": 8, "data_type": "fp8_e4m3", "group_size": 128 if block else -1, "sym": True}
    quant["hybrid_fp8"] = {
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128] if block else None,
        "source": source,
        "modules": sorted(plans),
    }
    return config


def _shard_extent(header: ShardHeader, entries: list[ShardEntry], rewritten: bool) -> tuple[int, list[int]]:
    """(bytes, each tensor's end offset) of an output shard: a rewritten one as write_shard lays it out,
    a copied one as the base shard is."""
    if not rewritten:
        return header.file_size, sorted(info.end for info in header.tensors.values())
    end, ends = len(encode_header(entries, header.metadata or {"format": "pt"})), []
    for entry in entries:
        end += entry.nbytes
        ends.append(end)
    return end, ends


class BuildProgress:
    """The build's progress as one line in a file (``--progress-file``), for a poll of the build to print
    (Ansible's, through files/bin/sparkfleet-job-progress): what the build does before it writes, then
    e.g. ``3/10 shards, 1203 of 2861 tensors, 3.9 GiB of 14.0 GiB written, 202.4 MiB/s``, refreshed every
    ``interval`` s from the size of the shard being written. The file goes when the build ends; without
    a path this keeps nothing."""

    def __init__(self, path: Path | None, interval: float = 2.0) -> None:
        self.path, self.interval = path, interval
        self.text = "starting"
        self._shards: list[tuple[int, list[int]]] = []  # per output shard: bytes, tensor end offsets
        self._written = 0  # shards complete
        self._partial: Path | None = None  # the shard being written
        self._began = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the refresh thread and the build both write the file

    def __enter__(self) -> BuildProgress:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._keep()
            self._thread = threading.Thread(target=self._refresh, name="checkpoint-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)

    def say(self, text: str) -> None:
        self.text = text
        self._keep()

    def plan(self, shards: list[tuple[int, list[int]]]) -> None:
        self._shards, self._began = shards, time.monotonic()
        self._keep()

    def writing(self, number: int, partial: Path) -> None:
        self._written, self._partial = number - 1, partial
        self._keep()

    def written(self, number: int) -> None:
        self._written, self._partial = number, None
        self._keep()

    def line(self) -> str:
        shards, written = self._shards, self._written
        if not shards:
            return self.text
        done = sum(size for size, _ in shards[:written])
        tensors = sum(len(ends) for _, ends in shards[:written])
        if self._partial is not None and written < len(shards):
            size, ends = shards[written]
            try:
                part = min(self._partial.stat().st_size, size)
            except OSError:  # not open yet, or just renamed to its final name
                part = size if self._partial.with_suffix("").exists() else 0
            done, tensors = done + part, tensors + bisect.bisect_right(ends, part)
        total = sum(size for size, _ in shards)
        rate = done / max(time.monotonic() - self._began, 1e-9)
        return (
            f"{written}/{len(shards)} shards, {tensors} of {sum(len(ends) for _, ends in shards)} tensors, "
            f"{_human(done)} of {_human(total)} written, {_human(rate)}/s"
        )

    def _keep(self) -> None:
        if self.path is None:
            return
        fresh = self.path.with_name(self.path.name + ".tmp")
        try:
            with self._lock:
                fresh.write_text(self.line() + "\n")
                os.replace(fresh, self.path)
        except OSError as error:  # a progress line is never worth failing the build for
            print(f"  (progress file {self.path}: {error.strerror})", file=sys.stderr, flush=True)

    def _refresh(self) -> None:
        while not self._stop.wait(self.interval):
            self._keep()


def build_hybrid(
    options: BuildOptions, log: Callable[[str], None] = print, progress: BuildProgress | None = None
) -> dict[str, Any]:
    """Write the hybrid checkpoint into options.out; return the manifest (also written as MANIFEST_NAME).
    ``progress`` (``--progress-file``) is told what the build does, and the shards' bytes as they are written."""
    started = time.monotonic()
    progress = progress or BuildProgress(None)
    base, out = Path(options.base), Path(options.out)
    if options.scales not in ("block", "tensor"):
        raise CheckpointError(f"--scales {options.scales!r} is not block or tensor")
    if options.chunk_bytes < 4096:
        raise CheckpointError(f"--chunk-mib gives {options.chunk_bytes} bytes; use at least 1 MiB")
    if out.resolve() == base.resolve():
        raise CheckpointError(f"--out {out} is the base checkpoint; write the hybrid to a new directory")
    layout = read_layout(base)
    if layout.config is None:
        raise CheckpointError(f"base {base} has no config.json; pass the INT4 base checkpoint directory")
    fingerprint = _fingerprint(layout, options)
    existing = _up_to_date(out, fingerprint)
    if existing is not None and not options.force:
        log(f"{out} is up to date (manifest matches the inputs); nothing to do")
        return {**existing, "changed": False}
    if options.error_report or options.donor is None:
        from sparkfleet.build import fp8_quant

        fp8_quant.require_torch()
    progress.say(
        f"planning: reading the base {base.name}"
        + (f" and fetching the tensors it needs of donor {options.donor.description}" if options.donor else "")
    )
    plans = _plan_modules(layout, options)  # fetches the donor shards it needs
    if out.exists() and any(out.iterdir()) and not options.force and existing is None:
        raise CheckpointError(
            f"--out {out} exists and is not a hybrid built from these inputs; pass an empty directory or --force"
        )
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        manifest = _write_hybrid(layout, plans, options, staging, fingerprint, started, log, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    summary = manifest["error_summary"]
    error_text = (
        f", FP8 rel. error median {summary['rel_fro_median']:.4f} max {summary['rel_fro_max']:.4f}" if summary else ""
    )
    log(
        f"wrote {out}: {len(plans)} modules FP8 ({manifest['source']}), {len(manifest['output_shards'])} shards, "
        f"{manifest['bytes_written'] / 1e9:.2f} GB in {manifest['seconds']:.1f} s ({manifest['mb_per_s']:.0f} MB/s), "
        f"saved {manifest['bytes_saved'] / 1e6:.1f} MB{error_text}, peak RSS {manifest['peak_rss_mib']:.0f} MiB"
    )
    return {**manifest, "changed": True}


def _write_hybrid(
    layout: CheckpointLayout,
    plans: dict[str, ModulePlan],
    options: BuildOptions,
    staging: Path,
    fingerprint: str,
    started: float,
    log: Callable[[str], None],
    progress: BuildProgress,
) -> dict[str, Any]:
    base = layout.path
    source = f"donor {options.donor.description}" if options.donor else f"quantized here ({options.scales} scales)"
    log(f"hybrid-fp8: {len(plans)} modules -> FP8 E4M3 ({source}); {len(layout.shard_names)} base shards")

    by_shard: dict[str, list[ModulePlan]] = defaultdict(list)
    for plan in plans.values():
        by_shard[plan.base_shard].append(plan)
    # every shard's tensors first (their data is produced only as the writer reaches them): the totals
    # of the progress line, and a base that already holds a module's scales refused before anything is written
    shards: list[tuple[str, dict[str, ModulePlan], list[ShardEntry]]] = []
    for shard in layout.shard_names:
        header = layout.headers[shard]
        replaced = {plan.base_weight.name: plan for plan in by_shard.get(shard, [])}
        entries: list[ShardEntry] = []
        for name, info in header.tensors.items():
            plan = replaced.get(name)
            if plan is None:
                entries.append(ShardEntry(name, info.dtype, info.shape, ByteRange(header.path, info.start, info.end)))
                continue
            producer = _ModuleProducer(plan, options)
            entries.append(ShardEntry(name, "F8_E4M3", info.shape, producer.weight))
            for suffix, dtype, shape in producer.extra_tensors():
                entries.append(ShardEntry(f"{plan.module}.{suffix}", dtype, shape, producer.extra(suffix)))
        # A base that already has scale tensors for a module would now hold them twice.
        names = [entry.name for entry in entries]
        if len(names) != len(set(names)):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(f"base shard {shard} already holds {duplicate}; pass the INT4 base, not a hybrid")
        shards.append((shard, replaced, entries))
    progress.plan([_shard_extent(layout.headers[name], entries, bool(swap)) for name, swap, entries in shards])

    weight_map: dict[str, str] = {}
    written_shards: list[dict[str, Any]] = []
    bytes_read = 0
    for number, (shard, replaced, entries) in enumerate(shards, 1):
        shard_started = time.monotonic()
        header = layout.headers[shard]
        progress.writing(number, staging / (shard + ".partial"))
        if replaced:
            written = write_shard(
                staging / shard,
                entries,
                header.metadata or {"format": "pt"},
                chunk_bytes=options.chunk_bytes,
                hash_output=options.hash_output,
            )
        else:  # nothing to change: the same bytes, header included
            written = copy_file(
                header.path, staging / shard, chunk_bytes=options.chunk_bytes, hash_output=options.hash_output
            )
        progress.written(number)
        bytes_read += header.file_size
        for entry in entries:
            weight_map[entry.name] = shard
        seconds = time.monotonic() - shard_started
        written_shards.append(
            {
                "name": shard,
                "size": written.size,
                "sha256": written.sha256,
                "tensors": written.tensors,
                "replaced_modules": len(replaced),
                "seconds": round(seconds, 3),
            }
        )
        log(
            f"  [{number}/{len(layout.shard_names)}] {shard}: {len(replaced)} modules FP8, "
            f"{written.size / 1e6:.1f} MB in {seconds:.1f} s ({written.size / 1e6 / max(seconds, 1e-9):.0f} MB/s)"
        )

    total_size = sum(
        entry_info.nbytes
        for shard in layout.shard_names
        for entry_info in read_header(staging / shard).tensors.values()
    )
    index = {
        "metadata": {**((layout.index or {}).get("metadata") or {}), "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = _updated_config(layout.config, plans, source)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = []
    for item in sorted(base.iterdir()):
        if item.name in {INDEX_NAME, "config.json", MANIFEST_NAME, *layout.shard_names} or not item.is_file():
            continue
        shutil.copyfile(item, staging / item.name)
        copied.append(item.name)

    seconds = time.monotonic() - started
    errors = {module: plan.error for module, plan in plans.items() if plan.error is not None}
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "tool": "sparkfleet checkpoint hybrid-fp8",
        "base": str(base),
        "source": source,
        "inputs_fingerprint": fingerprint,
        "options": _options_record(options),
        "donor_fetch": options.donor.fetch_record() if options.donor else None,
        "fp8_modules": {
            module: {
                "shape": list(plan.base_weight.shape),
                "scale": plan.scale_name,
                "scale_shape": list(plan.scale_shape),
                "base_bytes": plan.base_weight.nbytes,
                "fp8_bytes": plan.base_weight.numel,
                "rel_error": plan.error,
            }
            for module, plan in plans.items()
        },
        "error_summary": _error_summary(errors),
        "bytes_saved": sum(plan.base_weight.nbytes - plan.base_weight.numel for plan in plans.values())
        - sum(4 * max(1, _prod(plan.scale_shape)) for plan in plans.values()),
        "output_shards": written_shards,
        "copied_files": copied,
        "bytes_read": bytes_read,
        "bytes_written": sum(s["size"] for s in written_shards),
        "seconds": round(seconds, 3),
        "mb_per_s": round(sum(s["size"] for s in written_shards) / 1e6 / max(seconds, 1e-9), 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, where Linux has it: ru_maxrss of an exec'd child also counts the RSS
    its parent had when it forked (the kernel keeps the forked mm's high-water mark across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prod(shape: tuple[int, ...]) -> int:
    result = 1
    for dim in shape:
        result *= dim
    return result


def _error_summary(errors: dict[str, dict[str, float]]) -> dict[str, float] | None:
    if not errors:
        return None
    values = sorted(e["rel_fro"] for e in errors.values())
    return {
        "modules": len(values),
        "rel_fro_min": values[0],
        "rel_fro_median": values[len(values) // 2],
        "rel_fro_max": values[-1],
        "max_abs_over_max_ref_max": max(e["max_abs_over_max_ref"] for e in errors.values()),
    }


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint",
        help="build the dense profile's hybrid INT4 + FP8 checkpoint (streaming), inspect checkpoints",
        description=__doc__.splitlines()[0],
    )
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    inspect = sub.add_parser("inspect", help="which modules of a checkpoint are INT4, FP8, BF16 (headers only)")
    inspect.add_argument("path", type=Path, help="checkpoint directory (config.json + safetensors)")
    inspect.add_argument("--json", action="store_true", help="print the full report as JSON")
    inspect.set_defaults(func=run_inspect)

    hybrid = sub.add_parser(
        "hybrid-fp8",
        help="write the hybrid INT4 + FP8 shared-expert checkpoint from the INT4 base, shard by shard",
        description="Build the hybrid INT4 + FP8 checkpoint from the AutoRound INT4 base, streaming.",
    )
    hybrid.add_argument("--base", type=Path, required=True, help="the INT4 base checkpoint directory")
    hybrid.add_argument("--out", type=Path, required=True, help="output directory (new, or a previous build)")
    hybrid.add_argument(
        "--donor",
        help="FP8 release to take calibrated tensors from: a directory, or a Hub repo id with --donor-revision "
        "(only the shards holding the wanted tensors are fetched); omit to quantize here",
    )
    hybrid.add_argument("--donor-revision", help="40-hex commit of a Hub --donor")
    hybrid.add_argument(
        "--donor-fetch",
        choices=("shards", "ranges"),
        default="shards",
        help="Hub donor: download the shards holding the wanted tensors (default), or read only the wanted "
        "tensors by HTTP range into a small extract",
    )
    hybrid.add_argument("--donor-cache-dir", type=Path, help="Hugging Face cache for a Hub donor (default: HF_HOME's)")
    hybrid.add_argument(
        "--scales",
        choices=("block", "tensor"),
        default="block",
        help="without --donor: 128x128 block scales (weight_scale_inv, default) or one per-tensor weight_scale",
    )
    hybrid.add_argument(
        "--modules",
        default=DEFAULT_MODULE_PATTERN,
        help=f"regex over module names selecting the BF16 modules to make FP8 (default: {DEFAULT_MODULE_PATTERN})",
    )
    hybrid.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES // 2**20, help="copy buffer (MiB)")
    hybrid.add_argument(
        "--no-error-report",
        action="store_true",
        help="with --donor: skip the FP8-vs-BF16 error (then torch is not needed)",
    )
    hybrid.add_argument("--no-hash", action="store_true", help="do not sha256 the output shards")
    hybrid.add_argument("--force", action="store_true", help="rebuild even if --out is up to date or foreign")
    hybrid.add_argument("--json", action="store_true", help="print the manifest as JSON at the end")
    hybrid.add_argument(
        "--progress-file",
        type=Path,
        help="keep a one-line progress report in this file while the build runs (shards, tensors and bytes "
        "written of the total, rate), removed at the end",
    )
    hybrid.set_defaults(func=run_hybrid)
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])


def run_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_checkpoint(args.path)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_inspection(report))
    return 0


def run_hybrid(args: argparse.Namespace) -> int:
    try:
        donor = open_donor(args.donor, args.donor_revision, args.donor_cache_dir, args.donor_fetch)
        if args.no_error_report and donor is None:
            raise CheckpointError("--no-error-report needs --donor (quantizing here always measures the error)")
        options = BuildOptions(
            base=args.base,
            out=args.out,
            donor=donor,
            scales=args.scales,
            module_pattern=args.modules,
            error_report=not args.no_error_report,
            chunk_bytes=args.chunk_mib * 2**20,
            force=args.force,
            hash_output=not args.no_hash,
        )
        # With --json, stdout carries only the JSON (for Ansible); progress goes to stderr.
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
        with BuildProgress(args.progress_file) as progress:
            manifest = build_hybrid(options, log=log, progress=progress)
    except (CheckpointError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    return 0
