"""Ansible stdout callback: the default one, with YAML results whose one-line messages stay on one line.

``callback_result_format = yaml`` (ansible.cfg) prints a multi-line message (a failed check's report, a
stderr) as its lines instead of one JSON string full of ``\\n``. Ansible's YAML dumper folds a long
one-line scalar at 80 columns, though, so a one-line error would reach the operator, and every grep for
it, cut in pieces. This callback is ``ansible.builtin.default`` with the same YAML dumped at an unbounded
width: one line stays one line, several lines print as a block. JSON results are left as they are.
"""

from __future__ import annotations

import functools
import textwrap
from typing import Any

import yaml
from ansible.plugins.callback import _AnsibleCallbackDumper
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = r"""
name: sparkfleet_default
type: stdout
short_description: the default stdout callback, with YAML results that keep one-line messages on one line
description:
  - Everything as C(ansible.builtin.default); with C(callback_result_format = yaml) the results are
    dumped at an unbounded line width, so a long one-line message is never folded over several lines,
    while a multi-line one prints as a block of its lines.
extends_documentation_fragment:
  - default_callback
  - result_format_callback
requirements:
  - set as stdout_callback in ansible.cfg
"""

# PyYAML folds plain and quoted scalars at its best_width (80 when the width is not given).
UNBOUNDED = 2**31 - 1  # libyaml keeps the width in a C int


class _Dumper(_AnsibleCallbackDumper):
    """Ansible's callback dumper, with a one-line string holding an apostrophe double-quoted.

    YAML's single quotes double every ``'`` (``'model ''x'' isn''t pinned'``); double quotes leave it
    alone and escape only ``"`` and ``\\``, as the JSON results did, so a message reads and greps as written.
    """

    def _pretty_represent_str(self, data: Any) -> yaml.ScalarNode:
        node = super()._pretty_represent_str(data)
        if node.style is None and "'" in node.value:
            node.style = '"'
        return node


def dump_yaml(data: Any, indent: int | None, lossy: bool) -> str:
    """``data`` as Ansible's callback YAML (block style for multi-line strings), never folded."""
    return yaml.dump(
        data,
        allow_unicode=True,
        Dumper=functools.partial(_Dumper, lossy=lossy),
        default_flow_style=False,
        indent=indent,
        width=UNBOUNDED,
    )


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "sparkfleet_default"

    def _pretty(self) -> bool | None:
        return self.get_option("pretty_results")

    def _dump_results(
        self,
        result: Any,
        indent: int | None = None,
        sort_keys: bool = True,
        keep_invocation: bool = False,
        serialize: bool = True,
    ) -> Any:
        if not serialize or self.get_option("result_format") != "yaml":
            return super()._dump_results(result, indent, sort_keys, keep_invocation, serialize)
        # the base class strips what it always strips (internal keys, invocation, diff) and returns the rest
        abridged = super()._dump_results(result, indent, sort_keys, keep_invocation, serialize=False)
        pretty = self._pretty()
        indent = None if pretty is False else (indent or 4)
        lossy = pretty in (None, True)
        if lossy:  # as the base class: the text once, not again as its list of lines
            for key in ("stdout", "stderr"):
                if key in abridged and f"{key}_lines" in abridged:
                    abridged[f"{key}_lines"] = "<omitted>"
        return "\n" + textwrap.indent(dump_yaml(abridged, indent, lossy), " " * (indent or 4))

    def _serialize_diff(self, diff: Any) -> str:
        if self.get_option("result_format") != "yaml":
            return super()._serialize_diff(diff)
        return textwrap.indent(dump_yaml(diff, 4, self._pretty() in (None, True)), "    ") + "\n"
