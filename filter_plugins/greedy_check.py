"""Ansible filter: is a served greedy completion the target model's own greedy output?

``sparkfleet_greedy_check(prompt_logprobs, prompt_len, completion_ids, tie_nats)`` reads vLLM's
``prompt_logprobs`` (``prompt_logprobs: 1``) of one request whose prompt is the smoke prompt's ids
followed by the smoke completion's ids. Scoring a prompt is a prefill of the target alone: the
drafter plays no part in those logits, so each completion token must be the target's most likely
token after the tokens before it. If every one is, the completion is, token by token, what the
target would have said with no speculation at all (greedy decoding picks exactly that token at
every step). A token ranked below first is a mismatch, unless its logprob is within ``tie_nats`` of
the first's: prefill and decode kernels round differently, and a near tie may flip (reported as a
tie, not a failure). Pure and standard library only.
"""

from __future__ import annotations

from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # the unit tests import this file without Ansible on the path

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        """Stand-in when Ansible is not importable."""


def _entry(prompt_logprobs: list, index: int) -> dict[str, dict]:
    if index >= len(prompt_logprobs) or not isinstance(prompt_logprobs[index], dict):
        raise AnsibleFilterError(
            f"sparkfleet_greedy_check: prompt_logprobs has no entry for position {index} "
            f"({len(prompt_logprobs)} entries): was the request sent with prompt_logprobs=1?"
        )
    return prompt_logprobs[index]


def sparkfleet_greedy_check(
    prompt_logprobs: Any, prompt_len: Any, completion_ids: Any, tie_nats: Any = 0.05
) -> dict[str, Any]:
    """Each completion token against the target's own argmax at its position (see the module doc).

    Returns ``{"ok", "tokens", "mismatches", "ties"}``; each mismatch or tie is ``{"position",
    "token", "rank", "logprob", "top_token", "top_logprob"}`` (position counts from the completion's
    first token).
    """
    if not isinstance(prompt_logprobs, list):
        kind = type(prompt_logprobs).__name__
        raise AnsibleFilterError(f"sparkfleet_greedy_check: expected the response's prompt_logprobs list, got {kind}")
    if not isinstance(completion_ids, list) or not all(isinstance(t, int) for t in completion_ids):
        raise AnsibleFilterError(f"sparkfleet_greedy_check: completion_ids must be token ids, got {completion_ids!r}")
    try:
        start, tolerance = int(prompt_len), float(tie_nats)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"sparkfleet_greedy_check: prompt_len {prompt_len!r} / tie_nats {tie_nats!r}") from exc
    mismatches: list[dict[str, Any]] = []
    ties: list[dict[str, Any]] = []
    for position, token in enumerate(completion_ids):
        entry = _entry(prompt_logprobs, start + position)
        mine = entry.get(str(token))
        if mine is None:
            raise AnsibleFilterError(
                f"sparkfleet_greedy_check: position {position}: token {token} is not in its prompt_logprobs entry "
                f"{sorted(entry)}: the scored prompt is not the smoke prompt followed by its completion"
            )
        if int(mine.get("rank", 0)) == 1:
            continue
        top_id, top = min(entry.items(), key=lambda item: int(item[1].get("rank", 1 << 30)))
        found = {
            "position": position,
            "token": token,
            "rank": int(mine["rank"]),
            "logprob": float(mine["logprob"]),
            "top_token": int(top_id),
            "top_logprob": float(top["logprob"]),
        }
        (ties if float(top["logprob"]) - float(mine["logprob"]) <= tolerance else mismatches).append(found)
    return {"ok": not mismatches, "tokens": len(completion_ids), "mismatches": mismatches, "ties": ties}


class FilterModule:
    """serve_health's greedy-output filter."""

    def filters(self) -> dict[str, Any]:
        return {"sparkfleet_greedy_check": sparkfleet_greedy_check}
