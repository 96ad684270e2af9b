"""`sparkfleet weights pin` (make pin) against the hub stand-in: a profile's hub models resolved from a
branch to full commits without weights, written only into the inventory's own file; the drafter's KV
geometry read from its config.json; refusals (moved main, gated repo, unknown repo, typo'd ref, a drafter
vLLM would refuse) in one line that names the value and the fix, with nothing written."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sparkfleet.cli import main as cli_main
from sparkfleet.serving import model_pins, profiles
from tests.hub.server import HubDouble
from tests.unit.helpers import (
    ROOT,
    link_shared_group_vars,
    needs_ansible_playbook,
    run_playbook,
    write_hosts,
    write_play,
)

KV = ROOT / "tests/fixtures/kv_configs"
TARGET_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
DRAFTER_REPO = "z-lab/Qwen3.5-122B-A10B-DFlash"
WEIGHTS = b"\0" * 4096  # never to be fetched by a pin
# a site profile serving the dflash drafter on a wheel without the patches (so without the KV unify)
STOCK_PROFILE = {
    "dflash-stock": {
        "summary": "dflash on an unpatched wheel",
        "target": "intel-int4",
        "drafter": "dflash-drafter",
        "speculative": {"method": "dflash", "num_speculative_tokens": 12},
        "patches": [],
        "serve_args": {},
    }
}


def files(config_dir: str) -> dict[str, bytes]:
    return {"config.json": (KV / config_dir / "config.json").read_bytes(), "model.safetensors": WEIGHTS}


@pytest.fixture()
def hub() -> Iterator[HubDouble]:
    with HubDouble() as double:
        yield double


@pytest.fixture()
def shas(hub: HubDouble) -> dict[str, str]:
    target = hub.add_revision(TARGET_REPO, files("qwen3_5_122b_a10b"))
    old_drafter = hub.add_revision(DRAFTER_REPO, files("dflash_6c7242c"))
    new_drafter = hub.add_revision(DRAFTER_REPO, files("dflash_bce6f76"))  # main moves to it
    return {"target": target, "old_drafter": old_drafter, "new_drafter": new_drafter}


def inventory(tmp_path: Path, site: dict | None = None, pins: dict | None = None) -> Path:
    """An inventory like inventory/example: the shared group_vars linked, a site file, maybe a pins file."""
    inv = link_shared_group_vars(tmp_path / "prod", site or {"sparkfleet_profile": "dflash"})
    if pins is not None:
        (inv / model_pins.PINS_FILE).write_text(yaml.safe_dump({model_pins.PINS_VARIABLE: pins}))
    return inv


def run_pin(hub: HubDouble, inv: Path, profile: str = "dflash", **options: object) -> tuple[int, str]:
    out = io.StringIO()
    code = model_pins.pin(
        inv,
        profile,
        str(options.get("ref", "main")),
        hub.endpoint,
        options.get("token"),  # type: ignore[arg-type]
        inv.parent / "cache",
        out=out,
        update=bool(options.get("update", False)),
    )
    return code, out.getvalue()


def written(inv: Path) -> dict[str, str]:
    return yaml.safe_load((inv / model_pins.PINS_FILE).read_text())[model_pins.PINS_VARIABLE]


def test_pin_resolves_main_to_commits_without_weights_and_layers_over_the_shared_models(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str]
) -> None:
    # the drafter is pinned in the inventory's own file (the shared layer pins a commit the stand-in lacks)
    inv = inventory(tmp_path, pins={"dflash-drafter": shas["old_drafter"]})
    code, out = run_pin(hub, inv)
    assert code == 0, out
    assert f"pin: intel-int4 (target): {TARGET_REPO} main -> {shas['target']}" in out
    # a pinned model keeps its commit, and the run says that main moved past it
    assert f"dflash-drafter (drafter): {DRAFTER_REPO} kept at {shas['old_drafter']}; main is now " in out
    assert "KV geometry: 4 KV heads, head dim 128, 4 layers, sliding window 2048" in out
    assert "pin: KV plan for dflash: " in out and "unifies the KV cache" in out
    assert written(inv) == {"intel-int4": shas["target"], "dflash-drafter": shas["old_drafter"]}
    # only config.json files were fetched, never a weight
    assert {s.path for s in hub.file_gets()} == {"config.json"}
    # the deploy's own check now passes: the pins are layered over the shared sparkfleet_models
    assert cli_main(["profile", "check", "dflash", "--inventory", str(inv)]) == 0
    gv = profiles.inventory_profiles(inv)
    pinned = model_pins.apply_pins(gv["sparkfleet_models"], gv[model_pins.PINS_VARIABLE])
    assert pinned["intel-int4"]["revision"] == shas["target"] and pinned["intel-int4"]["size_gib"] == 67
    assert gv["sparkfleet_models"]["intel-int4"]["revision"] == "", "the shared layer itself is untouched"

    # nothing new: already pinned, the file is not rewritten
    before = (inv / model_pins.PINS_FILE).stat().st_mtime_ns
    code, out = run_pin(hub, inv)
    assert code == 0 and "already pinned, nothing changed" in out, out
    assert (inv / model_pins.PINS_FILE).stat().st_mtime_ns == before


def test_a_moved_main_is_reported_and_moved_only_with_update(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str]
) -> None:
    inv = inventory(tmp_path, pins={"dflash-drafter": shas["old_drafter"], "intel-int4": shas["target"]})
    moved = hub.add_revision(TARGET_REPO, {**files("qwen3_5_122b_a10b"), "README.md": b"new\n"})
    code, out = run_pin(hub, inv)
    assert code == 0 and f"kept at {shas['target']}; main is now {moved} (--update moves it)" in out, out
    assert written(inv)["intel-int4"] == shas["target"]
    code, out = run_pin(hub, inv, update=True)
    assert code == 0 and f"main -> {moved} (was {shas['target']})" in out, out
    # --update moves the drafter too, to the 8-KV-head revision, which the patched wheel unifies
    assert "KV geometry: 8 KV heads, head dim 128, 6 layers" in out
    assert written(inv) == {"intel-int4": moved, "dflash-drafter": shas["new_drafter"]}


def test_a_drafter_the_stock_wheel_would_refuse_is_refused_before_anything_is_written(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str]
) -> None:
    site = {"sparkfleet_profiles_site": STOCK_PROFILE}
    inv = inventory(tmp_path, site=site, pins={"dflash-drafter": shas["new_drafter"]})
    before = (inv / model_pins.PINS_FILE).read_text()
    with pytest.raises(model_pins.PinError) as refused:
        run_pin(hub, inv, profile="dflash-stock")
    message = str(refused.value)
    assert "vLLM 0.23 would refuse this drafter after loading the weights (unify:" in message
    assert "8 KV heads x 128" in message and "pin another drafter revision" in message and "\n" not in message
    assert (inv / model_pins.PINS_FILE).read_text() == before, "nothing was written"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("ref", "has no branch, tag or commit 'mian': give one that exists (--ref REF"),
        ("repo", "repo 'nobody/missing-model' not found on the hub (or private without a token): fix "
         "sparkfleet_models.intel-int4.repo"),
    ],
)  # fmt: skip
def test_a_typod_ref_or_an_unknown_repo_is_one_line_naming_it(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str], change: str, says: str
) -> None:
    site: dict = {"sparkfleet_profile": "dflash"}
    if change == "repo":
        shared = yaml.safe_load((ROOT / "inventory/group_vars/all/profiles.yml").read_text())["sparkfleet_models"]
        site["sparkfleet_models"] = {**shared, "intel-int4": {**shared["intel-int4"], "repo": "nobody/missing-model"}}
    inv = inventory(tmp_path, site=site, pins={"dflash-drafter": shas["old_drafter"]})
    before = (inv / model_pins.PINS_FILE).read_text()
    with pytest.raises(model_pins.PinError, match="^intel-int4: ") as refused:
        run_pin(hub, inv, ref="mian" if change == "ref" else "main")
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert (inv / model_pins.PINS_FILE).read_text() == before


def test_a_gated_repo_needs_the_token_and_never_shows_it(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "hf_pin_test_token_0123456789"
    hub.gate(TARGET_REPO, secret)
    inv = inventory(tmp_path, pins={"dflash-drafter": shas["old_drafter"]})
    with pytest.raises(model_pins.PinError, match="is gated and the hub refused this token") as refused:
        run_pin(hub, inv, token=None)
    assert "HF_TOKEN, or --token-file" in str(refused.value)
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    code = cli_main(
        ["weights", "pin", "dflash", "--inventory", str(inv), "--endpoint", hub.endpoint]
        + ["--token-file", str(token_file), "--cache-dir", str(tmp_path / "cache")]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"{TARGET_REPO} main -> {shas['target']}" in captured.out
    assert secret not in captured.out + captured.err
    assert secret not in (inv / model_pins.PINS_FILE).read_text()
    for path in (tmp_path / "cache").rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path


def test_the_cli_refuses_in_one_line_with_exit_2(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    inv = inventory(tmp_path, pins={"dflash-drafter": shas["old_drafter"]})
    argv = ["weights", "pin", "dflash", "--inventory", str(inv), "--endpoint", hub.endpoint, "--ref", "nope"]
    assert cli_main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sparkfleet: intel-int4: ") and "'nope'" in err[0], err
    assert cli_main(["weights", "pin", "no-such-profile", "--inventory", str(inv), "--endpoint", hub.endpoint]) == 2
    assert "no-such-profile" in capsys.readouterr().err


def test_apply_pins_sets_revisions_and_build_inputs() -> None:
    models = {
        "t": {"repo": "a/b", "revision": "", "size_gib": 1},
        "h": {"build": "hybrid-fp8", "base": {"repo": "a/c", "revision": ""}, "donor": {"repo": "a/d"}},
    }
    pinned = model_pins.apply_pins(models, {"t": "1" * 40, "h.base": "2" * 40, "h.donor": "3" * 40, "gone": "4" * 40})
    assert pinned["t"] == {"repo": "a/b", "revision": "1" * 40, "size_gib": 1}
    assert pinned["h"]["base"]["revision"] == "2" * 40 and pinned["h"]["donor"]["revision"] == "3" * 40
    assert models["t"]["revision"] == "", "the input is not changed"
    assert json.dumps(model_pins.apply_pins(models, None), sort_keys=True) == json.dumps(models, sort_keys=True)


def deploy_kv_check(tmp_path: Path, hub: HubDouble, site: dict, pins: dict) -> subprocess.CompletedProcess[str]:
    """The deploy's own steps on this machine: resolve-profile.yml, kv-plan-inputs.yml (config.json from the
    hub) and spark_preflight's KV plan check, as serve-profile.yml runs them before any host is touched."""
    inv = inventory(tmp_path, site={**site, "model_cache_hub_endpoint": hub.endpoint}, pins=pins)
    tasks = [
        {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/resolve-profile.yml")},
        {"ansible.builtin.import_tasks": str(ROOT / "playbooks/tasks/kv-plan-inputs.yml")},
        {
            "ansible.builtin.include_role": {"name": "spark_preflight", "tasks_from": "kv_plan"},
            "vars": {"spark_preflight_kv_plan": "{{ __deploy_kv_plan }}"},
        },
    ]
    return run_playbook(write_hosts(inv), write_play(tmp_path / "play.yml", tasks))


@needs_ansible_playbook
def test_the_deploy_checks_the_kv_plan_of_hub_models_from_their_config_json_alone(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str]
) -> None:
    pins = {"intel-int4": shas["target"], "dflash-drafter": shas["old_drafter"]}
    good = deploy_kv_check(tmp_path / "good", hub, {"sparkfleet_profile": "dflash"}, pins)
    assert good.returncode == 0, good.stdout[-3000:]
    assert "Assert the drafter's KV pages unify with the target's" in good.stdout
    assert {s.path for s in hub.file_gets()} == {"config.json"}, "no weights fetched"

    stock = {"sparkfleet_profile": "dflash-stock", "sparkfleet_profiles_site": STOCK_PROFILE}
    refused = deploy_kv_check(tmp_path / "stock", hub, stock, {**pins, "dflash-drafter": shas["new_drafter"]})
    assert refused.returncode != 0
    assert "cannot share KV pages with the target" in refused.stdout, refused.stdout[-3000:]
    assert "without the KV-unify patch" in refused.stdout and "8 KV heads x 128" in refused.stdout
    # the patched wheel's profile takes the same drafter
    patched = deploy_kv_check(
        tmp_path / "patched", hub, {"sparkfleet_profile": "dflash"}, {**pins, "dflash-drafter": shas["new_drafter"]}
    )
    assert patched.returncode == 0, patched.stdout[-3000:]


