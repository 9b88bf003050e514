"""Ingest of batches decoded in C equals ingest of the same batches decoded by the spec.

:func:`events.schema.decode_batch` reads the common shape in C (token ids as
``TokenIds``, hashed from their buffer) and leaves the rest to
:func:`events.schema.python_decode_batch`. An index fed either one ends in the same
state after every payload: the same entries, bridge maps and counters, the same orphan
errors; a ``BlockStored`` with token ids outside uint32 (left to the spec) is counted
malformed and changes nothing, while the rest of its batch is applied.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.errors import EventDecodeError
from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import (
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    python_decode_batch,
)
from router.errors import OrphanParentError
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from tests.support.event_payloads import any_payload, batches, small_hashes

W0 = WorkerId("w0")
# Token ids at the edges of uint32, and now and then beyond (negative or too wide).
tokens = st.one_of(
    st.integers(min_value=0, max_value=40),
    st.sampled_from([2**16, 2**32 - 1]),
    st.sampled_from([2**32, -1]),
)
payloads = st.one_of(
    st.builds(encode_batch, batches(small_hashes, tokens)),
    st.builds(encode_batch, batches(small_hashes)),
    any_payload,
)


async def apply(index: BridgedIndex, payload: bytes, decode: Any) -> Any:
    """What applying a payload did: rejected, an orphan at some position, or applied."""
    try:
        batch = decode(payload)
    except EventDecodeError as exc:
        return ("rejected", exc.reason)
    try:
        await index.apply(W0, batch)
    except OrphanParentError as exc:
        return ("orphan", exc.parent_hash, exc.num_applied)
    return ("applied",)


async def state(index: BridgedIndex) -> Any:
    bridge = index.bridge(W0)
    return (await index.worker_entries(W0), bridge.state(), bridge.counters)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(payloads, min_size=1, max_size=10), st.booleans())
def test_an_index_fed_the_c_decoder_ends_as_one_fed_the_spec(
    stream: list[bytes], tolerate_orphans: bool
) -> None:
    async def scenario() -> None:
        ours, spec = (BridgedIndex(MemoryPrefixIndex(), RouterKeyer(7)) for _ in range(2))
        ours.bridge(W0).tolerate_orphans = spec.bridge(W0).tolerate_orphans = tolerate_orphans
        for payload in stream:
            assert await apply(ours, payload, decode_batch) == await apply(
                spec, payload, python_decode_batch
            )
            assert await state(ours) == await state(spec)

    asyncio.run(scenario())


def test_token_ids_outside_uint32_count_the_event_malformed_and_keep_the_rest() -> None:
    def stored(hashes: list[int], token_ids: list[int]) -> BlockStored:
        return BlockStored(hashes, None, token_ids, 2, None, "GPU", None)

    good = stored([1, 2], [5, 6, 7, 8])
    payload = encode_batch(
        KVEventBatch(1.0, [stored([3], [1, 2**32]), good, stored([4], [-1, 0])], 0)
    )

    async def scenario() -> None:
        index, alone = BridgedIndex(MemoryPrefixIndex()), BridgedIndex(MemoryPrefixIndex())
        batch = decode_batch(payload)
        assert [type(e.token_ids) for e in batch.events] == [list, list, list]  # the spec's
        await index.apply(W0, batch)
        await alone.apply(W0, KVEventBatch(1.0, [good], 0))
        assert index.bridge(W0).counters.malformed == 2
        assert await index.worker_entries(W0) == await alone.worker_entries(W0)
        assert len(await index.worker_entries(W0)) == 2

    asyncio.run(scenario())
