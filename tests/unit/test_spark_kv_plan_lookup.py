"""Unit tests of lookup_plugins/spark_kv_plan.py, the controller-side bridge
from spark_preflight to sparkfleet.serving.kv_page_plan (loaded through Ansible's plugin loader)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleLookupError
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import lookup_loader

REPO = Path(__file__).resolve().parents[2]
KV_CONFIGS = "tests/fixtures/kv_configs"
TARGET = f"{KV_CONFIGS}/qwen3_5_122b_a10b/config.json"


@pytest.fixture
def kv_lookup() -> Any:
    lookup_loader.add_directory(str(REPO / "lookup_plugins"))
    plugin = lookup_loader.get("spark_kv_plan", loader=DataLoader(), templar=None)
    assert plugin is not None
    return plugin


def run(plugin: Any, **options: Any) -> dict[str, Any]:
    (result,) = plugin.run([], variables={}, **options)
    return result


def test_pinned_drafter_unifies_and_bce6f76_does_not_on_stock(kv_lookup: Any) -> None:
    good = run(
        kv_lookup,
        target_config=TARGET,
        drafter_config=f"{KV_CONFIGS}/dflash_6c7242c/config.json",
        num_speculative_tokens=12,
        patched=False,
    )
    assert good["available"] is True and good["ok"] is True, good
    assert good["plan"]["attention_block_size"] == 2240
    bad = run(
        kv_lookup,
        target_config=str(REPO / TARGET),
        drafter_config=f"{KV_CONFIGS}/dflash_bce6f76/config.json",
        num_speculative_tokens=12,
        patched=False,
    )
    assert bad["ok"] is False
    assert "dflash_bce6f76" in bad["reason"] and "cannot unify" in bad["reason"]
    patched = run(
        kv_lookup,
        target_config=TARGET,
        drafter_config=f"{KV_CONFIGS}/dflash_bce6f76/config.json",
        num_speculative_tokens=12,
        patched=True,
    )
    assert patched["ok"] is True


def test_without_the_planner_the_check_is_unavailable(kv_lookup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module = sys.modules[type(kv_lookup).__module__]
    monkeypatch.setattr(plugin_module, "PLANNER", "sparkfleet.kv_page_plan_not_written_yet")
    result = run(kv_lookup, target_config=TARGET, num_speculative_tokens=12)
    assert result["available"] is False
    assert "sparkfleet.kv_page_plan_not_written_yet is not installed where ansible-playbook runs" in result["reason"]


def test_missing_config_names_the_path_and_the_variable(kv_lookup: Any, tmp_path: Path) -> None:
    with pytest.raises(
        AnsibleLookupError,
        match=r"drafter_config .*nope/config.json on the controller: no such file; set "
        r"spark_preflight_kv_plan.drafter_config",
    ):
        run(
            kv_lookup,
            target_config=TARGET,
            drafter_config=str(tmp_path / "nope" / "config.json"),
            num_speculative_tokens=12,
        )


def test_a_config_that_is_not_an_object_is_refused(kv_lookup: Any, tmp_path: Path) -> None:
    listed = tmp_path / "config.json"
    listed.write_text(json.dumps([1, 2]))
    with pytest.raises(AnsibleLookupError, match="holds a list, not an object"):
        run(kv_lookup, target_config=str(listed), num_speculative_tokens=12)
