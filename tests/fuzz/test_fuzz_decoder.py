"""Hypothesis fuzzing of the event decoder, the framing and the index fold.

Inputs: random bytes, valid vLLM batches in both wire shapes (map and legacy array),
and those batches mutated at the byte level (flips, truncation, insertion, splicing)
and at the object level (wrong types, dropped and unknown fields, bad tags). Claims:

* :func:`events.schema.decode_batch` returns a batch or raises
  :class:`events.errors.EventDecodeError` with a known reason; nothing else escapes;
* :func:`events.framing.parse_message` returns or raises :class:`FramingError`;
* any decodable batch, folded into :class:`MemoryPrefixIndex`, applies or raises
  :class:`OrphanParentError`, never leaves the index inconsistent (its stats, its
  per-worker entries and its lookups agree), and a rejected payload changes nothing;
* every malformed ``BlockStored`` is counted by the bridge.

Coverage-guided fuzzing of the same decoder with atheris is in ``test_fuzz_atheris.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.errors import EventDecodeError, FramingError
from events.framing import SEQ_BYTES, parse_message
from events.identity import WorkerId
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from router.errors import OrphanParentError
from router.index.changes import CPU_MASK, GPU_MASK
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex

pytestmark = pytest.mark.slow

REASONS = frozenset({"msgpack", "unknown_tag", "bad_field", "bad_batch", "bad_event", "too_large"})
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
W0 = WorkerId("w0")

# -- strategies -------------------------------------------------------------------------

hashes = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=-1),  # pre-0.10.2 engines: Python hash()
    st.binary(min_size=16, max_size=32),
)
small_hashes = st.integers(min_value=0, max_value=7)  # collide often: parents, duplicates
media = st.sampled_from(["GPU", "CPU", "STORAGE", None])


@st.composite
def stored(draw: st.DrawFn, hash_values: st.SearchStrategy[Any] = hashes) -> BlockStored:
    block_size = draw(st.integers(min_value=1, max_value=4))
    block_hashes = draw(st.lists(hash_values, min_size=1, max_size=4))
    tokens = draw(
        st.lists(
            st.integers(min_value=0, max_value=50),
            min_size=block_size * len(block_hashes),
            max_size=block_size * len(block_hashes),
        )
    )
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=draw(st.none() | hash_values),
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=draw(media),
        lora_name=draw(st.none() | st.sampled_from(["a", "b"])),
        group_idx=draw(st.none() | st.integers(min_value=0, max_value=1)),
    )


def removed(hash_values: st.SearchStrategy[Any] = hashes) -> st.SearchStrategy[BlockRemoved]:
    return st.builds(
        BlockRemoved,
        block_hashes=st.lists(hash_values, min_size=1, max_size=4),
        medium=media,
    )


def events(hash_values: st.SearchStrategy[Any] = hashes) -> st.SearchStrategy[Any]:
    return st.one_of(stored(hash_values), removed(hash_values), st.just(AllBlocksCleared()))


def batches(hash_values: st.SearchStrategy[Any] = hashes) -> st.SearchStrategy[KVEventBatch]:
    return st.builds(
        KVEventBatch,
        ts=st.floats(allow_nan=False, allow_infinity=False, width=64),
        events=st.lists(events(hash_values), max_size=5),
        data_parallel_rank=st.none() | st.integers(min_value=0, max_value=7),
    )


def legacy_payload(batch: KVEventBatch) -> bytes:
    """The legacy array shape: every event ``[tag, field1, ...]`` with all fields."""
    raw: list[Any] = []
    for event in batch.events:
        fields = [getattr(event, name) for name in type(event).__struct_fields__]
        raw.append([type(event).__name__, *fields])
    return msgspec.msgpack.encode([batch.ts, raw, batch.data_parallel_rank])


@st.composite
def valid_payloads(draw: st.DrawFn) -> bytes:
    batch = draw(batches())
    return legacy_payload(batch) if draw(st.booleans()) else encode_batch(batch)


@st.composite
def byte_mutants(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_payloads()))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice"]))
        pos = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(min_value=1, max_value=8))]
        else:
            data[pos:pos] = draw(valid_payloads())[: draw(st.integers(0, 16))]
    return bytes(data)


odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2),
)


@st.composite
def object_mutants(draw: st.DrawFn) -> bytes:
    """A valid batch decoded to plain objects, one part replaced, re-encoded."""
    raw = msgspec.msgpack.decode(draw(valid_payloads()))
    target = draw(st.sampled_from(["batch", "ts", "rank", "event", "field", "tag", "extra"]))
    event_list = raw[1]
    if target == "batch":
        raw = draw(odd_values)
    elif target == "ts":
        raw[0] = draw(odd_values)
    elif target == "rank":
        raw.append(draw(odd_values)) if len(raw) < 3 else raw.__setitem__(2, draw(odd_values))
    elif not event_list:
        raw[1] = draw(odd_values)
    else:
        i = draw(st.integers(min_value=0, max_value=len(event_list) - 1))
        event = event_list[i]
        if target == "event":
            event_list[i] = draw(odd_values)
        elif isinstance(event, dict):
            keys = sorted(event)
            key = draw(st.sampled_from(keys))
            if target == "field":
                event[key] = draw(odd_values)
            elif target == "tag":
                event["type"] = draw(odd_values | st.sampled_from(["Future", "blockstored"]))
            elif draw(st.booleans()):
                event[draw(st.text(max_size=6))] = draw(odd_values)
            else:
                del event[key]
        else:
            pos = draw(st.integers(min_value=0, max_value=len(event) - 1))
            if target == "extra":
                event.append(draw(odd_values))
            else:
                event[pos] = draw(odd_values)
    return msgspec.msgpack.encode(raw)


any_payload = st.one_of(st.binary(max_size=256), byte_mutants(), object_mutants())

# -- decoder and framing ------------------------------------------------------------------


def decode_or_reason(payload: bytes) -> KVEventBatch | str:
    """The decoded batch, or the reason it was rejected (any other exception fails)."""
    try:
        return decode_batch(payload)
    except EventDecodeError as exc:
        assert exc.reason in REASONS, exc
        assert str(exc).startswith(f"{exc.reason}: ")
        return exc.reason


@FUZZ
@given(any_payload)
def test_decoder_returns_a_batch_or_a_counted_reason(payload: bytes) -> None:
    result = decode_or_reason(payload)
    if isinstance(result, KVEventBatch):
        for event in result.events:
            assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
        # What we decoded re-encodes and decodes to the same batch (no half-built events);
        # compared as bytes, since a NaN ts is not equal to itself.
        encoded = encode_batch(result)
        assert encode_batch(decode_batch(encoded)) == encoded


@FUZZ
@given(any_payload)
def test_skipping_unknown_events_counts_each_one(payload: bytes) -> None:
    """With ``on_unknown``, each unknown-tag event is reported once and the rest kept."""
    unknown: list[str] = []
    try:
        result = decode_batch(payload, unknown.append)
    except EventDecodeError as exc:
        assert exc.reason in REASONS - {"unknown_tag"}, exc
        return
    assert all(u.startswith("unknown_tag: ") for u in unknown)
    try:
        strict = decode_batch(payload)
    except EventDecodeError as exc:
        assert exc.reason == "unknown_tag" and unknown
        raw_events = msgspec.msgpack.decode(payload)[1]
        assert len(result.events) + len(unknown) == len(raw_events)
    else:
        assert unknown == []
        assert encode_batch(strict) == encode_batch(result)


@FUZZ
@given(batches())
def test_both_wire_shapes_decode_to_the_same_batch(batch: KVEventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(legacy_payload(batch)) == batch


frame = st.one_of(st.binary(max_size=12), st.binary(min_size=SEQ_BYTES, max_size=SEQ_BYTES))


@FUZZ
@given(st.lists(frame, max_size=5))
def test_framing_parses_or_raises_framing_error(frames: list[bytes]) -> None:
    try:
        topic, seq, payload = parse_message(frames)
    except FramingError as exc:
        assert exc.reason in ("bad_frames", "bad_seq")
        assert len(frames) != 3 or len(frames[1]) != SEQ_BYTES
        return
    assert len(frames) == 3 and len(frames[1]) == SEQ_BYTES
    assert (topic, payload) == (frames[0], frames[2])
    assert seq == int.from_bytes(frames[1], "big")


# -- the index under fuzzed batches ---------------------------------------------------------


async def index_state(index: MemoryPrefixIndex) -> dict[WorkerId, dict[int, int]]:
    return {w: dict(await index.worker_entries(w)) for w in (W0, WorkerId("w1"))}


async def check_consistent(index: MemoryPrefixIndex) -> None:
    """Stats, per-worker entries and lookups describe the same index."""
    state = await index_state(index)
    num_entries = sum(
        (mask & GPU_MASK) + (mask & CPU_MASK) // CPU_MASK
        for entries in state.values()
        for mask in entries.values()
    )
    stats = await index.stats()
    assert stats.num_entries == num_entries
    assert stats.num_workers == sum(1 for entries in state.values() if entries)
    for worker, entries in state.items():
        for key, mask in entries.items():
            assert mask in (GPU_MASK, CPU_MASK, GPU_MASK | CPU_MASK)
            match = (await index.lookup([key], [worker]))[worker]
            assert (match.num_gpu_blocks, match.num_cpu_blocks) == (
                int(bool(mask & GPU_MASK)),
                int(not mask & GPU_MASK),
            )


def fold_stream(payloads: list[bytes]) -> None:
    async def scenario() -> None:
        index = BridgedIndex(MemoryPrefixIndex())
        for i, payload in enumerate(payloads):
            worker = W0 if i % 3 else WorkerId("w1")
            before = await index_state(index)
            result = decode_or_reason(payload)
            if isinstance(result, str):
                # A rejected payload never reaches the index.
                assert await index_state(index) == before
                continue
            malformed_before = index.bridge(worker).counters.malformed
            try:
                await index.apply(worker, result)
            except OrphanParentError as exc:
                assert exc.worker_id == worker
            num_malformed = sum(
                1
                for e in result.events
                if isinstance(e, BlockStored)
                and len(e.token_ids) != e.block_size * len(e.block_hashes)
            )
            # Malformed events before an orphan are counted; at most all of them.
            assert index.bridge(worker).counters.malformed - malformed_before <= num_malformed
            await check_consistent(index)
        # Recovery always works: a clear empties the worker whatever came before.
        await index.apply(W0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert await index.worker_entries(W0) == {}
        await check_consistent(index)

    asyncio.run(scenario())


small_hash_payloads = st.builds(encode_batch, batches(small_hashes))


@settings(FUZZ, max_examples=100)
@given(st.lists(st.one_of(small_hash_payloads, any_payload), max_size=12))
def test_fuzzed_streams_never_corrupt_the_index(payloads: list[bytes]) -> None:
    fold_stream(payloads)


@settings(FUZZ, max_examples=100)
@given(st.lists(stored(small_hashes), min_size=1, max_size=6), st.data())
def test_every_malformed_block_stored_is_counted(
    good: list[BlockStored], data: st.DataObject
) -> None:
    """A BlockStored whose token count does not match its blocks is counted, never indexed."""
    bad = [
        BlockStored(
            block_hashes=e.block_hashes,
            parent_block_hash=None,
            token_ids=e.token_ids + data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)),
            block_size=e.block_size,
            lora_id=None,
            medium=e.medium,
            lora_name=None,
        )
        for e in good
    ]

    async def scenario() -> None:
        index = BridgedIndex(MemoryPrefixIndex())
        await index.apply(W0, KVEventBatch(ts=0.0, events=list(bad)))
        assert index.bridge(W0).counters.malformed == len(bad)
        assert await index.worker_entries(W0) == {}
        assert (await index.stats()).num_entries == 0

    asyncio.run(scenario())
