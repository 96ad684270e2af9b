"""Lookup ``sparkfleet_profile``: a serving profile resolved with this host's inventory layers.

The one way plays resolve a profile (deploy, switch, rolling, tune, bench, doctor and the profile check):
sparkfleet.serving.profiles.resolve_from reads the profiles and every layer
(sparkfleet.serving.profiles.LAYER_VARIABLES) from the task's variables, so no play lists them.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

# sparkfleet is installed in the controller venv (make venv), where ansible-playbook runs
from sparkfleet.serving import profiles, serving_plan

DOCUMENTATION = r"""
name: sparkfleet_profile
short_description: A sparkfleet serving profile, resolved with the host's inventory layers
description:
  - Returns the profile named by the term with C(serve_args) and C(env) layered from the inventory
    (sparkfleet_serve_args_common, sparkfleet_env_common, sparkfleet_serve_args_platform,
    sparkfleet_env_platform, sparkfleet_serve_args_host) and C(sparkfleet_tuned) applied.
  - An unknown profile or a bad layer fails with one line naming it (sparkfleet.serving.profiles.ProfileError).
options:
  _terms:
    description: The profile's name.
    required: true
"""

EXAMPLES = r"""
- name: Resolve the profile
  ansible.builtin.set_fact:
    profile: "{{ lookup('sparkfleet_profile', sparkfleet_profile) }}"
"""

RETURN = r"""
_raw:
  description: The resolved profile.
  type: list
  elements: dict
"""

VARIABLES = ("sparkfleet_profiles_builtin", "sparkfleet_profiles_site", *profiles.LAYER_VARIABLES)


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        try:
            return serving_plan.from_lookup(
                "sparkfleet_profile", terms, variables, VARIABLES, self._templar.template, profiles.resolve_from
            )
        except (profiles.ProfileError, serving_plan.PlanError) as exc:
            raise AnsibleLookupError(str(exc)) from exc
