"""Lookup ``sparkfleet_plan``: what this host serves, computed once (sparkfleet.serving.serving_plan.build).

The deploy, switch, rolling and tune plays call it first (playbooks/tasks/resolve-profile.yml) and keep
the result as the host fact ``sparkfleet_plan``; every later step reads its parts.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.serving import profiles, serving_plan

DOCUMENTATION = r"""
name: sparkfleet_plan
short_description: The serving plan of one host (profile, unit, models, wheel, venv)
description:
  - Resolves the profile named by the term with the host's inventory layers and returns the plan
    sparkfleet.serving.serving_plan.build describes (its module docstring lists the keys).
  - An unknown profile, a bad layer or a missing setting fails with one line naming it.
options:
  _terms:
    description: The profile's name.
    required: true
  speculative_tokens:
    description: Plan the profile drafting this many tokens per step (make tune's candidates).
    type: int
"""

EXAMPLES = r"""
- name: Plan what this host serves
  ansible.builtin.set_fact:
    sparkfleet_plan: "{{ lookup('sparkfleet_plan', sparkfleet_profile) }}"
"""

RETURN = r"""
_raw:
  description: The plan.
  type: list
  elements: dict
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        try:
            return serving_plan.from_lookup(
                "sparkfleet_plan",
                terms,
                variables,
                serving_plan.VARIABLES,
                self._templar.template,
                serving_plan.build,
                speculative_tokens=kwargs.get("speculative_tokens"),
            )
        except (profiles.ProfileError, serving_plan.PlanError) as exc:
            raise AnsibleLookupError(str(exc)) from exc
