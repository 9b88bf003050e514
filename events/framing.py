"""ZeroMQ message framing for KV events: ``[topic, seq (8 bytes big-endian), payload]``."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

from events.errors import FramingError

__all__ = [
    "END_OF_REPLAY_SEQ",
    "SEQ_BYTES",
    "Frame",
    "make_message",
    "pack_seq",
    "parse_message",
    "unpack_seq",
]

SEQ_BYTES: Final = 8
END_OF_REPLAY_SEQ: Final = b"\xff" * SEQ_BYTES
"""The seq frame of the replay end marker (-1 as signed 64-bit)."""

_SEQ: Final = struct.Struct(">Q")

Frame = bytes | memoryview


def pack_seq(seq: int) -> bytes:
    """Encode a sequence number as 8 bytes big-endian unsigned."""
    return _SEQ.pack(seq)


def unpack_seq(frame: Frame) -> int:
    """Decode an 8-byte big-endian unsigned sequence number.

    Raises:
        FramingError: The frame is not exactly 8 bytes long.
    """
    if len(frame) != SEQ_BYTES:
        raise FramingError("bad_seq", f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int(_SEQ.unpack(frame)[0])


def make_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one live KV event message."""
    return [topic, _SEQ.pack(seq), payload]


def parse_message(frames: Sequence[Frame]) -> tuple[bytes, int, Frame]:
    """Split a live message into topic, seq and payload.

    Raises:
        FramingError: The message does not have exactly three frames or its seq frame is
            not 8 bytes.
    """
    if len(frames) != 3:
        raise FramingError(
            "bad_frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}"
        )
    topic, seq, payload = frames
    return bytes(topic), unpack_seq(seq), payload
