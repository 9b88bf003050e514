"""OpenAI answer shapes: completions and chat completions, whole or as stream chunks.

Completion (and each chunk): ``{"id": "cmpl-...", "object": "text_completion", "created",
"model", "choices": [{"index", "text", "token_ids", "logprobs", "finish_reason",
"stop_reason"}], "usage"}``. Chat: ``{"id": "chatcmpl-...", "object": "chat.completion",
..., "choices": [{"index", "message": {"role": "assistant", "content"}, "logprobs",
"finish_reason", "stop_reason"}]}``; chat chunks (``"chat.completion.chunk"``) carry a
``delta`` instead, the first of each choice ``{"role": "assistant", "content": ""}``.

A stream carries ``usage`` only when ``stream_options.include_usage`` asked for it, as
OpenAI and vLLM do: then every chunk has ``"usage": null`` and one last chunk, before
``[DONE]``, has ``"choices": []`` and the usage of the whole request. A whole answer always
has its usage: ``{"prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens",
"prompt_tokens_details": {"cached_tokens"}}`` (``cached_tokens``: prompt tokens found in
the prefix cache; the top-level copy is kvroute's).

Logprobs (when asked): completions in the legacy shape ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``, chat as ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A completion's
``top_logprobs`` hold the sampled token and the likeliest ones (up to ``logprobs + 1``, as
OpenAI documents), a chat's the likeliest ``top_logprobs``. A token's text is
its own decoding; a log probability below -9999 (or -inf) is sent as -9999.0, as vLLM does
(JSON has no infinity).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from events.tokenizer import Tokenizer
from pool.worker.outputs import TokenLogprobs

__all__ = ["AnswerShape", "ChoiceResult", "Endpoint", "usage"]

Endpoint = Literal["completion", "chat"]
_MIN_LOGPROB: Final = -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object of an answer."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cached_tokens": cached_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ChoiceResult:
    """Everything one finished choice produced.

    Attributes:
        index: The choice's index in the answer.
        text: Its text (without a stop string).
        token_ids: Its tokens.
        logprobs: One entry per token when asked for, else ``None``.
        finish_reason: ``"stop"`` or ``"length"``.
        stop_reason: The stop string that ended it, if one did.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


class AnswerShape:
    """Shapes one request's answers: its id, creation time, model and endpoint.

    Args:
        endpoint: ``"completion"`` or ``"chat"``.
        model: The model name the answer reports.
        tokenizer: Decodes tokens for logprobs.
        include_usage: Streams carry ``"usage": null`` and a last usage chunk.
        request_id: The client's ``X-Request-Id`` (already checked printable), ending the
            answer's id so the request can be found in this worker's logs and answers.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        tokenizer: Tokenizer,
        include_usage: bool = False,
        request_id: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.include_usage = include_usage
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        # Unique whatever the client sends; its id, when given, as a suffix.
        self.id = f"{prefix}-{uuid.uuid4().hex}" + (f"-{request_id}" if request_id else "")
        self.created = int(time.time())
        self._tokenizer = tokenizer
        # NOTE: per choice, characters of text already streamed (completions' text_offset).
        self._offsets: dict[int, int] = {}

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.endpoint == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, choices: Sequence[ChoiceResult], usage_: dict[str, Any]) -> dict[str, Any]:
        """The answer of a request that was not streamed."""
        return {
            **self._envelope(chunk=False),
            "choices": [self._whole_choice(c) for c in choices],
            "usage": usage_,
        }

    def _whole_choice(self, c: ChoiceResult) -> dict[str, Any]:
        logprobs = None if c.logprobs is None else self._logprobs(c.index, c.logprobs, 0)
        if self.endpoint == "chat":
            return {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        return {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant role, no content yet."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def delta_chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: str | None,
        stop_reason: str | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of one choice: its new text and tokens."""
        offset = self._offsets.get(index, 0)
        entries = None if logprobs is None else self._logprobs(index, logprobs, offset)
        self._offsets[index] = offset + len(text)
        choice: dict[str, Any] = {"index": index}
        if self.endpoint == "chat":
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            choice.update(text=text, token_ids=token_ids)
        choice.update(logprobs=entries, finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._chunk([choice])

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage_}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._envelope(chunk=True), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _logprobs(
        self, index: int, entries: Sequence[TokenLogprobs], text_offset: int
    ) -> dict[str, Any]:
        if self.endpoint == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(e.logprob) for e in entries],
            # The sampled token first, then the likeliest: up to logprobs + 1 entries.
            "top_logprobs": [
                {self._token(t): _logprob(lp) for t, lp in ((e.token_id, e.logprob), *e.top)}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: TokenLogprobs) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token(token_id)
            return {
                "token": token,
                "logprob": _logprob(logprob),
                "bytes": list(token.encode("utf-8", errors="replace")),
            }

        return {
            **item(entry.token_id, entry.logprob),
            "top_logprobs": [item(t, lp) for t, lp in entry.top],
        }
