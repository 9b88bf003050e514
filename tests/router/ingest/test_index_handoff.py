"""The lease handoff's bridge state: what is read back folds exactly like the bridge it was
taken from, and whatever else is read back is refused with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import BlockRemoved, BlockStored, KVEventBatch
from router.errors import OrphanParentError
from router.index.changes import Changes
from router.ingest._native.words import BridgeState
from router.ingest.bridge import WorkerBridge, fold_batch
from router.ingest.handoff import HandoffError, decode_handoff, encode_handoff
from tests.support.prefix_tree import KEYER, event_st


async def fold(bridge: WorkerBridge, event: Any) -> list[object]:
    """What folding one event writes (per segment: the entry transitions), or the orphan."""
    written: list[object] = []

    async def write(changes: Changes) -> None:
        written.append(changes.masks())

    async def clear() -> None:
        written.append(bridge.reset().masks())

    try:
        await fold_batch("w", bridge, KVEventBatch(1.0, [event]), write, clear)
    except OrphanParentError:
        written.append("orphan")
    return written


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(event_st, max_size=14),
    after=st.lists(event_st, max_size=10),
    tolerant=st.booleans(),
)
def test_a_handed_over_bridge_folds_like_the_original(
    before: list[Any], after: list[Any], tolerant: bool
) -> None:
    async def main() -> None:
        original = WorkerBridge(KEYER, tolerate_orphans=tolerant)
        for event in before:
            await fold(original, event)
        data = encode_handoff(original, 7, 41, 1.5, "life-1")
        handoff = decode_handoff(data, KEYER)
        assert (handoff.epoch, handoff.applied_through, handoff.applied_ts) == (7, 41, 1.5)
        assert handoff.lifetime_id == "life-1"
        copy = handoff.bridge
        assert copy.tolerate_orphans == tolerant
        assert copy.entries() == original.entries()
        for event in after:
            assert await fold(copy, event) == await fold(original, event)
            assert copy.entries() == original.entries()

    asyncio.run(main())


def test_engine_hashes_of_every_wire_form_survive() -> None:
    """vLLM's hashes are signed or unsigned ints or digest bytes; removals find them after."""
    hashes: list[int | bytes] = [b"\x01" * 32, -(2**63), 2**64 - 1]
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(12)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )

    async def main() -> None:
        original = WorkerBridge(KEYER)
        await fold(original, event)
        copy = decode_handoff(encode_handoff(original, 1, None, None, None), KEYER).bridge
        assert copy.entries() == original.entries() and len(copy.entries()) == 3
        removal = BlockRemoved(block_hashes=hashes[::-1], medium="GPU")
        assert await fold(copy, removal) == await fold(original, removal)
        assert copy.entries() == {}

    asyncio.run(main())


def _handoff() -> bytes:
    bridge = WorkerBridge(KEYER)
    asyncio.run(fold(bridge, BlockStored([5, 6], None, list(range(8)), 4, None, "GPU", None)))
    return encode_handoff(bridge, 3, 9, 2.0, None)


def _wire(**changes: Any) -> bytes:
    """A valid handoff with some wire fields replaced (and a checksum that matches)."""
    fields = list(msgspec.msgpack.decode(_handoff()[:-8]))
    names = ["version", "root", "epoch", "applied_through", "applied_ts", "lifetime_id"]
    names += ["tolerate_orphans"]
    names += ["hashes", "copy_words", "keys", "key_words"]
    for name, value in changes.items():
        fields[names.index(name)] = value(fields[names.index(name)])
    payload = msgspec.msgpack.encode(fields)
    return payload + xxhash.xxh3_64_digest(payload)[::-1]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "checksum"),
        (b"\x93not a handoff", "checksum"),
        (_handoff()[:-1] + b"?", "checksum"),
        (b"\x01" + _handoff()[1:], "checksum"),
        (_wire(version=lambda v: 1), "version 1, expected"),  # an older layout's
        (_wire(copy_words=lambda b: b[:-8]), "not a whole number"),
        (_wire(hashes=lambda h: h[:1]), "word counts"),
        (_wire(keys=lambda b: b[8:] + b[:8]), "bad key word"),  # a key its own parent
        (_wire(key_words=lambda b: b[:-8] + b"\xff" * 8), "bad key word"),
        (_wire(epoch=lambda e: "three"), "unreadable"),
        (_wire(root=lambda r: r ^ 1), "another router key seed"),
    ],
)
def test_an_unreadable_handoff_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(HandoffError, match=reason):
        decode_handoff(data, KEYER)


def test_a_state_that_breaks_the_invariants_is_refused() -> None:
    held = 1 | 5 << 64  # one GPU copy of router key 5
    for state in (
        BridgeState({1: held}, {}, False),  # a copy of a key that is not held
        BridgeState({}, {5: 1}, False),  # a held key without copies
        BridgeState({1: 5 << 64}, {5: 0}, False),  # a copy word without copies
    ):
        bridge = WorkerBridge(KEYER, False, _copies=state.copies, _keys=state.keys)
        with pytest.raises(HandoffError):
            decode_handoff(encode_handoff(bridge, 1, None, None, None), KEYER)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    with contextlib.suppress(HandoffError):  # refused, or (rarely) a valid handoff
        decode_handoff(data, KEYER)
