"""The C event decoder ``events._wire`` against its spec, ``events.schema.python_decode_batch``.

Claims: every batch in the shape vLLM >= 0.33 and kvroute send is read in C (not left to
Python) into a batch equal to the spec's, re-encoding to the very payload bytes, its
token ids a ``TokenIds`` whose router keys are those of the list; every other payload
(other shapes, malformed, truncated, lying lengths, random bytes) is either read the same
or declined (``None``), so :func:`decode_batch` accepts, rejects and counts exactly what
the spec does; ``TokenIds`` behaves as the list it stands for (``events tail --json``
included); nothing leaks.
"""

from __future__ import annotations

import array
import copy
import json
import math
import pickle
import struct
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.cli.events import event_rows
from events.errors import EventDecodeError
from events.hashing import python_block_keys, router_block_keys
from events.identity import WorkerId
from events.native import native
from events.recorder import LogRecord
from events.schema import (
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    python_decode_batch,
)
from tests.support.event_payloads import any_payload, batches, legacy_payload

wire_decode: Callable[[bytes], KVEventBatch | None] | None = native("events._wire", "decode")
TokenIds: Any = native("events._wire", "TokenIds")
needs_wire = pytest.mark.skipif(wire_decode is None, reason="events._wire not built or not used")
pytestmark = needs_wire

