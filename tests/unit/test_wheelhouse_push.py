"""vllm_wheel's push plan: which of the controller's wheels go to a host (sparkfleet.build.wheelhouse.push_plan,
the filter vllm_wheel_push_plan in filter_plugins/vllm_wheel_push.py).

``__vllm_wheel_wheelhouse_push`` (roles/vllm_wheel/vars/main.yml) was a Jinja program; it is now one call
of the filter. Equality is shown by templating both with ansible-core (the repo's filter plugins loaded,
as ansible-playbook loads them) over a grid of find listings: the old program, kept below verbatim as
the reference, and the role's var as it now stands give the same list (same items, order, keys, types,
compared as JSON text), and so the same loop labels of tasks/wheelhouse.yml, rendered from that file.
The function's own behaviour is asserted on a few cases after the grid.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkfleet.build.wheelhouse import push_plan

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_wheel"
GIB = 2**30

# __vllm_wheel_wheelhouse_push as it was up to commit 08e9ab4, the reference the filter must equal
OLD_PUSH = """\
{%- set held = {} -%}
{%- for file in __vllm_wheel_wheelhouse_host.files | default([]) -%}
{%- set _ = held.update({file.path | basename: [file.checksum, file.mode, file.pw_name, file.gr_name]}) -%}
{%- endfor -%}
{%- set push = [] -%}
{%- for file in __vllm_wheel_wheelhouse_src.files | sort(attribute='path') -%}
{%- if held[file.path | basename] | default([]) != [file.checksum, '0644', 'root', 'root'] -%}
{%- set _ = push.append({'path': file.path, 'size': file.size}) -%}
{%- endif -%}
{%- endfor -%}
{{ push }}"""


@functools.cache
def _load_plugins() -> None:
    """ansible's plugin loader with the repo's filters (once per process)."""
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader([str(ROOT / "filter_plugins")])


def _trusted(value: Any) -> Any:
    from ansible.template import trust_as_template

    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {key: _trusted(item) for key, item in value.items()}
    return value


def template_text(text: str, variables: dict[str, Any]) -> Any:
    """text templated by ansible-core over variables (the role's vars among them, kept as templates)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    _load_plugins()
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(text))


@functools.cache
def role_vars() -> dict[str, Any]:
    return yaml.safe_load((ROLE / "vars" / "main.yml").read_text())


@functools.cache
def push_label() -> str:
    """The push task's loop label (tasks/wheelhouse.yml)."""
    tasks = yaml.safe_load((ROLE / "tasks" / "wheelhouse.yml").read_text())
    (push,) = [task for task in tasks if task.get("loop") == "{{ __vllm_wheel_wheelhouse_push }}"]
    return push["loop_control"]["label"]


def registered(host: Any) -> dict[str, Any]:
    """The two find results as the role registers them; host None: the host's listing was never registered."""
    return {} if host is None else {"__vllm_wheel_wheelhouse_host": host}


def render_push(program: str, source: list[dict[str, Any]], host: Any) -> Any:
    """__vllm_wheel_wheelhouse_push resolved as a task reads it, with the var defined as ``program``."""
    variables = {
        **_trusted(role_vars()),
        "__vllm_wheel_wheelhouse_push": _trusted(program),
        "__vllm_wheel_wheelhouse_src": {"changed": False, "files": source, "matched": len(source)},
        **registered(host),
    }
    return template_text("{{ __vllm_wheel_wheelhouse_push }}", variables)


def labels(push: list[dict[str, Any]]) -> list[str]:
    """The push task's label for each item, as ansible renders it (extended loop: index and length)."""
    return [
        template_text(
            push_label(),
            {
                "item": item,
                "ansible_loop": {"index": index, "length": len(push)},
                "__vllm_wheel_wheelhouse_push": push,
            },
        )
        for index, item in enumerate(push, start=1)
    ]


# ------------------------------------------------------------------------------------ find listings


def found(path: str, size: int, checksum: str, mode: str = "0644", owner: str = "root", group: str = "root") -> dict:
    """One file of ansible.builtin.find's ``files`` (get_checksum: true), its keys as find writes them."""
    return {
        "path": path,
        "mode": mode,
        "isdir": False,
        "isreg": True,
        "uid": 0,
        "gid": 0,
        "size": size,
        "pw_name": owner,
        "gr_name": group,
        "checksum": checksum,
    }


def sha1(name: str, salt: str = "") -> str:
    return hashlib.sha1(f"{salt}{name}".encode()).hexdigest()  # noqa: S324 - find's checksum, a stand-in


