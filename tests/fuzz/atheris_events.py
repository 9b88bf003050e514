"""atheris harness: coverage-guided fuzzing of the event decoder and the framing.

Run by ``test_fuzz_atheris.py`` in a subprocess with a bounded number of runs; by hand:
``python tests/fuzz/atheris_events.py -runs=1000000``. Any exception other than the
documented rejections (``EventDecodeError`` with a known reason, ``FramingError``)
crashes the run and libFuzzer saves the input, and so does a payload that
:func:`decode_batch` (the C decoder where built) and its spec, ``python_decode_batch``,
read differently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import atheris

with atheris.instrument_imports():
    from events.errors import EventDecodeError
    from events.framing import parse_message
    from events.schema import KVEventBatch, decode_batch, encode_batch, python_decode_batch

REASONS = frozenset({"msgpack", "unknown_tag", "bad_field", "bad_batch", "bad_event", "too_large"})


def decoded(decode: Callable[[bytes], KVEventBatch], data: bytes) -> bytes | str:
    """The batch re-encoded (as bytes: a NaN ts is not == itself) or the rejection reason."""
    try:
        return encode_batch(decode(data))
    except EventDecodeError as exc:
        if exc.reason not in REASONS:
            raise AssertionError(f"undocumented rejection reason {exc.reason!r}") from exc
        return exc.reason


def one_input(data: bytes) -> None:
    """Decode ``data`` as a payload and as three frames; only documented errors may escape."""
    encoded = decoded(decode_batch, data)
    if decoded(python_decode_batch, data) != encoded:
        raise AssertionError("decode_batch and its spec read the payload differently")
    if isinstance(encoded, bytes) and decoded(decode_batch, encoded) != encoded:
        raise AssertionError("a decoded batch does not survive re-encoding")
    cut1, cut2 = (len(data) // 3, 2 * len(data) // 3) if data else (0, 0)
    frames = [data[:cut1], data[cut1:cut2], data[cut2:]]
    try:
        parse_message(frames)
    except EventDecodeError as exc:
        if exc.reason not in ("bad_frames", "bad_seq"):
            raise AssertionError(f"undocumented framing reason {exc.reason!r}") from exc


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