PARITY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
EVENT = {
    "type": "BlockStored",
    "block_hashes": [7, 8],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
DEEP: Any = 1
for _ in range(40):  # deeper than the C reader goes (MAX_DEPTH)
    DEEP = [DEEP]


def c_decode(payload: bytes) -> KVEventBatch | None:
    assert wire_decode is not None
    return wire_decode(payload)


def outcome(decode: Callable[..., KVEventBatch], payload: bytes, *args: Any) -> Any:
    """What a decoder makes of a payload, comparable across decoders: the re-encoded
    batch (a NaN ts is not equal to itself) or the rejection's reason."""
    try:
        return ("batch", encode_batch(decode(payload, *args)))
    except EventDecodeError as exc:
        return ("rejected", exc.reason)


def stored_tokens(batch: KVEventBatch) -> list[Sequence[int]]:
    return [e.token_ids for e in batch.events if isinstance(e, BlockStored)]


def pack(*parts: bytes | Any) -> bytes:
    """Msgpack bytes: raw ``bytes`` parts as they are, other values encoded."""
    return b"".join(p if isinstance(p, bytes) else msgspec.msgpack.encode(p) for p in parts)


def event_map(items: list[tuple[Any, Any]]) -> bytes:
    """A map event with keys in the given order (repeats kept)."""
    return bytes([0x80 | len(items)]) + b"".join(pack(k, v) for k, v in items)


def batch_of(event: bytes) -> bytes:
    return pack(b"\x93", 1.5, b"\x91", event, 0)


# ---- the common shape: read in C, exactly -----------------------------------------------


@PARITY
@given(batches(token_values=uint32))
def test_every_batch_kvroute_and_vllm_send_is_read_in_c_exactly(batch: KVEventBatch) -> None:
    payload = encode_batch(batch)
    ours = c_decode(payload)
    spec = python_decode_batch(payload)
    assert ours is not None
    assert ours == spec == batch
    assert encode_batch(ours) == payload == encode_batch(spec)
    assert all(type(tokens) is TokenIds for tokens in stored_tokens(ours))
    assert all(type(tokens) is list for tokens in stored_tokens(spec))
    assert encode_batch(decode_batch(payload)) == payload


@PARITY
@given(
    tokens=st.lists(uint32, max_size=300),
    block_size=st.integers(1, 70),
    parent=st.integers(0, 2**64 - 1),
)
def test_router_keys_of_decoded_token_ids_are_those_of_the_list(
    tokens: list[int], block_size: int, parent: int
) -> None:
    # Block sizes 1-70 cross XXH3's length classes (the C hash and the xxhash package's).
    num_blocks = max(1, len(tokens) // block_size)
    event = BlockStored([1] * num_blocks, None, tokens, block_size, None, "GPU", None)
    ours = c_decode(encode_batch(KVEventBatch(0.5, [event])))
    assert ours is not None
    (decoded,) = stored_tokens(ours)
    assert type(decoded) is TokenIds
    expected = python_block_keys(tokens, block_size, parent)
    assert router_block_keys(decoded, block_size, parent) == expected
    assert router_block_keys(tokens, block_size, parent) == expected
    assert python_block_keys(decoded, block_size, parent) == expected


def test_a_large_batch_is_read_in_c_exactly() -> None:
    # 8,192 blocks of 16 tokens (a long prompt in one event), every token-id width.
    tokens = [(i * 2_654_435_761) % 2**32 >> (i % 4 * 8) for i in range(8_192 * 16)]
    event = BlockStored(list(range(8_192)), 3, tokens, 16, 1, "CPU", "a", group_idx=0)
    payload = encode_batch(KVEventBatch(2.5, [event] * 4, 1))
    ours = c_decode(payload)
    assert ours is not None and ours == python_decode_batch(payload)
    assert encode_batch(ours) == payload


def test_fields_newer_than_ours_are_skipped_in_c_as_the_spec_skips_them() -> None:
    payload = pack([1.5, [{**EVENT, "future": [1, {"a": b"x", "b": [None, 2.5]}]}], 3])
    ours = c_decode(payload)
    assert ours is not None and ours == python_decode_batch(payload)
    assert ours == python_decode_batch(pack([1.5, [EVENT], 3]))


# ---- other shapes and bad bytes: declined, the spec decides ------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(pack([1, [EVENT], 0]), id="int ts"),
        pytest.param(pack([1.5, [EVENT], 0, 9]), id="batch of 4"),
        pytest.param(pack([1.5, [EVENT]])[:-1], id="truncated"),
        pytest.param(pack([1.5, [EVENT]]) + b"\x00", id="trailing byte"),
        pytest.param(pack({"ts": 1.5, "events": []}), id="map batch"),
        pytest.param(pack([1.5, [{**EVENT, "token_ids": [1, 2, 3, -4]}]]), id="negative token"),
        pytest.param(pack([1.5, [{**EVENT, "token_ids": [1, 2, 3, 2**32]}]]), id="token > u32"),
        pytest.param(pack([1.5, [{**EVENT, "block_size": True}]]), id="bool block size"),
        pytest.param(pack([1.5, [{**EVENT, "medium": b"GPU"}]]), id="bin medium"),
        pytest.param(pack([1.5, [{**EVENT, "extra_keys": "x"}]]), id="extra keys not array"),
        pytest.param(
            pack([1.5, [{**EVENT, "locality": msgspec.msgpack.Ext(1, b"ab")}]]), id="ext in Any"
        ),
        pytest.param(pack([1.5, [{**EVENT, "locality": DEEP}]]), id="deep Any"),
        pytest.param(pack([1.5, [{**EVENT, "group_idx": msgspec.msgpack.Ext(1, b"")}]]), id="ext"),
        pytest.param(pack([1.5, [["BlockRemoved", [1], "GPU"]]]), id="legacy array event"),
        pytest.param(pack([1.5, [{**EVENT, "type": "Future"}]]), id="unknown tag"),
        pytest.param(pack([1.5, [{k: v for k, v in EVENT.items() if k != "lora_id"}]]), id="old"),
        pytest.param(batch_of(event_map([*EVENT.items(), ("block_size", 4)])), id="key twice"),
        pytest.param(batch_of(event_map([*EVENT.items(), ("type", "BlockRemoved")])), id="tag 2x"),
        pytest.param(
            batch_of(event_map([*list(EVENT.items())[1:], ("type", "BlockStored")])), id="tag last"
        ),
        pytest.param(batch_of(event_map([*EVENT.items(), (3, 4)])), id="int key"),
        pytest.param(batch_of(event_map([*EVENT.items(), (b"x", 4)])), id="bin key"),
        pytest.param(batch_of(event_map([*EVENT.items(), ("medium", "CPU")])), id="medium 2x"),
        pytest.param(batch_of(b"\x81\xa4type\xabBlockStored"), id="fields missing"),
        pytest.param(batch_of(b"\x82\xa4type\xb0AllBlocksCleared\xa1x\xa2\xff\xfe"), id="bad utf8"),
        pytest.param(batch_of(b"\x82\xa4type\xb0AllBlocksCleared\xa1x\xc1"), id="byte 0xc1"),
        pytest.param(b"\x92\xcb" + struct.pack(">d", math.nan) + b"\xdd\xff\xff\xff\xff", id="lie"),
        pytest.param(
            pack(
                b"\x92",
                1.5,
                b"\x91\x82\xa4type\xacBlockRemoved\xacblock_hashes",
                b"\xdd\x7f\xff\xff\xff",
            ),
            id="hashes lie",
        ),
        pytest.param(
            pack(
                b"\x92",
                1.5,
                b"\x91\x82\xa4type\xb0AllBlocksCleared\xa1x",
                b"\xdb\xff\xff\xff\xf0abc",
            ),
            id="str lies",
        ),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="never used byte"),
    ],
)
def test_payloads_outside_the_common_shape_are_left_to_the_spec(payload: bytes) -> None:
    assert c_decode(payload) is None
    unknown: list[str] = []
    spec_unknown: list[str] = []
    assert outcome(decode_batch, payload) == outcome(python_decode_batch, payload)
    assert outcome(decode_batch, payload, unknown.append) == outcome(
        python_decode_batch, payload, spec_unknown.append
    )
    assert unknown == spec_unknown


