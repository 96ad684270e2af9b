"""Lookup ``spark_kv_plan``: ask sparkfleet.serving.kv_page_plan, on the controller, whether a drafter's KV
cache pages unify with the target's.

Returns one dict: ``available`` (false when the Python running Ansible has no ``sparkfleet.serving.kv_page_plan``,
with ``reason`` saying so), ``ok``, ``reason`` and ``plan`` (the planner's answer as a dict).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: spark_kv_plan
short_description: Run sparkfleet's KV page planner on the controller
description:
  - Loads the target's and the drafter's config.json on the controller and calls
    C(sparkfleet.serving.kv_page_plan.plan(target_config, drafter_config, num_speculative_tokens, patched)).
  - When the Python that runs Ansible has no C(sparkfleet.serving.kv_page_plan), returns C(available=false) instead
    of failing, so the check is skipped cleanly.
options:
  target_config:
    description: Path of the target's config.json (absolute, or relative to the repo root).
    type: str
    required: true
  drafter_config:
    description: Path of the drafter's config.json; null for a profile without a drafter.
    type: str
  num_speculative_tokens:
    description: Tokens drafted per step.
    type: int
    required: true
  patched:
    description: Whether the wheel carries the KV page-size unification patch.
    type: bool
    default: true
  platform:
    description: The platform vLLM runs on (C(cuda) on a GB10, C(cpu) in the sandbox).
    type: str
    default: cuda
  serve_args:
    description:
      - The profile's resolved serve args; the planner judges C(enable-prefix-caching), C(max-model-len),
        C(max-num-batched-tokens) and C(max-num-seqs) of them (sparkfleet.serving.kv_page_plan.serving_options).
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Plan
  ansible.builtin.debug:
    msg: "{{ lookup('spark_kv_plan', target_config='t/config.json', num_speculative_tokens=12) }}"
"""

RETURN = r"""
_raw:
  description: One dict with available, ok, reason and plan.
  type: list
  elements: dict
"""

# lookup_plugins/spark_kv_plan.py -> the repo root, which holds sparkfleet/.
REPO_ROOT = Path(__file__).resolve().parents[1]
PLANNER = "sparkfleet.serving.kv_page_plan"


def load_config(path: str | None, what: str) -> dict[str, Any] | None:
    """The JSON object at ``path`` (relative paths from the repo root); None for no path."""
    if path in (None, ""):
        return None
    from sparkfleet.build import jsonfile  # importable: run() calls this once the planner imported

    resolved = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    try:
        return jsonfile.read_object(resolved)
    except jsonfile.NotAJsonObject as exc:
        raise AnsibleLookupError(
            f"spark_kv_plan: {what} {resolved} on the controller: {exc}; "
            f"set spark_preflight_kv_plan.{what} to the model's config.json"
        ) from None


def plan_as_dict(plan: Any) -> dict[str, Any]:
    """The planner's KVPlan as plain data (a dataclass, or any object with attributes)."""
    if dataclasses.is_dataclass(plan) and not isinstance(plan, type):
        data = dataclasses.asdict(plan)
    elif isinstance(plan, dict):
        data = dict(plan)
    else:
        data = {key: value for key, value in vars(plan).items() if not key.startswith("_")}
    return json.loads(json.dumps(data, default=str))


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        self.set_options(var_options=variables, direct=kwargs)
        try:
            planner = importlib.import_module(PLANNER)
        except ModuleNotFoundError as exc:
            if exc.name not in (PLANNER, "sparkfleet"):
                raise AnsibleLookupError(f"spark_kv_plan: {PLANNER} needs {exc.name}, which is not installed") from exc
            reason = f"{PLANNER} is not installed where ansible-playbook runs (the controller venv: make venv)"
            return [{"available": False, "ok": None, "reason": reason, "plan": {}}]
        target = load_config(self.get_option("target_config"), "target_config")
        drafter = load_config(self.get_option("drafter_config"), "drafter_config")
        try:
            # the drafter's directory names it in the planner's messages (e.g. a revision's snapshot)
            plan = planner.plan_for_profile(
                target,
                drafter,
                self.get_option("num_speculative_tokens"),
                self.get_option("patched"),
                drafter_path=self.get_option("drafter_config"),
                platform=self.get_option("platform"),
                serve_args=self.get_option("serve_args"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise AnsibleLookupError(f"spark_kv_plan: the planner cannot read these configs: {exc}") from exc
        return [{"available": True, "ok": bool(plan.ok), "reason": str(plan.reason), "plan": plan_as_dict(plan)}]