NAMES = [
    "vllm-0.23.0+sparkfleet-cp312-cp312-linux_aarch64.whl",
    "torch-2.11.0-cp312-cp312-manylinux_2_28_aarch64.whl",
    "PyYAML-6.0.2-cp312-cp312-manylinux_2_17_aarch64.whl",
    "MarkupSafe-3.0.2-cp312-cp312-manylinux_2_17_aarch64.whl",
    "markdown_it_py-3.0.0-py3-none-any.whl",
    "nvidia_cublas_cu13-13.0.2.14-py3-none-manylinux_2_27_aarch64.whl",
    "Jinja2-3.1.6-py3-none-any.whl",
    "jinja2_humanize-0.1-py3-none-any.whl",
    "_private_wheel-1.0-py3-none-any.whl",
    "aiohttp-3.12.15-cp312-cp312-manylinux_2_17_aarch64.whl",
    "Zope.interface-7.2-cp312-cp312-manylinux_2_17_aarch64.whl",
    "zstandard-0.23.0-cp312-cp312-manylinux_2_17_aarch64.whl",
]
# sizes whose running totals land on and around the label's unit boundaries (human_readable: 1024-based)
SIZES = [GIB - 1, 1, GIB, 2**20 - 1, 3 * GIB - 2**20, 0, 512, GIB + 1, 10**9, 2**20, 7 * GIB + 123, 73]