@settings(PARITY, max_examples=500)
@given(any_payload)
def test_any_payload_is_read_as_the_spec_reads_it_or_declined(payload: bytes) -> None:
    """Random bytes and valid batches damaged byte by byte or field by field."""
    ours = c_decode(payload)
    if ours is not None:
        assert encode_batch(ours) == encode_batch(python_decode_batch(payload))
    assert outcome(decode_batch, payload) == outcome(python_decode_batch, payload)
    unknown: list[str] = []
    spec_unknown: list[str] = []
    assert outcome(decode_batch, payload, unknown.append) == outcome(
        python_decode_batch, payload, spec_unknown.append
    )
    assert unknown == spec_unknown


@PARITY
@given(batches(token_values=uint32))
def test_the_legacy_array_shape_decodes_to_the_same_batch(batch: KVEventBatch) -> None:
    payload = legacy_payload(batch)
    assert decode_batch(payload) == python_decode_batch(payload) == batch


def test_decoding_leaks_nothing() -> None:
    good = encode_batch(
        KVEventBatch(
            1.5,
            [
                BlockStored(
                    list(range(32)),
                    5,
                    list(range(512)),
                    16,
                    None,
                    "GPU",
                    None,
                    extra_keys=[None] * 32,
                    locality={"a": [1]},
                )
            ],
            0,
        )
    )
    declined = good[:-3]

    def run() -> None:
        for _ in range(2_000):
            c_decode(good)
            c_decode(declined)

    run()  # warm caches and free lists
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes still held after 4,000 decodes"


# ---- TokenIds ---------------------------------------------------------------------------


def test_token_ids_behave_as_the_list_they_stand_for() -> None:
    values = [0, 1, 255, 65_536, 2**31, 2**32 - 1]
    tokens = TokenIds(values)
    assert len(tokens) == 6 and list(tokens) == values and tokens.tolist() == values
    assert tokens == values and values == tokens and tokens == tuple(values)
    assert tokens != [*values, 1] and tokens != values[:-1] and tokens != [1.5] * 6
    assert tokens == TokenIds(values) and tokens != TokenIds(values[:-1])
    assert tokens != "x" and tokens != {1: 2} and tokens != array.array("I", values)
    assert (tokens[0], tokens[-1], tokens[2:4], tokens[::-2]) == (
        0,
        2**32 - 1,
        [255, 65_536],
        values[::-2],
    )
    with pytest.raises(IndexError):
        tokens[6]
    with pytest.raises(TypeError):
        hash(tokens)
    assert isinstance(tokens, Sequence)
    assert pickle.loads(pickle.dumps(tokens)) == tokens
    assert copy.deepcopy(tokens) == tokens and type(copy.copy(tokens)) is TokenIds
    assert repr(tokens) == f"TokenIds({values!r})"
    view = memoryview(tokens)
    assert (view.format, view.itemsize, view.readonly, view.tolist()) == ("I", 4, True, values)
    assert array.array("I", tokens) == array.array("I", values)
    assert TokenIds([]) == [] and len(TokenIds(())) == 0


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ([-1], OverflowError),
        ([2**32], OverflowError),
        (["1"], TypeError),
        ([1.0], TypeError),
        (None, TypeError),
    ],
)
def test_token_ids_refuse_what_is_not_a_uint32(source: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        TokenIds(source)


def test_token_ids_are_read_only() -> None:
    tokens = TokenIds([1, 2])
    with pytest.raises(TypeError):
        tokens[0] = 5
    with pytest.raises(TypeError):
        memoryview(tokens)[0] = 5
    with pytest.raises(TypeError):
        struct.pack_into("I", tokens, 0, 5)  # asks for a writable buffer
    assert tokens == [1, 2]


def test_events_tail_rows_of_a_batch_decoded_in_c_are_json() -> None:
    payload = encode_batch(
        KVEventBatch(1.5, [BlockStored([7, b"\x01\x02"], None, [1, 2, 3, 4], 2, None, "GPU", None)])
    )
    record = LogRecord(2.0, WorkerId("w0"), "batch", 0, payload)
    assert type(record.decode().events[0].token_ids) is TokenIds
    (row,) = event_rows(record)
    assert json.loads(json.dumps(row))["token_ids"] == [1, 2, 3, 4]
    assert row["block_hashes"] == [7, "0102"]
