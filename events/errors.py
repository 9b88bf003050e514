"""Error hierarchy of the ``events`` package."""

from __future__ import annotations

__all__ = ["EventDecodeError", "EventsError", "FramingError"]


class EventsError(Exception):
    """Base of every error raised by the ``events`` package."""


class EventDecodeError(EventsError, ValueError):
    """A message or payload could not be decoded into KV events.

    Consumers catch it, count it under :attr:`reason` and skip the message; it never
    propagates out of a consumer loop.

    Attributes:
        reason: A short, stable, metric-friendly label (``"msgpack"``, ``"unknown_tag"``,
            ``"bad_field"``, ``"bad_batch"``, ``"too_large"``, ...).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class FramingError(EventDecodeError):
    """A ZeroMQ multipart message does not have the ``[topic, seq, payload]`` shape."""
