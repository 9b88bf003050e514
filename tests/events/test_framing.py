"""Framing of live KV event messages: ``[topic, seq (8 bytes BE), payload]``."""

from __future__ import annotations

import pytest

from events.errors import EventDecodeError, FramingError
from events.framing import END_OF_REPLAY_SEQ, make_message, pack_seq, parse_message, unpack_seq


def test_seq_is_8_bytes_big_endian_unsigned() -> None:
    assert pack_seq(0) == bytes(8)
    assert pack_seq(1) == b"\x00" * 7 + b"\x01"
    assert pack_seq(2**64 - 1) == END_OF_REPLAY_SEQ
    assert unpack_seq(pack_seq(123456789)) == 123456789


def test_message_round_trip() -> None:
    frames = make_message(b"kv@w1", 7, b"payload")
    assert frames == [b"kv@w1", b"\x00\x00\x00\x00\x00\x00\x00\x07", b"payload"]
    assert parse_message([memoryview(f) for f in frames]) == (b"kv@w1", 7, memoryview(b"payload"))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", pack_seq(1)], "bad_frames"),
        ([b"t", pack_seq(1), b"p", b"extra"], "bad_frames"),
        ([b"t", b"\x01", b"p"], "bad_seq"),
        ([b"t", bytes(9), b"p"], "bad_seq"),
    ],
)
def test_malformed_frames_raise(frames: list[bytes], reason: str) -> None:
    with pytest.raises(FramingError) as info:
        parse_message(frames)
    assert info.value.reason == reason
    assert isinstance(info.value, EventDecodeError)
