"""The fields of OpenAI request bodies the router reads to route them (the rest it never
touches: a request is forwarded as the client sent it).

Only what routing needs is typed: the prompt (or, for chat, the messages:
:mod:`router.front.chat`), the model, how many tokens and choices to expect, whether it
streams and the cache salt. ``null`` means the default, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeVar

import msgspec

__all__ = ["CompletionBody", "RequestBody", "RouteBody", "TokenId", "decode_token_ids_body"]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]

_DEFAULT_MAX_TOKENS = 16


class RequestBody(msgspec.Struct, kw_only=True):
    """What every generation request tells the router.

    Attributes:
        model: The model asked for (``None``: the only one served).
        max_tokens: Output tokens at most, per choice (OpenAI's default: 16).
        n: Choices (default 1).
        stream: Whether the answer is a stream.
        stream_options: As sent; ``msgspec.UNSET`` when absent.
        cache_salt: Salts the prefix keys (vLLM's ``cache_salt``).
        user: OpenAI's end-user id, a session key when no ``X-Session-Id`` names one
            (:func:`router.front.request_context.session_key`); any JSON, judged by
            the worker.
    """

    model: str | None = None
    max_tokens: NonNegative | None = None
    n: Positive | None = None
    stream: bool | None = None
    stream_options: Any = msgspec.UNSET
    cache_salt: str | None = None
    user: object = None

    @property
    def output_tokens(self) -> int:
        """Output tokens to expect in all, for load accounting."""
        per_choice = self.max_tokens if self.max_tokens is not None else _DEFAULT_MAX_TOKENS
        return per_choice * (self.n or 1)

    @property
    def streams(self) -> bool:
        """Whether the answer is a stream."""
        return bool(self.stream)


class CompletionBody(RequestBody, kw_only=True):
    """A ``/v1/completions`` body: ``prompt`` is a string, token ids, or a batch (a list of
    strings or of token id lists).

    Attributes:
        prompt: As sent (see :meth:`prompts`).
        add_special_tokens: vLLM's option for text prompts, when given.
    """

    prompt: str | list[TokenId | str | list[TokenId]]
    add_special_tokens: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or each of a batch.

        Raises:
            ValueError: A list mixing token ids, strings and token id lists.
        """
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]  # checked: all ints
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]  # checked: all of one kind
        raise ValueError(
            "'prompt' must be a string, a list of token ids, or a batch: a list of strings "
            "or a list of token id lists (not a mix)"
        )


B = TypeVar("B", bound="CompletionBody")


class RouteBody(CompletionBody, kw_only=True):
    """A ``/v1/route`` body: a completion plus ``dry_run`` and ``top_k`` (how many
    candidates the answer lists, best first; ``None``: the default, see
    :mod:`router.front.route_answer`)."""

    dry_run: bool = False
    top_k: int | None = None


class _CompletionIds(CompletionBody, kw_only=True):
    """A :class:`CompletionBody` whose prompt is one list of token ids."""

    prompt: list[TokenId]  # type: ignore[assignment]  # narrower: one prompt of ids

    def prompts(self) -> list[str | list[int]]:
        """The one prompt."""
        return [self.prompt]


class _RouteIds(RouteBody, kw_only=True):
    """A :class:`RouteBody` whose prompt is one list of token ids."""

    prompt: list[TokenId]  # type: ignore[assignment]  # narrower: one prompt of ids

    def prompts(self) -> list[str | list[int]]:
        """The one prompt."""
        return [self.prompt]


_TOKEN_IDS_DECODERS: Final[dict[type, msgspec.json.Decoder[Any]]] = {
    CompletionBody: msgspec.json.Decoder(_CompletionIds),
    RouteBody: msgspec.json.Decoder(_RouteIds),
}


def decode_token_ids_body(raw: bytes, kind: type[B]) -> B | None:
    """``raw`` as ``kind`` when its prompt is one list of token ids, else ``None`` (then
    decode it as ``kind``, which says what is wrong, if anything).

    The usual prompt of a gateway is validated in C this way: telling the shapes of the
    general ``prompt`` apart costs a Python check per token (~1.3 ms for 8,192 ids,
    ``bench_router``).
    """
    try:
        body: B = _TOKEN_IDS_DECODERS[kind].decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return body
