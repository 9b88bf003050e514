"""Chat requests for the router: render messages into one prompt, and answers into chat shape.

The router turns ``POST /v1/chat/completions`` into a plain completion (so it tokenizes,
routes and the worker caches exactly the same prompt text) and rewrites the worker's
``text_completion`` answer, buffered or streamed, into ``chat.completion`` objects.

Templates: a simple built-in one by default (``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n``), or the ``chat_template`` of a Hugging Face ``tokenizer_config.json``,
rendered with Jinja2 in a sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from router.errors import RouterError

__all__ = [
    "BuiltinChatTemplate",
    "ChatMessage",
    "ChatRewriter",
    "ChatTemplate",
    "ChatTemplateError",
    "HFChatTemplate",
    "TextPart",
    "load_chat_template",
]


class ChatTemplateError(RouterError, ValueError):
    """A chat template cannot be loaded or cannot render the messages."""


class TextPart(msgspec.Struct, frozen=True):
    """One part of a message's content list (only text parts are supported)."""

    text: str
    type: str = "text"


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat message: a role and its content (a string or a list of text parts)."""

    role: str
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatTemplate:
    """Base of chat templates: ``render(messages)`` gives the prompt text."""

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for ``messages``, ending with the assistant's turn."""
        raise NotImplementedError


class BuiltinChatTemplate(ChatTemplate):
    """``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for ``messages``."""
        return "".join(f"<|{m.role}|>\n{m.text}\n" for m in messages) + "<|assistant|>\n"


def _special(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class HFChatTemplate(ChatTemplate):
    """The ``chat_template`` of a Hugging Face ``tokenizer_config.json``, via Jinja2.

    Args:
        config_path: Path of ``tokenizer_config.json``.

    Raises:
        ChatTemplateError: Jinja2 is missing, or the file has no usable template.
    """

    def __init__(self, config_path: str | Path) -> None:
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ChatTemplateError(
                "--chat-template needs Jinja2: pip install 'kvroute[chat]'"
            ) from exc
        try:
            config = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {str(config_path)!r}: {exc}") from exc
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{str(config_path)!r} has no chat_template string")

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template of {str(config_path)!r}: {exc}") from exc
        self._template_error = TemplateError
        self._bos = _special(config.get("bos_token"))
        self._eos = _special(config.get("eos_token"))

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for ``messages``, with the generation prompt added.

        Raises:
            ChatTemplateError: The template fails on these messages.
        """
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.text} for m in messages],
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except self._template_error as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def load_chat_template(config_path: str | Path | None) -> ChatTemplate:
    """The HF template of ``config_path``, or the built-in one when ``None``."""
    return BuiltinChatTemplate() if config_path is None else HFChatTemplate(config_path)


_DONE: Final = b"[DONE]"


class ChatRewriter:
    """Rewrites one request's ``text_completion`` answer into ``chat.completion`` shape.

    NOTE: one instance per request: the first streamed chunk carries the assistant role
    in its delta and the rest do not, so the instance remembers whether it was sent.
    """

    def __init__(self) -> None:
        self._sent_role = False

    def rewrite_body(self, body: bytes) -> bytes:
        """A buffered completion as a ``chat.completion``."""
        raw = _decode(body)
        if raw is None:
            return body
        raw["object"] = "chat.completion"
        raw["choices"] = [
            {
                "index": c.get("index", 0),
                "message": {"role": "assistant", "content": c.get("text", "")},
                "finish_reason": c.get("finish_reason"),
            }
            for c in _choices(raw)
        ]
        return msgspec.json.encode(raw)

    def rewrite_event(self, data: bytes) -> bytes:
        """One streamed completion chunk as a ``chat.completion.chunk``."""
        raw = None if data == _DONE else _decode(data)
        if raw is None:
            return data
        raw["object"] = "chat.completion.chunk"
        choices = []
        for c in _choices(raw):
            delta: dict[str, Any] = {"content": c.get("text", "")}
            if not self._sent_role:
                delta["role"] = "assistant"
            choices.append(
                {
                    "index": c.get("index", 0),
                    "delta": delta,
                    "finish_reason": c.get("finish_reason"),
                }
            )
        if choices:
            self._sent_role = True
        raw["choices"] = choices
        return msgspec.json.encode(raw)


def _decode(data: bytes) -> dict[str, Any] | None:
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return raw if isinstance(raw, dict) else None


def _choices(raw: dict[str, Any]) -> list[dict[str, Any]]:
    choices = raw.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