def source_listing(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` controller wheels, listed in a shuffled order (find lists in directory order)."""
    names = (NAMES + [f"Dep_{n:03d}-1.0-py3-none-any.whl" for n in range(count)])[:count]
    files = [found(f"/srv/wheelhouse/gpu/{name}", SIZES[n % len(SIZES)], sha1(name)) for n, name in enumerate(names)]
    random.Random(seed).shuffle(files)
    return files


def host_listing(source: list[dict[str, Any]], variant: str) -> Any:
    """The host's find result for ``source`` in one of the ways a host can hold it."""
    if variant == "unregistered":
        return None
    if variant == "skipped":  # check mode on a new host: the task was skipped
        return {"changed": False, "skipped": True, "skip_reason": "Conditional result was False"}
    same = [{**f, "path": "/opt/sparkfleet/wheelhouse/" + f["path"].rsplit("/", 1)[1]} for f in source]
    if variant == "empty":
        return {"changed": False, "files": [], "matched": 0}
    if variant == "same":
        files = same
    elif variant == "checksums":  # every other wheel differs in content
        files = [{**f, "checksum": sha1(f["path"], "old")} if n % 2 else f for n, f in enumerate(same)]
    elif variant == "mode-owner-group":
        tweaks = [{"mode": "0600"}, {"pw_name": "vllm"}, {"gr_name": "vllm"}, {"mode": "0755"}]
        files = [{**f, **tweaks[n % 4]} if n % 3 == 0 else f for n, f in enumerate(same)]
    elif variant == "missing":  # the host lacks every third wheel
        files = [f for n, f in enumerate(same) if n % 3]
    elif variant == "extra":  # wheels only the host has (an older vLLM, a removed dependency)
        files = same + [
            found("/opt/sparkfleet/wheelhouse/vllm-0.22.0+sparkfleet-cp312-cp312-linux_aarch64.whl", GIB, "f" * 40),
            found("/opt/sparkfleet/wheelhouse/six-1.16.0-py2.py3-none-any.whl", 11053, "e" * 40),
        ]
    elif variant == "case":  # the same names in another case are other files to pip and to the push
        files = [{**f, "path": f["path"].upper()} for f in same]
    elif variant == "size-only":  # a size that differs but the same checksum: the checksum decides
        files = [{**f, "size": f["size"] + 1} for f in same]
    else:
        raise AssertionError(variant)
    return {"changed": False, "files": list(reversed(files)), "matched": len(files)}


VARIANTS = [
    "unregistered",
    "skipped",
    "empty",
    "same",
    "checksums",
    "mode-owner-group",
    "missing",
    "extra",
    "case",
    "size-only",
]
GRID = list(itertools.product([0, 1, 2, 5, len(NAMES), 40], VARIANTS))


@pytest.mark.parametrize(("count", "variant"), GRID, ids=[f"{c}-{v}" for c, v in GRID])
def test_the_filter_gives_what_the_old_jinja_gave(count: int, variant: str) -> None:
    source = source_listing(count, seed=count)
    host = host_listing(source, variant)
    old = render_push(OLD_PUSH, source, host)
    new = render_push(role_vars()["__vllm_wheel_wheelhouse_push"], source, host)
    assert isinstance(new, list) and all(isinstance(item["size"], int) for item in new)
    assert json.dumps(new) == json.dumps(old)
    assert labels(new) == labels(old)
    # and the function, called without Ansible, agrees
    host_files = (host or {}).get("files", [])
    assert json.dumps(push_plan(source, host_files, "root", "root", "0644")) == json.dumps(old)


def test_the_role_var_is_one_call_of_the_filter() -> None:
    text = role_vars()["__vllm_wheel_wheelhouse_push"]
    assert "vllm_wheel_push_plan(" in text and "{%" not in text and len(text.splitlines()) == 1, text


# ------------------------------------------------------------------------------------ the function


def test_a_new_host_gets_every_wheel_in_name_order_ignoring_case() -> None:
    source = [
        found("/w/torch.whl", 3 * GIB, "a" * 40),
        found("/w/PyYAML.whl", 700_000, "b" * 40),
        found("/w/pip.whl", 1_800_000, "c" * 40),
        found("/w/Jinja2.whl", 130_000, "d" * 40),
    ]
    push = push_plan(source, [], "root", "root", "0644")
    assert push == [
        {"path": "/w/Jinja2.whl", "size": 130_000},
        {"path": "/w/pip.whl", "size": 1_800_000},
        {"path": "/w/PyYAML.whl", "size": 700_000},
        {"path": "/w/torch.whl", "size": 3 * GIB},
    ]
    assert [list(item) for item in push] == [["path", "size"]] * 4
    assert labels(push) == [
        "Jinja2.whl: 1 of 4, 126.95 KB of 3.00 GB",
        "pip.whl: 2 of 4, 1.84 MB of 3.00 GB",
        "PyYAML.whl: 3 of 4, 2.51 MB of 3.00 GB",
        "torch.whl: 4 of 4, 3.00 GB of 3.00 GB",
    ]


def test_only_what_the_host_lacks_or_holds_different_is_sent() -> None:
    source = [found(f"/w/{name}.whl", size, name * 40) for name, size in (("a", GIB - 1), ("b", 1), ("c", 2), ("d", 3))]
    host = [
        found("/h/a.whl", GIB - 1, "a" * 40),  # the same: stays
        found("/h/b.whl", 1, "0" * 40),  # other content
        found("/h/c.whl", 2, "c" * 40, mode="0600"),  # other mode
        found("/h/old.whl", 9, "9" * 40),  # only on the host: nothing to send, nothing removed
    ]
    push = push_plan(source, host, "root", "root", "0644")
    assert [item["path"] for item in push] == ["/w/b.whl", "/w/c.whl", "/w/d.whl"]
    assert labels(push) == ["b.whl: 1 of 3, 1.00 Bytes of 6.00 Bytes", "c.whl: 2 of 3, 3.00 Bytes of 6.00 Bytes"] + [
        "d.whl: 3 of 3, 6.00 Bytes of 6.00 Bytes"
    ]
    assert push_plan(source, [*host[:1], found("/h/b.whl", 1, "b" * 40)], "root", "root", "0644") == push[1:]
    assert push_plan(source, host, "root", "root", "0600")[0]["path"] == "/w/a.whl"  # the mode is the caller's


def test_owner_and_group_are_compared_and_a_total_just_under_a_gib_reads_1024_mb() -> None:
    source = [found("/w/a.whl", GIB - 2, "a" * 40), found("/w/b.whl", 1, "b" * 40)]
    host = [found("/h/a.whl", GIB - 2, "a" * 40, owner="vllm"), found("/h/b.whl", 1, "b" * 40, group="vllm")]
    push = push_plan(source, host, "root", "root", "0644")
    assert labels(push) == ["a.whl: 1 of 2, 1024.00 MB of 1024.00 MB", "b.whl: 2 of 2, 1024.00 MB of 1024.00 MB"]
    assert push_plan(source, host, "vllm", "vllm", "0644") == push  # each differs in one of the two
    assert push_plan(source[:1], host, "vllm", "root", "0644") == []


def test_a_file_a_listing_cannot_vouch_for_is_sent() -> None:
    source = [found("/w/a.whl", 5, "a" * 40)]
    unreadable = {key: value for key, value in found("/h/a.whl", 5, "a" * 40).items() if key != "checksum"}
    assert push_plan(source, [unreadable], "root", "root", "0644") == [{"path": "/w/a.whl", "size": 5}]
    # nor does one the controller's listing could not checksum match a host file without a checksum
    unread_source = [{**unreadable, "path": "/w/a.whl"}]
    assert push_plan(unread_source, [unreadable], "root", "root", "0644") == [{"path": "/w/a.whl", "size": 5}]


@pytest.mark.parametrize(
    ("source", "host", "message"),
    [
        (None, [], "source_files must be find's files list"),
        ([], {"files": []}, "host_files must be find's files list"),
        ([{"size": 1, "checksum": "a"}], [], "without a path"),
        ([{"path": "/w/a.whl", "checksum": "a"}], [], "without a size"),
        ([], [{"size": 1}], "without a path"),
    ],
)
def test_a_listing_that_is_not_finds_is_refused(source: Any, host: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        push_plan(source, host, "root", "root", "0644")
