"""Batch completions: a prompt that is a list of prompts, served as one request per prompt.

OpenAI's ``/v1/completions`` takes a batch (a list of strings or of token id lists) and
answers one choice per prompt (``n`` per prompt). The router routes each prompt on its own
prefix (prompts of one batch rarely share one), forwards each as the client's body with
that prompt alone, and merges the answers: the first answer's envelope, the choices in
prompt order indexed ``prompt * n + i``, the usages summed. A batch is not streamed
through the router (its answers would interleave); any answer other than a 200 is the
batch's answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

__all__ = ["merge_answers", "prompt_body"]


def prompt_body(body: Mapping[str, Any], prompt: str | list[int]) -> bytes:
    """The client's body with one prompt of its batch in place of the batch."""
    return msgspec.json.encode({**body, "prompt": prompt})


def merge_answers(answers: Sequence[Mapping[str, Any]], n: int) -> dict[str, Any]:
    """One completion answer from the answers to each prompt of a batch, in prompt order.

    Args:
        answers: Each prompt's decoded answer.
        n: Choices per prompt.
    """
    choices: list[Any] = []
    usage: dict[str, Any] = {}
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or ():
            if isinstance(choice, dict):
                choices.append({**choice, "index": i * n + int(choice.get("index") or 0)})
        if isinstance(answer.get("usage"), dict):
            usage = _add(usage, answer["usage"])
    return {**answers[0], "choices": choices, "usage": usage or None}


def _add(total: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """``total`` plus ``more``, field by field (nested objects too); other values kept."""
    out = dict(total)
    for name, value in more.items():
        current = out.get(name)
        if isinstance(value, bool) or value is None:
            out.setdefault(name, value)
        elif isinstance(value, (int, float)):
            out[name] = (current if isinstance(current, (int, float)) else 0) + value
        elif isinstance(value, dict):
            out[name] = _add(current if isinstance(current, dict) else {}, value)
        else:
            out.setdefault(name, value)
    return out
