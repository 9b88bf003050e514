"""Chat templates shared by workers and routers: chat messages rendered into one prompt text.

A kvroute worker renders ``POST /v1/chat/completions`` messages with its template, and a
router renders the same messages to key the request: both must use the same template (and
tokenizer) or no chat prefix will ever match. Two kinds:

* the built-in one (``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``),
  the default of both a kvroute worker and a router;
* a Hugging Face ``chat_template`` (a Jinja2 template, rendered in a sandbox; ``pip install
  'kvroute[chat]'``), read from a model directory (``chat_template.jinja``, else the
  ``chat_template`` of ``tokenizer_config.json``) or from an explicit file.

Messages are rendered as vLLM renders them for string-content templates: a content given
as a list of text parts becomes their texts joined by newlines, ``null`` content the empty
string; every other field of a message (``name``, ``tool_calls``, ...) reaches the template
as sent. The template also gets the special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) and ``add_generation_prompt``
(true unless the request says otherwise).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from events.errors import EventsError

__all__ = [
    "BuiltinChatTemplate",
    "ChatTemplate",
    "ChatTemplateError",
    "HFChatTemplate",
    "find_chat_template",
    "load_chat_template",
    "message_text",
]

_SPECIAL_TOKENS: Final = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(EventsError, ValueError):
    """A chat template cannot be loaded, or cannot render the messages it was given."""


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string (text parts joined by newlines, as vLLM does).

    Raises:
        ChatTemplateError: The content is neither a string, ``null``, nor a list of
            ``{"type": "text", "text": ...}`` parts.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise ChatTemplateError(
                    f"content part {part!r} is not supported: only text parts "
                    '({"type": "text", "text": "..."}) are'
                )
            if part.get("type", "text") != "text":
                raise ChatTemplateError(f"content part of type {part['type']!r} is not supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"message content must be a string or a list of parts, got {content!r}")


class ChatTemplate:
    """Base of chat templates: :meth:`render` gives the prompt text of a conversation."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages``.

        Args:
            messages: The conversation, each a ``{"role", "content", ...}`` mapping.
            add_generation_prompt: End with the opening of the assistant's turn.
            extra: More template variables (``tools``, a request's
                ``chat_template_kwargs``); the built-in template ignores them.

        Raises:
            ChatTemplateError: The template refuses or fails on these messages.
        """
        raise NotImplementedError


class BuiltinChatTemplate(ChatTemplate):
    """``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages`` (see :meth:`ChatTemplate.render`)."""
        text = "".join(f"<|{_role(m)}|>\n{message_text(m)}\n" for m in messages)
        return text + "<|assistant|>\n" if add_generation_prompt else text


def _role(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatTemplateError(f"message {dict(message)!r} has no string 'role'")
    return role


def _special(value: Any) -> str:
    if isinstance(value, dict):  # an AddedToken: {"content": "<s>", ...}
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class HFChatTemplate(ChatTemplate):
    """A Hugging Face chat template (Jinja2 source), rendered in a sandbox.

    Args:
        source: The template's Jinja2 source.
        special_tokens: ``bos_token``, ``eos_token``, ... as the template sees them.
        origin: Where the template came from, for error messages.

    Raises:
        ChatTemplateError: Jinja2 is missing or the template does not compile.
    """

    def __init__(
        self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = ""
    ) -> None:
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ChatTemplateError(
                "a Hugging Face chat template needs Jinja2: pip install 'kvroute[chat]'"
            ) from exc

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"the chat template refused the messages: {message}")

        def strftime_now(fmt: str) -> str:
            return time.strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template {origin}: {exc}") from exc
        self._special = dict(special_tokens or {})
        self.origin = origin

    @classmethod
    def from_file(cls, path: str | Path) -> HFChatTemplate:
        """The template of a ``tokenizer_config.json`` (its ``chat_template``, the
        ``"default"`` one of a list) or of a Jinja2 file (any other name).

        Raises:
            ChatTemplateError: The file cannot be read or holds no template.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ChatTemplateError(f"cannot read {str(path)!r}: {exc}") from exc
        if path.suffix != ".json":
            return cls(text, _special_tokens(path.parent / "tokenizer_config.json"), str(path))
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ChatTemplateError(f"cannot read {str(path)!r}: {exc}") from exc
        source = _config_template(config)
        if source is None:
            raise ChatTemplateError(f"{str(path)!r} has no chat_template string")
        return cls(source, _special_tokens(path), str(path))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages`` (see :meth:`ChatTemplate.render`)."""
        conversation = [{**m, "role": _role(m), "content": message_text(m)} for m in messages]
        variables = {**self._special, **(extra or {})}
        try:
            return self._template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except Exception as exc:
            # A template runs on what the client sent (its messages, tools, kwargs): any
            # failure of it (a TypeError on an odd value too) is the request's.
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {exc}"
            ) from exc


def _config_template(config: Any) -> str | None:
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


def _special_tokens(config_path: Path) -> dict[str, str]:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {name: _special(config.get(name)) for name in _SPECIAL_TOKENS}


def find_chat_template(tokenizer_path: str | Path) -> Path | None:
    """The file holding the chat template of a tokenizer, if there is one.

    Looks beside a ``tokenizer.json`` file, or in a model directory:
    ``chat_template.jinja`` first (where recent Hugging Face releases keep it), then a
    ``tokenizer_config.json`` that has a ``chat_template``.
    """
    path = Path(tokenizer_path)
    folder = path if path.is_dir() else path.parent
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja
    config = folder / "tokenizer_config.json"
    try:
        has_template = _config_template(json.loads(config.read_text())) is not None
    except (OSError, ValueError):
        return None
    return config if has_template else None


def load_chat_template(
    override: str | Path | None = None, tokenizer_path: str | Path | None = None
) -> ChatTemplate:
    """The chat template a worker or router renders with.

    Args:
        override: An explicit template file (``--chat-template``): a
            ``tokenizer_config.json`` or a Jinja2 file; wins over everything.
        tokenizer_path: The tokenizer (a ``tokenizer.json`` or a model directory): its
            own template, found by :func:`find_chat_template`, when there is one.

    Returns:
        The template; the built-in one when neither names a template.

    Raises:
        ChatTemplateError: The template cannot be loaded.
    """
    if override is not None:
        return HFChatTemplate.from_file(override)
    found = None if tokenizer_path is None else find_chat_template(tokenizer_path)
    return BuiltinChatTemplate() if found is None else HFChatTemplate.from_file(found)
