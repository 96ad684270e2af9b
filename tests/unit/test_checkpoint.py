"""sparkfleet checkpoint: streaming safetensors I/O, `inspect`, and `hybrid-fp8` with a donor (standard library only).

The quantizing path and the error report need torch; they are tested in tests/vllm/test_checkpoint_hybrid_fp8.py.
Here the donor path runs with --no-error-report, which copies the donor's FP8 tensors byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from sparkfleet.build import checkpoint
from sparkfleet.build.checkpoint import (
    INDEX_NAME,
    MANIFEST_NAME,
    BuildOptions,
    CheckpointError,
    LocalDonor,
    build_hybrid,
    inspect_checkpoint,
    read_layout,
)
from sparkfleet.build.safetensors_stream import (
    ByteRange,
    SafetensorsError,
    ShardEntry,
    read_header,
    read_tensor_bytes,
    write_shard,
)
from sparkfleet.cli import main as cli_main
from tests.fixtures.hybrid_fp8_checkpoint import write_hybrid_fp8_checkpoint

SHARED = "model.language_model.layers.{layer}.mlp.shared_expert.{proj}"
SHARED_MODULES = sorted(SHARED.format(layer=i, proj=p) for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj"))
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        form: write_hybrid_fp8_checkpoint(root / form, fp8_scales=form).path for form in ("none", "block", "tensor")
    }


def _quiet(_line: str) -> None:
    pass


def _all_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    layout = read_layout(path)
    return {
        name: (info.dtype, info.shape, read_tensor_bytes(layout.path / shard, info))
        for name, (shard, info) in layout.all_tensors().items()
    }


# --------------------------------------------------------------------------------------------------------
# safetensors_stream
# --------------------------------------------------------------------------------------------------------


def test_header_of_a_fixture_shard(ckpts: dict[str, Path]) -> None:
    header = read_header(ckpts["block"] / "model-00002-of-00002.safetensors")
    scale = header.tensors[SHARED.format(layer=0, proj="down_proj") + ".weight_scale_inv"]
    assert (scale.dtype, scale.shape, scale.nbytes) == ("F32", (2, 2), 16)
    assert list(header.tensors) == sorted(header.tensors, key=lambda n: header.tensors[n].start)


def test_write_shard_round_trip_through_a_small_buffer(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    source = read_header(ckpts["none"] / "model-00001-of-00002.safetensors")
    entries = [
        ShardEntry(info.name, info.dtype, info.shape, ByteRange(source.path, info.start, info.end))
        for info in source.tensors.values()
    ]
    entries.append(ShardEntry("extra", "F32", (3,), lambda: struct.pack("<3f", 1.0, 2.0, 3.0)))
    written = write_shard(tmp_path / "out.safetensors", entries, {"format": "pt"}, chunk_bytes=4096)
    header = read_header(written.path)
    assert written.size == written.path.stat().st_size == header.file_size
    assert header.metadata == {"format": "pt"}
    for info in source.tensors.values():
        assert read_tensor_bytes(written.path, header.tensors[info.name]) == read_tensor_bytes(source.path, info)
    assert read_tensor_bytes(written.path, header.tensors["extra"]) == struct.pack("<3f", 1.0, 2.0, 3.0)
    assert not (tmp_path / "out.safetensors.partial").exists()


def test_write_shard_refuses_a_producer_of_the_wrong_size(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match=r"tensor 'x': produced 4 bytes, F32 \[2\] needs 8"):
        write_shard(tmp_path / "bad.safetensors", [ShardEntry("x", "F32", (2,), lambda: b"\0" * 4)])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:-3], "truncated download"),
        (lambda data: data[:8] + b"{not json" + data[17:], "header is not JSON"),
        (lambda data: struct.pack("<Q", 10**12) + data[8:], "does not fit"),
        (lambda data: data[:4], "too short"),
    ],
)
def test_damaged_shards_are_named(tmp_path: Path, ckpts: dict[str, Path], damage: Any, message: str) -> None:
    data = (ckpts["none"] / "model-00002-of-00002.safetensors").read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(data))
    with pytest.raises(SafetensorsError, match=message) as caught:
        read_header(bad)
    assert str(bad) in str(caught.value)


# --------------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------------


def test_inspect_tells_int4_fp8_and_bf16_apart(ckpts: dict[str, Path]) -> None:
    base, block, tensor = (inspect_checkpoint(ckpts[form]) for form in ("none", "block", "tensor"))
    for report in (base, block, tensor):
        assert report["totals"]["INT4"]["modules"] == 31
        assert report["modules"]["model.language_model.layers.1.self_attn.q_proj"]["format"] == "INT4"
        assert report["modules"]["lm_head"]["format"] == "BF16"
        assert report["modules"]["model.language_model.layers.0.mlp.shared_expert_gate"]["format"] == "BF16"
    assert {base["modules"][m]["format"] for m in SHARED_MODULES} == {"BF16"}
    assert "FP8" not in base["totals"]
    assert {block["modules"][m]["format"] for m in SHARED_MODULES} == {"FP8 E4M3 block 128x128"}
    assert {tensor["modules"][m]["format"] for m in SHARED_MODULES} == {"FP8 E4M3 per-tensor"}
    assert block["totals"]["FP8"]["modules"] == 6
    assert block["totals"]["BF16"]["modules"] == base["totals"]["BF16"]["modules"] - 6
    # Per decoder layer: layer 0 is GDN (3 INT4 attention projections), layer 1 full attention (4).
    assert block["layers"] == {"0": {"BF16": 8, "FP8": 3, "INT4": 15}, "1": {"BF16": 6, "FP8": 3, "INT4": 16}}
    # The FP8 scale sits in another shard than its weight; it still belongs to the module.
    down = block["modules"][SHARED.format(layer=0, proj="down_proj")]
    assert down["tensors"][-1].endswith(".weight_scale_inv")


def test_inspect_cli_prints_roles_and_totals(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["checkpoint", "inspect", str(ckpts["block"])]) == 0
    out = capsys.readouterr().out
    assert "model.language_model.layers.*.mlp.shared_expert.down_proj  FP8 E4M3 block 128x128" in out
    assert "model.language_model.layers.*.mlp.experts.*.gate_proj      INT4" in out
    assert "totals: BF16 28 modules" in out and "FP8 6 modules" in out and "INT4 31 modules" in out
    assert cli_main(["checkpoint", "inspect", "--json", str(ckpts["block"])]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["FP8"]["modules"] == 6


def test_inspect_of_a_non_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has neither model.safetensors.index.json nor model.safetensors" in err


# --------------------------------------------------------------------------------------------------------
# hybrid-fp8 with a donor (no torch needed)
# --------------------------------------------------------------------------------------------------------


def _donor_with_unrelated_shard(tmp_path: Path, donor: Path) -> Path:
    """The fixture donor plus a third shard holding only a tensor the builder never needs."""
    copy = tmp_path / "donor"
    shutil.copytree(donor, copy)
    write_shard(copy / "model-extra.safetensors", [ShardEntry("mtp.fc.weight", "F32", (2,), lambda: b"\0" * 8)])
    index = json.loads((copy / INDEX_NAME).read_text())
    index["weight_map"]["mtp.fc.weight"] = "model-extra.safetensors"
    (copy / INDEX_NAME).write_text(json.dumps(index))
    return copy


class _RecordingDonor(LocalDonor):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.opened: list[str] = []

    def shard_path(self, shard: str) -> Path:
        self.opened.append(shard)
        return super().shard_path(shard)


def test_donor_build_copies_fp8_tensors_and_everything_else_unchanged(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    donor = _RecordingDonor(_donor_with_unrelated_shard(tmp_path, ckpts["block"]))
    out = tmp_path / "hybrid"
    manifest = build_hybrid(BuildOptions(base=ckpts["none"], out=out, donor=donor, error_report=False), log=_quiet)
    assert manifest["changed"] is True
    # Only the donor shards that hold wanted tensors (found through its index) were opened.
    assert sorted(donor.opened) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    base, donor_bytes, result = _all_bytes(ckpts["none"]), _all_bytes(donor.path), _all_bytes(out)
    for name, value in result.items():
        module = name.rpartition(".")[0]
        if module in SHARED_MODULES:
            assert value == donor_bytes[name], name
        else:
            assert value == base[name], name
    assert set(result) == set(base) | {f"{m}.weight_scale_inv" for m in SHARED_MODULES}
    # Scales live next to their weight in the output; the index says so, and total_size adds up.
    index = json.loads((out / INDEX_NAME).read_text())
    for module in SHARED_MODULES:
        assert index["weight_map"][f"{module}.weight_scale_inv"] == index["weight_map"][f"{module}.weight"]
    layout = read_layout(out)
    assert index["metadata"]["total_size"] == sum(i.nbytes for _s, i in layout.all_tensors().values())
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["hybrid_fp8"]["modules"] == SHARED_MODULES
    assert quant["hybrid_fp8"]["weight_block_size"] == [128, 128]
    assert {quant["extra_config"][m]["bits"] for m in SHARED_MODULES} == {8}
    assert quant["extra_config"]["model.language_model.layers.0.mlp.gate"]["bits"] == 16
    assert (out / "generation_config.json").read_bytes() == (ckpts["none"] / "generation_config.json").read_bytes()
    written = json.loads((out / MANIFEST_NAME).read_text())
    assert written["bytes_saved"] == sum(
        256 * 256 - 4 * 2 * 2 for _m in SHARED_MODULES
    )  # BF16 -> FP8 halves 256x256x2 bytes; 2x2 F32 scales added
    for shard in written["output_shards"]:
        assert (out / shard["name"]).stat().st_size == shard["size"]
    assert inspect_checkpoint(out)["totals"]["FP8"]["modules"] == 6


def test_rerun_is_a_no_op_and_force_rebuilds(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    options = BuildOptions(base=ckpts["none"], out=tmp_path / "h", donor=LocalDonor(ckpts["block"]), error_report=False)
    first = build_hybrid(options, log=_quiet)
    mtime = (tmp_path / "h" / MANIFEST_NAME).stat().st_mtime_ns
    again = build_hybrid(options, log=_quiet)
    assert again["changed"] is False and again["inputs_fingerprint"] == first["inputs_fingerprint"]
    assert (tmp_path / "h" / MANIFEST_NAME).stat().st_mtime_ns == mtime
    options.force = True
    assert build_hybrid(options, log=_quiet)["changed"] is True


@pytest.fixture()
def hub_donor(tmp_path: Path, ckpts: dict[str, Path]) -> Path:
    """The block-FP8 donor with an unrelated shard, to stand behind a hub repo (needs huggingface_hub)."""
    if importlib.util.find_spec("huggingface_hub") is None:
        pytest.skip("huggingface_hub is not installed here")
    return _donor_with_unrelated_shard(tmp_path, ckpts["block"])


def test_hub_donor_fetches_only_the_needed_shards(
    tmp_path: Path, ckpts: dict[str, Path], hub_donor: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An offline HF cache at a pinned commit that lacks the unrelated shard: fetching it would fail.
    files = (INDEX_NAME, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    cache = _offline_snapshot(tmp_path, hub_donor, files, monkeypatch)
    code = cli_main(
        ["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(tmp_path / "h"), "--donor",
         "org/fp8", "--donor-revision", HUB_REVISION, "--donor-cache-dir", str(cache), "--no-error-report"]
    )  # fmt: skip
    assert code == 0
    manifest = json.loads((tmp_path / "h" / MANIFEST_NAME).read_text())
    assert manifest["options"]["donor"] == {"kind": "hub", "repo": "org/fp8", "revision": HUB_REVISION}
    assert manifest["donor_fetch"]["shards"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--modules", r"shared_expert\.gate_proj$", "--donor", "{block}"], "selects .*gate_proj but not .*up_proj"),
        (["--modules", "no_such_module", "--donor", "{block}"], "matches no BF16 weight"),
        (["--modules", "(", "--donor", "{block}"], "is not a valid regular expression"),
        (["--donor", "{none}"], r"is BF16, not F8_E4M3"),
        (["--donor", "org/fp8"], "pin it with --donor-revision"),
        (["--donor", "org/fp8", "--donor-revision", "main"], "is not a 40-hex commit"),
        (["--donor", "not a repo"], "neither a directory nor a Hub repo id"),
        (["--donor-revision", HUB_REVISION], "--donor-revision without --donor"),
        (["--scales", "tensor"], "--no-error-report needs --donor"),
    ],
)
def test_bad_inputs_fail_in_one_line_and_write_nothing(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    args = [a.format(**{k: str(v) for k, v in ckpts.items()}) for a in args]
    out = tmp_path / "out"
    code = cli_main(
        ["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(out), "--no-error-report", *args]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 0, err
    assert re.search(message, err), err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_hybrid_is_not_a_base(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="matches modules that are not 2-D BF16/F16/F32 in the base"):
        build_hybrid(
            BuildOptions(base=ckpts["block"], out=tmp_path / "o", donor=LocalDonor(ckpts["block"]), error_report=False),
            log=_quiet,
        )


def test_foreign_output_directory_is_refused(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    options = BuildOptions(base=ckpts["none"], out=out, donor=LocalDonor(ckpts["block"]), error_report=False)
    with pytest.raises(CheckpointError, match="exists and is not a hybrid built from these inputs"):
        build_hybrid(options, log=_quiet)
    assert (out / "precious.txt").read_text() == "keep me"


def test_a_failure_midway_leaves_no_partial_output(
    tmp_path: Path, ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_shard", broken)
    options = BuildOptions(base=ckpts["none"], out=tmp_path / "o", donor=LocalDonor(ckpts["block"]), error_report=False)
    with pytest.raises(OSError, match="disk full"):
        build_hybrid(options, log=_quiet)
    assert list(tmp_path.iterdir()) == []


def test_quantizing_without_torch_says_how_to_get_it(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is importable here; the quantizing path is tested under tests/vllm")
    code = cli_main(["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "need torch" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _offline_snapshot(tmp_path: Path, donor: Path, files: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> Path:
    snapshot = tmp_path / "hf" / "models--org--fp8" / "snapshots" / HUB_REVISION
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copyfile(donor / name, snapshot / name)
    # setattr first: it imports huggingface_hub before the variable is set, so the value it
    # restores afterwards is the real one, not a True read at import time (which would leave every
    # later test in this process offline)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_range_donor_reads_only_headers_and_wanted_tensors(
    tmp_path: Path, ckpts: dict[str, Path], hub_donor: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    donor_dir = hub_donor
    # The cache holds only the index: a whole-shard download would fail offline.
    cache = _offline_snapshot(tmp_path, donor_dir, (INDEX_NAME,), monkeypatch)
    requests: list[tuple[str, int, int]] = []

    def read_range(filename: str, start: int, length: int) -> bytes:  # the hub's HTTP range answers
        requests.append((filename, start, length))
        with (donor_dir / filename).open("rb") as handle:
            handle.seek(start)
            return handle.read(length)

    donor = checkpoint.HubRangeDonor("org/fp8", HUB_REVISION, cache, read_range=read_range)
    out = tmp_path / "ranged"
    manifest = build_hybrid(BuildOptions(base=ckpts["none"], out=out, donor=donor, error_report=False), log=_quiet)
    # Same output as from the whole local donor.
    reference = tmp_path / "whole"
    build_hybrid(
        BuildOptions(base=ckpts["none"], out=reference, donor=LocalDonor(donor_dir), error_report=False), _quiet
    )
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (out / shard).read_bytes() == (reference / shard).read_bytes()
    # What was read: 2 header reads per shard holding wanted tensors, then exactly the 12 wanted tensors.
    headers = {name: read_header(donor_dir / name) for name in ("model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors")}  # fmt: skip
    wanted = {f"{m}.{suffix}" for m in SHARED_MODULES for suffix in ("weight", "weight_scale_inv")}
    expected = sum(h.data_start for h in headers.values()) + sum(
        info.nbytes for h in headers.values() for name, info in h.tensors.items() if name in wanted
    )
    assert {filename for filename, _s, _l in requests} == set(headers)
    assert len(requests) == 2 * len(headers) + len(wanted)
    assert manifest["donor_fetch"] == {"mode": "ranges", "bytes": expected, "extract": str(donor.extract)}
    assert expected < 0.25 * sum((donor_dir / name).stat().st_size for name in headers)
    # A second build reuses the extract: no more requests.
    requests.clear()
    again = checkpoint.HubRangeDonor("org/fp8", HUB_REVISION, cache, read_range=read_range)
    build_hybrid(BuildOptions(base=ckpts["none"], out=tmp_path / "again", donor=again, error_report=False), _quiet)
    assert requests == []


def test_range_fetch_is_for_hub_donors(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        ["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(tmp_path / "o"),
         "--donor", str(ckpts["block"]), "--donor-fetch", "ranges", "--no-error-report"]
    )  # fmt: skip
    assert code == 2
    assert "--donor-fetch ranges is for a Hub donor" in capsys.readouterr().err


def test_json_output_is_only_json_and_says_changed(
    tmp_path: Path, ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["checkpoint", "hybrid-fp8", "--base", str(ckpts["none"]), "--out", str(tmp_path / "h"),
            "--donor", str(ckpts["block"]), "--no-error-report", "--json"]  # fmt: skip
    assert cli_main(args) == 0
    first = capsys.readouterr()
    assert json.loads(first.out)["changed"] is True
    assert "hybrid-fp8: 6 modules" in first.err
    assert cli_main(args) == 0
    second = capsys.readouterr()
    assert json.loads(second.out)["changed"] is False
    assert "is up to date" in second.err


def test_default_selection_leaves_an_mtp_head_alone(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    base = tmp_path / "base"
    shutil.copytree(ckpts["none"], base)
    mtp = [f"mtp.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    write_shard(base / "model-mtp.safetensors", [ShardEntry(n, "BF16", (2, 4), lambda: b"\x3c" * 16) for n in mtp])
    index = json.loads((base / INDEX_NAME).read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (base / INDEX_NAME).write_text(json.dumps(index))
    out = tmp_path / "h"
    manifest = build_hybrid(
        BuildOptions(base=base, out=out, donor=LocalDonor(ckpts["block"]), error_report=False), _quiet
    )
    assert sorted(manifest["fp8_modules"]) == SHARED_MODULES
    assert (out / "model-mtp.safetensors").read_bytes() == (base / "model-mtp.safetensors").read_bytes()
