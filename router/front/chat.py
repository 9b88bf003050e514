"""Chat requests for the router: the fields of a chat completion it reads to route it.

The router forwards ``POST /v1/chat/completions`` to the worker's own chat endpoint as the
client sent it (a vLLM engine and a kvroute worker both render the messages with their
chat template); it renders the same messages only to key the request
(:mod:`router.front.tokenization`), with the model's chat template or through the
engine's ``/tokenize``.
"""

from __future__ import annotations

from typing import Any

from router.front.bodies import NonNegative, RequestBody

__all__ = ["ChatBody", "chat_problem"]


class ChatBody(RequestBody, kw_only=True):
    """The fields of a chat completion the router reads.

    Attributes:
        messages: The conversation, each message an object with a string ``role``.
        max_completion_tokens: OpenAI's newer name of ``max_tokens``; wins over it.
    """

    messages: list[dict[str, Any]]
    max_completion_tokens: NonNegative | None = None

    def __post_init__(self) -> None:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


def chat_problem(body: ChatBody, max_messages: int) -> str | None:
    """What is wrong with a chat body's messages, or ``None``."""
    if not body.messages:
        return "messages is empty: send at least one message"
    if len(body.messages) > max_messages:
        return f"{len(body.messages)} messages; the limit is {max_messages}"
    for i, message in enumerate(body.messages):
        if not isinstance(message.get("role"), str):
            return f"messages[{i}] has no string 'role'"
    return None
