"""The router's own usage accounting on streams: ask the worker for usage, hide it when unasked.

OpenAI and vLLM stream a request's ``usage`` only when ``stream_options.include_usage``
asks for it: one last chunk with ``"choices": []`` (and ``"usage": null`` on the chunks
before it). The router counts every worker's prefix hits from that usage
(``kvroute_router_actual_hit_tokens``), so it asks for it on every stream, and takes it
out again when the client did not ask:

* :func:`ask_for_usage` is the only change the router makes to a client's body: it adds
  ``"stream_options": {"include_usage": true}`` after the opening brace, every other
  byte as the client sent it (a body whose ``stream_options`` exists but asks for no
  usage is re-encoded with ``include_usage`` set, the rest of its fields unchanged);
* :class:`UsageStripper` drops the usage chunk and the ``usage`` fields from the stream.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = ["NULL_USAGE_TAIL", "UsageStripper", "ask_for_usage", "usage_asked"]

_ASK: Final = b'"stream_options":{"include_usage":true},'
_DONE: Final = b"[DONE]"
NULL_USAGE_TAIL: Final = b',"usage":null}'
"""How a chunk before the usage chunk ends (vLLM's and kvroute's compact JSON): its last
member is ``"usage": null`` (no JSON string can hold these bytes unescaped)."""


def usage_asked(stream_options: Any) -> bool:
    """Whether a request's ``stream_options`` ask for the usage."""
    return isinstance(stream_options, dict) and stream_options.get("include_usage") is True


def ask_for_usage(raw: bytes, stream_options: Any = msgspec.UNSET) -> bytes:
    """``raw`` (the client's JSON object) asking for the stream's usage.

    Args:
        raw: The body as the client sent it.
        stream_options: Its ``stream_options`` (``msgspec.UNSET`` when it has none).

    Returns:
        ``raw`` itself when it already asks; else ``raw`` with the ask inserted after its
        opening brace (no ``stream_options`` key), or re-encoded with
        ``stream_options.include_usage`` set.
    """
    if usage_asked(stream_options):
        return raw
    if stream_options is msgspec.UNSET:
        start = raw.index(b"{") + 1
        return raw[:start] + _ASK + raw[start:]
    body = msgspec.json.decode(raw)
    merged = dict(stream_options) if isinstance(stream_options, dict) else {}
    merged["include_usage"] = True
    return msgspec.json.encode({**body, "stream_options": merged})


class UsageStripper:
    """Takes the usage the router asked for out of a stream the client gets.

    A :class:`router.front.proxy_contracts.ResponseRewriter` for streams: a chunk with no choices
    and a usage is dropped; other chunks lose their ``usage`` field. Everything else
    passes unchanged.
    """

    def rewrite_body(self, body: bytes) -> bytes:
        """A whole answer keeps its usage (OpenAI always sends it there)."""
        return body

    def rewrite_event(self, data: bytes) -> bytes | None:
        """One ``data:`` payload of the stream; ``None`` drops the event."""
        if data == _DONE or b'"usage"' not in data:
            return data
        if data.endswith(NULL_USAGE_TAIL):  # cut as bytes: no decode, no re-encode
            return data[: -len(NULL_USAGE_TAIL)] + b"}"
        try:
            chunk = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return data
        if not isinstance(chunk, dict) or "usage" not in chunk:
            return data
        if chunk.get("choices") == []:
            return None
        del chunk["usage"]
        return msgspec.json.encode(chunk)
