"""Lease handoff: the state a router passes to the next holder of a worker's lease.

When a router gives up a worker's lease on purpose (a replica joined and owns the worker
now, or the router shuts down), the entries it wrote stay in Redis and its engine-hash
bridge still matches them exactly. Handing that bridge over with the lease lets the next
holder continue the worker's stream where this router stopped, instead of clearing the
worker and rebuilding it: a vLLM engine's replay buffer rarely reaches back to seq 0, so a
rebuild would lose every block cached before the handover.

Wire form: one msgpack array (msgspec), words as little-endian 64-bit lanes (engine
hashes stay msgpack values: vLLM's are ints or bytes), then the XXH3-64 of that array
(8 bytes, little-endian). No pickle: a handoff read back from Redis is untrusted input,
checked against its checksum, field by field and against the bridge's invariants.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import msgspec
import xxhash

from events.hashing import BlockKey, RouterKeyer
from events.schema import WireHash
from router.errors import PrefixIndexError
from router.ingest._native.words import COPY_LANES, KEY_LANES, BridgeState
from router.ingest.bridge import WorkerBridge

__all__ = ["Handoff", "HandoffError", "decode_handoff", "encode_handoff"]

_VERSION: Final = 2
_CHECKSUM_BYTES: Final = 8


class HandoffError(PrefixIndexError):
    """A handoff read back from Redis is not one this version wrote, or is inconsistent."""


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    version: int
    root: int  # the router key of an empty prefix: tells the router key seed apart
    epoch: int
    applied_through: int | None
    applied_ts: float | None
    lifetime_id: str | None
    tolerate_orphans: bool
    hashes: list[int | bytes]
    copy_words: bytes
    keys: bytes
    key_words: bytes


@dataclass(frozen=True, slots=True)
class Handoff:
    """What the previous holder of a worker's lease knew of it.

    Attributes:
        epoch: The lease epoch it was written under: valid only for the acquisition that
            follows it (``epoch + 1``); any later epoch means someone else held the lease
            in between and may have changed the worker's entries.
        applied_through: The highest seq whose effect the entries hold (``None``: unknown).
        applied_ts: The timestamp of that batch (``None``: unknown).
        lifetime_id: The kvroute worker's publisher lifetime id it had recorded.
        bridge: The engine-hash bridge, matching the worker's entries in Redis.
    """

    epoch: int
    applied_through: int | None
    applied_ts: float | None
    lifetime_id: str | None
    bridge: WorkerBridge


def encode_handoff(
    bridge: WorkerBridge,
    epoch: int,
    applied_through: int | None,
    applied_ts: float | None,
    lifetime_id: str | None,
) -> bytes:
    """The handoff of ``bridge`` and the stream position, written under lease ``epoch``."""
    state = bridge.state()
    payload = msgspec.msgpack.encode(
        _Wire(
            version=_VERSION,
            root=bridge.keyer.root(),
            epoch=epoch,
            applied_through=applied_through,
            applied_ts=applied_ts,
            lifetime_id=lifetime_id,
            tolerate_orphans=state.tolerate_orphans,
            hashes=list(state.copies),
            copy_words=_lanes(state.copies.values(), COPY_LANES),
            keys=_lanes(state.keys, 1),
            key_words=_lanes(state.keys.values(), KEY_LANES),
        )
    )
    return payload + xxhash.xxh3_64_digest(payload)[::-1]


def decode_handoff(data: bytes, keyer: RouterKeyer) -> Handoff:
    """Read a handoff back, rebuilding its bridge with ``keyer``.

    Raises:
        HandoffError: ``data`` is not a handoff of this version, was written with another
            router key seed, or its bridge breaks an invariant (see
            :meth:`WorkerBridge.from_state`).
    """
    try:
        payload, checksum = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
        if len(data) < _CHECKSUM_BYTES or xxhash.xxh3_64_digest(payload)[::-1] != checksum:
            raise ValueError("checksum mismatch")
        wire = msgspec.msgpack.decode(payload, type=_Wire)
        if wire.version != _VERSION:
            raise ValueError(f"version {wire.version}, expected {_VERSION}")
        if wire.root != keyer.root():
            raise ValueError("written by a router with another router key seed")
        copy_words = _words(wire.copy_words, COPY_LANES)
        keys = _words(wire.keys, 1)
        key_words = _words(wire.key_words, KEY_LANES)
        if len(copy_words) != len(wire.hashes) or len(key_words) != len(keys):
            raise ValueError("word counts do not match the hashes and keys")
        hashes: list[WireHash] = list(wire.hashes)
        state = BridgeState(
            copies=dict(zip(hashes, copy_words, strict=True)),
            keys=dict(zip(map(BlockKey, keys), key_words, strict=True)),
            tolerate_orphans=wire.tolerate_orphans,
        )
        bridge = WorkerBridge.from_state(keyer, state)
    except (msgspec.DecodeError, ValueError) as exc:
        raise HandoffError(f"unreadable lease handoff: {exc}") from None
    return Handoff(wire.epoch, wire.applied_through, wire.applied_ts, wire.lifetime_id, bridge)


def _lanes(words: Iterable[int], lanes: int) -> bytes:
    """Words as ``lanes`` little-endian 64-bit lanes each, lowest first (so a word is
    its own little-endian bytes)."""
    size = 8 * lanes
    return b"".join([word.to_bytes(size, "little") for word in words])


def _words(data: bytes, lanes: int) -> list[int]:
    """The inverse of :func:`_lanes`.

    Raises:
        ValueError: ``data`` is not a whole number of words.
    """
    size = 8 * lanes
    if len(data) % size:
        raise ValueError(f"{len(data)} bytes is not a whole number of {lanes}-lane words")
    if lanes == 1:  # plain 64-bit words: one C-level conversion
        flat = array("Q")
        flat.frombytes(data)
        if sys.byteorder == "big":
            flat.byteswap()
        return flat.tolist()
    view = memoryview(data)
    return [int.from_bytes(view[i : i + size], "little") for i in range(0, len(data), size)]