@needs_ansible_playbook
def test_the_deploy_judges_the_profiles_prefix_caching_before_any_host_is_touched(
    tmp_path: Path, hub: HubDouble, shas: dict[str, str]
) -> None:
    """enable-prefix-caching is a planned setting: the profile's serve args (prefix caching, the batch and
    sequence limits) reach the KV check; a step budget below one cache block of the hybrid is refused with
    the figure to raise, the same budget with prefix caching off is not."""
    pins = {"intel-int4": shas["target"], "dflash-drafter": shas["new_drafter"]}

    def site(**serve_args: object) -> dict:
        return {"sparkfleet_profile": "dflash", "sparkfleet_profiles_site": {"dflash": {"serve_args": serve_args}}}

    # n=12 on the patched build: the cache block is 2240 tokens; DFlash holds 11 slots per sequence back
    cramped = {"max-num-batched-tokens": 2272, "max-num-seqs": 3}
    refused = deploy_kv_check(tmp_path / "refused", hub, site(**cramped, **{"enable-prefix-caching": True}), pins)
    assert refused.returncode != 0
    assert "vLLM's scheduler cannot serve this profile's settings" in refused.stdout, refused.stdout[-3000:]
    assert "a step may schedule only 2239 tokens" in refused.stdout and "Pin a drafter" not in refused.stdout
    assert "raise max-num-batched-tokens by at least 1 or turn prefix caching off" in refused.stdout
    off = deploy_kv_check(tmp_path / "off", hub, site(**cramped, **{"enable-prefix-caching": False}), pins)
    assert off.returncode == 0, off.stdout[-3000:]
    roomy = deploy_kv_check(tmp_path / "roomy", hub, site(**{"enable-prefix-caching": True}), pins)
    assert roomy.returncode == 0, roomy.stdout[-3000:]


@needs_ansible_playbook
def test_local_models_give_the_kv_check_their_own_config_json_and_fetch_nothing(tmp_path: Path, hub: HubDouble) -> None:
    """The sandbox's shape: target and drafter are local directories (path, no repo)."""
    site = {
        "sparkfleet_profile": "dflash",
        "sparkfleet_models": {
            "intel-int4": {"path": str(KV / "qwen3_5_122b_a10b"), "size_gib": 1},
            "dflash-drafter": {"path": str(KV / "dflash_6c7242c"), "size_gib": 1},
        },
    }
    run = deploy_kv_check(tmp_path, hub, site, pins={})
    assert run.returncode == 0, run.stdout[-3000:]
    assert "Assert the drafter's KV pages unify with the target's" in run.stdout
    assert hub.log == [], "nothing asked of the hub"
