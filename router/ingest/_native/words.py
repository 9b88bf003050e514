"""The engine-hash bridge's state words: their layout, and the checks of a handed-over state.

Per engine hash, a *copy word*: GPU copies (bits 0-31), CPU copies (32-63), router key
(64-127; :data:`NONE`: detached). Per router key, a *key word*: GPU copies, CPU copies (as
above), family tag (64-126), indexed (bit 127: router keys and tags are below ``2**63``, so
the flag shares the tag's lane), parent key (128-191; :data:`NONE`: block 0). Plain ints,
never tuples: a dict holding a freshly created tuple becomes tracked by CPython's cyclic
garbage collector again, and every collection then walks all of its entries (20-500 ms
pauses at a million cached blocks); dicts of ints are never tracked, so the bridge costs the
collector nothing however large it grows. Where kvroute's C module is built the maps are
``WordMap`` tables instead (:data:`router.index.runs.new_map`): the same words, kept as
64-bit lanes (:data:`COPY_LANES`, :data:`KEY_LANES`), untracked as well.

Invariants (kept by :class:`router.ingest.bridge.WorkerBridge`, checked by
:func:`checked_links` on a state read back from elsewhere): an engine hash's entry is
deleted when its GPU + CPU copies reach 0; a router key's counts equal the sums over the
engine hashes that map to it, and a key without copies is not held. A detached hash (key
:data:`NONE`) chains from an unknown ancestor: no router key, no index entry. Prefix
closure: a held key is indexed iff it is block 0 or its parent key is indexed, so along any
chain the index holds a prefix, and a lookup may binary-search it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, cast

from events.hashing import BlockKey
from events.schema import WireHash
from router.index.changes import CPU_MASK, GPU_MASK

__all__ = [
    "COPY_LANES",
    "COUNT",
    "COUNTS",
    "CPU_SHIFT",
    "GPU_SHIFT",
    "INDEXED",
    "KEY_BITS",
    "KEY_LANES",
    "NONE",
    "BridgeState",
    "checked_links",
    "key_of",
    "key_word",
    "mask_of",
    "pack_kids",
    "parent_of",
    "tag_of",
    "unpack_kids",
]

GPU_SHIFT: Final = 0
"""A tier is the shift of its copy count in a word."""
CPU_SHIFT: Final = 32
COUNT: Final = (1 << 32) - 1
COUNTS: Final = (1 << 64) - 1
NONE: Final = 1 << 63
"""No key (router keys are below ``2**63``)."""
KEY_BITS: Final = (1 << 63) - 1
"""A router key's bits (and a family tag's)."""
INDEXED: Final = 1 << 127
COPY_LANES: Final = 2
"""64-bit lanes of a copy word (counts, router key)."""
KEY_LANES: Final = 3
"""64-bit lanes of a key word (counts, tag with the indexed bit, parent): 32 bytes a slot
with the key, two to a cache line."""


@dataclass(frozen=True, slots=True)
class BridgeState:
    """A bridge's maps as plain data: what one router hands the next holder of a lease.

    Attributes:
        copies: Engine hash -> copy word.
        keys: Router key -> key word (the children map is derived from the parents).
        tolerate_orphans: The bridge's flag.
    """

    copies: dict[WireHash, int]
    keys: dict[BlockKey, int]
    tolerate_orphans: bool


def mask_of(word: int) -> int:
    """Tier mask of a copy or key word."""
    return (GPU_MASK if word & COUNT else 0) | (CPU_MASK if (word >> CPU_SHIFT) & COUNT else 0)


def key_of(copies: int) -> int:
    """Router key of a copy word (:data:`NONE`: detached)."""
    return copies >> 64


def tag_of(word: int) -> BlockKey:
    """Family tag of a key word."""
    return BlockKey((word >> 64) & KEY_BITS)


def parent_of(word: int) -> BlockKey | None:
    """Parent key of a key word (``None``: block 0)."""
    parent = (word >> 128) & COUNTS
    return None if parent == NONE else BlockKey(parent)


def key_word(tag: int, parent: int | None, indexed: bool) -> int:
    """A key word with no copies."""
    return tag << 64 | (NONE if parent is None else parent) << 128 | indexed << 127


def pack_kids(keys: tuple[int, ...]) -> int:
    """A key's children as one int: the child itself, or for a branch :data:`NONE`, the
    count and each child in its own 64 bits above (an int, not a tuple: see above)."""
    if len(keys) == 1:
        return keys[0]
    packed = NONE | len(keys)
    for i, key in enumerate(keys, start=1):
        packed |= key << (64 * i)
    return packed


def unpack_kids(kids: int) -> tuple[BlockKey, ...]:
    """The inverse of :func:`pack_kids`."""
    if kids < NONE:
        return cast("tuple[BlockKey, ...]", (kids,))
    return cast(
        "tuple[BlockKey, ...]",
        tuple((kids >> (64 * i)) & COUNTS for i in range(1, (kids & COUNT) + 1)),
    )


def checked_links(state: BridgeState) -> list[tuple[BlockKey, BlockKey]]:
    """Every ``(parent, key)`` link of a state, once its words are checked.

    Raises:
        ValueError: ``state`` breaks an invariant (a copy naming a key that is not held,
            a key's counts not the sum of its copies', a key its own parent or in another
            family than its held parent, a field out of range): a bridge holding it could
            fail at any later event.
    """
    sums: dict[int, int] = {}
    for copies in state.copies.values():
        key, count = key_of(copies), copies & COUNTS
        if not count or key > NONE:
            raise ValueError(f"bad copy word {copies:#x}")
        if key != NONE:
            sums[key] = sums.get(key, 0) + count
    if sums.keys() != state.keys.keys():
        raise ValueError("the keys the copies name are not the keys held")
    links: list[tuple[BlockKey, BlockKey]] = []
    for key, word in state.keys.items():
        parent = (word >> 128) & COUNTS
        bad = word >> 192 or parent > NONE or parent == key
        if bad or key >= NONE or sums[key] != word & COUNTS:
            raise ValueError(f"bad key word of router key {key}")
        if parent != NONE:
            above = state.keys.get(BlockKey(parent))
            if above is not None and (above ^ word) >> 64 & KEY_BITS:
                raise ValueError(f"router key {key} is not in its parent's family")
            links.append((BlockKey(parent), key))
    return links
