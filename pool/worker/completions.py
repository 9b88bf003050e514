"""The OpenAI-style completions wire format: request bodies in, response and stream chunks out.

Request body: ``{"prompt": str | list[int], "max_tokens": int = 16, "stream": bool =
false, "temperature": float = 0.0, "top_p": float = 1.0, "top_k": int = 0, "ignore_eos":
bool = false, "seed": int | null}`` (ranges: :mod:`pool.worker.sampling`); unknown keys are
ignored, ``null`` means the default, and ``NaN`` / ``Infinity`` are refused as the
non-JSON they are. Response (and each stream chunk):
``{"id", "object": "text_completion", "created", "model", "choices": [{"index": 0,
"text", "token_ids", "finish_reason"}]}``, plus on the final one ``"usage":
{"prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens",
"prompt_tokens_details": {"cached_tokens"}}``, where ``cached_tokens`` counts the prompt
tokens found in the prefix cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from events.tokenizer import Tokenizer
from pool.errors import PoolError
from pool.worker.engine import SamplingParams
from pool.worker.outputs import RequestOutput

__all__ = [
    "CompletionRequest",
    "CompletionRequestError",
    "IncrementalText",
    "completion_chunk",
    "parse_completion_request",
    "usage",
]


class CompletionRequestError(PoolError, ValueError):
    """A completion request body is malformed; the message says what to fix."""


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed completion request.

    Attributes:
        prompt_token_ids: The prompt, tokenized when it came as text.
        params: How to generate.
        stream: Whether to answer with Server-Sent Events.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool


def parse_completion_request(raw: bytes, tokenizer: Tokenizer) -> CompletionRequest:
    """Parse and type-check a request body; text prompts are tokenized.

    Raises:
        CompletionRequestError: The body is not JSON, not an object, or a field has the
            wrong type.
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise CompletionRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CompletionRequestError("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        try:
            tokens = tokenizer.encode(prompt)
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") is no UTF-8 text
            raise CompletionRequestError(f"'prompt' is not valid Unicode text: {exc}") from exc
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        tokens = prompt
    else:
        raise CompletionRequestError("'prompt' must be a string or a list of token ids (ints)")
    params = SamplingParams(
        max_tokens=_int_field(body, "max_tokens", 16),
        temperature=_float_field(body, "temperature", 0.0),
        ignore_eos=_bool_field(body, "ignore_eos", False),
        seed=None if body.get("seed") is None else _int_field(body, "seed", 0),
        top_p=_float_field(body, "top_p", 1.0),
        top_k=_int_field(body, "top_k", 0),
    )
    return CompletionRequest(tokens, params, _bool_field(body, "stream", False))


def completion_chunk(
    request_id: str, model: str, text: str, token_ids: list[int], finish_reason: str | None
) -> dict[str, Any]:
    """A completion response, or one stream chunk, without usage."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish_reason}
        ],
    }


def usage(last: RequestOutput) -> dict[str, Any]:
    """The ``usage`` object of a finished request."""
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
        "cached_tokens": last.num_cached_tokens,
        "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens},
    }


class IncrementalText:
    """Turns a growing list of token ids into text deltas for streaming.

    NOTE: an incomplete UTF-8 sequence at the end is held back (not sent as U+FFFD)
    until its last byte arrives or the request finishes.

    Args:
        tokenizer: Decodes the ids.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._sent = ""

    def push(self, token_ids: list[int], finished: bool) -> str:
        """Add tokens; returns the text not sent yet."""
        self._token_ids.extend(token_ids)
        text = self._tokenizer.decode(self._token_ids)
        if not finished:
            text = text.rstrip("\ufffd")
        delta = text[len(self._sent) :] if text.startswith(self._sent) else ""
        self._sent += delta
        return delta


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be an integer, got {value!r}")
    return value


def _float_field(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range, e.g. 10**400
        digits = len(str(abs(value)))
        raise CompletionRequestError(
            f"{name!r} is out of range: got an integer of {digits} digits"
        ) from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be true or false, got {value!r}")
    return value
