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
from tests.support.event_payloads import (
    any_payload,
    batches,
    legacy_payload,
    small_hashes,
    stored,
)

pytestmark = pytest.mark.slow

REASONS = frozenset({"msgpack", "unknown_tag", "bad_field", "bad_batch", "bad_event", "too_large"})
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
W0 = WorkerId("w0")

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
