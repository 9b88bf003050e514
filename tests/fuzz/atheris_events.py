"""atheris harness: coverage-guided fuzzing of the event decoder and the framing.

Run by ``test_fuzz_atheris.py`` in a subprocess with a bounded number of runs; by hand:
``python tests/fuzz/atheris_events.py -runs=1000000``. Any exception other than the
documented rejections (``EventDecodeError`` with a known reason, ``FramingError``)
crashes the run and libFuzzer saves the input.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from events.errors import EventDecodeError
    from events.framing import parse_message
    from events.schema import decode_batch, encode_batch

REASONS = frozenset({"msgpack", "unknown_tag", "bad_field", "bad_batch", "bad_event", "too_large"})


def one_input(data: bytes) -> None:
    """Decode ``data`` as a payload and as three frames; only documented errors may escape."""
    try:
        batch = decode_batch(data)
    except EventDecodeError as exc:
        if exc.reason not in REASONS:
            raise AssertionError(f"undocumented rejection reason {exc.reason!r}") from exc
    else:
        encoded = encode_batch(batch)  # compared as bytes: a NaN ts is not == itself
        if encode_batch(decode_batch(encoded)) != encoded:
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
